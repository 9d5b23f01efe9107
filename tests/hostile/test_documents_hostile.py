"""Issue 10, item 3 (and the document parts of item 10): a hostile document costs seconds, not minutes."""

from __future__ import annotations

import os
import tracemalloc

import pytest

from engine.chat.documents import load_document
from engine.errors import DocumentError
from tests.hostile.builders import pdf_with_pages, pdf_with_shared_text_stream


def test_small_pdf_sharing_one_huge_text_stream_is_refused_at_the_first_page(tmp_path, monkeypatch):
    # The probe's file: 200 pages sharing one stream, a few tens of KB on disk, 79 s and 878 MB to read.
    from pypdf import PageObject

    path = tmp_path / "shared.pdf"
    path.write_bytes(pdf_with_shared_text_stream(200, 300_000))
    assert path.stat().st_size < 64_000
    pages_extracted = []
    extract_text = PageObject.extract_text

    def counting_extract_text(page, *args, **kwargs):
        pages_extracted.append(page)
        return extract_text(page, *args, **kwargs)

    monkeypatch.setattr(PageObject, "extract_text", counting_extract_text)
    tracemalloc.start()
    try:
        with pytest.raises(DocumentError, match="page 1 of 200") as error:
            load_document(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "\n" not in str(error.value)
    assert len(pages_extracted) == 1  # one page's worth of work, not 200 (timing-free: CI may be busy)
    assert peak < 100_000_000, peak


def test_total_character_limit_stops_extraction_at_the_page_that_crosses_it(tmp_path):
    path = tmp_path / "long.pdf"
    path.write_bytes(pdf_with_pages(["word " * 2_000] * 40))  # 10,000 characters a page
    with pytest.raises(DocumentError, match=r"limit of 35,000 characters of text \(reached at page 4 of 40\)"):
        load_document(path, max_chars=35_000)


def test_time_budget_stops_a_slow_extraction(tmp_path):
    path = tmp_path / "slow.pdf"
    path.write_bytes(pdf_with_pages(["word " * 2_000] * 40))
    with pytest.raises(DocumentError, match=r"took longer than 0\.05 s \(stopped at page \d+ of 40\)"):
        load_document(path, max_seconds=0.05)


def test_ordinary_pdf_within_the_limits_is_read_whole(tmp_path):
    path = tmp_path / "fine.pdf"
    path.write_bytes(pdf_with_pages(["first page text", "second page text"]))
    document = load_document(path)
    assert "first page text" in document.text and "second page text" in document.text


def test_pypdf_warnings_do_not_reach_the_terminal(tmp_path, capfd):
    # startxref pointing a few bytes off the cross-reference table: pypdf logs "incorrect startxref
    # pointer" and "parsing for Object Streams" on stderr, then recovers the text.
    data = bytearray(pdf_with_pages(["recoverable text"]))
    start = data.rindex(b"xref\n")
    marker = data.rindex(b"startxref\n") + len(b"startxref\n")
    end = data.index(b"\n", marker)
    data[marker:end] = str(start + 3).encode()
    path = tmp_path / "damaged-xref.pdf"
    path.write_bytes(bytes(data))
    document = load_document(path)
    assert "recoverable text" in document.text
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == "", captured


def test_aes_encrypted_pdf_opens_and_a_password_is_named(tmp_path):
    from pypdf import PdfReader, PdfWriter

    source = PdfReader(_write(tmp_path / "plain.pdf", pdf_with_pages(["secret aes text"])))
    for password, name in (("", "aes-open.pdf"), ("hunter2", "aes-locked.pdf")):
        writer = PdfWriter()
        writer.append(source)
        writer.encrypt(user_password=password, owner_password="owner", algorithm="AES-256")
        with open(tmp_path / name, "wb") as stream:
            writer.write(stream)
    assert "secret aes text" in load_document(tmp_path / "aes-open.pdf").text
    with pytest.raises(DocumentError, match="password-protected"):
        load_document(tmp_path / "aes-locked.pdf")


def _write(path, data):
    path.write_bytes(data)
    return path


@pytest.mark.skipif(os.name != "posix", reason="symbolic links")
def test_symlink_loop_and_dangling_link_are_named_as_such(tmp_path):
    loop = tmp_path / "loop.txt"
    loop.symlink_to(loop)
    dangling = tmp_path / "dangling.txt"
    dangling.symlink_to(tmp_path / "moved-away.txt")
    for path in (loop, dangling):
        with pytest.raises(DocumentError, match="symbolic link that leads nowhere"):
            load_document(path)

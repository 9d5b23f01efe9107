"""Loading documents: every supported format, and a clear DocumentError for each way a file can be unreadable."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import pytest
from pypdf import PdfWriter
from pypdf.generic import DecodedStreamObject, DictionaryObject, NameObject
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from tokenizers.processors import TemplateProcessing

from engine.chat.documents import Document, count_tokens, load_document
from engine.errors import DocumentError


def write(tmp_path: Path, name: str, content: bytes | str) -> Path:
    path = tmp_path / name
    if isinstance(content, str):
        path.write_text(content, encoding="utf-8", newline="")
    else:
        path.write_bytes(content)
    return path


def make_pdf(page_texts: list[str | None], *, user_password: str | None = None) -> bytes:
    """A real PDF whose pages show the given strings in Helvetica (None: a page with no text at all)."""
    writer = PdfWriter()
    font = writer._add_object(
        DictionaryObject(
            {
                NameObject("/Type"): NameObject("/Font"),
                NameObject("/Subtype"): NameObject("/Type1"),
                NameObject("/BaseFont"): NameObject("/Helvetica"),
            }
        )
    )
    for text in page_texts:
        page = writer.add_blank_page(width=612, height=792)
        if text is None:
            continue
        page[NameObject("/Resources")] = DictionaryObject(
            {NameObject("/Font"): DictionaryObject({NameObject("/F1"): font})}
        )
        content = DecodedStreamObject()
        content.set_data(f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode("latin-1"))
        page[NameObject("/Contents")] = writer._add_object(content)
    if user_password is not None:
        # RC4 needs no optional crypto package; the owner password differs so the file is really locked.
        writer.encrypt(user_password=user_password, owner_password="owner-secret", algorithm="RC4-128")
    buffer = io.BytesIO()
    writer.write(buffer)
    return buffer.getvalue()


def make_png() -> bytes:
    """A valid 1x1 PNG, to be renamed as a document."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    pixels = zlib.compress(b"\x00\xff\x00\x00")
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def error_message(path: Path, **limits: int) -> str:
    with pytest.raises(DocumentError) as caught:
        load_document(path, **limits)
    return str(caught.value)


# --- plain text and markdown -------------------------------------------------------------------------


def test_text_file_is_normalised(tmp_path: Path) -> None:
    path = write(
        tmp_path, "notes.txt", "Title  \r\n\r\n\r\n\r\n\r\nFirst line\t\r\n  indented\rold mac\n\n\n"
    )
    document = load_document(path)
    assert document == Document(
        path=path,
        name="notes.txt",
        kind="text",
        text="Title\n\nFirst line\n  indented\nold mac",
        n_chars=len("Title\n\nFirst line\n  indented\nold mac"),
    )


def test_markdown_kind_and_unicode(tmp_path: Path) -> None:
    document = load_document(write(tmp_path, "README.MD", "# Café ☕\n\n* naïve — ok\n"))
    assert document.kind == "markdown"
    assert document.text == "# Café ☕\n\n* naïve — ok"


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-be"])
def test_byte_order_marked_unicode(tmp_path: Path, encoding: str) -> None:
    text = "Grüße aus Köln — 東京"
    raw = text.encode(encoding)
    if encoding == "utf-16-be":
        raw = b"\xfe\xff" + raw  # the codec itself writes no BOM
    assert load_document(write(tmp_path, "bom.txt", raw)).text == text


def test_windows_1252_text_is_accepted(tmp_path: Path) -> None:
    text = (
        "Le café était très “bon” – naïve résumé… à l’école.\n"
        "Größere Straßen führen über die „Brücke“ für 5 €.\n"
        "As informações da ação são públicas; ¿dónde está la niña?"
    )
    document = load_document(write(tmp_path, "legacy.txt", text.encode("cp1252")))
    assert document.text == text


@pytest.mark.parametrize(
    ("encoding", "foreign_text"),
    [
        ("shift_jis", "これは日本語の文書です。"),  # not even decodable as cp1252
        ("gbk", "这是一个中文文件，我们需要测试编码。"),  # decodes as cp1252, but into mojibake
        ("cp1251", "Это русский текст в кодировке Windows."),
        ("iso8859-2", "Zażółć gęślą jaźń, pchnąć w tę łódź jeża."),
    ],
)
def test_other_legacy_encodings_are_rejected_not_garbled(
    tmp_path: Path, encoding: str, foreign_text: str
) -> None:
    text = f"Mostly English words with a little {foreign_text} in the middle of them.\n"
    message = error_message(write(tmp_path, "foreign.txt", text.encode(encoding)))
    assert "foreign.txt" in message and "encoding" in message and "UTF-8" in message


def test_renamed_png_is_binary(tmp_path: Path) -> None:
    message = error_message(write(tmp_path, "photo.txt", make_png()))
    assert "photo.txt" in message and "binary" in message


def test_control_characters_without_nul_are_binary(tmp_path: Path) -> None:
    raw = bytes(range(1, 32)) * 40 + b"some words"
    message = error_message(write(tmp_path, "blob.md", raw))
    assert "blob.md" in message and "binary" in message


@pytest.mark.parametrize(
    ("content", "expected"),
    [(b"", "is empty"), (b"  \n\t\r\n  \n", "contains no text")],
)
def test_empty_and_blank_files(tmp_path: Path, content: bytes, expected: str) -> None:
    message = error_message(write(tmp_path, "blank.txt", content))
    assert "blank.txt" in message and expected in message


def test_missing_file(tmp_path: Path) -> None:
    message = error_message(tmp_path / "nope.txt")
    assert "nope.txt" in message and "does not exist" in message


def test_directory(tmp_path: Path) -> None:
    folder = tmp_path / "folder.txt"
    folder.mkdir()
    assert "is a folder" in error_message(folder)


def test_unsupported_extension_lists_supported(tmp_path: Path) -> None:
    message = error_message(write(tmp_path, "report.docx", "text"))
    assert "report.docx" in message and "'.docx'" in message
    assert all(extension in message for extension in (".txt", ".md", ".pdf", ".html", ".htm"))


def test_size_limit_names_size_and_limit(tmp_path: Path) -> None:
    path = write(tmp_path, "big.txt", "word " * 600)  # 3000 bytes
    message = error_message(path, max_bytes=1000)
    assert "big.txt" in message and "3.0 KB" in message and "1.0 KB" in message


def test_character_limit(tmp_path: Path) -> None:
    path = write(tmp_path, "long.txt", "a" * 1500)
    assert load_document(path, max_chars=1500).n_chars == 1500
    message = error_message(path, max_chars=1000)
    assert "long.txt" in message and "1,500" in message and "1,000" in message


# --- HTML ----------------------------------------------------------------------------------------------


def test_html_visible_text_with_paragraphs(tmp_path: Path) -> None:
    html = """<!doctype html>
<html><head><title>Report &amp; Notes</title>
<style>p { color: red; }</style>
<script>var hidden = "do not show";</script></head>
<body>
  <h1>Caf&eacute; &lt;menu&gt;</h1>
  <p>First   paragraph
     spans lines.</p>
  <p>Second&nbsp;one&#8212;with <b>bold</b> text.<br>New line.</p>
  <ul><li>apple</li><li>pear</li></ul>
  <pre>keep   this
    indentation</pre>
  <noscript>enable JS</noscript>
</body></html>"""
    document = load_document(write(tmp_path, "page.htm", html))
    assert document.kind == "html"
    assert document.text == (
        "Report & Notes\n\n"
        "Café <menu>\n\n"
        "First paragraph spans lines.\n\n"
        "Second one—with bold text.\nNew line.\n\n"  # &nbsp; is a plain space in text
        "- apple\n- pear\n\n"
        "keep   this\n    indentation"
    )


def test_html_with_only_script_has_no_text(tmp_path: Path) -> None:
    path = write(tmp_path, "app.html", "<html><script>document.write('x')</script></html>")
    assert "contains no text" in error_message(path)


# --- PDF -----------------------------------------------------------------------------------------------


def test_pdf_pages_are_joined(tmp_path: Path) -> None:
    document = load_document(write(tmp_path, "paper.pdf", make_pdf(["Hello Velox", "Second page"])))
    assert document.kind == "pdf"
    assert document.text == "Hello Velox\n\nSecond page"


def test_pdf_without_text_layer(tmp_path: Path) -> None:
    message = error_message(write(tmp_path, "scan.pdf", make_pdf([None, None])))
    assert "scan.pdf" in message and "no text layer" in message and "OCR" in message


def test_pdf_with_user_password_is_refused(tmp_path: Path) -> None:
    message = error_message(write(tmp_path, "locked.pdf", make_pdf(["Secret"], user_password="pw")))
    assert "locked.pdf" in message and "password-protected" in message


def test_pdf_encrypted_with_empty_user_password_opens(tmp_path: Path) -> None:
    path = write(tmp_path, "owner-only.pdf", make_pdf(["Readable anyway"], user_password=""))
    assert load_document(path).text == "Readable anyway"


@pytest.mark.parametrize("damage", ["truncated", "png"])
def test_corrupt_pdf(tmp_path: Path, damage: str) -> None:
    whole = make_pdf(["Hello Velox"])
    raw = whole[: len(whole) // 2] if damage == "truncated" else make_png()
    message = error_message(write(tmp_path, "broken.pdf", raw))
    assert "broken.pdf" in message and "could not be read as a PDF" in message


# --- token counting ------------------------------------------------------------------------------------


def word_tokenizer() -> Tokenizer:
    """A whitespace word-level tokenizer that, like real LLM tokenizers, adds a BOS token by default."""
    vocabulary = {"[UNK]": 0, "[BOS]": 1, "the": 2, "cat": 3, "sat": 4}
    tokenizer = Tokenizer(WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    tokenizer.post_processor = TemplateProcessing(single="[BOS] $A", special_tokens=[("[BOS]", 1)])
    return tokenizer


def test_count_tokens_on_text_and_document(tmp_path: Path) -> None:
    tokenizer = word_tokenizer()
    assert len(tokenizer.encode("the cat sat").ids) == 4  # BOS included by default...
    assert count_tokens("the cat sat", tokenizer) == 3  # ...but not counted as part of the document
    document = load_document(write(tmp_path, "cat.txt", "the cat\n\nsat on the mat\n"))
    assert count_tokens(document, tokenizer) == 6


def test_count_tokens_with_hugging_face_and_mlx_lm_tokenizers() -> None:
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_tokenizer(), unk_token="[UNK]", bos_token="[BOS]"
    )
    assert hf_tokenizer.encode("the cat sat") == [1, 2, 3, 4]
    assert count_tokens("the cat sat on a mat", hf_tokenizer) == 6
    assert count_tokens("the cat sat on a mat", TokenizerWrapper(hf_tokenizer)) == 6

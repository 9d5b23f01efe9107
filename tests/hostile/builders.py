"""Small hostile files built in memory: nothing is downloaded, nothing large is committed."""

from __future__ import annotations

import zlib


def pdf_with_shared_text_stream(pages: int, text_bytes: int, *, line: bytes = b"hostile text " * 8) -> bytes:
    """A PDF of `pages` pages whose page objects all point at ONE compressed content stream of about
    `text_bytes` of text: 200 pages x 1 MB of text in a ~32 KB file, the probe's 79-second, 878 MB PDF."""
    operations = [b"BT /F1 10 Tf 72 720 Td 12 TL"]
    for _ in range(max(1, text_bytes // (len(line) + 8))):
        operations.append(b"(" + line + b") Tj T*")
    operations.append(b"ET")
    content = zlib.compress(b"\n".join(operations), 9)

    objects: list[bytes] = []  # object n is objects[n - 1]
    first_page = 5
    kids = b" ".join(b"%d 0 R" % (first_page + index) for index in range(pages))
    objects.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    objects.append(b"<< /Type /Pages /Kids [" + kids + b"] /Count %d >>" % pages)
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    objects.append(b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(content) + content + b"\nendstream")
    for _ in range(pages):
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
                       b"/Resources << /Font << /F1 3 0 R >> >> /Contents 4 0 R >>")
    return _assemble_pdf(objects)


def pdf_with_pages(page_texts: list[str]) -> bytes:
    """An ordinary PDF with one uncompressed content stream per page."""
    objects: list[bytes] = []
    first_page = 4
    count = len(page_texts)
    kids = b" ".join(b"%d 0 R" % (first_page + 2 * index) for index in range(count))
    objects.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    objects.append(b"<< /Type /Pages /Kids [" + kids + b"] /Count %d >>" % count)
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    for index, text in enumerate(page_texts):
        lines = [b"(" + chunk.encode("latin-1") + b") Tj T*" for chunk in _chunks(text, 90)]
        content = b"\n".join([b"BT /F1 10 Tf 72 720 Td 12 TL", *lines, b"ET"])
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
                       b"/Resources << /Font << /F1 3 0 R >> >> /Contents %d 0 R >>" % (first_page + 2 * index + 1))
        objects.append(b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream")
    return _assemble_pdf(objects)


def _chunks(text: str, size: int) -> list[str]:
    return [text[start:start + size] for start in range(0, len(text), size)] or [""]


def _assemble_pdf(objects: list[bytes]) -> bytes:
    out = bytearray(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    for offset in offsets:
        out += b"%010d 00000 n \n" % offset
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def model_folder_copy(source, target, *, copied=()):
    """A model folder at `target` whose files are symbolic links to those of `source` (no 100 MB copy),
    except the names in `copied`, which are real copies the test may damage."""
    import shutil
    from pathlib import Path

    source, target = Path(source), Path(target)
    target.mkdir(parents=True)
    for entry in source.iterdir():
        if entry.name in copied:
            shutil.copyfile(entry, target / entry.name)
        else:
            (target / entry.name).symlink_to(entry.resolve())
    return target

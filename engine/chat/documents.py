"""Load a document file (.txt, .md, .pdf, .html/.htm) as plain text, or say clearly why it cannot be read."""

from __future__ import annotations

import io
import logging
import re
import time
import warnings
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from engine.errors import DocumentError
from engine.planning.memory import format_bytes

# Extension -> kind. The kind tells the caller (and the UI) how the text was obtained.
SUPPORTED_EXTENSIONS: dict[str, str] = {
    ".txt": "text",
    ".md": "markdown",
    ".pdf": "pdf",
    ".html": "html",
    ".htm": "html",
}

# PDF extraction limits: a dense page of small print holds ~10,000 characters, so 200,000 on one page is
# never a real page; a 1,000-page book extracts in well under a minute with pypdf on one slow core.
MAX_PAGE_CHARS = 200_000
MAX_EXTRACTION_SECONDS = 120.0

# Control characters that never appear in real text; tab, newline, carriage return and form feed do.
_CONTROL_CHARACTERS = re.compile(r"[\x00-\x08\x0b\x0e-\x1f\x7f]")
# Above this share of control characters a "text" file is really binary data.
_MAX_CONTROL_FRACTION = 0.01
# A cp1252 reading is accepted only when it looks like Western text. In French, German, Spanish or Portuguese
# the non-ASCII characters are letters or common typography, and they stand alone or in pairs inside words
# ("ação"). Text in another legacy encoding (Cyrillic, Greek, CJK) or binary data read as cp1252 gives runs
# of 3+ non-ASCII characters (whole foreign words) and symbol soup (‚ ¤ ¦ ¨ ¬ ¯ ´ ¸ ¹).
_CP1252_TYPOGRAPHY = frozenset("“”„‘’–—…•€£°©®«»§¿¡·\u00a0™×÷±")
_NON_ASCII_RUN = re.compile(r"[^\x00-\x7f\s]{3,}")
_MAX_RUN_FRACTION_CP1252 = 0.2
_MAX_SYMBOL_FRACTION_CP1252 = 0.1

_BOMS: tuple[tuple[bytes, str], ...] = (
    # UTF-32 first: its little-endian BOM starts with the UTF-16 one.
    (b"\xff\xfe\x00\x00", "utf-32"),
    (b"\x00\x00\xfe\xff", "utf-32"),
    (b"\xef\xbb\xbf", "utf-8-sig"),
    (b"\xff\xfe", "utf-16"),
    (b"\xfe\xff", "utf-16"),
)


@dataclass(frozen=True)
class Document:
    """A document's plain text and where it came from."""

    path: Path
    name: str
    kind: str
    text: str
    n_chars: int


def load_document(
    path: str | Path,
    *,
    max_bytes: int = 50 * 1024 * 1024,
    max_chars: int = 5_000_000,
    max_page_chars: int = MAX_PAGE_CHARS,
    max_seconds: float = MAX_EXTRACTION_SECONDS,
) -> Document:
    """Read `path` as plain text with normalised whitespace; raise DocumentError saying why if it can't.

    PDF text is extracted under the limits (`max_chars` in all, `max_page_chars` per page, `max_seconds`
    of work), checked as the text comes out, so a small file that expands to gigabytes of text is refused
    as soon as it crosses one, not after all of it was extracted."""
    path = Path(path).expanduser()
    name = path.name
    if not path.exists():
        if path.is_symlink():
            raise DocumentError(f"{path} is a symbolic link that leads nowhere (a missing target or a loop).")
        raise DocumentError(f"The file {path} does not exist.")
    if path.is_dir():
        raise DocumentError(f"{path} is a folder, not a document file.")
    kind = SUPPORTED_EXTENSIONS.get(path.suffix.lower())
    if kind is None:
        supported = ", ".join(SUPPORTED_EXTENSIONS)
        raise DocumentError(
            f"{name} has an unsupported file type '{path.suffix or '(none)'}'; supported types are {supported}."
        )
    size = path.stat().st_size
    if size > max_bytes:
        raise DocumentError(
            f"{name} is {format_bytes(size)}, larger than the {format_bytes(max_bytes)} limit for documents."
        )
    if size == 0:
        raise DocumentError(f"{name} is empty.")
    raw = path.read_bytes()

    if kind == "pdf":
        text = _pdf_text(raw, name, _ExtractionLimits(name, max_chars, max_page_chars, max_seconds))
    else:
        text = _decode_text(raw, name)
        if kind == "html":
            text = html_to_text(text)

    text = normalise_text(text)
    if not text.strip():
        if kind == "pdf":
            raise DocumentError(
                f"{name} has no text layer (it is probably a scanned image); run OCR on it first."
            )
        raise DocumentError(f"{name} contains no text.")
    if len(text) > max_chars:
        raise DocumentError(
            f"{name} has {len(text):,} characters of text, more than the limit of {max_chars:,}."
        )
    return Document(path=path, name=name, kind=kind, text=text, n_chars=len(text))


def count_tokens(document_or_text: Document | str, tokenizer: Any) -> int:
    """Number of tokens the tokenizer gives the document's text, without BOS/EOS special tokens.

    Special tokens are left out because the document is embedded in a prompt whose template adds them once.
    Works with an mlx_lm TokenizerWrapper, a Hugging Face tokenizer, or a `tokenizers.Tokenizer`.
    """
    text = document_or_text.text if isinstance(document_or_text, Document) else document_or_text
    try:
        encoded = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # a tokenizer whose encode takes the text only
        encoded = tokenizer.encode(text)
    # `tokenizers.Tokenizer.encode` returns an Encoding; the others return a list of ids.
    ids = encoded.ids if hasattr(encoded, "ids") else encoded
    return len(ids)


def normalise_text(text: str) -> str:
    """Unix newlines, no trailing whitespace on lines, at most one blank line in a row, no blank ends."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\f", "\n")
    text = re.sub(r"[ \t\v\u00a0]+\n", "\n", text + "\n")
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n")


def _decode_text(raw: bytes, name: str) -> str:
    """Decode a text file: BOM-marked Unicode, UTF-8, or (only if it reads as Western text) cp1252."""
    text = None
    for bom, encoding in _BOMS:
        if raw.startswith(bom):
            try:
                text = raw.decode(encoding)
            except UnicodeDecodeError as error:
                raise DocumentError(
                    f"{name} starts with a {encoding} byte-order mark but is not valid {encoding} text."
                ) from error
            break
    if text is None:
        if b"\x00" in raw:
            raise DocumentError(f"{name} looks like a binary file, not text (it contains NUL bytes).")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = _decode_cp1252_if_text(raw)
        if text is None:
            if _control_fraction(raw.decode("latin-1")) > _MAX_CONTROL_FRACTION:
                raise DocumentError(f"{name} looks like a binary file, not text.")
            raise DocumentError(
                f"{name} is not in a text encoding Velox can read (UTF-8, UTF-16, or Windows-1252); "
                "save it as UTF-8."
            )
    if _control_fraction(text) > _MAX_CONTROL_FRACTION:
        raise DocumentError(f"{name} looks like a binary file, not text (it is full of control characters).")
    return text


def _decode_cp1252_if_text(raw: bytes) -> str | None:
    try:
        text = raw.decode("cp1252")
    except UnicodeDecodeError:
        return None
    non_ascii = [character for character in text if ord(character) > 127]
    if not non_ascii:
        return text
    in_runs = sum(len(run) for run in _NON_ASCII_RUN.findall(text))
    symbols = sum(1 for c in non_ascii if not c.isalpha() and c not in _CP1252_TYPOGRAPHY)
    if in_runs > _MAX_RUN_FRACTION_CP1252 * len(non_ascii):
        return None
    if symbols > _MAX_SYMBOL_FRACTION_CP1252 * len(non_ascii):
        return None
    return text


def _control_fraction(text: str) -> float:
    return len(_CONTROL_CHARACTERS.findall(text)) / max(len(text), 1)


class _ExtractionLimits:
    """Counts PDF text as pypdf produces it (its `visitor_text` callback sees every piece) and stops the
    extraction, by raising DocumentError from inside it, once a limit is crossed.

    Why inside: one page's content stream can hold megabytes of text, and 200 pages may share one stream
    (a 32 KB file that extracts to 200 MB of text); checking only between pages would still pay for the
    first page, checking only at the end pays for all of them."""

    def __init__(self, name: str, max_chars: int, max_page_chars: int, max_seconds: float) -> None:
        self.name = name
        self.max_chars = max_chars
        self.max_page_chars = max_page_chars
        self.max_seconds = max_seconds
        self.deadline = time.monotonic() + max_seconds
        self.total_chars = 0
        self.page_chars = 0
        self.page_number = 0
        self.page_count = 0

    def start_page(self, number: int, count: int) -> None:
        self.page_number, self.page_count, self.page_chars = number, count, 0
        self._check_time()

    def visit(self, text: str, *_layout: Any) -> None:
        self.page_chars += len(text)
        self.total_chars += len(text)
        where = f"page {self.page_number} of {self.page_count}"
        if self.page_chars > self.max_page_chars:
            raise DocumentError(
                f"{self.name} has more than {self.max_page_chars:,} characters of text on {where}, which no "
                "real page holds; it was not read further."
            )
        if self.total_chars > self.max_chars:
            raise DocumentError(
                f"{self.name} has more than the limit of {self.max_chars:,} characters of text (reached at "
                f"{where}); it was not read further."
            )
        self._check_time()

    def _check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise DocumentError(
                f"Extracting the text of {self.name} took longer than {self.max_seconds:g} s (stopped at page "
                f"{self.page_number} of {self.page_count}); the PDF is too large or too complex."
            )


def _pdf_text(raw: bytes, name: str, limits: _ExtractionLimits) -> str:
    """Text of every page of a PDF, pages separated by a blank line, extracted within `limits`."""
    # Imported here so that loading text files does not pay for pypdf's import.
    from pypdf import PdfReader
    from pypdf.errors import DependencyError

    _quiet_pypdf_logger()
    try:
        with warnings.catch_warnings():
            # pypdf reports recoverable damage as warnings; the user gets the text or one clear error.
            warnings.simplefilter("ignore")
            reader = PdfReader(io.BytesIO(raw))
            if reader.is_encrypted and reader.decrypt("") == 0:  # PasswordType.NOT_DECRYPTED
                raise DocumentError(f"{name} is password-protected; remove the password and load it again.")
            pages = []
            count = len(reader.pages)
            for number, page in enumerate(reader.pages, start=1):
                limits.start_page(number, count)
                pages.append(page.extract_text(visitor_text=limits.visit) or "")
    except DocumentError:
        raise
    except DependencyError as error:
        raise DocumentError(
            f"{name} is encrypted with AES, which needs the 'cryptography' package to open."
        ) from error
    except Exception as error:  # pypdf raises many types (PdfReadError, ValueError, KeyError...) on damage
        raise DocumentError(
            f"{name} could not be read as a PDF (the file is damaged or not a PDF)."
        ) from error
    return "\n\n".join(pages)


def _quiet_pypdf_logger() -> None:
    """pypdf logs every recoverable oddity of a file ("Ignoring wrong pointing object ...") at WARNING,
    which Python prints on the user's terminal; Velox reports what matters as one DocumentError."""
    logging.getLogger("pypdf").setLevel(logging.ERROR)


class _HTMLTextExtractor(HTMLParser):
    """Collects the visible text of an HTML page, with blank lines between blocks."""

    _SKIPPED = frozenset({"script", "style", "noscript", "template"})
    # Blocks are set apart by a blank line; line-like elements only start a new line (their end needs
    # nothing: the next line or the enclosing block's end breaks the line).
    _BLOCKS = frozenset(
        {
            "address", "article", "aside", "blockquote", "div", "dl", "fieldset", "figcaption", "figure",
            "footer", "form", "h1", "h2", "h3", "h4", "h5", "h6", "header", "hr", "main", "nav", "ol", "p",
            "pre", "section", "table", "title", "ul",
        }
    )  # fmt: skip
    _LINES = frozenset({"br", "dd", "dt", "li", "tr"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)  # entities arrive unescaped in handle_data
        self.pieces: list[str] = []
        self._skip_depth = 0
        self._pre_depth = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self._SKIPPED:
            self._skip_depth += 1
        elif tag in self._BLOCKS:
            self.pieces.append("\n\n")
            if tag == "pre":
                self._pre_depth += 1
        elif tag in self._LINES:
            self.pieces.append("\n- " if tag == "li" else "\n")
        elif tag in ("td", "th"):
            self.pieces.append(" ")

    def handle_endtag(self, tag: str) -> None:
        if tag in self._SKIPPED:
            self._skip_depth = max(self._skip_depth - 1, 0)
        elif tag in self._BLOCKS:
            self.pieces.append("\n\n")
            if tag == "pre":
                self._pre_depth = max(self._pre_depth - 1, 0)

    def handle_data(self, data: str) -> None:
        if self._skip_depth:
            return
        if not self._pre_depth:
            # Outside <pre>, HTML whitespace (source line breaks included) is only a word separator,
            # and none is needed right after a line break or a space already emitted.
            data = re.sub(r"\s+", " ", data)
            if not self.pieces or self.pieces[-1][-1].isspace():
                data = data.lstrip()
        if data:
            self.pieces.append(data)


def html_to_text(html: str) -> str:
    """Visible text of an HTML page: scripts and styles dropped, entities unescaped, paragraphs kept."""
    extractor = _HTMLTextExtractor()
    extractor.feed(html)
    extractor.close()
    return "".join(extractor.pieces)

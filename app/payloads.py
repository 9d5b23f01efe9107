"""What travels between the engine worker, the controller and the views: small frozen records.

Each record is built once from the engine's own objects (ModelInfo, CompressionLevel, FitVerdict, ...) on the
worker thread, so the GUI thread never holds a model, a tokenizer or an mx.array, and every reader sees named,
typed fields instead of dict keys. Frozen records are safe to hand across threads.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from engine.chat.documents import Document
from engine.chat.session import GenerationStats


@dataclass(frozen=True)
class ModelSummary:
    """What the GUI shows about the loaded model."""

    name: str
    path: str  # '' for a model without a folder
    source: str  # 'embedded' | 'local' | 'hf-cache'
    parameters: int
    bytes_on_disk: int
    max_context: int
    layers: int
    kv_heads: int
    head_dim: int
    quantization: str
    kv_bytes_per_token_16: int
    ready: bool
    note: str

    @classmethod
    def from_info(cls, info: Any) -> ModelSummary:
        """From an engine ModelInfo."""
        return cls(
            name=info.name, path=str(info.path) if info.path else "", source=info.source,
            parameters=int(info.parameters), bytes_on_disk=int(info.bytes_on_disk),
            max_context=int(info.max_context), layers=int(info.layers), kv_heads=int(info.kv_heads),
            head_dim=int(info.head_dim), quantization=info.quantization,
            kv_bytes_per_token_16=int(info.kv_bytes_per_token(16)), ready=bool(info.ready), note=info.note,
        )


@dataclass(frozen=True)
class LevelSummary:
    """One compression level (a slider stop)."""

    key: str  # '16', '8', '4', '3', '2'
    label: str
    method: str
    key_bits: int
    value_bits: int
    group_size: int
    quality_note: str
    extras: str = ""  # what the level keeps besides its codes, e.g. "4 sink tokens in 16 bits"

    @classmethod
    def from_level(cls, level: Any) -> LevelSummary:
        """From an engine CompressionLevel; the one place the app reads a level's fields."""
        config = level.config
        extras = []
        if config.sink_tokens:
            extras.append(f"{config.sink_tokens} sink tokens in 16 bits")
        if config.residual_window:
            extras.append(f"last {config.residual_window} tokens in 16 bits")
        if "key_block" in config.options:
            extras.append(f"keys in blocks of {config.options['key_block']} tokens")
        if config.wide_fraction:
            extras.append(f"one bit more on the {config.wide_fraction:.0%} most sensitive layers")
        if "key_widths" in config.options:
            extras.append("key channels at calibrated widths")
        if config.options.get("rope") in ("auto", "pre"):
            extras.append("keys stored before RoPE" + (" on a GPU" if config.options["rope"] == "auto" else ""))
        return cls(key=str(level.key), label=str(level.label), method=str(config.method),
                   key_bits=int(config.key_bits), value_bits=int(config.value_bits),
                   group_size=int(config.group_size), quality_note=str(level.quality_note),
                   extras=", ".join(extras))


@dataclass(frozen=True)
class LevelAdvice:
    """The level the engine recommends for a context (key '' when none fits), and why."""

    key: str
    label: str
    reason: str
    context_tokens: int


@dataclass(frozen=True)
class GenerationOptions:
    """How to generate one reply (or the defaults, for `configure`)."""

    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = 0
    overflow_policy: str | None = None  # None, 'drop-oldest' or 'truncate-middle'


@dataclass(frozen=True)
class TurnResult:
    """A finished reply (complete or stopped)."""

    text: str
    cancelled: bool
    stats: GenerationStats | None
    regenerated: bool
    documents: tuple[str, ...]


@dataclass(frozen=True)
class Overflow:
    """A question (or a regeneration) that does not fit in the model's context: the user must choose."""

    text: str
    message: str
    needed: int
    limit: int
    has_documents: bool
    regenerate: bool
    remedies: tuple[str, ...] = ()  # the overflow policies that make it fit (ChatSession.overflow_remedies)


@dataclass(frozen=True)
class LevelVerdict:
    """Whether a context fits in memory at one level."""

    key: str
    label: str
    fits: bool
    supported: bool
    bytes: int  # the cache's size at that level
    sentence: str

    @classmethod
    def from_verdict(cls, verdict: Any) -> LevelVerdict:
        """From an engine FitVerdict."""
        return cls(key=str(verdict.level.key), label=str(verdict.level.label), fits=bool(verdict.fits),
                   supported=bool(verdict.supported), bytes=int(verdict.cache_bytes), sentence=verdict.message)


@dataclass(frozen=True)
class DocumentInspection:
    """A document read but not attached yet: its size, and whether it fits the context and memory."""

    doc_id: int
    path: str
    name: str
    kind: str
    chars: int
    tokens: int
    context_needed: int
    context_length: int
    fits_context: bool
    available_bytes: int
    current_level: str
    verdicts: tuple[LevelVerdict, ...]
    advice: LevelAdvice | None

    def verdict(self, key: str) -> LevelVerdict | None:
        return next((v for v in self.verdicts if v.key == key), None)


@dataclass(frozen=True)
class IngestChoice:
    """What the user chose in the document dialog before the document is read."""

    level: str | None = None  # switch to this compression level first
    method: str | None = None  # with this method instead of the level's
    overflow_policy: str | None = None  # 'truncate-middle' to let an overflowing document in


@dataclass(frozen=True)
class IngestResult:
    """How reading a document into the cache ended."""

    doc_id: int
    name: str
    path: str = ""
    tokens: int = 0
    seconds: float = 0.0
    cancelled: bool = False
    failed: bool = False
    message: str = ""
    document: Document | None = None  # the engine's frozen Document, for saving with the question


@dataclass(frozen=True)
class CompressionReport:
    """What a compression switch did (or why it did not happen: available=False and a message)."""

    key: str
    label: str
    method: str
    override: str | None
    before: int = 0
    after: int = 0
    available: bool = False
    message: str = ""
    seconds: float = 0.0
    tokens: int = 0
    note: str = ""


@dataclass(frozen=True)
class DownloadStatus:
    """A model download's progress: fraction is negative while the size is not known yet."""

    message: str
    fraction: float


@dataclass(frozen=True)
class PendingDocument:
    """A document read into the cache, waiting to be sent with the next question."""

    name: str
    tokens: int


@dataclass(frozen=True)
class SavedCacheStatus:
    """What happened to a conversation's saved cache (the file beside the database): saved, reused when the
    conversation was reopened, or refused (then `message` says why in one sentence)."""

    conversation_id: int
    action: str  # 'saved' | 'restored' | 'refused' | 'not-saved' | 'deleted'
    file_bytes: int = 0  # the conversation's file on disk (0: none)
    tokens: int = 0  # tokens the file holds (saved) or the session took over (restored)
    message: str = ""


@dataclass(frozen=True)
class MemoryReading:
    """One reading of every memory number the panel shows, in bytes."""

    system_total: int
    system_available: int
    system_used: int
    pressure: str
    process_rss: int
    mlx_active: int
    mlx_peak: int
    mlx_cache: int
    kv_held: int
    kv_fp16: int
    read_seconds: float
    saved_cache_bytes: int = 0  # this conversation's saved cache file on disk
    saved_caches_bytes: int = 0  # every saved conversation cache on disk
    saved_cache_budget: int = 0  # the disk budget for them (0: caches are not kept)

    @classmethod
    def from_snapshot(cls, snap: Any, kv_held: int, kv_fp16: int, read_seconds: float,
                      saved: tuple[int, int, int] = (0, 0, 0)) -> MemoryReading:
        """From an engine MemorySnapshot, the cache figures the worker last reported, and the saved caches'
        (this conversation's file, all files, budget) bytes."""
        return cls(system_total=snap.system_total, system_available=snap.system_available,
                   system_used=snap.system_total - snap.system_available, pressure=snap.pressure,
                   process_rss=snap.process_rss, mlx_active=snap.mlx_active, mlx_peak=snap.mlx_peak,
                   mlx_cache=snap.mlx_cache, kv_held=kv_held, kv_fp16=kv_fp16, read_seconds=read_seconds,
                   saved_cache_bytes=saved[0], saved_caches_bytes=saved[1], saved_cache_budget=saved[2])


def stats_from_record(stats: dict[str, Any] | None) -> GenerationStats | None:
    """A reply's GenerationStats from its saved form (the store keeps them as JSON)."""

    if not stats:
        return None
    names = [f.name for f in fields(GenerationStats)]
    if any(name not in stats for name in names):
        return None  # saved by a version with other figures: shown without them
    return GenerationStats(**{name: stats[name] for name in names})

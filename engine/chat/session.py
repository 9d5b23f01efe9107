"""ChatSession: one conversation with one model, its prompt cache reused across turns.

The cache always holds the tokens of `cached_tokens` (its first `offset` tokens). Each turn renders the
whole conversation with the model's chat template, keeps the longest common prefix with what the cache
already holds (trimming the cache back to it), and prefills only the rest. Prefill runs in chunks so it
reports progress and can be cancelled; decoding goes through `mlx_lm.stream_generate` unchanged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from engine.chat.documents import Document
from engine.chat.prefill import prefill_chunks
from engine.errors import CancelledError, ContextOverflowError, VeloxError
from engine.kvcache import KVCacheBuilder, KVCacheConfig, reencode_caches, reencode_into
from engine.kvcache.trim import trim_for_reuse
from engine.planning.memory import kv_cache_bytes
from engine.runtime.cpu import attention as cpu_attention

OVERFLOW_POLICIES = (None, "drop-oldest", "truncate-middle")


@dataclass
class GenerationSettings:
    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = 0
    prefill_chunk: int = 512
    overflow_policy: str | None = None  # None: raise ContextOverflowError; or one of OVERFLOW_POLICIES


@dataclass(frozen=True)
class TextChunk:
    text: str


@dataclass(frozen=True)
class PrefillProgress:
    done: int
    total: int


@dataclass(frozen=True)
class Notice:
    """Something the user should know, e.g. that older turns were dropped to fit the context."""

    text: str


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int  # tokens in the whole rendered prompt
    prefilled_tokens: int  # of those, how many were actually run through the model this turn
    reused_tokens: int  # how many were already in the cache
    generated_tokens: int
    prefill_tokens_per_second: float
    decode_tokens_per_second: float
    time_to_first_token: float
    peak_memory_bytes: int
    kv_cache_bytes: int
    finish_reason: str  # 'stop' | 'length' | 'cancelled'


Event = TextChunk | PrefillProgress | Notice | GenerationStats


@dataclass(frozen=True)
class SwitchReport:
    """What a live compression switch did."""

    before: str  # description of the old cache config
    after: str
    tokens: int  # tokens carried over
    bytes_before: int
    bytes_after: int
    seconds: float
    reprefilled: bool  # True when the cache was rebuilt by running the model over the tokens again
    note: str


@dataclass
class Message:
    role: str
    content: str
    documents: list[Document] = field(default_factory=list)
    cancelled: bool = False


CacheFactory = Callable[[Any], list[Any]]


def _default_cache_factory(model: Any) -> list[Any]:
    """Uncompressed: mlx-lm's own cache, or on the Linux CPU fast path the float32 Velox cache, which
    attends with `engine.runtime.cpu.attention` (MLX has no fused CPU attention). Same bytes either way."""
    caches = make_prompt_cache(model)
    # Only plain caches are replaced: a model that asks for others (e.g. sliding-window) keeps them.
    if cpu_attention.active() and all(type(c).__name__ == "KVCache" for c in caches):
        return KVCacheBuilder(KVCacheConfig("fp32")).for_model(model).build()
    return caches


_SAME = object()  # adopt_saved_cache: the cache was made with the session's own compression


def _resolved(model: Any, config: Any, tokenizer: Any = None, progress: Any = None) -> Any:
    """`config` validated for `model` (None stays None); a `wide=F` config gets its layers named here, calibrated
    on prose through `tokenizer` or read from the calibration cache (see layer_sensitivity). On a GPU, its kernels'
    first run (engine/kvcache/kernel_check.py) happens here too, where `progress` hears of it, not in the first
    reply's cache."""
    if config is None:
        return None
    return KVCacheBuilder(config).for_model(model, tokenizer=tokenizer, progress=progress).verify_kernels(progress).config


def _factory_for(model: Any, config: Any, tokenizer: Any = None, progress: Any = None) -> CacheFactory:
    """The cache factory of a compression (None: the uncompressed default); validates `config` for `model`
    (see `_resolved`)."""
    if config is None:
        return _default_cache_factory
    config = _resolved(model, config, tokenizer, progress)

    def factory(model: Any, _config: Any = config) -> list[Any]:
        return KVCacheBuilder(_config).for_model(model).build()

    return factory


class ChatSession:
    """A conversation with a loaded model. Not thread-safe: drive it from one worker thread; `cancel()`
    may be called from any thread."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        context_length: int | None = None,
        system_prompt: str | None = None,
        settings: GenerationSettings | None = None,
        cache_factory: CacheFactory | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.settings = settings or GenerationSettings()
        self.system_prompt = system_prompt
        self.context_length = context_length or self._model_context_length(model)
        self.history: list[Message] = []
        self.pending_documents: list[Document] = []
        self._cache_factory = cache_factory or _default_cache_factory
        self.compression: Any = None  # the KVCacheConfig in use; None = mlx-lm's 16-bit KVCache
        self.prompt_cache: list[Any] = self._cache_factory(model)
        self.cached_tokens: list[int] = []
        self._cancel = threading.Event()
        self.last_stats: GenerationStats | None = None

    # ----- facts -----------------------------------------------------------------------------------
    @staticmethod
    def _model_context_length(model: Any) -> int:
        args = getattr(model, "args", None)
        return int(getattr(args, "max_position_embeddings", None) or 4096)

    @property
    def cache_offset(self) -> int:
        return int(self.prompt_cache[0].offset) if self.prompt_cache else 0

    def kv_cache_bytes(self) -> int:
        return kv_cache_bytes(self.prompt_cache)

    # ----- conversation editing ------------------------------------------------------------------
    def attach_document(self, document: Document) -> None:
        """Attach a document to the next user message (it is placed before the question)."""
        self.pending_documents.append(document)

    def new_chat(self) -> None:
        """Start over. The cache is kept: the system-prompt prefix is reused by the next turn."""
        self.history.clear()
        self.pending_documents.clear()

    def cancel(self) -> None:
        self._cancel.set()

    # ----- rendering -------------------------------------------------------------------------------
    @staticmethod
    def _render_user_content(message: Message) -> str:
        if not message.documents:
            return message.content
        blocks = [f'Document "{doc.name}":\n\n{doc.text}' for doc in message.documents]
        return "\n\n".join(blocks) + "\n\n" + message.content

    def _chat_messages(self, history: list[Message]) -> list[dict[str, str]]:
        messages = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        for message in history:
            content = self._render_user_content(message) if message.role == "user" else message.content
            messages.append({"role": message.role, "content": content})
        return messages

    def render_tokens(self, history: list[Message] | None = None) -> list[int]:
        """Token ids of the conversation plus the assistant generation prompt."""
        messages = self._chat_messages(self.history if history is None else history)
        try:
            tokens = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as error:  # the template is the model folder's Jinja code: it raises what it likes
            raise VeloxError(_template_refusal(error, has_system=bool(self.system_prompt))) from error
        if isinstance(tokens, dict):  # some tokenizers return a BatchEncoding
            tokens = tokens["input_ids"]
        return list(tokens)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    # ----- overflow ----------------------------------------------------------------------------------
    def _fit_to_context(self, history: list[Message]) -> tuple[list[Message], list[int], list[str]]:
        """Apply the overflow policy; return the (possibly shortened) history, its tokens and notices."""
        budget = self.context_length - self.settings.max_tokens
        tokens = self.render_tokens(history)
        notices: list[str] = []
        if len(tokens) <= budget:
            return history, tokens, notices
        policy = self.settings.overflow_policy
        if policy not in OVERFLOW_POLICIES:
            raise VeloxError(f"Unknown overflow policy '{policy}'; use one of: drop-oldest, truncate-middle.")
        if policy == "drop-oldest":
            history = list(history)
            dropped = 0
            # Keep the newest message (the question being asked); drop the oldest turns first.
            while len(tokens) > budget and len(history) > 1:
                history.pop(0)
                if history and history[0].role == "assistant":
                    history.pop(0)
                dropped += 1
                tokens = self.render_tokens(history)
            if dropped:
                notices.append(f"Dropped the {dropped} oldest turn(s) to fit the {self.context_length}-token context.")
        elif policy == "truncate-middle":
            history, omitted = self._truncate_documents(history, len(tokens) - budget)
            tokens = self.render_tokens(history)
            if omitted:
                notices.append(f"Left out {omitted} tokens from the middle of the document(s) to fit the context.")
        if len(tokens) > budget:
            raise ContextOverflowError(
                len(tokens) + self.settings.max_tokens,
                self.context_length,
                detail=f"(prompt {len(tokens)} tokens + room for a {self.settings.max_tokens}-token reply)",
                advice=_overflow_advice(history, policy),
            )
        return history, tokens, notices

    def _truncate_documents(self, history: list[Message], excess: int) -> tuple[list[Message], int]:
        """Cut `excess` tokens (plus a small margin for the marker) from the middle of the longest docs."""
        margin = 32
        new_history: list[Message] = []
        remaining = excess + margin
        omitted_total = 0
        # Newest documents first: they are most likely what the question is about, but the longest
        # document gives the most room, so cut the longest ones first.
        docs = sorted(
            ((len(self.tokenizer.encode(d.text, add_special_tokens=False)), i, j)
             for i, m in enumerate(history) for j, d in enumerate(m.documents)),
            reverse=True,
        )
        replacements: dict[tuple[int, int], Document] = {}
        for n_tokens, i, j in docs:
            if remaining <= 0:
                break
            doc = history[i].documents[j]
            ids = self.tokenizer.encode(doc.text, add_special_tokens=False)
            cut = min(remaining, n_tokens - 64)
            if cut <= 0:
                continue
            head = (n_tokens - cut) // 2
            tail = n_tokens - cut - head
            text = (self.tokenizer.decode(ids[:head]) + f"\n\n[... {cut} tokens omitted ...]\n\n"
                    + self.tokenizer.decode(ids[n_tokens - tail:]))
            replacements[(i, j)] = Document(doc.path, doc.name, doc.kind, text, len(text))
            remaining -= cut
            omitted_total += cut
        for i, message in enumerate(history):
            documents = [replacements.get((i, j), d) for j, d in enumerate(message.documents)]
            new_history.append(Message(message.role, message.content, documents, message.cancelled))
        return new_history, omitted_total

    # ----- cache management -------------------------------------------------------------------------
    def _sync_cache_to(self, tokens: list[int]) -> int:
        """Trim the cache to the longest common prefix with `tokens` (leaving at least one token to run).
        Returns how many cached tokens are reused."""
        common = 0
        limit = min(len(tokens) - 1, len(self.cached_tokens))
        while common < limit and self.cached_tokens[common] == tokens[common]:
            common += 1
        excess = self.cache_offset - common
        if excess > 0:
            if can_trim_prompt_cache(self.prompt_cache):
                # Back to where the cache can be rebuilt exactly (a cut KIVI key block would be quantized twice).
                common = self.cache_offset - trim_for_reuse(self.prompt_cache, excess)
            else:
                self.prompt_cache = self._cache_factory(self.model)
                common = 0
        self.cached_tokens = self.cached_tokens[:common]
        return common

    def _settle_cache(self, known_tokens: list[int]) -> None:
        """After generation the cache may hold one token more than we saw (mlx-lm evaluates the next step
        ahead); trim it so the cache holds exactly a prefix of `known_tokens`."""
        offset = self.cache_offset
        if offset > len(known_tokens):
            trim_for_reuse(self.prompt_cache, offset - len(known_tokens))
            offset = self.cache_offset
        self.cached_tokens = list(known_tokens[:offset])

    def _trim_layers_to(self, n_tokens: int) -> None:
        """Make every layer hold exactly the first `n_tokens` of `cached_tokens` (each layer trimmed on its
        own; a cache that cannot be trimmed is started afresh)."""
        if not can_trim_prompt_cache(self.prompt_cache):
            self.reset_cache()
            return
        for cache in self.prompt_cache:
            if cache.offset > n_tokens:
                cache.trim(cache.offset - n_tokens)
        self.cached_tokens = self.cached_tokens[:n_tokens]

    def reset_cache(self) -> None:
        self.prompt_cache = self._cache_factory(self.model)
        self.cached_tokens = []

    def adopt_saved_cache(self, prompt_cache: list[Any], tokens: list[int], compression: Any = _SAME) -> None:
        """Take over a cache saved earlier (engine.chat.saved_cache) that holds exactly `tokens`, made with
        this session's model, template and compression (the loader checked that). The next turn reuses
        its longest common prefix with the rendered conversation, like any cache, so only new tokens run.
        A cache made with another compression names it (a KVCacheConfig, or None for 16-bit): the session
        takes that compression over, and `set_compression` can then re-encode it like a live cache."""
        offsets = {int(layer.offset) for layer in prompt_cache}
        if offsets != {len(tokens)}:
            raise ValueError(f"The cache holds {sorted(offsets)} tokens, not {len(tokens)}.")
        if compression is not _SAME:
            self._cache_factory = _factory_for(self.model, compression, self.tokenizer)
            self.compression = compression
        self.prompt_cache = prompt_cache
        self.cached_tokens = list(tokens)

    def replace_cache(self, prompt_cache: list[Any], cache_factory: CacheFactory | None = None) -> None:
        """Swap in a cache holding the same tokens (used by the live compression switch)."""
        self.prompt_cache = prompt_cache
        if cache_factory is not None:
            self._cache_factory = cache_factory

    # ----- live compression switch -----------------------------------------------------------------
    def set_compression(self, config: Any, *, reprefill: bool = False, chunk_tokens: int = 1024,
                        progress: Callable[[str, float], None] | None = None) -> SwitchReport:
        """Change the KV cache method/bits mid-conversation without reloading the model.

        By default the held cache is re-encoded layer by layer (decoded in chunks of `chunk_tokens`, never
        the whole history at once) — no model call, no re-prefill. Re-encoding cannot restore precision
        that was already thrown away, so a switch *up* in precision keeps the old quantization error; with
        `reprefill=True` the cache is instead rebuilt exactly by running the model over the held tokens
        (the report says which happened). `config=None` switches to mlx-lm's plain 16-bit cache. A level with
        `wide=F` calibrates its layers for this model the first time (minutes on a small CPU; see
        engine/kvcache/layer_sensitivity.py): `progress(message, fraction)` hears of it."""
        start = time.perf_counter()
        bytes_before = self.kv_cache_bytes()
        before = self._describe_compression(self.compression)
        # validates the config before touching anything (and calibrates a wide level's layers, once per model);
        # resolved once, so the factory's own validation finds the layers already named
        config = _resolved(self.model, config, self.tokenizer, progress)
        factory = _factory_for(self.model, config)

        upgrading = self._precision_rank(config) > self._precision_rank(self.compression)
        tokens = list(self.cached_tokens)
        if reprefill and tokens:
            old_cache, self.prompt_cache = self.prompt_cache, factory(self.model)
            self.cached_tokens = []
            try:
                for _ in self._prefill(tokens, threading.Event()):
                    pass
            except BaseException:
                self.prompt_cache, self.cached_tokens = old_cache, tokens
                raise
            note = "Rebuilt the cache by re-reading the conversation at the new precision."
        else:
            # The one re-encode path (engine.kvcache.builder), which `velox bench speed` times.
            if not tokens:
                new_cache = factory(self.model)
            elif config is None:
                new_cache = reencode_into(self.prompt_cache, factory(self.model), chunk_tokens)
            else:
                new_cache = reencode_caches(self.prompt_cache, config, chunk_tokens)
            self.prompt_cache = new_cache
            note = "Re-encoded the held cache."
            if upgrading and tokens:
                note += (" Switching up keeps the error of the lower precision already applied; "
                         "use reprefill=True to rebuild it exactly.")
        self._cache_factory = factory
        self.compression = config
        return SwitchReport(before, self._describe_compression(config), len(tokens), bytes_before,
                            self.kv_cache_bytes(), time.perf_counter() - start, bool(reprefill and tokens), note)

    @staticmethod
    def _describe_compression(config: Any) -> str:
        return "16-bit (mlx-lm KVCache)" if config is None else config.describe()

    def _precision_rank(self, config: Any) -> float:
        """Bits per value of a config for this model (16 for the plain cache), to tell up from down."""
        if config is None:
            return 16.0
        return KVCacheBuilder(config).for_model(self.model).effective_bits_per_value()

    def _prefill(self, tokens: list[int], cancel: threading.Event) -> Iterator[PrefillProgress]:
        """Run `tokens` through the model into the cache in chunks, yielding progress; stops on cancel (the chunk
        in flight is finished: engine/chat/prefill.py)."""
        total = len(tokens)
        yield PrefillProgress(0, total)
        if not total:
            return
        counted = 0
        for done in prefill_chunks(self.model, self.prompt_cache, tokens, self.settings.prefill_chunk, cancel):
            self.cached_tokens.extend(tokens[counted:done])
            counted = done
            yield PrefillProgress(done, total)

    # ----- the turn ------------------------------------------------------------------------------------
    def prefill_pending(self) -> Iterator[PrefillProgress]:
        """Ingest attached documents before the question is asked (cancellable with `cancel()`).

        Renders the conversation with the documents and an empty question, and prefills up to the end of
        the document text; the following `send()` reuses it."""
        self._cancel.clear()
        if not self.pending_documents:
            return
        draft = [*self.history, Message("user", "", list(self.pending_documents))]
        _, tokens, _ = self._fit_to_context(draft)
        # Stop short of the end-of-turn markers, which will differ once the question is appended.
        tokens = tokens[:-8]
        reused = self._sync_cache_to(tokens)
        yield from self._prefill(tokens[reused:], self._cancel)
        if self._cancel.is_set():
            raise CancelledError("Document ingestion was cancelled; the part already read is kept in the cache.")

    def send(self, text: str, settings: GenerationSettings | None = None) -> Iterator[Event]:
        """Add a user message and stream the reply: PrefillProgress*, TextChunk*, then GenerationStats.

        The history gets the user message and the (possibly partial, if cancelled) reply."""
        yield from self._turn(*self._next_turn(text, regenerate=False), settings)

    def regenerate(self, settings: GenerationSettings | None = None) -> Iterator[Event]:
        """Answer the last user message again, in place of the last reply (which stays until the new turn
        starts: if it cannot, e.g. the conversation no longer fits, nothing changes)."""
        yield from self._turn(*self._next_turn("", regenerate=True), settings)

    def _next_turn(self, text: str, *, regenerate: bool) -> tuple[list[Message], Message]:
        """(the messages before it, the user message) of the turn `send(text)` or `regenerate()` would answer."""
        if not regenerate:
            return self.history, Message("user", text, list(self.pending_documents))
        if len(self.history) < 2 or self.history[-1].role != "assistant" or self.history[-2].role != "user":
            raise VeloxError("There is no reply to regenerate.")
        asked = self.history[-2]
        return self.history[:-2], Message("user", asked.content, [*asked.documents, *self.pending_documents])

    def overflow_remedies(self, text: str, settings: GenerationSettings | None = None, *,
                          regenerate: bool = False) -> tuple[str, ...]:
        """The overflow policies that would make the turn `send(text, settings)` (or `regenerate(settings)`)
        fit the context, in OVERFLOW_POLICIES order; () when none can (a single turn without a document that
        is too long, or a document that is too long even with its middle cut). Tries each policy on the
        rendered conversation only: the session, its history and its cache are not changed."""
        earlier, user = self._next_turn(text, regenerate=regenerate)
        candidate = [*earlier, user]
        base = settings or self.settings
        remedies = []
        previous = self.settings
        try:
            for policy in OVERFLOW_POLICIES:
                if policy is None:
                    continue
                self.settings = replace(base, overflow_policy=policy)
                try:
                    self._fit_to_context(candidate)
                except ContextOverflowError:
                    continue
                remedies.append(policy)
        finally:
            self.settings = previous
        return tuple(remedies)

    def _turn(self, earlier: list[Message], user: Message, settings: GenerationSettings | None) -> Iterator[Event]:
        """Answer `user` after the messages `earlier`, which become the history with the reply."""
        settings = settings or self.settings
        previous, self.settings = self.settings, settings
        try:
            yield from self._answer(earlier, user, settings)
        finally:
            self.settings = previous

    def _answer(self, earlier: list[Message], user: Message, settings: GenerationSettings) -> Iterator[Event]:
        """The turn. Everything that can refuse it (the overflow check) runs before the session changes. A
        failure inside the model puts history and attached documents back as they were and leaves the cache
        holding exactly `cached_tokens`; a cancel or an abandoned stream keeps the partial reply."""
        self._cancel.clear()
        candidate = [*earlier, user]
        _fitted, tokens, notices = self._fit_to_context(candidate)
        for notice in notices:
            yield Notice(notice)
        if settings.seed is not None:
            mx.random.seed(settings.seed)
        mx.reset_peak_memory()

        start = time.perf_counter()
        reused = self._sync_cache_to(tokens)  # the cache keeps agreeing with cached_tokens
        history_before, documents_before = self.history, self.pending_documents
        self.pending_documents = []
        self.history = candidate
        reply_tokens: list[int] = []
        stop_token: list[int] = []
        reply_text = ""
        finish_reason = "cancelled"
        first_token_time = None
        failed = False
        try:
            yield from self._prefill(tokens[reused:-1], self._cancel)
            if not self._cancel.is_set():
                sampler = make_sampler(temp=settings.temperature, top_p=settings.top_p)
                responses = stream_generate(
                    self.model, self.tokenizer, mx.array(tokens[-1:]), max_tokens=settings.max_tokens,
                    sampler=sampler, prompt_cache=self.prompt_cache,
                )
                try:
                    for response in responses:
                        if first_token_time is None:
                            first_token_time = time.perf_counter()
                        if response.finish_reason is None or response.finish_reason == "length":
                            reply_tokens.append(response.token)
                        else:  # the end-of-turn token: already in the cache, and rendered next turn
                            stop_token.append(response.token)
                        if response.finish_reason is not None:
                            finish_reason = response.finish_reason
                        if response.text:
                            reply_text += response.text
                            yield TextChunk(response.text)
                        if self._cancel.is_set():
                            finish_reason = "cancelled"
                            break
                finally:
                    responses.close()
        except Exception:
            failed = True
            raise
        finally:
            if failed:
                # A failure inside the model (e.g. out of memory) may have left some layers a chunk ahead of
                # others: cut every layer back to the tokens known to be complete, and undo the turn.
                self._trim_layers_to(len(self.cached_tokens))
                self.history, self.pending_documents = history_before, documents_before
            else:
                # Normal completion, cancel, or a consumer that abandons the generator or is interrupted
                # (Ctrl-C): the cache is trimmed to exactly the tokens we know, and the history records the
                # (possibly partial) reply, so the next turn starts from a consistent state.
                if self._cancel.is_set():
                    finish_reason = "cancelled"
                self._settle_cache(tokens + reply_tokens + stop_token)
                self.history.append(Message("assistant", reply_text, cancelled=finish_reason == "cancelled"))
        end = time.perf_counter()
        prefill_time = (first_token_time or end) - start
        decode_time = end - (first_token_time or end)
        decoded = max(len(reply_tokens) - 1, 0)
        stats = GenerationStats(
            prompt_tokens=len(tokens),
            prefilled_tokens=len(tokens) - reused,
            reused_tokens=reused,
            generated_tokens=len(reply_tokens),
            prefill_tokens_per_second=(len(tokens) - reused) / prefill_time if prefill_time > 0 else 0.0,
            decode_tokens_per_second=decoded / decode_time if decode_time > 0 and decoded else 0.0,
            time_to_first_token=prefill_time,
            peak_memory_bytes=int(mx.get_peak_memory()),
            kv_cache_bytes=self.kv_cache_bytes(),
            finish_reason=finish_reason,
        )
        self.last_stats = stats
        yield stats


def _overflow_advice(history: list[Message], policy: str | None) -> str:
    """What can still make an overflowing conversation fit, given the policy already applied: never a
    policy that cannot help (dropping older turns when the question is the only turn)."""
    has_documents = any(message.documents for message in history)
    options = []
    if len(history) > 1 and policy != "drop-oldest":
        options.append("'drop-oldest' to drop older turns")
    if has_documents and policy != "truncate-middle":
        options.append("'truncate-middle' to cut the middle of the document(s)")
    shorten = "a shorter document or question" if has_documents else "a shorter question"
    if policy == "truncate-middle" and has_documents:
        shorten = "a shorter question, or fewer documents (the cut keeps each document's start and end)"
    prefix = "Dropping older turns cannot help: this is the only turn left. " if policy == "drop-oldest" else ""
    if options:
        return f"{prefix}Use {' or '.join(options)}, or {shorten}."
    return f"{prefix}Use {shorten}."


def _template_refusal(error: Exception, *, has_system: bool) -> str:
    """One line for a chat template that failed: its own message (Gemma's "System role not supported"),
    or the Jinja sandbox's refusal of an unsafe template."""
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    message = f"The model's chat template cannot render this conversation: {reason.rstrip('.')}."
    if has_system and "system" in reason.lower():
        message += " This model takes no system prompt; leave it out."
    return message

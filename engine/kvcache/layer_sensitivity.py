"""Which layers lose the most when their KV cache is quantized: the calibration behind option `wide=F`.

A `wide=F` configuration stores floor(F × n_layers) layers with one more key and value bit (config.py). Which
ones is decided here, once per model and spec, by the method the simulation of issue 12 validated
(benchmarks/results/near_lossless_lowbits_experiments.json): a reference pass with 16-bit caches in every layer,
then one pass per layer with that layer ALONE storing the spec at PROBE_BITS (2) bits and every other layer
16-bit; a layer's sensitivity is the mean KL(reference || probe) of the next-token distributions over the chunks from
the middle of the tokens on (those attend over compressed history). n_layers + 1 passes, batched over several token
streams. The probe runs at 2 bits, not at the spec's own, because at 4 bits one layer's KL on a few thousand
tokens is at the noise floor; at 2 bits every layer's error shows while the layout (groups, key blocks, value
rotation) stays the spec's. On SmolLM2-135M the simulation picked layers 10, 18 and 1 this way (k2v2 on prose),
and widening them took the 4-bit level from +1.04% to +0.46% perplexity on held-out prose.

Tokens: the caller's; else, where the builder is given the model's tokenizer, the bundled prose
(`calibration_prose.txt`, ~1k tokens of Milton's Areopagitica); else, with the model alone, text the model writes
itself from seeded random start tokens at temperature 0.7. Human prose ranks better: on SmolLM2 at the 4-bit
level's probe, the prose picks layers 1, 10, 18 (as does Botchan from token 2000), while the model's own text
picks 1, 18, 19 (at temperature 1: 1, 16, 18; one 1,024-token stream: 1, 19, 20; a stream repeated: 16, 18, 19);
layer 10 shows only on human text. On held-out prose (benchmarks/results/near_lossless_layerbits.json and
_selfwritten.json) layers 1, 10, 18 give +0.46% perplexity at 4 bits (KL 0.0096) and +4.17% at 3 (KL 0.0575),
layers 1, 18, 19 +0.54% (0.0125) and +7.13% (0.0743); the 3-bit level's own probe (no value rotation) picks
1, 9, 10 on the prose: +5.82% (0.0580), against +7.20% (0.0740) without wide. The calibration costs ~185 s for
SmolLM2 on a 2-core CPU (31 passes over the ~1k prose tokens), once per model and spec. Everything is seeded,
so a calibration is deterministic on one device.

Results are cached in the user's data folder (`calibration/`), one JSON file per (model identity incl. a
fingerprint of its weights, probe spec, tokens): the per-layer KLs, from which any fraction's layers follow.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from engine.errors import ConfigError
from engine.kvcache.attention import install_attention_dispatch
from engine.kvcache.builder import model_shape
from engine.kvcache.config import KVCacheConfig, n_wide_layers
from engine.kvcache.quant.vq import model_identity, weights_fingerprint
from engine.kvcache.registry import get_method
from engine.paths import data_dir, make_private_file, private_dir

SCHEMA = "velox-layer-sensitivity/1"
PROBE_BITS = 2
# Self-written calibration text: 2 streams of 512 tokens, written as one batch. At temperature 0.7 SmolLM2 writes
# coherent prose (at 1.0 it drifts into made-up words); the calibration's cost is n_layers + 1 passes over these
# 1,024 tokens (SmolLM2 on a 2-core CPU: ~50 s to write them, ~160 s for the passes).
DEFAULT_STREAMS = 2
DEFAULT_TOKENS = 512
DEFAULT_SEED = 0
DEFAULT_TEMPERATURE = 0.7
# Human prose, for callers that have the model's tokenizer (the app's chat session, benchmarks/near_lossless.py).
PROSE_FILE = Path(__file__).with_name("calibration_prose.txt")
# Tokens per forward call: one key block of the 4-bit level, so each chunk attends over compressed blocks as
# prefill does.
CHUNK_TOKENS = 128

Progress = Callable[[str, float], None]


# Options that choose how a cache computes, not what it stores: a calibration (and its key) leaves them out, so the
# quality sweep's caches (which set prefill_attention) widen the layers the app's do.
PATH_OPTIONS = ("kernels", "prefill_attention")


def probe_config(config: KVCacheConfig) -> KVCacheConfig:
    """The spec one layer stores during calibration: `config` without `wide`, at PROBE_BITS bits, with keys as the
    model gives them (no rope option: KIVI's rope=auto stores them before RoPE only on a GPU, and a level must
    widen the same layers on every device; on SmolLM2 a probe with keys before RoPE ranked the same three layers
    first, 1, 10 and 18: benchmarks/results/prerope_option_heldout.json), without PATH_OPTIONS and without KIVI's
    key_widths (calibrated after the wide layers, for their bits)."""
    plain = config.without_wide()
    kept = {k: v for k, v in plain.options.items()
            if k != "rope" and not k.startswith("rope_") and k not in PATH_OPTIONS and k != "key_widths"}
    return replace(plain, key_bits=PROBE_BITS, value_bits=PROBE_BITS, options=kept)


def prose_calibration_tokens(tokenizer: Any) -> list[int]:
    """The bundled calibration prose (`calibration_prose.txt`, the opening of Milton's Areopagitica, public
    domain; ~1k tokens), tokenized; the file's header, up to its first blank line, is left out."""
    text = PROSE_FILE.read_text(encoding="utf-8").split("\n\n", 1)[1]
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def self_written_tokens(
    model: Any,
    n_streams: int = DEFAULT_STREAMS,
    n_tokens: int = DEFAULT_TOKENS,
    seed: int = DEFAULT_SEED,
    temperature: float = DEFAULT_TEMPERATURE,
) -> mx.array:
    """[n_streams, n_tokens] tokens the model samples itself (at `temperature`) after seeded random start tokens.

    The streams are one batch, so each step is one model call for all of them (generation itself is a loop
    over positions: each token depends on the previous one)."""
    vocab = model_shape_vocab(model)
    key = mx.random.key(seed)
    key, start_key = mx.random.split(key)
    token = mx.random.randint(0, vocab, (n_streams, 1), key=start_key).astype(mx.uint32)
    cache = make_prompt_cache(model)
    columns = [token]
    for _ in range(n_tokens - 1):
        logits = model(token, cache=cache)[:, -1, :].astype(mx.float32)
        key, step_key = mx.random.split(key)
        token = mx.random.categorical(logits / temperature, key=step_key)[:, None].astype(mx.uint32)
        columns.append(token)
        mx.eval(token)
    return mx.concatenate(columns, axis=1)


def model_shape_vocab(model: Any) -> int:
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    if not vocab:
        raise ConfigError("Cannot read this model's vocabulary size, so it cannot write its calibration text.")
    return int(vocab)


def _logprobs(model: Any, inputs: mx.array, caches: list[Any]) -> mx.array:
    logits = model(inputs, cache=caches).astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def layer_kl(
    model: Any,
    tokens: mx.array,
    probe: KVCacheConfig,
    chunk_tokens: int = CHUNK_TOKENS,
    progress: Progress | None = None,
) -> list[float]:
    """Per layer, the mean KL(16-bit reference || that layer alone stored as `probe`) over the tokens of the
    chunks that start at or after the middle of `tokens` ([streams, n] or [n]), fed `chunk_tokens` at a time."""
    # The builder imports this module: imported at call time.
    from engine.kvcache.builder import KVCacheBuilder

    tokens = tokens if tokens.ndim == 2 else tokens[None]
    n = tokens.shape[1]
    if n < 2 * chunk_tokens:
        raise ConfigError(f"Layer calibration needs at least {2 * chunk_tokens} tokens per stream, not {n}.")
    shape = model_shape(model)
    reference_builder = KVCacheBuilder(KVCacheConfig("fp16")).for_model(model)
    probe = KVCacheBuilder(probe).for_model(model).config
    probe_class = get_method(probe.method)
    install_attention_dispatch()
    starts = list(range(0, n, chunk_tokens))
    score_from = min(start for start in starts if start >= n // 2)  # whole chunks are scored
    # The reference's log-probabilities of the scored chunks (float32: the KLs are small differences).
    reference_caches = reference_builder.build()
    reference: dict[int, mx.array] = {}
    for start in starts:
        logprobs = _logprobs(model, tokens[:, start : start + chunk_tokens], reference_caches)
        if start >= score_from:
            reference[start] = logprobs
        mx.eval(logprobs, [c.state for c in reference_caches])
    del reference_caches
    n_scored = tokens.shape[0] * (n - score_from)
    kls = []
    for layer in range(shape.n_layers):
        caches = reference_builder.build()
        caches[layer] = probe_class(probe, layer_index=layer)
        total = mx.array(0.0)
        for start in starts:
            logprobs = _logprobs(model, tokens[:, start : start + chunk_tokens], caches)
            if start >= score_from:
                ref = reference[start]
                total = total + (mx.exp(ref) * (ref - logprobs)).sum()
            mx.eval(total, [c.state for c in caches])
        kls.append(total.item() / n_scored)
        if progress:
            progress(f"layer {layer + 1}/{shape.n_layers}", (layer + 1) / shape.n_layers)
    return kls


def calibration_dir() -> Path:
    """Where calibrations are kept: `calibration/` in the user's data folder (private, like the rest)."""
    return private_dir(data_dir() / "calibration")


def _calibration_key(model: Any, probe: KVCacheConfig, tokens_described: dict[str, Any]) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "model": {**model_identity(model), "weights_sha256": weights_fingerprint(model)},
        "probe": str(probe),
        "chunk_tokens": CHUNK_TOKENS,
        "tokens": tokens_described,
    }


# Calibrations that ship with Velox (the embedded default model at the app's levels), read before the data
# folder's: the first use of a wide level on the default model then measures nothing (~3 minutes on a 2-core
# CPU otherwise). Same file format and key; a file whose key does not match is ignored.
BUNDLED_DIR = Path(__file__).with_name("calibrations")


def calibration_name(key: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return f"layer_sensitivity-{digest}.json"


def calibration_path(key: dict[str, Any]) -> Path:
    return calibration_dir() / calibration_name(key)


def _saved_kls(path: Path, key: dict[str, Any], n_layers: int) -> list[float] | None:
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # none yet, or unreadable: measure again (and overwrite it)
    if saved.get("key") == key and len(saved.get("kl", ())) == n_layers:
        return [float(kl) for kl in saved["kl"]]
    return None


def layer_sensitivity(
    model: Any,
    config: KVCacheConfig,
    tokens: Sequence[int] | None = None,
    progress: Progress | None = None,
) -> list[float]:
    """Each layer's KL when it alone is stored as `probe_config(config)` (see the module doc), read from the
    calibrations bundled with Velox (`BUNDLED_DIR`) or the data folder's cache, or measured (on `tokens`, or on
    text the model writes) and saved in the data folder."""
    probe = probe_config(config)
    if tokens is None:
        described: dict[str, Any] = {
            "self_written": {"streams": DEFAULT_STREAMS, "tokens": DEFAULT_TOKENS, "seed": DEFAULT_SEED,
                             "temperature": DEFAULT_TEMPERATURE}
        }
    else:
        described = {"given_sha256": hashlib.sha256(json.dumps([int(t) for t in tokens]).encode()).hexdigest(),
                     "count": len(tokens)}
    key = _calibration_key(model, probe, described)
    n_layers = model_shape(model).n_layers
    bundled = _saved_kls(BUNDLED_DIR / calibration_name(key), key, n_layers)
    if bundled is not None:
        return bundled
    path = calibration_path(key)
    saved = _saved_kls(path, key, n_layers)
    if saved is not None:
        return saved
    began = time.perf_counter()
    if tokens is None:
        if progress:
            progress("the model writes its calibration text", 0.0)
        ids = self_written_tokens(model, DEFAULT_STREAMS, DEFAULT_TOKENS, DEFAULT_SEED, DEFAULT_TEMPERATURE)
    else:
        ids = mx.array([int(t) for t in tokens])[None]
    kls = layer_kl(model, ids, probe, CHUNK_TOKENS, progress=progress)
    record = {"key": key, "kl": kls, "seconds": time.perf_counter() - began}
    partial = path.with_suffix(".tmp")
    partial.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    make_private_file(partial)
    os.replace(partial, path)  # whole or not at all: a reader never sees half a file
    return kls


def rank_layers(kls: Sequence[float], count: int) -> tuple[int, ...]:
    """The `count` layers with the largest KL (ties: the lower index), in increasing order."""
    order = sorted(range(len(kls)), key=lambda i: (-kls[i], i))
    return tuple(sorted(order[:count]))


def calibrated_wide_layers(
    model: Any,
    config: KVCacheConfig,
    tokens: Sequence[int] | None = None,
    progress: Progress | None = None,
) -> tuple[int, ...]:
    """The floor(F × n_layers) layers a `wide=F` config widens on `model`: the most sensitive ones."""
    fraction = config.wide_fraction
    if fraction is None:
        raise ConfigError(f"The spec {config} has no wide=F option: no layers to choose.")
    count = n_wide_layers(fraction, model_shape(model).n_layers)
    if count == 0:
        return ()  # nothing widened: no calibration to run
    return rank_layers(layer_sensitivity(model, config, tokens, progress), count)

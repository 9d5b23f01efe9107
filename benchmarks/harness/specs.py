"""What is compared: each prompt cache is named by one spec token.

    fp16, fp32, kivi:k4v4:g64, ...          a Velox cache: `KVCacheConfig.parse` reads it (engine/kvcache/config.py
                                            says the syntax), e.g. rotated:k3v2:g32:w128, turboquant:k3v3
    mlx-q:kBvB[:gG]                         mlx-lm's own QuantizedKVCache (group 64 by default)
    mlx-kv                                  mlx-lm's own KVCache (stores the model's dtype: fp32 on Linux CPU)
    vq:METHOD:kBvB                          the PyPI package veloxquant-mlx (run in its own venv, see peers.py);
                                            Velox's own `vq` method has settings right after the colon
                                            (vq:k2v2:codebooks=DIR), the peer a method name (vq:kivi:k4v4)

Velox compressed configs get `prefill_attention=auto` unless the spec sets it (the faster prefill path of each
device: decoded blocks on a CPU, the fused kernels on a GPU); decoding always reads the packed codes.

Results written before this syntax name their caches the old way (`kivi:4:64`, `rotated:3/2:32+w128`,
`mlx-q:4`, `vq:kivi:4`); `read_result_spec` reads both, so the report can still read them. The label a table
shows (`CacheSpec.label`, e.g. 'kivi 4 g64') is separate from the spec and the same for both spellings.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from engine.errors import ConfigError

if TYPE_CHECKING:  # importing engine.kvcache loads MLX, which the CLI imports only after preparing the runtime
    from engine.kvcache.config import KVCacheConfig

VELOXQUANT_PREFIX = "vq:"
MLX_QUANTIZED_PREFIX = "mlx-q:"
MLX_PLAIN = "mlx-kv"
MLX_DEFAULT_GROUP = 64
# What the harness sets on compressed Velox caches when the spec does not say (see the module doc).
DEFAULT_PREFILL_ATTENTION = "auto"
DENSE_METHODS = ("fp16", "fp32")
# Methods whose label shows the group size (the others do not quantize in channel groups).
_GROUPED_METHODS = ("affine", "rotated", "kivi")
# A spec setting without '=' (bits kKvV, gG, wN, sN): what follows `vq:` in a spec of Velox's own `vq` method.
_SETTING = re.compile(r"k\d+(?:v\d+)?|v\d+|[gws]\d+")
# Options a label leaves out: the device's prefill choice, and paths.
_UNLABELLED_OPTIONS = ("prefill_attention", "codebooks")

# The quality sweep: every method at every bit width that is meant to be used, plus mlx-lm's cache.
QUALITY_SPECS = (
    "fp16",
    "affine:k8v8:g64", "affine:k4v4:g64", "affine:k4v4:g32", "affine:k3v3:g32", "affine:k2v2:g64",
    "affine:k2v2:g32",
    "rotated:k8v8:g64", "rotated:k4v4:g64", "rotated:k4v4:g32", "rotated:k3v3:g64", "rotated:k3v3:g32",
    "rotated:k3v2:g64", "rotated:k3v2:g32", "rotated:k2v2:g64", "rotated:k2v2:g32",
    "kivi:k8v8:g64", "kivi:k4v4:g64", "kivi:k4v4:g32", "kivi:k3v3:g64", "kivi:k3v3:g32", "kivi:k3v2:g64",
    "kivi:k3v2:g32", "kivi:k2v2:g64", "kivi:k2v2:g32",
    "turboquant:k4v4", "turboquant:k3v3", "turboquant:k4v3", "turboquant:k3v2", "turboquant:k2v2",
    "turboquant:k1v1",
    "rvq:k4v4", "rvq:k3v3", "rvq:k2v2",
    "mlx-q:k8v8", "mlx-q:k4v4", "mlx-q:k3v3", "mlx-q:k2v2",
)
QUALITY_SPECS_QUICK = (
    "fp16", "affine:k8v8:g64", "rotated:k4v4:g64", "kivi:k4v4:g64", "kivi:k3v3:g64", "turboquant:k3v3", "rvq:k3v3",
    "mlx-q:k4v4",
)
# fp32 is what the app's "Off" level holds on the Linux CPU fast path (the model computes in fp32 there).
SPEED_SPECS = (
    "fp16", "fp32", "mlx-kv", "mlx-q:k8v8", "mlx-q:k4v4",
    "affine:k8v8:g64", "affine:k4v4:g64", "rotated:k4v4:g64", "rotated:k3v3:g32",
    "kivi:k8v8:g64", "kivi:k4v4:g64", "kivi:k3v3:g64", "kivi:k2v2:g64",
    "turboquant:k4v4", "turboquant:k3v3", "rvq:k3v3",
)
SPEED_SPECS_QUICK = ("fp32", "mlx-q:k4v4", "kivi:k4v4:g64", "turboquant:k3v3")
MEMORY_SPECS = (*QUALITY_SPECS, "mlx-kv")
MEMORY_SPECS_QUICK = (*QUALITY_SPECS_QUICK, "mlx-kv")
VELOXQUANT_SPECS = ("vq:turboquant_rvq:k1v1", "vq:turboquant_rvq:k2v2", "vq:kivi:k2v2", "vq:kivi:k4v4")
VELOXQUANT_SPECS_QUICK = ("vq:turboquant_rvq:k2v2", "vq:kivi:k4v4")


@dataclass(frozen=True)
class CacheSpec:
    """One prompt cache to compare: the spec text it was read from, its family, and its configuration.

    For a Velox cache `config` is the KVCacheConfig that is built; for mlx-lm's caches it holds the method
    ('kv' or 'quantized'), bits and group size; for veloxquant-mlx the peer's method name and bits."""

    text: str
    family: str  # "velox" | "mlx-lm" | "veloxquant"
    config: KVCacheConfig

    @property
    def method(self) -> str:
        return self.config.method

    @property
    def key_bits(self) -> int | None:
        return self._resolved_bits()[0]

    @property
    def value_bits(self) -> int | None:
        return self._resolved_bits()[1]

    @property
    def group_size(self) -> int:
        return self.config.group_size

    @property
    def residual_window(self) -> int:
        return self.config.residual_window

    @property
    def sink_tokens(self) -> int:
        return self.config.sink_tokens

    @property
    def options(self) -> dict[str, Any]:
        return self.config.options

    def _resolved_bits(self) -> tuple[int | None, int | None]:
        # A Velox spec without bits means the method's default bits, and values default to the keys' bits.
        key_bits, value_bits = self.config.key_bits, self.config.value_bits
        if self.family == "velox" and key_bits is None and self.method not in DENSE_METHODS:
            from engine.kvcache.registry import get_method

            key_bits = get_method(self.method).default_bits
        return key_bits, key_bits if value_bits is None else value_bits

    @property
    def label(self) -> str:
        """A human label, e.g. 'rotated K3/V2 g32', 'mlx-lm Q4 g64', 'veloxquant turboquant_rvq 2-bit'."""
        if self.family == "mlx-lm":
            if self.method == "kv":
                return "mlx-lm KVCache"
            return f"mlx-lm Q{self.key_bits} g{self.group_size}"
        if self.family == "veloxquant":
            return f"veloxquant {self.method} {self.key_bits}-bit"
        if self.method in DENSE_METHODS:
            return self.method
        bits = f"{self.key_bits}" if self.key_bits == self.value_bits else f"K{self.key_bits}/V{self.value_bits}"
        label = f"{self.method} {bits}"
        if self.method in _GROUPED_METHODS:
            label += f" g{self.group_size}"
        if self.residual_window:
            label += f" w{self.residual_window}"
        if self.sink_tokens:
            label += f" s{self.sink_tokens}"
        for name, value in sorted(self.options.items()):
            if name not in _UNLABELLED_OPTIONS:
                label += f" {name}={value}"
        return label

    @property
    def canonical(self) -> str:
        """This spec in today's syntax (what `parse_spec` reads back to the same cache), whatever its text."""
        if self.family == "mlx-lm":
            if self.method == "kv":
                return MLX_PLAIN
            group = "" if self.group_size == MLX_DEFAULT_GROUP else f":g{self.group_size}"
            return f"{MLX_QUANTIZED_PREFIX}k{self.key_bits}v{self.key_bits}{group}"
        if self.family == "veloxquant":
            return f"{VELOXQUANT_PREFIX}{self.method}:k{self.key_bits}v{self.key_bits}"
        options = dict(self.options)
        if options.get("prefill_attention") == DEFAULT_PREFILL_ATTENTION:
            del options["prefill_attention"]
        return str(replace(self.config, options=options))

    @property
    def nominal_bits(self) -> float:
        """The code bits per value the name promises (16 for dense caches): mean of key and value bits."""
        if self.method in ("fp16", "kv"):
            return 16.0
        if self.method == "fp32":
            return 32.0
        assert self.key_bits is not None and self.value_bits is not None
        return (self.key_bits + self.value_bits) / 2

    def velox_config(self) -> KVCacheConfig:
        """The KVCacheConfig of a Velox spec (ConfigError for other families)."""
        if self.family != "velox":
            raise ConfigError(f"{self.text!r} is not a Velox cache.")
        return self.config

    def factory(self, model: Any, tokenizer: Any = None) -> Callable[[], list[Any]]:
        """A function building a fresh per-layer prompt cache for `model` on each call. `tokenizer`: the
        model's, so a `wide=F` spec calibrates its layers on the bundled prose as the app does (see
        engine/kvcache/layer_sensitivity.py; without it the model's own text, which picks other layers)."""
        n_layers = len(model.layers)
        if self.family == "velox":
            from engine.kvcache import KVCacheBuilder

            builder = KVCacheBuilder(self.velox_config()).for_model(model, tokenizer=tokenizer)
            return builder.build
        if self.family == "mlx-lm":
            return self._mlx_factory(n_layers)
        return _veloxquant_factory(self, model)

    def factory_for_shape(self, n_layers: int, head_dim: int) -> Callable[[], list[Any]]:
        """Like `factory`, from the attention shape alone (no model: random K/V benchmarks)."""
        if self.family == "velox":
            from engine.kvcache import KVCacheBuilder, ModelShape

            shape = ModelShape(n_layers=n_layers, n_heads=1, n_kv_heads=1, head_dim=head_dim)
            return KVCacheBuilder(self.velox_config()).for_shape(shape).build
        if self.family == "mlx-lm":
            return self._mlx_factory(n_layers)
        return _veloxquant_shape_factory(self, n_layers, head_dim)

    def _mlx_factory(self, n_layers: int) -> Callable[[], list[Any]]:
        from mlx_lm.models.cache import KVCache, QuantizedKVCache

        if self.method == "kv":
            return lambda: [KVCache() for _ in range(n_layers)]
        group, bits = self.group_size, self.key_bits or 8
        return lambda: [QuantizedKVCache(group_size=group, bits=bits) for _ in range(n_layers)]


def parse_spec(text: str) -> CacheSpec:
    """Read a spec token (see the module doc); ConfigError with the accepted forms otherwise."""
    from engine.kvcache.config import KVCacheConfig
    from engine.kvcache.registry import get_method

    text = text.strip()
    if text == MLX_PLAIN:
        return CacheSpec(text, "mlx-lm", KVCacheConfig("kv"))
    if text.startswith(MLX_QUANTIZED_PREFIX):
        config = KVCacheConfig.parse("quantized:" + text[len(MLX_QUANTIZED_PREFIX):])
        _check_peer_config(text, config, "mlx-q:k4v4 or mlx-q:k4v4:g32")
        return CacheSpec(text, "mlx-lm", config)
    if _is_peer_vq(text):
        config = KVCacheConfig.parse(text[len(VELOXQUANT_PREFIX):])
        _check_peer_config(text, config, "vq:turboquant_rvq:k2v2", group_allowed=False)
        return CacheSpec(text, "veloxquant", config)
    config = KVCacheConfig.parse(text)
    if get_method(config.method).attention_path != "dense" and "prefill_attention" not in config.options:
        config = replace(config, options={**config.options, "prefill_attention": DEFAULT_PREFILL_ATTENTION})
    return CacheSpec(text, "velox", config)


def _is_peer_vq(text: str) -> bool:
    """Whether `text` names the veloxquant-mlx peer (vq:METHOD:...) rather than Velox's `vq` (vq:SETTING:...)."""
    if not text.startswith(VELOXQUANT_PREFIX):
        return False
    first = text[len(VELOXQUANT_PREFIX):].split(":")[0]
    return not (_SETTING.fullmatch(first) or "=" in first)


def _check_peer_config(text: str, config: KVCacheConfig, example: str, group_allowed: bool = True) -> None:
    """A peer's cache takes one bit width for keys and values, and (mlx-lm) a group size; nothing else."""
    from engine.kvcache.config import KVCacheConfig

    plain = KVCacheConfig(config.method, config.key_bits, config.value_bits,
                          config.group_size if group_allowed else KVCacheConfig.group_size)
    if config.key_bits is None or config.key_bits != config.value_bits or config != plain:
        raise ConfigError(f"Cannot read the cache spec {text!r}: this cache takes equal key and value bits"
                          f"{' and a group size' if group_allowed else ''} only, e.g. {example}.")


# ----- results written before the spec syntax of engine/kvcache/config.py -------------------------------------

_LEGACY_VELOX = re.compile(r"(?P<method>[A-Za-z0-9_-]+)(?::(?P<key>\d+)(?:/(?P<value>\d+))?(?::(?P<group>\d+))?)?"
                           r"(?P<extras>(?:\+[ws]\d+)*)")


def read_legacy_spec(text: str) -> CacheSpec:
    """A spec in the harness's old syntax (`kivi:4:64`, `rotated:3/2:32+w128+s4`, `turboquant:3`, `mlx-q:4`,
    `mlx-q:4:32`, `vq:kivi:4`), read with the meaning it had then; ConfigError for anything else.

    It is translated to today's syntax and read by `parse_spec`, so both spellings build the same cache; the
    spec keeps its old text, which is how result files name their rows."""
    text = text.strip()
    if text.startswith(MLX_QUANTIZED_PREFIX):
        bits, _, group = text[len(MLX_QUANTIZED_PREFIX):].partition(":")
        if bits.isdigit() and (not group or group.isdigit()):
            new = f"{MLX_QUANTIZED_PREFIX}k{bits}v{bits}" + (f":g{group}" if group else "")
            return replace(parse_spec(new), text=text)
    elif _is_peer_vq(text):
        method, _, bits = text[len(VELOXQUANT_PREFIX):].partition(":")
        if bits.isdigit():
            return replace(parse_spec(f"{VELOXQUANT_PREFIX}{method}:k{bits}v{bits}"), text=text)
    else:
        match = _LEGACY_VELOX.fullmatch(text)
        if match:
            new = match["method"]
            if match["key"]:
                new += f":k{match['key']}v{match['value'] or match['key']}"
            if match["group"]:
                new += f":g{match['group']}"
            for extra in match["extras"].split("+")[1:]:
                new += f":{extra}"
            return replace(parse_spec(new), text=text)
    raise ConfigError(f"{text!r} is not a cache spec of the old syntax (e.g. kivi:4:64, rotated:3/2:32+w128, mlx-q:4).")


def read_result_spec(text: str) -> CacheSpec:
    """The cache a result file's spec names, in today's syntax or the old one (see the module doc)."""
    try:
        return parse_spec(text)
    except ConfigError as error:
        try:
            return read_legacy_spec(text)
        except ConfigError as legacy_error:
            # Old syntax naming a method no longer registered: that is the error worth showing.
            old_syntax = "is not a cache spec of the old syntax" not in str(legacy_error)
            raise (legacy_error if old_syntax else error) from None


def same_cache(a: CacheSpec, b: CacheSpec, head_dim: int = 64) -> bool:
    """Whether two specs build the same cache (e.g. 'turboquant:k3v3' and 'turboquant:k3v3:g64')."""
    if a.family != b.family:
        return False
    if a.family != "velox":
        return a.canonical == b.canonical
    return a.velox_config().validate(head_dim) == b.velox_config().validate(head_dim)


def with_extra(specs: list[CacheSpec], extra: list[CacheSpec]) -> list[CacheSpec]:
    """`specs` followed by the specs of `extra` that build a cache not already in `specs`."""
    out = list(specs)
    for spec in extra:
        if not any(same_cache(spec, other) for other in out):
            out.append(spec)
    return out


def parse_specs(texts: str | list[str] | tuple[str, ...]) -> list[CacheSpec]:
    items = texts.split(",") if isinstance(texts, str) else list(texts)
    specs = [parse_spec(item) for item in items if item.strip()]
    if len({spec.text for spec in specs}) != len(specs):
        raise ConfigError("A cache spec is listed twice.")
    return specs


# ----- veloxquant-mlx (only importable inside its own venv, see peers.py) -----------------------------------


def _veloxquant_config(spec: CacheSpec, head_dim: int) -> Any:
    from veloxquant_mlx import KVCacheConfig as VQConfig

    return VQConfig(method=spec.method, head_dim=head_dim, bit_width_inlier=spec.key_bits, seed=42)


def _veloxquant_factory(spec: CacheSpec, model: Any) -> Callable[[], list[Any]]:
    from veloxquant_mlx import KVCacheBuilder as VQBuilder

    from engine.kvcache import model_shape

    config = _veloxquant_config(spec, model_shape(model).head_dim)
    return lambda: VQBuilder.for_model(model, config)


def _veloxquant_shape_factory(spec: CacheSpec, n_layers: int, head_dim: int) -> Callable[[], list[Any]]:
    from veloxquant_mlx.cache.base import KVCacheFactory

    config = _veloxquant_config(spec, head_dim)
    return lambda: [KVCacheFactory.create(config) for _ in range(n_layers)]

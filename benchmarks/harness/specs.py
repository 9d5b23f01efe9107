"""What is compared: each prompt cache is named by a short spec string.

    fp16, fp32                              Velox dense caches
    METHOD[:BITS[/VBITS][:GROUP]][+wN][+sN]  a Velox method, e.g. rotated:3/2:32, turboquant:3, kivi:4:32+w128
    mlx-q:BITS[:GROUP]                      mlx-lm's own QuantizedKVCache (group 64 by default)
    mlx-kv                                  mlx-lm's own KVCache (stores the model's dtype: fp32 on Linux CPU)
    vq:METHOD:BITS                          the PyPI package veloxquant-mlx (run in its own venv, see peers.py)

Velox compressed configs get `prefill_attention="auto"` (the faster prefill path of each device: decoded
blocks on a CPU, the fused kernels on a GPU); decoding always reads the packed codes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.errors import ConfigError

VELOXQUANT_PREFIX = "vq:"
MLX_QUANTIZED_PREFIX = "mlx-q:"
MLX_PLAIN = "mlx-kv"
MLX_DEFAULT_GROUP = 64

# The quality sweep: every method at every bit width that is meant to be used, plus mlx-lm's cache.
QUALITY_SPECS = (
    "fp16",
    "affine:8:64", "affine:4:64", "affine:4:32", "affine:3:32", "affine:2:64", "affine:2:32",
    "rotated:8:64", "rotated:4:64", "rotated:4:32", "rotated:3:64", "rotated:3:32", "rotated:3/2:64",
    "rotated:3/2:32", "rotated:2:64", "rotated:2:32",
    "kivi:8:64", "kivi:4:64", "kivi:4:32", "kivi:3:64", "kivi:3:32", "kivi:3/2:64", "kivi:3/2:32", "kivi:2:64",
    "kivi:2:32",
    "turboquant:4", "turboquant:3", "turboquant:4/3", "turboquant:3/2", "turboquant:2", "turboquant:1",
    "rvq:4", "rvq:3", "rvq:2",
    "mlx-q:8", "mlx-q:4", "mlx-q:3", "mlx-q:2",
)
QUALITY_SPECS_QUICK = (
    "fp16", "affine:8:64", "rotated:4:64", "kivi:4:64", "kivi:3:64", "turboquant:3", "rvq:3", "mlx-q:4",
)
# fp32 is what the app's "Off" level holds on the Linux CPU fast path (the model computes in fp32 there).
SPEED_SPECS = (
    "fp16", "fp32", "mlx-kv", "mlx-q:8", "mlx-q:4",
    "affine:8:64", "affine:4:64", "rotated:4:64", "rotated:3:32",
    "kivi:8:64", "kivi:4:64", "kivi:3:64", "kivi:2:64",
    "turboquant:4", "turboquant:3", "rvq:3",
)
SPEED_SPECS_QUICK = ("fp32", "mlx-q:4", "kivi:4:64", "turboquant:3")
MEMORY_SPECS = (*QUALITY_SPECS, "mlx-kv")
MEMORY_SPECS_QUICK = (*QUALITY_SPECS_QUICK, "mlx-kv")
VELOXQUANT_SPECS = ("vq:turboquant_rvq:1", "vq:turboquant_rvq:2", "vq:kivi:2", "vq:kivi:4")
VELOXQUANT_SPECS_QUICK = ("vq:turboquant_rvq:2", "vq:kivi:4")


@dataclass(frozen=True)
class CacheSpec:
    """One prompt cache to compare, parsed from its spec string."""

    text: str
    family: str  # "velox" | "mlx-lm" | "veloxquant"
    method: str
    key_bits: int | None = None
    value_bits: int | None = None
    group_size: int | None = None
    residual_window: int = 0
    sink_tokens: int = 0
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """A human label, e.g. 'rotated K3/V2 g32', 'mlx-lm Q4 g64', 'veloxquant turboquant_rvq 2-bit'."""
        if self.family == "mlx-lm":
            if self.method == "kv":
                return "mlx-lm KVCache"
            return f"mlx-lm Q{self.key_bits} g{self.group_size}"
        if self.family == "veloxquant":
            return f"veloxquant {self.method} {self.key_bits}-bit"
        if self.method in ("fp16", "fp32"):
            return self.method
        bits = f"{self.key_bits}" if self.key_bits == self.value_bits else f"K{self.key_bits}/V{self.value_bits}"
        label = f"{self.method} {bits}"
        if self.group_size and self.method in ("affine", "rotated", "kivi"):
            label += f" g{self.group_size}"
        if self.residual_window:
            label += f" w{self.residual_window}"
        if self.sink_tokens:
            label += f" s{self.sink_tokens}"
        for name, value in sorted(self.options.items()):
            if name not in ("prefill_attention", "codebooks"):  # the device's choice; a path
                label += f" {name}={value}"
        return label

    @property
    def nominal_bits(self) -> float:
        """The code bits per value the name promises (16 for dense caches): mean of key and value bits."""
        if self.method in ("fp16", "kv"):
            return 16.0
        if self.method == "fp32":
            return 32.0
        assert self.key_bits is not None
        return (self.key_bits + (self.value_bits or self.key_bits)) / 2

    def velox_config(self) -> Any:
        """The KVCacheConfig of a Velox spec (ConfigError for other families)."""
        if self.family != "velox":
            raise ConfigError(f"{self.text!r} is not a Velox cache.")
        from engine.kvcache import KVCacheConfig

        options = dict(self.options)
        fields: dict[str, Any] = {"method": self.method}
        for name in ("seed", "rotation"):  # config fields written as `+name=value` extras
            if name in options:
                fields[name] = options.pop(name)
        fields["options"] = options
        for name in ("key_bits", "value_bits", "group_size"):
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        if self.residual_window:
            fields["residual_window"] = self.residual_window
        if self.sink_tokens:
            fields["sink_tokens"] = self.sink_tokens
        return KVCacheConfig(**fields)

    def factory(self, model: Any) -> Callable[[], list[Any]]:
        """A function building a fresh per-layer prompt cache for `model` on each call."""
        n_layers = len(model.layers)
        if self.family == "velox":
            from engine.kvcache import KVCacheBuilder

            builder = KVCacheBuilder(self.velox_config()).for_model(model)
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
        group, bits = self.group_size or MLX_DEFAULT_GROUP, self.key_bits or 8
        return lambda: [QuantizedKVCache(group_size=group, bits=bits) for _ in range(n_layers)]


def parse_spec(text: str) -> CacheSpec:
    """Parse a spec string (see the module doc); ConfigError with the accepted forms otherwise."""
    text = text.strip()
    try:
        if text == MLX_PLAIN:
            return CacheSpec(text, "mlx-lm", "kv")
        if text.startswith(MLX_QUANTIZED_PREFIX):
            parts = text[len(MLX_QUANTIZED_PREFIX) :].split(":")
            bits = int(parts[0])
            group = int(parts[1]) if len(parts) > 1 else MLX_DEFAULT_GROUP
            return CacheSpec(text, "mlx-lm", "quantized", bits, bits, group)
        # The peer is vq:NAME:BITS; Velox's own `vq` method has bits right after the colon (vq:2+codebooks=D).
        if text.startswith(VELOXQUANT_PREFIX) and not text[len(VELOXQUANT_PREFIX) :][:1].isdigit():
            method, bits = text[len(VELOXQUANT_PREFIX) :].split(":")
            return CacheSpec(text, "veloxquant", method, int(bits), int(bits))
        head, *extras = text.split("+")
        method, *rest = head.split(":")
        key_bits = value_bits = group = None
        if rest:
            key_text, _, value_text = rest[0].partition("/")
            key_bits = int(key_text)
            value_bits = int(value_text) if value_text else key_bits
        if len(rest) > 1:
            group = int(rest[1])
        window = sinks = 0
        options: dict[str, Any] = {}
        for extra in extras:
            if "=" in extra:  # method options, seed, rotation: read by KVCacheConfig.parse (the one syntax)
                options.update(_config_extras(f"{method}+{extra}"))
            elif extra.startswith("w"):
                window = int(extra[1:])
            elif extra.startswith("s"):
                sinks = int(extra[1:])
            else:
                raise ValueError(extra)
    except ValueError:
        raise ConfigError(
            f"Cannot read the cache spec {text!r}; use e.g. fp16, rotated:4:64, rotated:3/2:32+w128, "
            "turboquant:3, mlx-q:4, mlx-kv or vq:turboquant_rvq:2."
        ) from None
    from engine.kvcache import get_method

    method_class = get_method(method)  # ConfigError naming the known methods
    if method_class.attention_path != "dense":
        options = {"prefill_attention": "auto", **options}
    return CacheSpec(text, "velox", method, key_bits, value_bits, group, window, sinks, options)


def _config_extras(text: str) -> dict[str, Any]:
    """Options (and seed/rotation, kept under their field names) of one `+name=value` spec extra."""
    from engine.kvcache import KVCacheConfig

    config = KVCacheConfig.parse(text)
    extras = dict(config.options)
    if config.seed:
        extras["seed"] = config.seed
    if config.rotation != "hadamard":
        extras["rotation"] = config.rotation
    return extras


def same_cache(a: CacheSpec, b: CacheSpec, head_dim: int = 64) -> bool:
    """Whether two specs build the same cache (e.g. 'turboquant:3' and 'turboquant:3/3:64')."""
    if a.family != b.family:
        return False
    if a.family != "velox":
        return a.text == b.text
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

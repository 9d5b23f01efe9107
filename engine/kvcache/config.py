"""What a compressed KV cache should be: the method and its knobs, checked against a model's head_dim.

A configuration is written as one spec token without spaces (`str(config)`, read by `KVCacheConfig.parse`):

    METHOD[:SETTING]...          settings in any order, each at most once; omitted ones keep their defaults
      kK  vV  kKvV               key and value bits (e.g. k4v4, k3v2; k4 alone: values like keys;
                                 none: the method's default bits)
      gG                         group size (channels sharing one scale; default 64)
      wN                         residual window: the N most recent tokens stay in 16-bit floats
      sN                         sink tokens: the first N tokens stay in 16-bit floats
      seed=N                     seed of the random rotations (default 0)
      rotation=NAME              rotation kind (default hadamard)
      NAME=VALUE                 a method option: true, false, null, an integer, a float (with '.' or 'e'),
                                 a word or path ([A-Za-z_/~.][A-Za-z0-9_./~-]*), or '...' (percent-escaped
                                 text)

    fp16    kivi:k4v4:g64    rotated:k3v2:g32:w128:s4    turboquant:k3v3:g64:codebook=beta
    affine:k4v4:g64:prefill_attention=dequantize-blocks

Method options in use (each method's `check_config` says which it reads):
      key_block=N                kivi: tokens per key block (32, 64, 128; default the group size), e.g.
                                 kivi:k4v4:g64:s4:key_block=128 (the keys' scales cost 0.25 bits, not 0.5)
      rotate_values=true         kivi: values stored after the layer's seeded rotation, output rotated back
                                 (keys untouched), e.g. kivi:k4v4:g64:rotate_values=true; =plain: the
                                 plain Walsh-Hadamard transform, nothing held
      clip_search=true           kivi: each group quantized at the clipping of its range with the least
                                 squared error (same layout), e.g. kivi:k4v4:g64:clip_search=true
      symmetric_values=true      kivi: each value group as s·(code - h), one scale and no bias (for rotated
                                 values), e.g. kivi:k3v3:g64:rotate_values=true:symmetric_values=true
      key_outliers=1             kivi: per key channel and block, the entry that widens its range most kept
                                 aside in 16 bits (its residual) with its index; the 3-bit level uses both
      values=NAME                qjl: the partner method that stores the values (affine), e.g.
                                 qjl:k4v4:g64:values=affine
      codebooks=DIR              vq: the folder `velox precompute` wrote, e.g. vq:k2v2:codebooks=/data/cb
      wide=F                     kivi: per-layer bits. floor(F × n_layers) layers (a fraction 0..1; the floor
                                 never spends more than the fraction's bits) store keys and values with one
                                 more bit each, the rest with the spec's bits; which layers is decided by a
                                 calibration pass on the model (engine/kvcache/layer_sensitivity.py), e.g.
                                 kivi:k4v4:g64:s4:key_block=128:rotate_values=true:wide=0.1
      wide_layers=LI.J...        kivi, with wide: those layers (0-based, dot-separated after an L; a word
                                 the syntax reads unquoted), e.g. wide=0.1:wide_layers=L1.10.18. The builder
                                 writes it after calibrating, so a validated config names its layers; given,
                                 it replaces the calibration (its count must be floor(F × n_layers))
      rope=pre                   kivi: the compressed keys are stored before RoPE (turned back by their
                                 positions on entry, forward again when decoded; engine/kvcache/quant/rope.py),
                                 e.g. kivi:k3v3:g64:s4:key_block=128:rope=pre. The builder writes the model's
                                 RoPE beside it (rope_dims=N:rope_base=F:rope_scale=F:rope_traditional=B), so a
                                 saved or re-encoded cache needs no model; a model without plain RoPE is refused
      rope=auto                  kivi: rope=pre where a GPU decode kernel turns the keys, keys as given elsewhere
                                 (no error); the builder resolves it for the model and the device
      minmax_keys=true           kivi: each key block over its exact min..max (mx.quantize's layout; its own grid
                                 widens the step until zero is a code)
      key_widths=calibrated      kivi: key channels at different widths averaging the key bits (2-5 bits in a
                                 3-bit layer, 1-4 in a 2-bit one), chosen by a calibration pass on the model
                                 (engine/kvcache/key_widths.py); the builder writes the table's digest in its
                                 place, key_widths=kw<16 hex digits>, kept in the data folder
      kernels=auto|require|off   compressed methods: the GPU decode kernels (engine/kvcache/kernels)
      prefill_attention=NAME     compressed methods: how several query tokens attend (fused, auto, ...)

`parse(str(config)) == config` for every configuration whose option names are identifiers other than the
field names (`seed=`, `rotation=` are the fields; `validate` requires this of every option name). `parse` checks the syntax only; `validate(head_dim)`
checks the method and whether its settings suit the model.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, NoReturn
from urllib.parse import quote, unquote

from engine.errors import ConfigError
from engine.kvcache.registry import get_method

# Option values must survive a JSON round trip unchanged (they are saved with the cache).
_OPTION_TYPES = (str, int, float, bool, type(None))

# ----- the spec syntax (see the module doc) -------------------------------------------------------------------
SPEC_FORM = "METHOD[:kKvV][:gG][:wN][:sN][:seed=N][:rotation=NAME][:OPTION=VALUE]..."
SPEC_EXAMPLE = "kivi:k4v4:g64"
_METHOD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_BITS = re.compile(r"(?:k(-?\d+))?(?:v(-?\d+))?")
_TAGGED_INT = re.compile(r"([gws])(-?\d+)")
_TAGS = {"g": "group_size", "w": "residual_window", "s": "sink_tokens"}
_OPTION_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_WORD = re.compile(r"[A-Za-z_/~.][A-Za-z0-9_./~-]*")  # names and paths (codebooks=/data/cb)
_INT = re.compile(r"-?\d+")
_FLOAT = re.compile(r"-?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|-?inf|nan")
_LITERALS: dict[str, Any] = {"true": True, "false": False, "null": None}

# ----- per-layer bits (options `wide` and `wide_layers`; see the module doc) --------------------------------
WIDE_OPTION = "wide"
WIDE_LAYERS_OPTION = "wide_layers"
_WIDE_LAYERS = re.compile(r"L(?:\d+(?:\.\d+)*)?")
# floor(F × L) of a float F: 0.1 × 30 is 3.0000000000000004 and 0.29 × 100 is 28.999999999999996; the slack
# makes a fraction written to a few decimals count the layers it names.
_WIDE_SLACK = 1e-9


def n_wide_layers(fraction: float, n_layers: int) -> int:
    """How many of `n_layers` layers `wide=fraction` widens: floor(fraction × n_layers), so the averaged
    bits never exceed base + fraction × (widened - base)."""
    return int(math.floor(fraction * n_layers + _WIDE_SLACK))


def format_wide_layers(layers: Any) -> str:
    """The `wide_layers` value for these layer indices, e.g. 'L1.10.18' (sorted, each once)."""
    return "L" + ".".join(str(int(i)) for i in sorted(set(layers)))


def parse_wide_layers(text: Any) -> tuple[int, ...]:
    """The layer indices of a `wide_layers` value ('L1.10.18' -> (1, 10, 18)); ConfigError if malformed."""
    if not isinstance(text, str) or not _WIDE_LAYERS.fullmatch(text):
        raise ConfigError(
            f"wide_layers takes L and dot-separated layer indices (e.g. wide_layers=L1.10.18), not {text!r}."
        )
    layers = tuple(int(i) for i in text[1:].split(".")) if len(text) > 1 else ()
    if len(set(layers)) != len(layers) or list(layers) != sorted(layers):
        raise ConfigError(f"wide_layers names each layer once, in increasing order, not {text!r}.")
    return layers


@dataclass(frozen=True)
class KVCacheConfig:
    """How every layer's KV cache is stored.

    `key_bits`/`value_bits` of None mean "the method's default"; `validate()` returns a copy with them
    filled in. `residual_window` recent tokens and the first `sink_tokens` tokens stay in 16-bit floats
    (both are counted in the effective bits). `seed` makes random rotations reproducible; each layer uses
    `seed + layer_index`. `options` holds method-specific settings (JSON-serialisable values only).
    """

    method: str = "fp16"
    key_bits: int | None = None
    value_bits: int | None = None
    group_size: int = 64
    residual_window: int = 0
    sink_tokens: int = 0
    seed: int = 0
    rotation: str = "hadamard"
    options: dict[str, Any] = field(default_factory=dict)

    def validate(self, head_dim: int) -> KVCacheConfig:
        """Check this configuration for a model with `head_dim`; return it with defaults resolved.

        Raises ConfigError with one clear sentence for an unknown method, bits the method does not
        support, a group size or head_dim that does not fit, or negative window sizes.
        """
        method_class = get_method(self.method)
        if not isinstance(head_dim, int) or head_dim <= 0:
            raise ConfigError(f"head_dim must be a positive integer, not {head_dim!r}.")
        if self.residual_window < 0 or self.sink_tokens < 0:
            raise ConfigError(
                f"residual_window ({self.residual_window}) and sink_tokens ({self.sink_tokens}) "
                "must be zero or positive."
            )
        for name, value in self.options.items():
            if not isinstance(name, str) or not _OPTION_NAME.fullmatch(name) or name in _FIELD_NAMES:
                raise ConfigError(
                    f"Option name {name!r} cannot be used: option names are identifiers (letters, digits, "
                    f"underscores) other than the settings {', '.join(_FIELD_NAMES)}."
                )
            if not isinstance(value, _OPTION_TYPES):
                raise ConfigError(
                    f"Option {name!r} has a value of type {type(value).__name__}; "
                    "options must be strings, numbers, booleans or None."
                )
        resolved = replace(
            self,
            key_bits=method_class.default_bits if self.key_bits is None else self.key_bits,
            value_bits=(
                (self.key_bits if self.key_bits is not None else method_class.default_bits)
                if self.value_bits is None
                else self.value_bits
            ),
        )
        supported = method_class.supported_bits
        for role, bits in (("key", resolved.key_bits), ("value", resolved.value_bits)):
            if bits not in supported:
                raise ConfigError(
                    f"Method {self.method!r} does not support {bits}-bit {role}s; "
                    f"it supports {', '.join(str(b) for b in supported)} bits."
                )
        if self.has_wide and not method_class.widens_layers:
            raise ConfigError(
                f"Method {self.method!r} cannot store some layers with more bits (options wide, wide_layers); "
                "kivi can."
            )
        method_class.check_config(resolved, head_dim)
        return resolved

    # ----- per-layer bits ------------------------------------------------------------------------------

    @property
    def has_wide(self) -> bool:
        """Whether option `wide` or `wide_layers` is given (some layers stored one bit wider)."""
        return WIDE_OPTION in self.options or WIDE_LAYERS_OPTION in self.options

    @property
    def wide_fraction(self) -> float | None:
        """Option `wide` (the fraction of layers stored one bit wider), or None without it."""
        fraction = self.options.get(WIDE_OPTION)
        return None if fraction is None else float(fraction)

    @property
    def wide_layers(self) -> tuple[int, ...] | None:
        """Option `wide_layers` read as layer indices, or None when the layers are not named (yet)."""
        text = self.options.get(WIDE_LAYERS_OPTION)
        return None if text is None else parse_wide_layers(text)

    def without_wide(self) -> KVCacheConfig:
        """This configuration without `wide`/`wide_layers`: what every layer not widened stores."""
        if not self.has_wide:
            return self
        options = {k: v for k, v in self.options.items() if k not in (WIDE_OPTION, WIDE_LAYERS_OPTION)}
        return replace(self, options=options)

    def widened(self) -> KVCacheConfig:
        """What a wide layer stores: one more key and value bit, no `wide` options (bits resolved first:
        None means the method's default, values like keys)."""
        plain = self.without_wide()
        key_bits = get_method(self.method).default_bits if self.key_bits is None else self.key_bits
        value_bits = key_bits if self.value_bits is None else self.value_bits
        return replace(plain, key_bits=key_bits + 1, value_bits=value_bits + 1)

    def with_wide_layers(self, layers: Any) -> KVCacheConfig:
        """This configuration naming its wide layers (option `wide_layers`)."""
        return replace(self, options={**self.options, WIDE_LAYERS_OPTION: format_wide_layers(layers)})

    def for_layer(self, layer_index: int) -> KVCacheConfig:
        """The configuration layer `layer_index` really stores: `widened()` for a wide layer, `without_wide()`
        for the others; the configuration itself when it has no `wide` option. A cache holds this as its
        `config`, so every reader of its bits (attention, trim, the decode kernel, save/load) sees the
        layer's real bits without knowing about `wide`."""
        if not self.has_wide:
            return self
        layers = self.wide_layers
        if layers is None:
            raise ConfigError(
                f"The spec {self} does not name its wide layers: build it with KVCacheBuilder.for_model(model), "
                "which calibrates them, or give wide_layers=L..."
            )
        return self.widened() if layer_index in layers else self.without_wide()

    def check_wide_layers(self, n_layers: int) -> None:
        """ConfigError unless the named wide layers fit a model of `n_layers` layers: floor(F × n_layers) of
        them, each below n_layers. Nothing to check without `wide` or before the layers are named."""
        fraction, layers = self.wide_fraction, self.wide_layers
        if fraction is None or layers is None:
            return
        expected = n_wide_layers(fraction, n_layers)
        if len(layers) != expected or any(i >= n_layers for i in layers):
            raise ConfigError(
                f"wide={self.options[WIDE_OPTION]} widens {expected} of this model's {n_layers} layers, "
                f"but wide_layers={self.options[WIDE_LAYERS_OPTION]} names {len(layers)}"
                + (" (some past the last layer)." if any(i >= n_layers for i in layers) else ".")
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVCacheConfig:
        """Build a config from a dict; unknown keys are an error rather than silently dropped."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"Unknown KV cache setting(s): {', '.join(unknown)}; known are {', '.join(sorted(known))}."
            )
        return cls(**{**data, "options": dict(data.get("options") or {})})

    @classmethod
    def from_json(cls, text: str) -> KVCacheConfig:
        return cls.from_dict(json.loads(text))

    def __str__(self) -> str:
        """This configuration as one spec token (see the module doc), e.g. 'rotated:k3v2:g32:w128'.

        Defaults are left out, except that the group size is written whenever bits are, so a quantized
        cache always says its group. ConfigError if the method or an option name cannot be written."""
        if not _METHOD_NAME.fullmatch(self.method):
            raise ConfigError(f"The method name {self.method!r} cannot be written as a spec.")
        parts = [self.method]
        bits = ("" if self.key_bits is None else f"k{self.key_bits}") + (
            "" if self.value_bits is None else f"v{self.value_bits}"
        )
        if bits:
            parts.append(bits)
        if bits or self.group_size != _DEFAULT.group_size:
            parts.append(f"g{self.group_size}")
        if self.residual_window != _DEFAULT.residual_window:
            parts.append(f"w{self.residual_window}")
        if self.sink_tokens != _DEFAULT.sink_tokens:
            parts.append(f"s{self.sink_tokens}")
        if self.seed != _DEFAULT.seed:
            parts.append(f"seed={self.seed}")
        if self.rotation != _DEFAULT.rotation:
            parts.append(f"rotation={_format_value(self.rotation)}")
        for name in sorted(self.options):
            if not _OPTION_NAME.fullmatch(name) or name in _FIELD_NAMES:
                raise ConfigError(f"The option name {name!r} cannot be written as a spec.")
            parts.append(f"{name}={_format_value(self.options[name])}")
        return ":".join(parts)

    @classmethod
    def parse(cls, text: str) -> KVCacheConfig:
        """Read a spec token (see the module doc); ConfigError saying what is wrong and the accepted form.

        Only the syntax is checked here: `validate(head_dim)` says whether the method exists and its
        settings suit a model."""
        if not isinstance(text, str):
            raise ConfigError(f"A KV cache spec is text, not {type(text).__name__}.")
        method, *settings = text.strip().split(":")
        if not _METHOD_NAME.fullmatch(method):
            _spec_error(text, f"{method!r} is not a method name")
        values: dict[str, Any] = {"method": method}
        options: dict[str, Any] = {}
        for setting in settings:
            name, equals, value_text = setting.partition("=")
            if equals:
                if not _OPTION_NAME.fullmatch(name):
                    _spec_error(text, f"{name!r} is not a setting name")
                value = _parse_value(text, value_text)
                if name == "seed":
                    if type(value) is not int:
                        _spec_error(text, f"the seed must be an integer, not {value_text!r}")
                    _set_once(text, values, "seed", value)
                elif name == "rotation":
                    if not isinstance(value, str):
                        _spec_error(text, f"the rotation must be a name, not {value_text!r}")
                    _set_once(text, values, "rotation", value)
                else:
                    _set_once(text, options, name, value)
                continue
            tagged = _TAGGED_INT.fullmatch(setting)
            if tagged:
                _set_once(text, values, _TAGS[tagged.group(1)], int(tagged.group(2)))
                continue
            bits = _BITS.fullmatch(setting)
            if setting and bits:
                if "key_bits" in values or "value_bits" in values:
                    _spec_error(text, "it gives the bits twice")
                key_bits, value_bits = bits.groups()
                values["key_bits"] = None if key_bits is None else int(key_bits)
                values["value_bits"] = None if value_bits is None else int(value_bits)
                continue
            _spec_error(text, f"{setting!r} is not a setting")
        return cls(**values, options=options)

    def describe(self) -> str:
        """A short human label, e.g. 'rotated K4/V4 g64 (window 128, sinks 4)'."""
        label = self.method
        try:
            dense = get_method(self.method).attention_path == "dense"
        except ConfigError:
            dense = False
        if self.key_bits is not None and not dense:
            value_bits = self.key_bits if self.value_bits is None else self.value_bits
            label += f" K{self.key_bits}/V{value_bits} g{self.group_size}"
        extras = []
        if self.residual_window:
            extras.append(f"window {self.residual_window}")
        if self.sink_tokens:
            extras.append(f"sinks {self.sink_tokens}")
        if self.wide_fraction:
            extras.append(f"{self.wide_fraction:.0%} of layers +1 bit")
        if extras:
            label += f" ({', '.join(extras)})"
        return label


_DEFAULT = KVCacheConfig()
_FIELD_NAMES = tuple(f.name for f in fields(KVCacheConfig))


def _spec_error(text: str, problem: str) -> NoReturn:
    raise ConfigError(
        f"Cannot read the KV cache spec {text!r}: {problem}. Write one token without spaces, "
        f"{SPEC_FORM}, e.g. {SPEC_EXAMPLE}."
    )


def _set_once(text: str, target: dict[str, Any], name: str, value: Any) -> None:
    if name in target:
        _spec_error(text, f"it sets {name} twice")
    target[name] = value


def _format_value(value: Any) -> str:
    """An option value as spec text that `_parse_value` reads back as the same value and type."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) or math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        looks_like_another_type = value in _LITERALS or _FLOAT.fullmatch(value) or _INT.fullmatch(value)
        if _WORD.fullmatch(value) and not looks_like_another_type:
            return value
        return "'" + quote(value, safe="/") + "'"  # ':', '=', quotes, spaces and '%' are escaped
    raise ConfigError(
        f"An option value of type {type(value).__name__} cannot be written as a spec; "
        "options must be strings, numbers, booleans or None."
    )


def _parse_value(text: str, value_text: str) -> Any:
    if len(value_text) >= 2 and value_text[0] == value_text[-1] == "'" and "'" not in value_text[1:-1]:
        return unquote(value_text[1:-1])
    if value_text in _LITERALS:
        return _LITERALS[value_text]
    if _INT.fullmatch(value_text):
        return int(value_text)
    if _FLOAT.fullmatch(value_text):
        return float(value_text)
    if _WORD.fullmatch(value_text):
        return value_text
    _spec_error(text, f"{value_text!r} is not a value (true, false, null, a number, a word or '...')")

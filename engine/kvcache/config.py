"""What a compressed KV cache should be: the method and its knobs, checked against a model's head_dim."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any
from urllib.parse import quote, unquote

from engine.errors import ConfigError

# Option values must survive a JSON round trip unchanged (they are saved with the cache).
_OPTION_TYPES = (str, int, float, bool, type(None))
# Characters kept as they are in option values of a spec string; everything else (notably '+', '=',
# spaces and '%') is percent-encoded, so any string option (e.g. a codebook path) survives `parse(str(c))`.
_SPEC_SAFE = "/:._-~,@"
_DEFAULT_GROUP_SIZE = 64


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
        from engine.kvcache.registry import get_method  # late: the registry imports the method files

        method_class = get_method(self.method)
        if not isinstance(head_dim, int) or head_dim <= 0:
            raise ConfigError(f"head_dim must be a positive integer, not {head_dim!r}.")
        if self.residual_window < 0 or self.sink_tokens < 0:
            raise ConfigError(
                f"residual_window ({self.residual_window}) and sink_tokens ({self.sink_tokens}) "
                "must be zero or positive."
            )
        for name, value in self.options.items():
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
        method_class.check_config(resolved, head_dim)
        return resolved

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

    # ----- the one spec syntax --------------------------------------------------------------------------
    #
    #     METHOD[:[BITS[/VBITS]][:GROUP]][+wN][+sN][+seed=N][+rotation=KIND][+OPTION=VALUE ...]
    #
    # e.g. `kivi:4:64`, `rotated:3/2:32+w128+s4`, `vq:2:64+codebooks=/data/cb`. The bench's cache specs
    # (benchmarks/harness/specs.py) are this syntax for Velox caches. No spaces, so a spec is one shell word.

    def __str__(self) -> str:
        """This config as one spec string; `KVCacheConfig.parse(str(c)) == c` for every config."""
        text = self.method
        bits = ""
        if self.key_bits is not None:
            bits = str(self.key_bits) + ("" if self.value_bits is None else f"/{self.value_bits}")
        elif self.value_bits is not None:
            bits = f"/{self.value_bits}"
        if bits or self.group_size != _DEFAULT_GROUP_SIZE:
            text += f":{bits}:{self.group_size}"
        if self.residual_window:
            text += f"+w{self.residual_window}"
        if self.sink_tokens:
            text += f"+s{self.sink_tokens}"
        if self.seed:
            text += f"+seed={self.seed}"
        if self.rotation != "hadamard":
            text += f"+rotation={_spec_value(self.rotation)}"
        for name in sorted(self.options):
            text += f"+{quote(name, safe='_')}={_spec_value(self.options[name])}"
        return text

    @classmethod
    def parse(cls, text: str) -> KVCacheConfig:
        """Read a spec string (see `__str__`); ConfigError with the accepted form otherwise. Only the syntax
        is checked here; `validate(head_dim)` checks the method and its settings."""
        text = text.strip()
        try:
            head, *extras = text.split("+")
            method, *rest = head.split(":")
            if not method or len(rest) > 2:
                raise ValueError(head)
            fields: dict[str, Any] = {"method": method}
            if rest and rest[0]:
                key_text, slash, value_text = rest[0].partition("/")
                fields["key_bits"] = int(key_text) if key_text else None
                fields["value_bits"] = int(value_text) if slash else None
            if len(rest) > 1:
                fields["group_size"] = int(rest[1])
            options: dict[str, Any] = {}
            for extra in extras:
                name, equals, value = extra.partition("=")
                if not equals and name[:1] in ("w", "s") and name[1:].isdigit():
                    fields["residual_window" if name[0] == "w" else "sink_tokens"] = int(name[1:])
                elif not equals or not name:
                    raise ValueError(extra)
                elif name == "seed":
                    fields["seed"] = int(value)
                elif name == "rotation":
                    fields["rotation"] = str(_read_spec_value(value))
                else:
                    options[unquote(name)] = _read_spec_value(value)
        except ValueError:
            raise ConfigError(
                f"Cannot read the KV cache spec {text!r}; use METHOD[:BITS[/VBITS][:GROUP]][+wN][+sN]"
                "[+OPTION=VALUE], e.g. kivi:4:64, rotated:3/2:32+w128+s4 or fp16."
            ) from None
        return cls(**fields, options=options)

    def describe(self) -> str:
        """A short human label, e.g. 'rotated K4/V4 g64 (window 128, sinks 4)'."""
        from engine.kvcache.registry import get_method

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
        if extras:
            label += f" ({', '.join(extras)})"
        return label


def _spec_value(value: Any) -> str:
    """An option value as spec text: JSON for numbers, booleans and None; strings as they are unless they
    would read back as something else (then JSON-quoted), percent-encoded outside `_SPEC_SAFE`."""
    if isinstance(value, str):
        text = json.dumps(value) if _read_spec_value(quote(value, safe=_SPEC_SAFE)) != value else value
    else:
        text = json.dumps(value)
    return quote(text, safe=_SPEC_SAFE + '"')


def _read_spec_value(text: str) -> Any:
    text = unquote(text)
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, _OPTION_TYPES) else text

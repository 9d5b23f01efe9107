"""What a compressed KV cache should be: the method and its knobs, checked against a model's head_dim."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from engine.errors import ConfigError
from engine.kvcache.registry import get_method

# Option values must survive a JSON round trip unchanged (they are saved with the cache).
_OPTION_TYPES = (str, int, float, bool, type(None))


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
        if extras:
            label += f" ({', '.join(extras)})"
        return label

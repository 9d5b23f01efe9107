"""The registered methods in words, for `velox methods`. Apart from the registry because it builds
configs: `engine.kvcache.config` validates against the registry, so the registry itself never imports it."""

from __future__ import annotations

from engine.kvcache.config import KVCacheConfig
from engine.kvcache.registry import all_method_info, get_method


def describe_methods(head_dims: tuple[int, ...] = (64, 128)) -> list[str]:
    """Human-readable lines for `velox methods`: each method's bits, its effective bits per value at each
    bit width (long-context limit, default group size, every scale/norm/codebook counted; keys and values
    averaged), whether it needs calibration, and its attention path."""
    lines = []
    for info in all_method_info():
        cls = get_method(info.name)
        lines.append(f"{info.name}: {info.description}")
        lines.append(f"    bits {', '.join(str(b) for b in info.supported_bits)} (default {info.default_bits}); "
                     f"attention {info.attention_path}; calibration {'needed' if info.needs_calibration else 'none'}")
        for head_dim in head_dims:
            cells = []
            for bits in info.supported_bits:
                config = KVCacheConfig(method=info.name, key_bits=bits, value_bits=bits)
                try:
                    cells.append(f"{bits}→{cls.effective_bits_per_value(config, head_dim):.2f}")
                except Exception as error:  # a bit width or group size that does not suit this head_dim
                    cells.append(f"{bits}→n/a ({type(error).__name__})")
            lines.append(f"    effective bits/value at head_dim {head_dim}: {'  '.join(cells)}")
    return lines

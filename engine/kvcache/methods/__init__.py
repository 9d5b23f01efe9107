"""One file per KV cache method; each registers itself with `@register_method`.

The registry imports every module in this package on first look-up (engine/kvcache/registry.py), so a
new method needs no edit here.
"""

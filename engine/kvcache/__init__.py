"""Velox's compressed KV caches: configuration, method registry, per-layer caches for mlx-lm, and the
single attention hook that lets a compressed cache attend over its own storage.

    from engine.kvcache import KVCacheBuilder, KVCacheConfig
    caches = KVCacheBuilder(KVCacheConfig(method="affine", key_bits=4)).for_model(model).build()

Importing this package registers every method and adds their cache classes (by their unique Velox...
names) to `mlx_lm.models.cache`, so `mlx_lm.models.cache.load_prompt_cache` can rebuild saved Velox
caches; `unregister_from_mlx_lm()` removes exactly those names again.
"""

from engine.kvcache.attention import (
    attention_dispatch_installed,
    install_attention_dispatch,
    uninstall_attention_dispatch,
)
from engine.kvcache.base import SegmentedKVCache, VeloxKVCache
from engine.kvcache.builder import KVCacheBuilder, ModelShape, model_shape, reencode_caches, reencode_into
from engine.kvcache.config import KVCacheConfig
from engine.kvcache.describe import describe_methods
from engine.kvcache.registry import (
    MethodInfo,
    all_method_info,
    get_method,
    known_methods,
    method_info,
    register_method,
    register_with_mlx_lm,
    unregister_from_mlx_lm,
)

register_with_mlx_lm()

__all__ = [
    "KVCacheBuilder",
    "KVCacheConfig",
    "MethodInfo",
    "ModelShape",
    "SegmentedKVCache",
    "VeloxKVCache",
    "all_method_info",
    "describe_methods",
    "attention_dispatch_installed",
    "get_method",
    "install_attention_dispatch",
    "known_methods",
    "method_info",
    "model_shape",
    "reencode_caches",
    "reencode_into",
    "register_method",
    "register_with_mlx_lm",
    "uninstall_attention_dispatch",
    "unregister_from_mlx_lm",
]

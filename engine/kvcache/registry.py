"""The catalogue of KV cache methods: one file per method under `methods/`, each registered by name.

A method is a cache class (a subclass of `engine.kvcache.base.VeloxKVCache`) decorated with
`@register_method("name")`. The class itself declares what the catalogue shows: supported bits, default
bits, whether it needs calibration, its attention path, a one-line description, and the exact
`effective_bits_per_value` formula. Every module in `engine/kvcache/methods/` is imported on first
look-up, so adding a method is adding a file.

Registration also makes the class findable by `mlx_lm.models.cache.load_prompt_cache`, which rebuilds
caches with `globals()[class_name].from_state(state)` inside that module: we add each class under its own
(unique, `Velox`-prefixed) name to that module's namespace. Nothing of mlx-lm's is replaced; names are only
added, and `unregister_from_mlx_lm()` removes exactly the names we added.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import mlx_lm.models.cache as mlx_cache_module

from engine.errors import ConfigError

if TYPE_CHECKING:
    from engine.kvcache.base import VeloxKVCache

ATTENTION_PATHS = ("dense", "fused", "dequantize-per-step")

_METHODS: dict[str, type[VeloxKVCache]] = {}
_NAMES_ADDED_TO_MLX_LM: set[str] = set()
_discovered = False

CacheClass = TypeVar("CacheClass", bound="type[VeloxKVCache]")


@dataclass(frozen=True)
class MethodInfo:
    """What the catalogue says about one method (for settings screens, docs and benchmarks)."""

    name: str
    class_name: str
    supported_bits: tuple[int, ...]
    default_bits: int
    needs_calibration: bool
    attention_path: str
    description: str


def register_method(name: str):
    """Class decorator: register a cache class as method `name` and make mlx-lm's loader find it."""

    def decorate(cls: CacheClass) -> CacheClass:
        for attribute in ("supported_bits", "default_bits", "attention_path", "description"):
            if attribute not in _declared_attributes(cls):
                raise TypeError(f"KV cache method {name!r} ({cls.__name__}) must declare {attribute}.")
        if cls.attention_path not in ATTENTION_PATHS:
            raise TypeError(f"{cls.__name__}.attention_path must be one of {ATTENTION_PATHS}.")
        if cls.default_bits not in cls.supported_bits:
            raise TypeError(f"{cls.__name__}.default_bits is not among its supported_bits.")
        existing = _METHODS.get(name)
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise TypeError(f"KV cache method {name!r} is already registered by {existing.__name__}.")
        cls.method_name = name
        _METHODS[name] = cls
        _add_to_mlx_lm(cls)
        return cls

    return decorate


def _declared_attributes(cls: type) -> set[str]:
    # Attributes declared by the class or an intermediate base, but not only by VeloxKVCache itself,
    # so a method cannot silently inherit the abstract placeholders.
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__name__ == "VeloxKVCache":
            break
        names.update(vars(klass))
    return names


def _add_to_mlx_lm(cls: type) -> None:
    current = getattr(mlx_cache_module, cls.__name__, None)
    if current is not None and current is not cls and cls.__name__ not in _NAMES_ADDED_TO_MLX_LM:
        raise TypeError(f"mlx_lm.models.cache already defines {cls.__name__}; rename the Velox class.")
    setattr(mlx_cache_module, cls.__name__, cls)
    _NAMES_ADDED_TO_MLX_LM.add(cls.__name__)


def register_with_mlx_lm() -> None:
    """(Re-)add every registered class to mlx-lm's cache module so `load_prompt_cache` finds it."""
    _discover()
    for cls in _METHODS.values():
        _add_to_mlx_lm(cls)


def unregister_from_mlx_lm() -> None:
    """Remove the names registration added to `mlx_lm.models.cache` (and only those)."""
    for name in sorted(_NAMES_ADDED_TO_MLX_LM):
        if name in vars(mlx_cache_module):
            delattr(mlx_cache_module, name)
    _NAMES_ADDED_TO_MLX_LM.clear()


def _discover() -> None:
    """Import every module in engine/kvcache/methods once, so each registers itself."""
    global _discovered
    if _discovered:
        return
    package = importlib.import_module("engine.kvcache.methods")
    for module in pkgutil.iter_modules(package.__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{module.name}")
    _discovered = True


def known_methods() -> list[str]:
    """Names of every registered method, sorted."""
    _discover()
    return sorted(_METHODS)


def get_method(name: str) -> type[VeloxKVCache]:
    """The cache class registered as `name`; ConfigError listing the known names otherwise."""
    _discover()
    try:
        return _METHODS[name]
    except KeyError:
        raise ConfigError(
            f"Unknown KV cache method {name!r}; known methods are {', '.join(known_methods())}."
        ) from None


def method_info(name: str) -> MethodInfo:
    cls = get_method(name)
    return MethodInfo(
        name=name,
        class_name=cls.__name__,
        supported_bits=tuple(cls.supported_bits),
        default_bits=cls.default_bits,
        needs_calibration=cls.needs_calibration,
        attention_path=cls.attention_path,
        description=cls.description,
    )


def all_method_info() -> list[MethodInfo]:
    return [method_info(name) for name in known_methods()]

"""KVCacheConfig validation, the method registry, and the effective-bits formulas."""

from __future__ import annotations

from dataclasses import replace

import mlx_lm.models.cache as mlx_cache
import pytest

from engine.errors import ConfigError
from engine.kvcache import (
    KVCacheBuilder,
    KVCacheConfig,
    all_method_info,
    get_method,
    known_methods,
    register_with_mlx_lm,
    unregister_from_mlx_lm,
)
from engine.kvcache.quant.rotation import make_rotation
from tests.kvcache_helpers import tiny_llama


def test_unknown_method_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as error:
        KVCacheConfig(method="zip").validate(64)
    message = str(error.value)
    assert "'zip'" in message
    for name in ("affine", "fp16", "rotated"):
        assert name in message


@pytest.mark.parametrize(
    ("config", "head_dim", "fragment"),
    [
        (KVCacheConfig("affine", key_bits=7), 64, "7-bit keys"),
        (KVCacheConfig("affine", key_bits=4, value_bits=1), 64, "1-bit values"),
        (KVCacheConfig("fp16", key_bits=4), 64, "does not support 4-bit"),
        (KVCacheConfig("affine", group_size=128), 64, "not divisible by 128"),
        (KVCacheConfig("affine", group_size=48), 96, "group sizes 32, 64, 128"),
        (KVCacheConfig("affine", group_size=64), 80, "not divisible by 64"),
        (KVCacheConfig("affine", residual_window=-1), 64, "zero or positive"),
        (KVCacheConfig("fp16", residual_window=8), 64, "residual_window and sink_tokens must be 0"),
        (KVCacheConfig("rotated", rotation="fourier"), 64, "Unknown rotation"),
        (KVCacheConfig("affine", options={"x": [1]}), 64, "options must be"),
    ],
)
def test_invalid_configs_raise_one_clear_sentence(config: KVCacheConfig, head_dim: int, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        config.validate(head_dim)


def test_validate_fills_in_default_bits() -> None:
    resolved = KVCacheConfig("affine").validate(64)
    assert (resolved.key_bits, resolved.value_bits) == (4, 4)
    resolved = KVCacheConfig("affine", key_bits=8).validate(64)
    assert (resolved.key_bits, resolved.value_bits) == (8, 8)
    resolved = KVCacheConfig("rotated", key_bits=4, value_bits=2).validate(64)
    assert (resolved.key_bits, resolved.value_bits) == (4, 2)
    assert KVCacheConfig("fp16").validate(64).key_bits == 16


def test_config_json_round_trip_and_unknown_keys() -> None:
    config = KVCacheConfig("rotated", 3, 2, group_size=32, residual_window=64, sink_tokens=4, seed=9,
                           options={"note": "x", "n": 2})
    assert KVCacheConfig.from_json(config.to_json()) == config
    with pytest.raises(ConfigError, match="Unknown KV cache setting"):
        KVCacheConfig.from_dict({"method": "affine", "bitz": 4})


def test_every_method_declares_its_catalogue_entry() -> None:
    infos = {info.name: info for info in all_method_info()}
    assert {"fp16", "fp32", "affine", "rotated"} <= set(infos)
    assert set(infos) == set(known_methods())
    for info in infos.values():
        assert info.attention_path in ("dense", "fused", "dequantize-per-step")
        assert info.description and "\n" not in info.description
        assert info.default_bits in info.supported_bits
        assert info.needs_calibration is (info.name == "vq")  # only vq has calibrated codebooks
    assert infos["affine"].supported_bits == (2, 3, 4, 5, 6, 8)
    assert infos["affine"].attention_path == "fused"


def test_effective_bits_affine_counts_scales_and_biases() -> None:
    affine = get_method("affine")
    # 4-bit codes + one fp16 scale and one fp16 bias per 64 channels = 4 + 32/64.
    assert affine.effective_bits_per_value(KVCacheConfig("affine", 4, group_size=64), 64) == 4.5
    assert affine.effective_bits_per_value(KVCacheConfig("affine", 4, group_size=32), 64) == 5.0
    # Separate key/value bits average: (4 + 0.5 + 2 + 0.5) / 2.
    assert affine.effective_bits_per_value(KVCacheConfig("affine", 4, 2, group_size=64), 64) == 3.5


def test_effective_bits_amortise_sinks_and_window() -> None:
    affine = get_method("affine")
    config = KVCacheConfig("affine", 4, group_size=64, residual_window=100, sink_tokens=4)
    # 1000 tokens: 4 sinks + 100 window tokens at 16 bits, 896 tokens at 4.5 bits.
    expected = (896 * 4.5 + 104 * 16) / 1000
    assert affine.effective_bits_per_value(config, 64, n_tokens=1000) == pytest.approx(expected)
    # Short contexts are entirely 16-bit; the long-context limit is the compressed rate.
    assert affine.effective_bits_per_value(config, 64, n_tokens=50) == 16.0
    assert affine.effective_bits_per_value(config, 64) == 4.5


def test_effective_bits_rotated_counts_the_rotation() -> None:
    rotated = get_method("rotated")
    config = KVCacheConfig("rotated", 4, group_size=64)
    rotation = make_rotation(64, 0, "hadamard")
    rotation_bytes = sum(a.nbytes for a in vars(rotation).values() if hasattr(a, "nbytes"))
    assert rotation_bytes > 0
    n_tokens, n_kv_heads = 256, 3
    expected = 4.5 + rotation_bytes * 8 / n_kv_heads / (n_tokens * 2 * 64)
    assert rotated.effective_bits_per_value(config, 64, n_tokens, n_kv_heads) == pytest.approx(expected)
    assert rotated.effective_bits_per_value(config, 64) == 4.5


def test_dense_methods_are_16_and_32_bits() -> None:
    assert get_method("fp16").effective_bits_per_value(KVCacheConfig("fp16"), 64, 10) == 16
    assert get_method("fp32").effective_bits_per_value(KVCacheConfig("fp32"), 64, 10) == 32


def test_builder_reads_the_model_and_validates() -> None:
    model = tiny_llama(head_dim=32, n_heads=4, n_kv_heads=2, n_layers=3)
    builder = KVCacheBuilder(KVCacheConfig("affine", 4, group_size=32)).for_model(model)
    assert (builder.shape.n_layers, builder.shape.n_kv_heads, builder.shape.head_dim) == (3, 2, 32)
    caches = builder.build()
    assert [c.layer_index for c in caches] == [0, 1, 2]
    assert all(type(c) is get_method("affine") for c in caches)
    assert builder.effective_bits_per_value() == 5.0  # 4 bits + 32 bits per 32 channels
    with pytest.raises(ConfigError, match="not divisible by 64"):
        KVCacheBuilder(KVCacheConfig("affine", group_size=64)).for_model(model)


def test_loader_registration_is_reversible() -> None:
    names = [get_method(m).__name__ for m in known_methods()]
    register_with_mlx_lm()
    assert all(getattr(mlx_cache, name) is get_method(m) for name, m in zip(names, known_methods(), strict=True))
    unregister_from_mlx_lm()
    assert not any(hasattr(mlx_cache, name) for name in names)
    assert hasattr(mlx_cache, "KVCache") and hasattr(mlx_cache, "QuantizedKVCache")
    register_with_mlx_lm()
    assert all(hasattr(mlx_cache, name) for name in names)


def test_describe_gives_a_short_label() -> None:
    assert KVCacheConfig("fp16").validate(64).describe() == "fp16"
    assert KVCacheConfig("affine", 4, 2, group_size=32).describe() == "affine K4/V2 g32"
    assert KVCacheConfig("rotated", 3).describe() == "rotated K3/V3 g64"
    labelled = KVCacheConfig("rotated", 4, residual_window=128, sink_tokens=4).describe()
    assert labelled == "rotated K4/V4 g64 (window 128, sinks 4)"


@pytest.mark.parametrize(
    "config",
    [
        KVCacheConfig(),
        KVCacheConfig("kivi", 4, group_size=32),
        KVCacheConfig("kivi", 4, 4, sink_tokens=4, options={"key_block": 128}),
        KVCacheConfig("rotated", 3, 2, 32, 128, 4, seed=9, rotation="orthogonal"),
        KVCacheConfig("vq", 2, options={"codebooks": "/data/my codebooks+v2/x=y%", "n": 3, "s": "4", "b": True}),
        KVCacheConfig("turboquant", None, 2, options={"codebook": "beta", "none": None, "f": 0.5}),
        KVCacheConfig("kivi", group_size=32),
    ],
    ids=str,
)
def test_spec_string_round_trips(config: KVCacheConfig) -> None:
    text = str(config)
    assert " " not in text and KVCacheConfig.parse(text) == config


def test_spec_strings_of_the_new_options() -> None:
    assert KVCacheConfig.parse("kivi:k4v4:g64:s4:key_block=128") == KVCacheConfig(
        "kivi", 4, 4, 64, sink_tokens=4, options={"key_block": 128})
    assert str(KVCacheConfig("qjl", 4, 4, options={"values": "affine"})) == "qjl:k4v4:g64:values=affine"
    codebooks = KVCacheConfig("vq", 2, 2, options={"codebooks": "/data/cb"})
    assert str(codebooks) == "vq:k2v2:g64:codebooks=/data/cb"
    assert KVCacheConfig.parse("vq:k2v2:codebooks=/data/cb") == replace(codebooks, group_size=64)
    assert KVCacheConfig.parse("vq:k2v2:codebooks='/data/cb'") == codebooks  # quoted, as other text may be
    assert KVCacheConfig.parse("x:name=~/cb").options == {"name": "~/cb"}

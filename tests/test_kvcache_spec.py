"""The one spec syntax of a KV cache configuration: `KVCacheConfig.parse` and `str(config)`."""

from __future__ import annotations

import random
import string

import pytest

from engine.errors import ConfigError
from engine.kvcache import KVCacheConfig, all_method_info
from engine.kvcache.methods._rotation import ROTATION_KINDS


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("fp16", KVCacheConfig("fp16")),
        ("kivi:k4v4:g64", KVCacheConfig("kivi", 4, 4, group_size=64)),
        ("rotated:k3v2:g32:w128:s4", KVCacheConfig("rotated", 3, 2, 32, residual_window=128, sink_tokens=4)),
        ("turboquant:k3", KVCacheConfig("turboquant", key_bits=3)),
        ("affine:v2", KVCacheConfig("affine", value_bits=2)),
        # Settings in any order; the canonical text orders them.
        ("rotated:s4:g32:k4v4:seed=7:rotation=orthogonal", KVCacheConfig(
            "rotated", 4, 4, 32, sink_tokens=4, seed=7, rotation="orthogonal")),
        ("affine:k4v4:prefill_attention=dequantize-blocks",
         KVCacheConfig("affine", 4, 4, options={"prefill_attention": "dequantize-blocks"})),
        ("turboquant:k3v3:codebook=beta:n=2:x=2.5:on=true:off=false:none=null:text='2'", KVCacheConfig(
            "turboquant", 3, 3,
            options={"codebook": "beta", "n": 2, "x": 2.5, "on": True, "off": False, "none": None, "text": "2"})),
        ("  kivi:k8v8:g64  ", KVCacheConfig("kivi", 8, 8)),  # surrounding whitespace is not part of the token
    ],
)
def test_parse_reads_every_setting(text: str, expected: KVCacheConfig) -> None:
    parsed = KVCacheConfig.parse(text)
    assert parsed == expected
    assert type(parsed.options.get("n", 0)) is int and type(parsed.options.get("x", 0.0)) is float
    assert KVCacheConfig.parse(str(parsed)) == parsed


def test_str_is_the_canonical_spec() -> None:
    assert str(KVCacheConfig()) == "fp16"
    assert str(KVCacheConfig("kivi", 4, 4)) == "kivi:k4v4:g64"  # a quantized cache always says its group
    assert str(KVCacheConfig("rotated", 3, 2, 32, residual_window=128, sink_tokens=4)) == "rotated:k3v2:g32:w128:s4"
    assert str(KVCacheConfig("affine", group_size=32)) == "affine:g32"
    assert str(KVCacheConfig("rotated", 4, seed=3, rotation="orthogonal", options={"b": 1, "a": "x y"})) == (
        "rotated:k4:g64:seed=3:rotation=orthogonal:a='x%20y':b=1"
    )
    assert " " not in str(KVCacheConfig("x", options={"note": "with: spaces, 'quotes' = and %"}))


def _random_option_value(rng: random.Random) -> object:
    kind = rng.randrange(7)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.randint(-10**6, 10**6)
    if kind == 2:
        return rng.uniform(-1e3, 1e3) * 10 ** rng.randint(-8, 8)
    if kind == 3:  # strings that look like other types must come back as strings
        return rng.choice(["2", "-3", "2.5", "1e5", "true", "null", "inf", "nan", "", "'", "''"])
    if kind == 4:
        return rng.choice(["auto", "fused", "dequantize-blocks", "beta", "gaussian", "a/b.c", "_x"])
    alphabet = string.ascii_letters + string.digits + " :=%'\"+,/\\.-_é→\t"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))


def _random_config(rng: random.Random, method: str, supported_bits: tuple[int, ...]) -> KVCacheConfig:
    def bits() -> int | None:
        return rng.choice([None, *supported_bits])

    options = {}
    for _ in range(rng.randint(0, 3)):
        name = rng.choice(["prefill_attention", "codebook", "note", "n", "_private", "x1"])
        options[name] = _random_option_value(rng)
    return KVCacheConfig(
        method=method,
        key_bits=bits(),
        value_bits=bits(),
        group_size=rng.choice([32, 64, 128, 48]),
        residual_window=rng.choice([0, 0, 16, 128, 1024]),
        sink_tokens=rng.choice([0, 0, 4]),
        seed=rng.choice([0, 0, 1, 42, -5, 2**31]),
        rotation=rng.choice(["hadamard", *ROTATION_KINDS]),
        options=options,
    )


def test_parse_of_str_round_trips_over_the_registry() -> None:
    """Property: for random configurations of every registered method (every bit width, window, seed,
    rotation, and options of every allowed type), parse(str(c)) == c, and likewise once validated."""
    rng = random.Random(20261130)
    methods = [(info.name, info.supported_bits) for info in all_method_info()]
    assert {"fp16", "fp32", "affine", "rotated", "kivi", "turboquant", "rvq"} <= {name for name, _ in methods}
    checked = validated = 0
    for _ in range(300):
        for method, supported_bits in methods:
            config = _random_config(rng, method, supported_bits)
            text = str(config)
            assert " " not in text and "\n" not in text and "\t" not in text
            assert KVCacheConfig.parse(text) == config, text
            checked += 1
            try:
                resolved = config.validate(128)
            except ConfigError:
                continue
            assert KVCacheConfig.parse(str(resolved)) == resolved
            validated += 1
    assert checked == 300 * len(methods) and validated > checked // 4


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("kivi:4:64", "'4' is not a setting"),  # the old benchmark syntax
        ("rotated:3/2:32+w128", "is not a setting"),
        ("kivi:k4:k3", "bits twice"),
        ("kivi:g32:g64", "group_size twice"),
        ("kivi:seed=1:seed=2", "seed twice"),
        ("kivi:a=1:a=2", "a twice"),
        ("kivi:g", "'g' is not a setting"),
        ("kivi:k", "'k' is not a setting"),
        ("kivi:", "'' is not a setting"),
        ("", "is not a method name"),
        (":k4", "is not a method name"),
        ("kivi k4", "is not a method name"),
        ("kivi:k4 v4", "is not a setting"),
        ("kivi:seed=x", "seed must be an integer"),
        ("kivi:seed=1.5", "seed must be an integer"),
        ("kivi:rotation=2", "rotation must be a name"),
        ("kivi:x=", "is not a value"),
        ("kivi:x=a b", "is not a value"),
        ("kivi:x='a'b'", "is not a value"),
        ("kivi:2x=1", "is not a setting name"),
    ],
)
def test_bad_spec_text_is_one_clear_config_error(text: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        KVCacheConfig.parse(text)
    message = str(caught.value)
    assert problem in message
    assert repr(text) in message and "e.g. kivi:k4v4:g64" in message and "\n" not in message


def test_parse_checks_syntax_and_validate_the_method() -> None:
    config = KVCacheConfig.parse("zip:k4v4")  # a well-formed token naming no registered method
    with pytest.raises(ConfigError, match="Unknown KV cache method 'zip'"):
        config.validate(64)
    with pytest.raises(ConfigError, match="does not support 7-bit keys"):
        KVCacheConfig.parse("kivi:k7").validate(64)
    with pytest.raises(ConfigError, match="A KV cache spec is text"):
        KVCacheConfig.parse(4)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["seed", "rotation", "group_size", "has space", "", "a:b"])
def test_options_that_cannot_be_written_are_refused(name: str) -> None:
    config = KVCacheConfig("affine", 4, options={name: 1})
    with pytest.raises(ConfigError, match="Option name"):
        config.validate(64)
    with pytest.raises(ConfigError, match="cannot be written as a spec"):
        str(config)

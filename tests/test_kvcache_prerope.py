"""KIVI's option rope=pre: compressed keys stored before RoPE, turned forward again by their positions on every
path (engine/kvcache/quant/rope.py, methods/kivi.py)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine.errors import ConfigError
from engine.kvcache import KVCacheBuilder, KVCacheConfig, ModelShape, get_method
from engine.kvcache.quant.rope import RopeParameters, model_rope
from tests.kvcache_helpers import (
    assert_save_and_load_round_trip_bit_exactly,
    assert_trim_drops_the_newest_tokens,
    feed_tokens,
    filled,
    random_kv,
    relative_error,
    tiny_llama,
    tiny_tokenizer,
)

PRE = "kivi:k8v8:g64:s4:key_block=64:rope=pre"


def _model():
    return tiny_llama(head_dim=64, n_heads=4, n_kv_heads=2, n_layers=2)


def test_the_builder_writes_the_models_rope_into_the_spec() -> None:
    model = _model()
    config = KVCacheBuilder(KVCacheConfig.parse(PRE)).for_model(model).config
    rope = model_rope(model)
    assert rope == RopeParameters(64, 10000.0, 1.0, False)  # mlx-lm llama's default RoPE
    assert get_method("kivi").rope_parameters(config) == rope
    assert KVCacheConfig.parse(str(config)) == config  # a saved or re-encoded cache needs no model
    # Built again for the same model: nothing changes; for a model with another RoPE: a clear error.
    assert KVCacheBuilder(config).for_model(model).config == config
    other = _model()
    for layer in other.layers:
        layer.self_attn.rope.base = 500000.0
    with pytest.raises(ConfigError, match="model's is"):
        KVCacheBuilder(config).for_model(other)


def test_keys_come_back_as_the_model_gave_them_and_the_stored_ones_differ() -> None:
    """At 8 bits the keys a cache hands back (to_dense) are those it was given (after RoPE) up to rounding, at
    every position of several blocks, fed in uneven chunks; and what the blocks hold is not the plain cache's
    codes, so the keys really were turned back before quantizing."""
    model = _model()
    pre = KVCacheBuilder(KVCacheConfig.parse(PRE)).for_model(model).build()[1]
    plain = KVCacheBuilder(KVCacheConfig.parse(PRE.replace(":rope=pre", ""))).for_model(model).build()[1]
    keys, values = random_kv(n_kv_heads=2, n_tokens=300, head_dim=64, seed=3)
    for cache in (pre, plain):
        filled(cache, keys, values, chunk=37)
        assert cache.n_compressed == 256 and cache.n_window == 44
        assert relative_error(cache.to_dense()[0], keys) < 5e-3
    assert not mx.array_equal(pre._store["key_codes"], plain._store["key_codes"])
    # Turned back by their positions, the stored keys are the given ones turned by -position (after the
    # sinks' stream copies, which are stand-ins never attended to).
    turned_back = model_rope(model).rotate(keys[..., :256, :], 0, inverse=True)
    stored = pre._decode_keys(pre._compressed_view())
    assert relative_error(stored[..., 4:, :], turned_back[..., 4:, :]) < 1e-2  # not turned back: ~1


def test_logits_follow_the_16_bit_cache_in_prefill_and_decode_steps() -> None:
    """Prefill chunks and single-token steps (which decode the history: no packed-code path turns keys) stay as
    close to the 16-bit cache's logits as the plain 8-bit cache does; keys turned by wrong positions would not
    (checked with a cache told another RoPE)."""
    model = _model()
    reference = make_prompt_cache(model)
    pre = KVCacheBuilder(KVCacheConfig.parse(PRE)).for_model(model).build()
    plain = KVCacheBuilder(KVCacheConfig.parse(PRE.replace(":rope=pre", ""))).for_model(model).build()
    expected = feed_tokens(model, reference, 200, chunk=50)
    plain_error = relative_error(feed_tokens(model, plain, 200, chunk=50), expected)
    assert relative_error(feed_tokens(model, pre, 200, chunk=50), expected) < 2 * plain_error + 1e-2
    for token in (5, 17, 42):
        step = mx.array([[token]])
        wanted = model(step, cache=reference)
        plain_error = relative_error(model(step, cache=plain), wanted)
        assert relative_error(model(step, cache=pre), wanted) < 2 * plain_error + 1e-2
    for cache in pre:
        cache._rope = RopeParameters(64, 500000.0)  # the wrong positions' turn
    assert relative_error(model(mx.array([[9]]), cache=pre), model(mx.array([[9]]), cache=reference)) > 0.1


def test_save_load_and_trim_keep_the_positions(tmp_path: Path) -> None:
    model = _model()
    caches = KVCacheBuilder(KVCacheConfig.parse(PRE)).for_model(model).build()
    feed_tokens(model, caches, 100, chunk=30)
    assert_save_and_load_round_trip_bit_exactly(model, caches, tmp_path / "cache.safetensors")
    caches = KVCacheBuilder(KVCacheConfig.parse(PRE)).for_model(model).build()
    feed_tokens(model, caches, 100, chunk=30)
    assert_trim_drops_the_newest_tokens(model, caches)  # 100 -> 75 cuts into the second 64-token block


def test_mlx_lm_generate_runs_unchanged() -> None:
    from mlx_lm import generate

    model = _model()
    caches = KVCacheBuilder(KVCacheConfig.parse("kivi:k4v4:g64:s4:key_block=64:rope=pre")).for_model(model).build()
    text = generate(model, tiny_tokenizer(), " ".join(f"w{i % 90 + 1}" for i in range(150)), max_tokens=8,
                    prompt_cache=caches)
    assert len(text.split()) == 8 and caches[0].n_compressed == 128


def test_not_a_level_while_the_cpu_decodes_its_keys() -> None:
    """No quantized_matmul applies RoPE to packed keys, so without the GPU kernel attention decodes them: the
    level rule leaves the option out (the tiled kernel's variant: tests/test_kvcache_kernel_emulation.py)."""
    kivi = get_method("kivi")
    config = KVCacheConfig.parse(PRE)
    assert kivi.kernel_declines(config) is None
    assert "rope=pre" in kivi.decodes_history_without_kernel(config)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("kivi:k4v4:g64:rope=post", "rope=pre"),
        ("kivi:k4v4:g64:rope_dims=64", "only with rope=pre"),
        ("kivi:k4v4:g64:rope=pre:rope_dims=64:rope_base=10000.0", "missing"),
        ("kivi:k4v4:g64:rope=pre:rope_dims=63:rope_base=10000.0:rope_scale=1.0:rope_traditional=false", "even"),
        ("kivi:k4v4:g64:rope=pre:rope_dims=64:rope_base=0:rope_scale=1.0:rope_traditional=false", "positive"),
    ],
)
def test_bad_rope_options_are_clear_errors(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        KVCacheConfig.parse(spec).validate(64)


def test_without_the_models_rope_a_cache_refuses_to_start() -> None:
    caches = KVCacheBuilder(KVCacheConfig.parse(PRE)).for_shape(ModelShape(2, 4, 2, 64)).build()
    keys = mx.zeros((1, 2, 8, 64))
    with pytest.raises(ConfigError, match="for_model"):
        caches[0].update_and_fetch(keys, keys)


def test_a_model_without_plain_rope_is_refused() -> None:
    model = _model()

    class Shifted:  # some other position scheme
        def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
            return x

    for layer in model.layers:
        layer.self_attn.rope = Shifted()
    with pytest.raises(ConfigError, match="plain RoPE"):
        KVCacheBuilder(KVCacheConfig.parse(PRE)).for_model(model)


AUTO = "kivi:k4v4:g64:s4:key_block=64:rotate_values=true:wide=0.5:wide_layers=L1:rope=auto"


def _resolved(spec: str, model=None) -> KVCacheConfig:
    return KVCacheBuilder(KVCacheConfig.parse(spec)).for_model(model or _model()).config


def test_rope_auto_keeps_keys_as_given_where_no_kernel_turns_them() -> None:
    """On the CPU (no kernel backend) rope=auto resolves to the plain cache: the same config as without the
    option, so nothing decodes the history; it never counts as decoding it."""
    assert _resolved(AUTO) == _resolved(AUTO.replace(":rope=auto", ""))
    assert get_method("kivi").decodes_history_without_kernel(KVCacheConfig.parse(AUTO)) is None
    assert "no GPU decode kernel" in get_method("kivi").rope_pre_declines(KVCacheConfig.parse(AUTO), _model())


def test_rope_auto_stores_keys_before_rope_where_the_kernel_turns_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the decode kernel turns keys (here the CPU emulator standing in for a GPU backend) rope=auto is
    rope=pre with the model's RoPE written in, for the widened layers' bits too; with kernels off, a RoPE over
    part of the channels or another position scheme it falls back to keys as given, without an error."""
    from engine.kvcache import kernels

    monkeypatch.setattr(kernels, "available_backend", lambda: "emulate")
    assert _resolved(AUTO) == _resolved(AUTO.replace("rope=auto", "rope=pre"))
    assert get_method("kivi").rope_parameters(_resolved(AUTO)) == RopeParameters(64, 10000.0, 1.0, False)
    plain = AUTO.replace(":rope=auto", "")
    assert _resolved(AUTO + ":kernels=off") == _resolved(plain + ":kernels=off")
    partial = _model()
    for layer in partial.layers:
        layer.self_attn.rope.dims = 32
    assert _resolved(AUTO, partial) == _resolved(plain, partial)

    class Shifted:  # some other position scheme
        def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
            return x

    other = _model()
    for layer in other.layers:
        layer.self_attn.rope = Shifted()
    assert _resolved(AUTO, other) == _resolved(plain, other)
    monkeypatch.setattr(kernels.decode, "ROPE_BACKENDS", ())
    assert _resolved(AUTO) == _resolved(plain)


def test_rope_auto_takes_no_rope_parameters() -> None:
    with pytest.raises(ConfigError, match="only with rope=pre"):
        KVCacheConfig.parse("kivi:k4v4:g64:rope=auto:rope_dims=64").validate(64)


def test_each_level_with_rope_auto_is_the_rules_cache_where_no_kernel_runs() -> None:
    """LEVEL_TABLE writes rope=auto beside the rule's choice (benchmarks.harness.levels.DEVICE_OPTIONS): on the CPU
    every level builds exactly the cache the rule chose and the sweep measured."""
    from benchmarks.harness.levels import without_device_options
    from engine.planning.recommend import LEVELS

    model = tiny_llama(head_dim=64, n_heads=4, n_kv_heads=2, n_layers=10)
    carrying = [level for level in LEVELS if level.config.options.get("rope") == "auto"]
    assert [level.key for level in carrying] == ["3", "2"]
    for level in carrying:
        config = level.config
        if config.wide_fraction is not None:
            config = config.with_wide_layers((1,))  # a tiny model: no calibration
        built = KVCacheBuilder(config).for_model(model).config
        assert built == KVCacheBuilder(without_device_options(config)).for_model(model).config, level.key
        assert "rope" not in built.options


def test_a_held_cache_re_encodes_into_keys_before_rope_and_back() -> None:
    """The live level switch (reencode_caches) into a rope=pre cache turns the held keys back by their positions:
    at 8 bits the keys come back as the plain cache held them; and back out again."""
    from engine.kvcache import reencode_caches

    model = _model()
    plain = KVCacheBuilder(KVCacheConfig.parse(PRE.replace(":rope=pre", ""))).for_model(model).build()
    keys, values = random_kv(n_kv_heads=2, n_tokens=300, head_dim=64, seed=5)
    for cache in plain:
        filled(cache, keys, values, chunk=41)
    pre_config = KVCacheBuilder(KVCacheConfig.parse(PRE)).for_model(model).config
    pre = reencode_caches(plain, pre_config, 64)
    assert pre[0].config == pre_config.for_layer(0) and pre[0].offset == 300
    assert relative_error(pre[0].to_dense()[0], plain[0].to_dense()[0]) < 5e-3
    back = reencode_caches(pre, plain[0].config, 64)
    assert relative_error(back[1].to_dense()[0], plain[1].to_dense()[0]) < 1e-2

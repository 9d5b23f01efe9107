"""KIVI's option key_widths: key channels at different widths averaging the key bits (quant/channel_widths.py), the
calibration that chooses them (engine/kvcache/key_widths.py) and the cache that stores them (methods/kivi.py)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import engine.kvcache.kernels as kernels
from engine.errors import ConfigError
from engine.kvcache import KVCacheBuilder, KVCacheConfig, get_method
from engine.kvcache import key_widths as calibration
from engine.kvcache.layer_sensitivity import calibration_dir
from engine.kvcache.quant.channel_widths import WidthClasses, allocate_widths, width_choices
from engine.planning.memory import array_bytes
from tests.kvcache_helpers import (
    TINY_VOCAB,
    assert_save_and_load_round_trip_bit_exactly,
    assert_trim_drops_the_newest_tokens,
    feed_tokens,
    filled,
    queries_for,
    random_kv,
    reference_attention,
    relative_error,
    tiny_llama,
)

SPEC = "kivi:k3v3:g64:s4:key_block=64:key_outliers=1:key_widths=calibrated"


def _tokens(n: int = 600, seed: int = 3) -> list[int]:
    return mx.random.randint(0, TINY_VOCAB, (n,), key=mx.random.key(seed)).tolist()


def _model():  # noqa: ANN202
    return tiny_llama(head_dim=64, n_heads=4, n_kv_heads=2, n_layers=2)


def _varied_spec() -> str:
    """SPEC with a table of widths 2-5 in both layers, registered in this process (the tiny random llama's channels
    matter about equally: its own calibration gives every channel 3 bits)."""
    rng = np.random.default_rng(7)
    digest = calibration.register_table([allocate_widths(rng.lognormal(0.0, 2.0, (2, 64)), 3) for _ in range(2)])
    return SPEC.replace("calibrated", digest)


def _built(spec: str | None = None, model=None):  # noqa: ANN001, ANN202
    model = model or _model()
    config = KVCacheConfig.parse(spec or _varied_spec())
    return model, KVCacheBuilder(config).for_model(model, calibration_tokens=_tokens())


# ----- the allocation ---------------------------------------------------------------------------------------------


def test_width_choices_stay_among_mlx_codes_and_contiguous() -> None:
    assert width_choices(3) == (2, 3, 4, 5)
    assert width_choices(4) == (3, 4, 5, 6)
    assert width_choices(2) == (1, 2, 3, 4)   # MLX's 1-bit codes
    assert width_choices(1) == (1, 2, 3)
    assert width_choices(6) == (5, 6)      # no 7-bit code: 8 is not next to 6
    assert width_choices(8) == (8,)


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_allocation_averages_the_bits_with_one_count_per_width_in_every_head(bits: int) -> None:
    rng = np.random.default_rng(bits)
    importance = rng.lognormal(0.0, 2.0, size=(3, 64))
    widths = allocate_widths(importance, bits)
    assert widths.dtype == np.uint8 and widths.shape == (3, 64)
    assert (widths.astype(int).sum(axis=1) == bits * 64).all()
    counts = [np.bincount(row, minlength=9) for row in widths]
    assert all((c == counts[0]).all() for c in counts)
    assert len(np.unique(widths)) > 1  # such spread importance does not come out uniform
    # Within a head, a more important channel never gets fewer bits than a less important one.
    for head in range(3):
        order = np.argsort(-importance[head], kind="stable")
        assert (np.diff(widths[head][order].astype(int)) <= 0).all()


def test_the_allocation_lowers_the_weighted_error_it_is_built_for() -> None:
    rng = np.random.default_rng(0)
    importance = rng.lognormal(0.0, 1.5, size=(2, 64))
    widths = allocate_widths(importance, 3)
    weighted = (importance / (2.0 ** widths - 1) ** 2).sum()
    uniform = (importance / (2.0**3 - 1) ** 2).sum()
    assert weighted < 0.6 * uniform


def test_bad_importance_or_widths_are_refused() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        allocate_widths(np.array([[1.0, -1.0]]), 3)
    with pytest.raises(ValueError, match="same count"):
        WidthClasses.of(np.array([[2, 4, 3, 3], [3, 3, 3, 3]]), 3)
    with pytest.raises(ValueError, match="average 3"):
        WidthClasses.of(np.array([[2, 3, 3, 3]]), 3)
    with pytest.raises(ValueError, match="among"):
        WidthClasses.of(np.array([[1, 5, 3, 3]]), 3)


def test_width_classes_give_each_width_its_rows_in_storage_order() -> None:
    widths = np.array([[4, 2, 3, 3], [3, 3, 2, 4]])
    classes = WidthClasses.of(widths, 3)
    assert classes.rows == ((2, 0, 1), (3, 1, 3), (4, 3, 4))
    assert (np.take_along_axis(widths, classes.order, axis=1) == [[2, 3, 3, 4]] * 2).all()
    assert (np.take_along_axis(classes.order, classes.inverse, axis=1) == np.arange(4)).all()


# ----- the cache --------------------------------------------------------------------------------------------------


def test_the_builder_writes_a_digest_whose_table_is_kept_on_disk() -> None:
    model, builder = _built(SPEC)
    digest = builder.config.options["key_widths"]
    assert calibration.is_digest(digest)
    saved = json.loads((calibration_dir() / f"key_widths-{digest}.json").read_text())
    assert saved["digest"] == digest and len(saved["widths"]) == 2
    assert KVCacheConfig.parse(str(builder.config)) == builder.config
    # Built again for the same model and tokens: read back, not measured again.
    calibration._TABLES.clear()
    measured = calibration.channel_importance
    try:
        calibration.channel_importance = None  # type: ignore[assignment]
        again = KVCacheBuilder(KVCacheConfig.parse(SPEC)).for_model(model, calibration_tokens=_tokens())
    finally:
        calibration.channel_importance = measured
    assert again.config == builder.config


def test_each_width_is_stored_at_its_width_and_decodes_closer_the_wider_it_is() -> None:
    model, builder = _built()
    cache = builder.build()[0]
    keys, values = random_kv(n_kv_heads=2, n_tokens=300, head_dim=64, outlier_channels=(3, 17))
    filled(cache, keys, values)
    widths = calibration.key_widths_table(builder.config.options["key_widths"])[0]
    stored = {name: array for name, array in cache._store.items() if name.startswith("key_codes")}
    assert sorted(stored) == sorted(f"key_codes_w{w}" for w in np.unique(widths))
    for name, codes in stored.items():
        width = int(name.rsplit("_w", 1)[1])
        rows = int((widths[0] == width).sum())
        assert codes.shape[:3] == (1, 2, rows) and codes.shape[3] * 32 == cache.capacity * width
    decoded, _ = cache.to_dense()
    # Per channel, relative to its range: the error falls with the channel's width (compressed tokens only).
    n = cache.n_compressed
    error = mx.abs(decoded[..., 4:n, :] - keys[..., 4:n, :]).max(axis=2) / (
        keys[..., :n, :].max(axis=2) - keys[..., :n, :].min(axis=2))
    error = np.array(error)[0]
    means = {int(w): float(error[widths == w].mean()) for w in np.unique(widths)}
    assert len(means) == 4
    assert all(means[a] > means[b] for a, b in zip(sorted(means), sorted(means)[1:], strict=False))


def test_a_2bit_layer_keeps_its_quietest_channels_at_one_bit() -> None:
    """At 2 key bits the widths are 1-4 (MLX's 1-bit codes: each entry at its block's min or max); attention reads
    the 1-bit codes like the others."""
    rng = np.random.default_rng(11)
    importance = rng.lognormal(0.0, 2.0, (2, 64))
    widths = allocate_widths(importance, 2)
    assert widths.min() == 1 and widths.max() > 2 and (widths.astype(int).sum(axis=1) == 2 * 64).all()
    digest = calibration.register_table([widths, widths])
    spec = f"kivi:k2v2:g64:key_block=64:clip_search=true:key_widths={digest}"
    cache = get_method("kivi")(KVCacheConfig.parse(spec), layer_index=0)
    keys, values = random_kv(n_kv_heads=2, n_tokens=300, head_dim=64)
    filled(cache, keys, values)
    codes = cache._store["key_codes_w1"]
    assert codes.shape[:3] == (1, 2, int((widths[0] == 1).sum())) and codes.shape[3] * 32 == cache.capacity
    # A 1-bit channel's decoded entries are two values per block: its block's two levels.
    decoded, _ = cache.to_dense()
    channel = int(np.flatnonzero(widths[0] == 1)[0])
    block = np.array(decoded[0, 0, 64:128, channel])
    assert len(np.unique(block)) <= 2
    queries = queries_for(4, 3, 64)
    on_codes = cache.attention(queries, cache, cache, 0.125, None)
    assert relative_error(on_codes, reference_attention(queries, decoded, cache.to_dense()[1], 0.125, None)) < 2e-3


def test_one_bit_channels_wait_for_a_gpu_parity_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Until a GPU backend reads 1-bit key channels in its parity run, the level rule leaves 2-bit key widths out
    (gpu_unverified) and a GPU's decode kernel declines them."""
    kivi = get_method("kivi")
    two_bit = KVCacheConfig.parse("kivi:k2v2:g64:s4:key_block=128:clip_search=true:key_widths=calibrated")
    monkeypatch.setattr(kernels.decode, "ONE_BIT_BACKENDS", ("emulate",))
    assert "1-bit" in kivi.gpu_unverified(two_bit)
    assert kivi.gpu_unverified(KVCacheConfig.parse(SPEC)) is None
    codec = kernels.Codec("kivi_keys", 2, widths=width_choices(2))
    assert "1-bit" in kernels.decode.unverified_on(codec, "cuda")
    assert kernels.decode.unverified_on(codec, "emulate") is None
    monkeypatch.setattr(kernels.decode, "ONE_BIT_BACKENDS", ("emulate", "cuda"))
    assert kivi.gpu_unverified(two_bit) is None and kernels.decode.unverified_on(codec, "cuda") is None


def test_one_bit_codes_are_packed_and_read_here_as_mlx_reads_them_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """1-bit codes are packed by Velox (MLX's CUDA backend returns zeros for them) in MLX's layout: MLX's CPU
    dequantize and quantized_matmul read them as Velox's own decode does, and the decode-then-multiply used off the
    CPU gives the same products."""
    from engine.kvcache.methods import affine

    x = mx.array(np.random.default_rng(4).standard_normal((2, 6, 256)).astype(np.float32))
    store = affine.affine_quantize(x, "key", 64, 1)
    ours = affine.affine_dequantize(store, "key", 64, 1, float32_scales=True)
    theirs = mx.dequantize(store["key_codes"], store["key_scales"], store["key_biases"], group_size=64, bits=1)
    assert mx.array_equal(ours, theirs)
    levels = np.unique(np.array(ours[0, 0, :64]))
    assert len(levels) == 2 and np.isclose(levels, [float(x[0, 0, :64].min()), float(x[0, 0, :64].max())]).all()
    query = mx.array(np.random.default_rng(5).standard_normal((2, 3, 256)).astype(np.float32))
    on_cpu = affine.affine_matmul(query, store, "key", 64, 1, transpose=True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)  # the branch taken off the CPU (run here on the CPU)
    elsewhere = affine.affine_matmul(query, store, "key", 64, 1, transpose=True)
    assert float(mx.max(mx.abs(on_cpu - elsewhere))) < 1e-4


def test_attention_on_the_codes_matches_attention_on_the_decoded_keys() -> None:
    model, builder = _built()
    cache = builder.build()[1]
    keys, values = random_kv(n_kv_heads=2, n_tokens=333, head_dim=64, outlier_channels=(5,))
    filled(cache, keys, values)
    queries = queries_for(4, 3, 64)
    on_codes = cache.attention(queries, cache, cache, 0.125, None)
    dense_keys, dense_values = cache.to_dense()
    on_decoded = reference_attention(queries, dense_keys, dense_values, 0.125, None)
    assert relative_error(on_codes, on_decoded) < 2e-3
    # Against exact attention, about as close as plain KIVI at the same bits (widths calibrated on the model, not
    # on these random keys, need not help them; a wrong channel order would be far off).
    plain = get_method("kivi")(KVCacheConfig.parse(SPEC.replace(":key_widths=calibrated", "")), layer_index=1)
    filled(plain, keys, values)
    exact = reference_attention(queries, keys, values, 0.125, None)
    plain_error = relative_error(plain.attention(queries, plain, plain, 0.125, None), exact)
    assert relative_error(on_codes, exact) < 1.5 * plain_error
    cache._key_order = mx.array(np.array(cache._key_order)[:, ::-1].copy())  # each head's channels misplaced
    assert relative_error(cache.attention(queries, cache, cache, 0.125, None), exact) > 2 * plain_error


def test_held_bytes_are_the_arrays_and_the_formula_counts_them() -> None:
    model, builder = _built()
    cache = builder.build()[0]
    keys, values = random_kv(n_kv_heads=2, n_tokens=512, head_dim=64)
    filled(cache, keys, values, chunk=64)
    # Every array the cache holds, walked (the channel order and its inverse among them), is what it reports.
    assert cache.nbytes == array_bytes(cache) > 0
    assert any(a is cache._key_order for a in cache._held_arrays())
    kivi = get_method("kivi")
    assert kivi.head_constant_bytes(cache.config, 64) == 2 * 64
    assert cache.nbytes == pytest.approx(kivi.expected_nbytes(cache.config, 64, cache.offset, 2), rel=1e-12)
    # The widths average the key bits: the same bits per value as plain KIVI but for the channel orders.
    plain = KVCacheConfig.parse(SPEC.replace(":key_widths=calibrated", ""))
    difference = kivi.effective_bits_per_value(cache.config, 64, 4096, 2) - kivi.effective_bits_per_value(
        plain, 64, 4096, 2)
    assert difference == pytest.approx(2 * 64 * 8 / (4096 * 2 * 64))


def test_save_load_and_trim(tmp_path: Path) -> None:
    model, builder = _built()
    caches = builder.build()
    feed_tokens(model, caches, 150, chunk=40)
    # A loaded cache brings its own widths: the table (registered in this process only) is not needed.
    saved = dict(calibration._TABLES)
    calibration._TABLES.clear()
    try:
        assert_save_and_load_round_trip_bit_exactly(model, caches, tmp_path / "cache.safetensors")
        with pytest.raises(ConfigError, match="No key width calibration"):
            feed_tokens(model, builder.build(), 100)
    finally:
        calibration._TABLES.update(saved)
    caches = builder.build()
    feed_tokens(model, caches, 100, chunk=30)
    assert_trim_drops_the_newest_tokens(model, caches)


def test_a_cache_saved_with_per_width_scales_loads_as_the_shared_layout() -> None:
    """Before the widths shared one array of scales, biases and outliers (so a kernel reads all classes through a few
    buffers), a saved cache held one of each per width (key_scales_w3, ...). Such a state loads into today's layout and
    decodes the same keys and values."""
    model, builder = _built()
    cache = builder.build()[0]
    keys, values = random_kv(n_kv_heads=2, n_tokens=300, head_dim=64, outlier_channels=(3, 17))
    filled(cache, keys, values)
    state = cache.state
    shared = ("key_scales", "key_biases", "key_outlier_residuals", "key_outlier_index")
    assert set(shared) <= set(state["compressed"])
    old = {name: array for name, array in state["compressed"].items() if name not in shared}
    for width, start, end in cache._width_rows:
        for name in shared:
            old[f"{name}_w{width}"] = state["compressed"][name][..., start:end, :]
    loaded = type(cache).__new__(type(cache))
    loaded.state = {**state, "compressed": old}
    assert sorted(loaded._store) == sorted(state["compressed"])
    for name, array in state["compressed"].items():
        assert mx.array_equal(loaded._store[name], array), name
    for mine, theirs in zip(loaded.to_dense(), cache.to_dense(), strict=True):
        assert mx.array_equal(mine, theirs)


def test_bad_key_widths_options_are_clear_errors() -> None:
    for spec, message in (
        ("kivi:k3v3:key_widths=yes", "key_widths=calibrated"),
        ("kivi:k8v8:key_widths=calibrated", "2, 3, 4, 5 or 6 key bits"),
        ("kivi:k3v3:key_grid=lloyd:key_widths=calibrated", "not both"),
    ):
        with pytest.raises(ConfigError, match=message):
            KVCacheConfig.parse(spec).validate(64)
    with pytest.raises(ConfigError, match="for_model"):
        get_method("kivi")(KVCacheConfig.parse(SPEC)).update_and_fetch(*random_kv(n_tokens=8))
    # rope=auto keeps the keys as given where no kernel turns keys at different widths (a GPU backend whose parity run
    # of them has not passed; here on the CPU, no GPU kernel at all).
    kivi = get_method("kivi")
    assert kivi.rope_pre_declines(KVCacheConfig.parse(SPEC), _model()) is not None
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "available_backend", lambda: "cuda")
        patch.setattr(kernels.decode, "WIDTH_ROPE_BACKENDS", ("emulate",))
        assert "key_widths" in kivi.rope_pre_declines(KVCacheConfig.parse(SPEC), _model())
        patch.setattr(kernels.decode, "WIDTH_ROPE_BACKENDS", ("emulate", "cuda"))
        assert kivi.rope_pre_declines(KVCacheConfig.parse(SPEC), _model()) is None


def test_wide_layers_get_widths_around_their_own_bits() -> None:
    model = _model()
    spec = SPEC + ":wide=0.5:wide_layers=L1"
    builder = KVCacheBuilder(KVCacheConfig.parse(spec)).for_model(model, calibration_tokens=_tokens())
    table = calibration.key_widths_table(builder.config.options["key_widths"])
    assert (table[0].astype(int).sum(axis=1) == 3 * 64).all() and table[0].min() >= 2
    assert (table[1].astype(int).sum(axis=1) == 4 * 64).all() and table[1].min() >= 3
    caches = builder.build()
    feed_tokens(model, caches, 200)
    for cache, layer in zip(caches, table, strict=True):
        assert sorted(n for n in cache._store if n.startswith("key_codes")) == sorted(
            f"key_codes_w{w}" for w in np.unique(layer))


@pytest.mark.parametrize("rope", ["", ":rope=pre"])
@pytest.mark.parametrize("layout", [
    "kivi:k3v3:g64:s4:key_block=128:key_outliers=1:rotate_values=true:symmetric_values=true:wide=0.1",
    "kivi:k2v2:g64:s4:clip_search=true:key_block=128:rotate_values=true:wide=0.1",
    "kivi:k4v4:g64:s4:key_block=128:rotate_values=true:wide=0.1"], ids=["3bit", "2bit", "4bit"])
def test_the_bundled_widths_of_the_default_model_are_what_it_measures(smollm, layout: str, rope: str, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The 4-, 3- and 2-bit layouts' key widths on the default model ship with Velox (keys as given and before RoPE), so
    their first use measures nothing and every device uses the widths the CPU figures were measured with; measured
    again here (bundle and data folder set aside), the calibration writes the same key and, but for near ties, the same
    widths. The widths rank channels by measured sensitivity, and a CPU whose BLAS kernels round otherwise (an AMD EPYC
    with AVX2 against the machines the bundle was measured on) swaps a few channels of nearly equal rank: at most
    1 % of the channels may differ, each by one bit, with every layer's and head's mean width (its bytes) the same."""
    model, tokenizer, _ = smollm
    monkeypatch.setattr(calibration, "BUNDLED_DIR", tmp_path / "no-bundle")
    monkeypatch.setattr(calibration, "_TABLES", {})
    monkeypatch.setenv("VELOX_DATA_DIR", str(tmp_path / "data"))
    spec = layout + ":key_widths=calibrated" + rope
    digest = KVCacheBuilder(KVCacheConfig.parse(spec)).for_model(model, tokenizer=tokenizer).config.options["key_widths"]
    measured = json.loads((calibration_dir() / f"key_widths-{digest}.json").read_text())
    bundled_files = Path(calibration.__file__).with_name("calibrations").glob("key_widths-*.json")
    (bundled,) = [b for b in (json.loads(f.read_text()) for f in bundled_files) if b["key"] == measured["key"]]
    got, want = np.array(measured["widths"]), np.array(bundled["widths"])
    assert got.shape == want.shape
    assert int(np.abs(got - want).max()) <= 1 and float(np.mean(got != want)) <= 0.01, float(np.mean(got != want))
    assert np.array_equal(got.sum(axis=-1), want.sum(axis=-1))

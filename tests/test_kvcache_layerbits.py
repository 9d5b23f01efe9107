"""Per-layer bits (option `wide=F`): the spec, the averaged bits formula, the builder's per-layer caches (nbytes,
save/load, trim, re-encode) and the layer-sensitivity calibration that picks the wide layers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from engine.errors import ConfigError
from engine.kvcache import KVCacheBuilder, KVCacheConfig, ModelShape, get_method, reencode_caches
from engine.kvcache import layer_sensitivity as sensitivity
from engine.kvcache.config import n_wide_layers
from engine.planning.memory import array_bytes
from tests.kvcache_helpers import (
    assert_save_and_load_round_trip_bit_exactly,
    assert_trim_drops_the_newest_tokens,
    feed_tokens,
    relative_error,
    tiny_llama,
    tiny_tokenizer,
)

LEVEL_4 = "kivi:k4v4:g64:s4:key_block=128:rotate_values=true"
LEVEL_3 = "kivi:k3v3:g64:s4:key_block=128"
# A tiny model's caches: 4 layers, head_dim 32; layers 1 and 3 widened (wide=0.5 of 4 layers).
TINY_WIDE = "kivi:k4v3:g32:s2:rotate_values=true:wide=0.5:wide_layers=L1.3"


def _tiny_model():
    return tiny_llama(n_layers=4)


# ----- the spec ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text", [f"{LEVEL_4}:wide=0.1", f"{LEVEL_4}:wide=0.1:wide_layers=L1.10.18", f"{LEVEL_3}:wide=0", TINY_WIDE,
             "kivi:k4v4:g64:wide=1:wide_layers=L"]
)
def test_wide_specs_round_trip(text: str) -> None:
    config = KVCacheConfig.parse(text)
    assert str(config) == text and KVCacheConfig.parse(str(config)) == config
    assert config.validate(128).options == config.options


def test_wide_options_read_as_a_fraction_and_layer_indices() -> None:
    config = KVCacheConfig.parse(f"{LEVEL_4}:wide=0.1:wide_layers=L1.10.18")
    assert config.wide_fraction == 0.1 and config.wide_layers == (1, 10, 18)
    assert KVCacheConfig.parse(LEVEL_4).wide_fraction is None
    assert KVCacheConfig.parse(f"{LEVEL_4}:wide=0.1").wide_layers is None
    assert [n_wide_layers(0.1, n) for n in (30, 29, 9, 10)] == [3, 2, 0, 1]
    assert n_wide_layers(0.29, 100) == 29  # 0.29 × 100 is 28.999999999999996 in floats
    widened = config.for_layer(10)
    assert (widened.key_bits, widened.value_bits) == (5, 5) and str(widened) == LEVEL_4.replace("k4v4", "k5v5")
    assert str(config.for_layer(2)) == LEVEL_4
    assert config.describe() == "kivi K4/V4 g64 (sinks 4, 10% of layers +1 bit)"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("kivi:k8v8:g64:wide=0.1", "cannot widen 8-bit keys"),
        ("kivi:k4v8:g64:wide=0.1", "cannot widen 8-bit values"),
        ("kivi:k6v4:g64:wide=0.1", "cannot widen 6-bit keys"),
        ("affine:k4v4:g64:wide=0.1", "Method 'affine' cannot store some layers with more bits"),
        ("fp16:wide=0.1", "Method 'fp16' cannot store"),
        ("rotated:k4v4:g64:wide_layers=L1", "Method 'rotated' cannot store"),
        ("kivi:k4v4:g64:wide=1.5", "a fraction of the layers, 0 to 1"),
        ("kivi:k4v4:g64:wide=-0.1", "a fraction of the layers, 0 to 1"),
        ("kivi:k4v4:g64:wide=true", "a fraction of the layers, 0 to 1"),
        ("kivi:k4v4:g64:wide=some", "a fraction of the layers, 0 to 1"),
        ("kivi:k4v4:g64:wide_layers=L1", "only with wide=F"),
        ("kivi:k4v4:g64:wide=0.1:wide_layers=L1.x", "dot-separated layer indices"),
        ("kivi:k4v4:g64:wide=0.1:wide_layers=L3.1", "in increasing order"),
        ("kivi:k4v4:g64:wide=0.1:wide_layers=L1.1", "each layer once"),
        ("kivi:k2v2:g64:key_grid=lloyd:clip_search=true:wide=0.1", "not both"),
    ],
)
def test_wrong_use_of_wide_is_one_clear_config_error(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        KVCacheConfig.parse(text).validate(128)


# ----- the bits formula -------------------------------------------------------------------------------------


def test_bits_are_averaged_over_the_layers() -> None:
    kivi = get_method("kivi")
    wide = KVCacheConfig.parse(f"{LEVEL_4}:wide=0.1")
    base = kivi.effective_bits_per_value(KVCacheConfig.parse(LEVEL_4), 128, 4096, 8)
    widened = kivi.effective_bits_per_value(KVCacheConfig.parse(LEVEL_4.replace("k4v4", "k5v5")), 128, 4096, 8)
    assert base == pytest.approx(4.391, abs=5e-4)
    # The layer count unknown (the levels' rule): F itself.
    bits = kivi.effective_bits_per_value(wide, 128, 4096, 8)
    assert bits == pytest.approx(base + 0.1 * (widened - base), rel=1e-12)
    assert bits == pytest.approx(4.4911, abs=1e-3) and bits <= 4.5
    # A known layer count: floor(F·L)/L (2 of 25 layers, not 2.5).
    assert kivi.effective_bits_per_value(wide, 128, 4096, 8, n_layers=25) == pytest.approx(
        base + 2 / 25 * (widened - base), rel=1e-12)
    assert kivi.effective_bits_per_value(wide, 128, 4096, 8, n_layers=30) == pytest.approx(bits, rel=1e-12)
    # The builder, knowing the shape, counts floor(F·L)/L.
    shape = ModelShape(n_layers=25, n_heads=32, n_kv_heads=8, head_dim=128)
    named = KVCacheConfig.parse(f"{LEVEL_4}:wide=0.1:wide_layers=L3.7")
    assert KVCacheBuilder(named).for_shape(shape).effective_bits_per_value(4096) == pytest.approx(
        base + 2 / 25 * (widened - base), rel=1e-12)


def test_the_level_rule_counts_the_wide_4_bit_level_within_its_budget() -> None:
    from benchmarks.harness.levels import LEVEL_BUDGET_BITS, budget_bits

    bits = budget_bits(f"{LEVEL_4}:wide=0.1")
    assert bits == pytest.approx(4.4911, abs=1e-3) and bits <= LEVEL_BUDGET_BITS["4"]
    assert budget_bits(f"{LEVEL_3}:wide=0.1") <= LEVEL_BUDGET_BITS["3"]


# ----- the builder's caches ---------------------------------------------------------------------------------


def test_builder_gives_the_named_layers_one_more_bit() -> None:
    model = _tiny_model()
    builder = KVCacheBuilder(KVCacheConfig.parse(TINY_WIDE)).for_model(model)
    caches = builder.build()
    assert [(c.config.key_bits, c.config.value_bits) for c in caches] == [(4, 3), (5, 4), (4, 3), (5, 4)]
    assert all(c.spec == builder.config and "wide" not in c.config.options for c in caches)


def test_builder_refuses_layer_sets_that_do_not_fit_the_model() -> None:
    model = _tiny_model()
    with pytest.raises(ConfigError, match="widens 2 of this model's 4 layers, but wide_layers=L1 names 1"):
        KVCacheBuilder(KVCacheConfig.parse("kivi:k4v4:g32:wide=0.5:wide_layers=L1")).for_model(model)
    with pytest.raises(ConfigError, match="past the last layer"):
        KVCacheBuilder(KVCacheConfig.parse("kivi:k4v4:g32:wide=0.5:wide_layers=L1.4")).for_model(model)
    shape = ModelShape(n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32)
    unnamed = KVCacheBuilder(KVCacheConfig.parse("kivi:k4v4:g32:wide=0.5")).for_shape(shape)
    assert unnamed.effective_bits_per_value(100) > 0  # the bits are known without the model
    with pytest.raises(ConfigError, match="does not name its wide layers"):
        unnamed.build()  # which layers needs the model (calibration)


def test_caches_bytes_add_up_to_the_averaged_formula() -> None:
    model = _tiny_model()
    builder = KVCacheBuilder(KVCacheConfig.parse(TINY_WIDE)).for_model(model)
    caches = builder.build()
    feed_tokens(model, caches, 512)  # a whole number of 256-token buffer steps: no slack allocated
    assert all(c.nbytes == array_bytes(c) > 0 for c in caches)
    kivi = get_method("kivi")
    for cache in caches:  # each layer holds exactly its own bits' bytes
        assert cache.nbytes == pytest.approx(kivi.expected_nbytes(cache.config, 32, 512, 2), rel=1e-12)
    wide, narrow = caches[1].nbytes, caches[0].nbytes
    assert wide > narrow
    # The GPU decode kernel's codecs read each layer's own code widths.
    codecs = [c._kernel_codecs() for c in caches]
    assert [(key.bits, value.bits) for key, _, value, _ in codecs] == [(4, 3), (5, 4), (4, 3), (5, 4)]
    total_bits = builder.effective_bits_per_value(512) * 2 * 32 * 512 * 2 * len(caches)
    assert sum(c.nbytes for c in caches) * 8 == pytest.approx(total_bits, rel=1e-12)


def test_save_and_load_keep_each_layers_bits(tmp_path: Path) -> None:
    model = _tiny_model()
    caches = KVCacheBuilder(KVCacheConfig.parse(TINY_WIDE)).for_model(model).build()
    feed_tokens(model, caches, 300)
    assert_save_and_load_round_trip_bit_exactly(model, caches, tmp_path / "wide.safetensors")
    save_prompt_cache(str(tmp_path / "again.safetensors"), caches)
    loaded = load_prompt_cache(str(tmp_path / "again.safetensors"))
    assert [(c.config.key_bits, c.config.value_bits) for c in loaded] == [(4, 3), (5, 4), (4, 3), (5, 4)]
    assert all(str(c.spec) == TINY_WIDE for c in loaded)
    assert all(c.nbytes == array_bytes(c) for c in loaded) and loaded[1].nbytes > loaded[0].nbytes


def test_trim_keeps_each_layers_bits() -> None:
    model = _tiny_model()
    caches = KVCacheBuilder(KVCacheConfig.parse(TINY_WIDE)).for_model(model).build()
    feed_tokens(model, caches, 100)
    assert_trim_drops_the_newest_tokens(model, caches)
    assert [c.config.key_bits for c in caches] == [4, 5, 4, 5]


def test_reencode_from_a_wide_config_to_another_level_and_back() -> None:
    model = _tiny_model()
    wide_config = KVCacheBuilder(KVCacheConfig.parse(TINY_WIDE)).for_model(model).config
    caches = KVCacheBuilder(wide_config).for_model(model).build()
    feed_tokens(model, caches, 200)
    before = [c.to_dense() for c in caches]
    plain = KVCacheBuilder(KVCacheConfig.parse("kivi:k8v8:g32")).for_model(model).config
    switched = reencode_caches(caches, plain)
    assert [c.config.key_bits for c in switched] == [8, 8, 8, 8] and all(c.offset == 200 for c in switched)
    back = reencode_caches(switched, wide_config)
    assert [(c.config.key_bits, c.config.value_bits) for c in back] == [(4, 3), (5, 4), (4, 3), (5, 4)]
    assert all(c.offset == 200 and c.spec == wide_config for c in back)
    for cache, (keys, _) in zip(back, before, strict=True):
        assert relative_error(cache.to_dense()[0], keys) < 0.1  # quantized again: still the same tokens
    with pytest.raises(ConfigError, match="names 2"):
        reencode_caches(caches[:2], wide_config)  # 2 layers: wide=0.5 widens 1


# ----- the calibration --------------------------------------------------------------------------------------


def test_calibration_is_deterministic_and_cached_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VELOX_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(sensitivity, "DEFAULT_TOKENS", 256)
    monkeypatch.setattr(sensitivity, "CHUNK_TOKENS", 64)
    model = _tiny_model()
    config = KVCacheConfig.parse("kivi:k4v4:g32:wide=0.5")
    first = sensitivity.layer_sensitivity(model, config)
    files = list((tmp_path / "calibration").glob("layer_sensitivity-*.json"))
    assert len(files) == 1 and len(first) == 4 and all(kl > 0 for kl in first)
    record = json.loads(files[0].read_text())
    assert record["kl"] == first and record["key"]["probe"] == "kivi:k2v2:g32"
    assert record["key"]["model"]["weights_sha256"]
    # Measured again from scratch (the file gone): the same figures.
    files[0].unlink()
    assert sensitivity.layer_sensitivity(model, config) == first
    # The second call reads the file: figures written there come back, nothing is measured.
    record["kl"] = [0.1, 0.4, 0.3, 0.2]
    files[0].write_text(json.dumps(record))
    assert sensitivity.layer_sensitivity(model, config) == [0.1, 0.4, 0.3, 0.2]
    assert sensitivity.calibrated_wide_layers(model, config) == (1, 2)
    built = KVCacheBuilder(config).for_model(model)
    assert str(built.config) == "kivi:k4v4:g32:wide=0.5:wide_layers=L1.2"
    # Another model (same architecture, other weights) is another calibration.
    sensitivity.layer_sensitivity(tiny_llama(n_layers=4, seed=1), config)
    assert len(list((tmp_path / "calibration").glob("layer_sensitivity-*.json"))) == 2


def test_the_probe_keeps_what_a_cache_stores_and_drops_how_it_computes() -> None:
    """The sweep's caches set prefill_attention (and a user may set kernels): the probe, and so the calibration's
    key and the layers widened, are those of the same cache without them; keys before RoPE and wide go too."""
    level = KVCacheConfig.parse("kivi:k2v2:g64:s4:clip_search=true:key_block=128:rope=auto:rotate_values=true:wide=0.1")
    swept = KVCacheConfig.parse(f"{level}:prefill_attention=auto:kernels=off")
    probe = sensitivity.probe_config(level)
    assert str(probe) == "kivi:k2v2:g64:s4:clip_search=true:key_block=128:rotate_values=true"
    assert sensitivity.probe_config(swept) == probe
    assert str(sensitivity.probe_config(KVCacheConfig.parse("kivi:k3v3:g64:key_grid=lloyd"))) == \
        "kivi:k2v2:g64:key_grid=lloyd"  # what is stored stays


def test_rank_layers_takes_the_largest_kl_and_breaks_ties_by_index() -> None:
    assert sensitivity.rank_layers([0.1, 0.5, 0.5, 0.2, 0.9], 3) == (1, 2, 4)
    assert sensitivity.rank_layers([0.1, 0.5], 0) == ()


def test_wide_zero_widens_nothing_and_needs_no_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VELOX_DATA_DIR", str(tmp_path))
    builder = KVCacheBuilder(KVCacheConfig.parse("kivi:k4v4:g32:wide=0.2")).for_model(_tiny_model())
    assert builder.config.wide_layers == () and not (tmp_path / "calibration").exists()
    assert [c.config.key_bits for c in builder.build()] == [4, 4, 4, 4]


def test_builder_calibrates_on_the_bundled_prose_given_a_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    def calibrated(model, config, tokens=None, progress=None):
        seen.append(tokens)
        return (0, 2)

    monkeypatch.setattr(sensitivity, "calibrated_wide_layers", calibrated)
    model, tokenizer = _tiny_model(), tiny_tokenizer()
    config = KVCacheConfig.parse("kivi:k4v4:g32:wide=0.5")
    assert KVCacheBuilder(config).for_model(model, tokenizer=tokenizer).config.wide_layers == (0, 2)
    assert seen[-1] == sensitivity.prose_calibration_tokens(tokenizer) and len(seen[-1]) > 500
    KVCacheBuilder(config).for_model(model)  # no tokenizer: the model writes its own text
    assert seen[-1] is None
    KVCacheBuilder(config).for_model(model, calibration_tokens=[1, 2, 3], tokenizer=tokenizer)
    assert seen[-1] == [1, 2, 3]
    assert not sensitivity.PROSE_FILE.read_text(encoding="utf-8").split("\n\n", 1)[1].startswith("Calibration")


@pytest.mark.slow
def test_smollm2_calibrated_layers_at_the_4_bit_level(smollm, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the bundled prose, the builder picks the layers the simulation of issue 12 found (10, 18 and 1 at
    k2v2 on other Areopagitica text), which gave the best held-out result; measured here (the bundled
    calibrations set aside), and the bundled file holds the same KLs, so it is not stale."""
    monkeypatch.setenv("VELOX_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(sensitivity, "BUNDLED_DIR", tmp_path / "no-bundle")
    model, tokenizer, _ = smollm
    config = KVCacheBuilder(KVCacheConfig.parse(f"{LEVEL_4}:wide=0.1")).for_model(model, tokenizer=tokenizer).config
    assert config.wide_layers == (1, 10, 18) and len(config.wide_layers) == math.floor(0.1 * 30)
    (measured,) = (tmp_path / "calibration").glob("layer_sensitivity-*.json")
    bundled = json.loads((Path(sensitivity.__file__).with_name("calibrations") / measured.name).read_text())
    assert bundled["key"] == json.loads(measured.read_text())["key"]
    # Within 3 %: on a CPU whose BLAS kernels round otherwise (an AMD EPYC with AVX2 against the machines the bundle
    # was measured on) a few quantization codes fall the other way, and the layers' KLs moved by up to 1.2 %; a stale
    # file (another model, layout or probe) is off by far more, and the layers chosen, asserted above, are the same.
    assert bundled["kl"] == pytest.approx(json.loads(measured.read_text())["kl"], rel=3e-2, abs=1e-6)


@pytest.mark.parametrize("gpu", [False, True])
@pytest.mark.parametrize(("key", "layers"), [("4", (1, 10, 18)), ("3", (1, 10, 18)), ("2", (1, 2, 10))])
def test_the_default_model_needs_no_calibration_run(smollm, key: str, layers: tuple[int, ...], gpu: bool,
                                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Velox ships the default model's calibrations for the wide levels: building one measures nothing (the
    measuring function fails if called) and writes nothing to the data folder; so also where a GPU kernel turns
    keys (the CPU emulator stands in for it) and the 3- and 2-bit levels' rope=auto stores them before RoPE: the
    same layers widen on every device."""
    from engine.kvcache import kernels
    from engine.planning.recommend import level_by_key

    monkeypatch.setenv("VELOX_DATA_DIR", str(tmp_path))
    if gpu:
        monkeypatch.setattr(kernels, "available_backend", lambda: "emulate")

    def measure(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the bundled calibration was not used")

    monkeypatch.setattr(sensitivity, "layer_kl", measure)
    model, tokenizer, _ = smollm
    level = level_by_key(key).config
    # The 3- and 2-bit levels store keys before RoPE on a GPU (the 4-bit level keeps them as given).
    assert level.wide_fraction == 0.1 and (level.options.get("rope") == "auto") == (key in ("3", "2"))
    config = KVCacheBuilder(level).for_model(model, tokenizer=tokenizer).config
    assert config.wide_layers == layers
    assert (config.options.get("rope") == "pre") == (gpu and key in ("3", "2"))
    if gpu and key == "3":  # the layout the H200's needle and greedy runs of the 3-bit level measured
        assert config.options["key_widths"] == "kwda1f23c2fc149293"
    assert config.options["key_widths"].startswith("kw")  # the bundled key widths of that form, measured by no one
    assert not list(tmp_path.rglob("*.json"))


def test_the_server_resolves_a_wide_level_once_with_the_tokenizer(smollm, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`velox serve` builds caches per request: the level's layers are resolved once, when the model loads,
    from the bundled prose calibration (the tokenizer given), and no request measures anything."""
    from engine.serve.provider import serving_cache_factory

    monkeypatch.setenv("VELOX_DATA_DIR", str(tmp_path))
    model, tokenizer, _ = smollm
    factory = serving_cache_factory(KVCacheConfig.parse(f"{LEVEL_4}:wide=0.1"))
    factory.prepare(model, tokenizer)

    def measure(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a request calibrated")

    monkeypatch.setattr(sensitivity, "layer_kl", measure)
    monkeypatch.setattr(sensitivity, "layer_sensitivity", measure)
    for _ in range(2):
        caches = factory(model)
        assert [i for i, cache in enumerate(caches) if cache.config.key_bits == 5] == [1, 10, 18]

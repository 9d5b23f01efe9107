"""The first run of a cache's kernels on the machine's GPU (engine/kvcache/kernel_check.py), here on the CPU emulator
standing in for the GPU: kernels that agree with the reference path stay on; one that raises or computes something
else turns every kernel off under "auto" (the caches then take the reference path) and fails the build under
"require"."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest

from engine.errors import ConfigError
from engine.kvcache import KVCacheBuilder, KVCacheConfig, ModelShape, kernel_check, kernels
from engine.kvcache.kernels import backend, emulate
from engine.kvcache.kernels.emulate import EMULATE

SPEC = "kivi:k4v4:g64:s4:key_block=128"
SHAPE = ModelShape(n_layers=2, n_heads=8, n_kv_heads=2, head_dim=128)


@pytest.fixture(autouse=True)
def emulated_gpu(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The emulator as the default device's kernel backend (so `disable` still turns it off), nothing verified or
    disabled yet; returns the names of the kernels launched."""
    monkeypatch.setattr(backend, "device_backend", lambda: EMULATE)
    monkeypatch.setattr(kernel_check, "CHECKED_BACKENDS", (EMULATE,))
    monkeypatch.setattr(backend, "_DISABLED", [])
    kernel_check.forget()
    launched: list[str] = []
    monkeypatch.setattr(emulate, "LAUNCH_CHECKS", [*emulate.LAUNCH_CHECKS, lambda source, *_: launched.append(source.name)])
    yield launched
    kernel_check.forget()


def _config(mode: str = "auto") -> KVCacheConfig:
    config = KVCacheConfig.parse(SPEC)
    return replace(config, options={**config.options, "kernels": mode})


def test_kernels_that_agree_with_the_reference_stay_on(emulated_gpu: list[str]) -> None:
    caches = KVCacheBuilder(_config()).for_shape(SHAPE).build()
    assert backend.disabled_reason() is None
    # the check ran the layout's encode, decode pass and merge
    assert {"velox_kivi_encode_1", "velox_decode_tiled_kivi_affine", "velox_decode_merge"} <= set(emulated_gpu)
    # once per configuration in a process
    emulated_gpu.clear()
    KVCacheBuilder(_config()).for_shape(SHAPE).build()
    assert emulated_gpu == []
    assert len(caches) == 2 and kernels.available_backend() == EMULATE


def test_the_first_run_reports_each_layer_layout_before_running_it(emulated_gpu: list[str]) -> None:
    """A caller with progress (the app's compression switch) hears of each distinct layer configuration before its
    run, and nothing once the process has run them: `build` afterwards launches nothing of its own."""
    config = KVCacheConfig.parse(SPEC + ":wide=0.5:wide_layers=L1")  # layer 1 a bit wider: two configurations
    heard: list[tuple[str, float, int]] = []
    builder = KVCacheBuilder(config).for_shape(SHAPE)
    builder.verify_kernels(lambda message, fraction: heard.append((message, fraction, len(emulated_gpu))))
    assert [(m, f) for m, f, _ in heard] == [("GPU kernels (1 of 2)", 0.0), ("GPU kernels (2 of 2)", 0.5)]
    assert heard[0][2] == 0 < heard[1][2] < len(emulated_gpu)  # each message before its layout's launches
    emulated_gpu.clear()
    heard.clear()
    builder.verify_kernels(lambda message, fraction: heard.append((message, fraction, 0)))
    builder.build()
    assert heard == [] and emulated_gpu == []


def test_a_compression_switch_runs_the_first_run_with_its_progress(smollm, emulated_gpu: list[str]) -> None:
    """The chat session pays the kernels' first run where the app shows progress (the switch to a level), not inside
    the first reply's cache build."""
    from engine.chat.session import ChatSession

    model, tokenizer, _ = smollm
    session = ChatSession(model, tokenizer)
    heard: list[str] = []
    session.set_compression(_config(), progress=lambda message, fraction: heard.append(message))
    assert heard and all(m.startswith("GPU kernels") for m in heard)
    assert any(name.startswith("velox_decode") for name in emulated_gpu)
    emulated_gpu.clear()
    session.reset_cache()  # a new cache of that compression: nothing left to run first
    assert emulated_gpu == []


def test_a_kernel_computing_something_else_turns_every_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    right = kernels.decode_attention
    monkeypatch.setattr(kernels, "decode_attention", lambda *args, **kwargs: right(*args, **kwargs) + 0.5)
    caches = KVCacheBuilder(_config()).for_shape(SHAPE).build()
    assert "a decode step differs from the reference path" in backend.disabled_reason()
    assert kernels.available_backend() is None
    # the caches built take the reference path, and "require" now says why it cannot have a kernel
    keys = mx.random.normal((1, 2, 300, 128), key=mx.random.key(0))
    caches[0].update_and_fetch(keys, keys)
    assert caches[0]._decode_plan(4) is None
    with pytest.raises(ConfigError, match="turned off in this process: .*differs from the reference"):
        kernels.resolve_backend("require")


def test_a_kernel_that_does_not_build_turns_every_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(source, backend_name):  # noqa: ANN001, ANN202 - as MLX raises when Metal rejects a library
        raise RuntimeError(f"[metal::Device] Unable to build metal library from source ({source.name})")

    monkeypatch.setattr(backend, "_BUILT", {})
    monkeypatch.setattr(backend, "build", refuse)
    KVCacheBuilder(_config()).for_shape(SHAPE).build()
    assert "Unable to build metal library" in backend.disabled_reason()


def test_under_require_a_failing_kernel_fails_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    right = kernels.decode_attention
    monkeypatch.setattr(kernels, "decode_attention", lambda *args, **kwargs: right(*args, **kwargs) * float("nan"))
    with pytest.raises(ConfigError, match="kernels='require' but the emulate kernels of .* differs"):
        KVCacheBuilder(_config("require")).for_shape(SHAPE).build()
    assert backend.disabled_reason() is None  # "require" reports; it does not turn anything off


def test_nothing_runs_with_kernels_off_or_without_a_gpu(emulated_gpu: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    KVCacheBuilder(_config("off")).for_shape(SHAPE).build()
    # a shape the decode kernel declines (head_dim 96) is no failure of the kernels: its caches take the reference path
    KVCacheBuilder(KVCacheConfig.parse("affine:k4v4:g32")).for_shape(replace(SHAPE, head_dim=96)).build()
    assert backend.disabled_reason() is None
    monkeypatch.setattr(backend, "device_backend", lambda: None)
    KVCacheBuilder(_config()).for_shape(SHAPE).build()
    assert emulated_gpu == [] and backend.disabled_reason() is None


def test_the_check_runs_in_the_dtype_of_the_models_activations() -> None:
    import mlx.nn as nn

    from engine.kvcache.builder import model_dtype

    for dtype in (mx.float16, mx.bfloat16, mx.float32):
        layer = nn.Linear(64, 64)
        layer.set_dtype(dtype)
        nn.quantize(layer, group_size=32, bits=4)  # its codes are integers; its scales have the activations' dtype
        assert model_dtype(layer) == dtype
    assert model_dtype(object()) == mx.bfloat16


@pytest.mark.parametrize("key", ["8", "4", "3", "2"])
def test_the_app_levels_pass_their_first_run_on_the_real_model(key: str, smollm, emulated_gpu: list[str]) -> None:
    """No false alarm: every compressed level the app offers, resolved for the embedded model as the app resolves it
    (its calibrated key widths, wide layers, keys before RoPE where the kernels turn them), passes the check, so a GPU
    keeps its kernels for them."""
    from engine.planning.recommend import level_by_key

    model, tokenizer, _ = smollm
    KVCacheBuilder(level_by_key(key).config).for_model(model, tokenizer=tokenizer).build()
    assert backend.disabled_reason() is None
    assert any(name.startswith("velox_decode") for name in emulated_gpu), emulated_gpu


@pytest.mark.parametrize("spec", ["affine:k4v4:g64", "rotated:k3v3:g64:s4:w16", "turboquant:k4v4:g64", "rvq:k3v3:g64",
                                  "qjl:k4v4:g64", "turboquant_prod:k4v4:g64", "polarquant:k4v4:g64"])
def test_every_method_passes_its_first_run(spec: str) -> None:
    KVCacheBuilder(KVCacheConfig.parse(spec)).for_shape(SHAPE).build()
    assert backend.disabled_reason() is None


@pytest.mark.parametrize("perturbed", [(), (1,), (2,), (1, 2)])
def test_the_encode_is_held_to_the_first_reference_device_it_is_close_to(perturbed: tuple[int, ...]) -> None:
    """MLX quantizes an affine group by one rule on a GPU and by another on the CPU (BENCHMARKS.md, round 19), and the
    encode kernels follow the CPU's: their store is held to a reference cache filled on the CPU, and, only where it is
    not close to that one, to one filled on the default device (`kernel_check.REFERENCE_DEVICES`). Here the references
    whose instances are in `perturbed` (1: the first, 2: the second) store their values tripled, standing in for a rule
    that is not the kernels' own: with one of them so, the check passes; with both, it fails."""
    from engine.kvcache.registry import get_method

    kivi = get_method("kivi")
    made: list[object] = []
    devices: dict[int, set[object]] = {}  # instance: the device types its updates ran on

    class SomeReferencesOff(kivi):  # the kernels' cache is instance 0, the references 1 and 2
        def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            super().__init__(*args, **kwargs)
            self.instance = len(made)
            made.append(self)

        def update_and_fetch(self, keys: mx.array, values: mx.array):  # noqa: ANN201
            devices.setdefault(self.instance, set()).add(mx.default_device().type)
            return super().update_and_fetch(keys, values * 3 if self.instance in perturbed else values)

    failure = kernel_check._first_run(SomeReferencesOff, _config(), 0, SHAPE, mx.bfloat16)
    assert kernel_check.REFERENCE_DEVICES == (mx.cpu, None)
    assert devices[1] == {mx.cpu}  # (on a GPU, where the default device is not the CPU, this tells)
    # the default device's reference is filled only where the CPU's is not close
    assert len(made) == (3 if 1 in perturbed else 2)
    if perturbed == (1, 2):
        assert failure is not None and "a decode step over the kernels' encode differs" in failure
    else:
        assert failure is None

"""The encode's compiled form (engine/kvcache/quant/fused.py): KIVI's key and value quantizers give the store
entries of their eager form, compiled with `mx.compile` as a GPU runs them.

On the CPU the wrapper runs the eager form (the reference), so these tests compile it explicitly, where `mx.compile`
can build kernels here (it needs a C++ compiler); on a GPU they call the wrapper, as the cache does.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.kvcache.kernels import available_backend
from engine.kvcache.methods.affine import affine_dequantize, with_symmetric_biases
from engine.kvcache.methods.kivi import quantize_key_blocks, quantize_value_groups
from engine.kvcache.quant import fused


def _compiles_here() -> bool:
    try:
        return mx.compile(lambda x: x * 2 + 1)(mx.ones((4,))).tolist() == [3.0] * 4
    except Exception:  # no C++ compiler for MLX's CPU kernels
        return False


def _forms() -> list[str]:
    # On a GPU the wrapper is the compiled form the caches run (each configuration compiles its kernels once, which
    # on CUDA takes seconds: one form, not two); elsewhere the eager function compiled here, where MLX can.
    if available_backend() is not None:
        return ["wrapper"]
    return ["compiled"] if _compiles_here() else []


FORMS = _forms()


def _run(function, form: str, *args):  # noqa: ANN001, ANN202
    return mx.compile(function.eager)(*args) if form == "compiled" else function(*args)


def _keys_with_outliers(seed: int, tokens: int) -> mx.array:
    """Kᵀ [1, 8, 128, T] in bf16 with a few large entries per channel, as real keys have."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((1, 8, 128, tokens)).astype(np.float32)
    spikes = rng.random(keys.shape) < 0.01
    keys[spikes] *= 12
    return mx.array(keys).astype(mx.bfloat16)


# The levels' key encodes: 3-bit with outliers at widths 2/3/4 (the 3-bit level), clip search at 2 bits (the 2-bit
# level), min-max keys, and 4-bit keys alone.
KEY_CASES = (
    (((2, 0, 24), (3, 24, 104), (4, 104, 128)), 3, "affine", 1),
    (((1, 0, 16), (2, 16, 112), (3, 112, 128)), 2, "clipped", 0),
    (None, 3, "minmax", 1),
    (None, 4, "affine", 0),
)


@pytest.mark.skipif(not FORMS, reason="mx.compile builds no kernels here (no C++ compiler) and there is no GPU")
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("rows", "bits", "quantizer", "outliers"), KEY_CASES)
def test_compiled_key_encode_matches_eager(form: str, rows, bits: int, quantizer: str, outliers: int) -> None:  # noqa: ANN001
    keys = _keys_with_outliers(0, 640)
    order = mx.array(np.stack([np.random.default_rng(h).permutation(128) for h in range(8)]).astype(np.uint8))
    args = (keys, order if rows else None, rows, 128, bits, quantizer, None, outliers)
    expected, got = quantize_key_blocks.eager(*args), _run(quantize_key_blocks, form, *args)
    assert sorted(got) == sorted(expected)
    if outliers:
        assert any(name.startswith("key_outlier_residuals") for name in got)
    for name, array in expected.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
        if "codes" in name or "index" in name:
            # Fused float arithmetic may round a value lying on a code boundary the other way: a few codes at most.
            differing = np.mean(np.array(got[name]) != np.array(array))
            assert differing <= (0 if form == "compiled" else 1e-3), (name, differing)
        else:
            np.testing.assert_allclose(np.array(got[name].astype(mx.float32)), np.array(array.astype(mx.float32)),
                                       rtol=1e-2, atol=1e-3, err_msg=name)


@pytest.mark.skipif(not FORMS, reason="mx.compile builds no kernels here (no C++ compiler) and there is no GPU")
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("bits", "quantizer"), ((3, "symmetric"), (2, "clipped"), (4, "affine")))
def test_compiled_value_encode_matches_eager(form: str, bits: int, quantizer: str) -> None:
    values = mx.random.normal((1, 8, 333, 128), key=mx.random.key(3)).astype(mx.bfloat16)
    expected, got = (quantize_value_groups.eager(values, 64, bits, quantizer, None),
                     _run(quantize_value_groups, form, values, 64, bits, quantizer, None))
    assert sorted(got) == sorted(expected)
    if quantizer == "symmetric":
        got, expected = (with_symmetric_biases(store, "value", bits) for store in (got, expected))
    decoded, reference = (affine_dequantize(store, "value", 64, bits, float32_scales=True) for store in (got, expected))
    step = float(mx.max(expected["value_scales"].astype(mx.float32)).item())
    assert float(mx.max(mx.abs(decoded - reference)).item()) <= (0 if form == "compiled" else 1.01 * step)


def test_wrapper_runs_the_eager_form_off_a_gpu_and_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def traced(x: mx.array, bits: int) -> mx.array:
        calls.append(bits)  # Python runs on every eager call, only while tracing once compiled
        return x * bits

    wrapped = fused.compiled_on_gpu(traced)
    x = mx.ones((3,))
    monkeypatch.setattr(fused, "COMPILE_ENCODE", False)
    for _ in range(3):
        assert wrapped(x, 2).tolist() == [2.0] * 3
    assert calls == [2, 2, 2]
    monkeypatch.setattr(fused, "COMPILE_ENCODE", True)
    for _ in range(3):
        wrapped(x, 2)
    assert len(calls) == (4 if mx.default_device() == mx.gpu else 6)  # compiled: one trace, then none

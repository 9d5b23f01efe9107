"""The model catalogue: inspection without loading, clear errors, listing sources, resolving and loading."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from engine.errors import ModelError
from engine.models.catalog import (
    DEFAULT_DOWNLOAD_NOTE,
    DEFAULT_MODEL_SPEC,
    ModelInfo,
    add_model_folder,
    inspect_model_folder,
    list_models,
    load_model,
    read_safetensors_header,
    registered_model_folders,
    remove_model_folder,
    resolve_model,
)
from engine.models.default_model import default_model_dir

SMOLLM2_PARAMETERS = 134_515_008  # published count of SmolLM2-135M (tied embeddings)

TINY_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}
# Embedding 256*64 + per layer (q 64*64, k 32*64, v 32*64, o 64*64, gate/up/down 3*128*64, 2 norms of 64)
# + final norm 64.
TINY_PARAMETERS = 256 * 64 + 2 * (64 * 64 + 32 * 64 + 32 * 64 + 64 * 64 + 3 * 128 * 64 + 2 * 64) + 64


def _tiny_model(config: dict) -> nn.Module:
    args = llama.ModelArgs.from_dict(config)
    return llama.Model(args)


def make_tiny_folder(folder: Path, config: dict | None = None, quantize: bool = False) -> Path:
    """A small but real mlx-lm llama folder: config, safetensors written by MLX, a tokenizer file."""
    config = dict(config or TINY_CONFIG)
    folder.mkdir(parents=True, exist_ok=True)
    model = _tiny_model(config)
    if quantize:
        # Mixed precision as mlx-lm writes it: the default is 4-bit g32, the embedding is 8-bit g32.
        def predicate(path: str, module: nn.Module) -> dict | bool:
            if not hasattr(module, "to_quantized"):
                return False
            return {"group_size": 32, "bits": 8} if path.endswith("embed_tokens") else True

        nn.quantize(model, group_size=32, bits=4, class_predicate=predicate)
        config["quantization"] = {"group_size": 32, "bits": 4}
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.fixture
def isolated_dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    data, hub = tmp_path / "velox-data", tmp_path / "hf-hub"
    hub.mkdir()
    monkeypatch.setenv("VELOX_DATA_DIR", str(data))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    return {"data": data, "hub": hub}


def make_hf_snapshot(hub: Path, repo_id: str, revision: str = "abc123") -> Path:
    repo_dir = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = make_tiny_folder(repo_dir / "snapshots" / revision)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(revision)
    return snapshot


# ------------------------------------------------------------------------------------ the real default

def test_default_model_folder_is_described_exactly(default_model_path) -> None:
    info = inspect_model_folder(default_model_dir())
    assert info.ready and info.note == ""
    assert info.model_type == "llama"
    assert (info.layers, info.attention_heads, info.kv_heads, info.head_dim) == (30, 9, 3, 64)
    assert info.max_context == 8192
    assert info.vocab_size == 49152 and info.hidden_size == 576
    # 4-bit packed layers and the 8-bit embedding unpack to exactly the published parameter count.
    assert info.parameters == SMOLLM2_PARAMETERS
    assert info.bytes_on_disk > 90_000_000
    assert info.dtype == "float16"
    assert info.quantization == "4-bit g32 (1 tensor at 8-bit)"
    assert info.kv_bytes_per_token() == 2 * 30 * 3 * 64 * 2 == 23040
    assert info.kv_bytes_per_token(bits=4) == 5760


def test_default_spec_shown_before_download_matches_the_real_folder(default_model_path) -> None:
    info = inspect_model_folder(default_model_dir())
    for field, value in DEFAULT_MODEL_SPEC.items():
        assert getattr(info, field) == value, field


def test_load_model_gives_a_working_model(default_model_path) -> None:
    model, tokenizer, info = load_model(default_model_dir())
    assert info.parameters == SMOLLM2_PARAMETERS
    tokens = mx.array([tokenizer.encode("The quick brown fox jumps")[:3]])
    assert tokens.shape == (1, 3)
    logits = model(tokens)
    mx.eval(logits)
    assert logits.shape == (1, 3, 49152)
    assert bool(mx.all(mx.isfinite(logits)))


def test_the_weights_fingerprint_is_the_checkpoints_on_every_device(default_model_path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader stamps the fingerprint of the weights as the checkpoint gives them: the CPU's fp32 copy and the
    packed weights a GPU keeps (here: the CPU's fast path declined) are told apart by their sampled fingerprints but
    name one checkpoint, so a calibration made on either (the bundled ones: on the CPU) is found on the other."""
    from engine.kvcache.quant.vq import sampled_fingerprint, weights_fingerprint
    from engine.models import catalog

    fp32, _, _ = load_model(default_model_dir())
    monkeypatch.setattr(catalog, "prefer_fp32_weights", lambda: False)
    packed, _, _ = load_model(default_model_dir())
    assert sampled_fingerprint(fp32) != sampled_fingerprint(packed)
    assert weights_fingerprint(fp32) == weights_fingerprint(packed) == sampled_fingerprint(packed)


# ------------------------------------------------------------------------------------- tiny folders


def test_plain_tiny_folder_counts_every_stored_parameter(tmp_path: Path) -> None:
    info = inspect_model_folder(make_tiny_folder(tmp_path / "tiny"))
    assert info.parameters == TINY_PARAMETERS
    assert info.quantization == "none"
    assert info.dtype == "float32"
    assert (info.layers, info.kv_heads, info.head_dim, info.max_context) == (2, 2, 16, 512)
    assert info.bytes_on_disk == sum(p.stat().st_size for p in (tmp_path / "tiny").iterdir())


def test_mixed_precision_quantized_folder_counts_logical_parameters(tmp_path: Path) -> None:
    folder = make_tiny_folder(tmp_path / "tiny-q", quantize=True)
    header = read_safetensors_header(folder / "model.safetensors")
    assert header["model.embed_tokens.weight"]["dtype"] == "U32"  # really packed
    info = inspect_model_folder(folder)
    # Scales and biases are not parameters; packed words unpack with each tensor's own bit width.
    assert info.parameters == TINY_PARAMETERS
    assert info.quantization == "4-bit g32 (1 tensor at 8-bit)"


def test_per_path_quantization_override_in_config_is_used(tmp_path: Path) -> None:
    folder = make_tiny_folder(tmp_path / "tiny-q", quantize=True)
    config = json.loads((folder / "config.json").read_text())
    config["quantization"]["model.embed_tokens"] = {"group_size": 32, "bits": 8}
    (folder / "config.json").write_text(json.dumps(config))
    assert inspect_model_folder(folder).parameters == TINY_PARAMETERS


def test_nested_text_config_and_missing_head_dim(tmp_path: Path) -> None:
    folder = make_tiny_folder(tmp_path / "nested")
    text_config = {key: value for key, value in TINY_CONFIG.items() if key != "model_type"}
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "text_config": text_config}))
    info = inspect_model_folder(folder)
    assert (info.layers, info.attention_heads, info.kv_heads) == (2, 4, 2)
    assert info.head_dim == 64 // 4
    assert info.max_context == 512


def test_remapped_model_type_is_supported(tmp_path: Path) -> None:
    # mlx-lm has no module named 'xverse': its MODEL_REMAPPING sends it to llama.
    folder = make_tiny_folder(tmp_path / "remapped", {**TINY_CONFIG, "model_type": "xverse"})
    assert inspect_model_folder(folder).model_type == "xverse"


def test_sharded_weights_with_index(tmp_path: Path) -> None:
    folder = make_tiny_folder(tmp_path / "sharded")
    weights = mx.load(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file_name, shard_names in halves.items():
        mx.save_safetensors(str(folder / file_name), {name: weights[name] for name in shard_names})
    weight_map = {name: file_name for file_name, shard_names in halves.items() for name in shard_names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert inspect_model_folder(folder).parameters == TINY_PARAMETERS
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelError, match="incomplete: 1 of 2 weight shards are missing"):
        inspect_model_folder(folder)


def test_kv_bytes_per_token_formula() -> None:
    info = ModelInfo(name="x", path=None, source="local", layers=30, kv_heads=3, head_dim=64)
    assert info.kv_bytes_per_token() == 23040
    assert info.kv_bytes_per_token(bits=8) == 11520


# ------------------------------------------------------------------------------------- broken folders


def _truncate_weights(folder: Path) -> None:
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])


def _corrupt_header(folder: Path) -> None:
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:12] = b"\x00\xff{{"
    weights.write_bytes(bytes(data))


def _garbage_header_length(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(b"\xff" * 8 + weights.read_bytes()[8:])


BROKEN_CASES = {
    "no config": (lambda f: (f / "config.json").unlink(), "has no config.json"),
    "bad json": (lambda f: (f / "config.json").write_text("{not json"), "is not valid JSON"),
    "unknown architecture": (
        lambda f: (f / "config.json").write_text(json.dumps({**TINY_CONFIG, "model_type": "notamodel"})),
        "architecture 'notamodel', which the installed mlx-lm does not support",
    ),
    "no model_type": (
        lambda f: (f / "config.json").write_text(json.dumps({"hidden_size": 64})),
        "does not say which architecture",
    ),
    "custom code": (
        lambda f: (f / "config.json").write_text(json.dumps({**TINY_CONFIG, "model_file": "evil.py"})),
        "needs its own Python code",
    ),
    "no weights": (lambda f: (f / "model.safetensors").unlink(), "has no model weights"),
    "only pytorch weights": (
        lambda f: (f / "model.safetensors").rename(f / "pytorch_model.bin"),
        "only PyTorch or GGUF files",
    ),
    "weights not named model*": (
        lambda f: (f / "model.safetensors").rename(f / "consolidated.safetensors"),
        "only loads files named model",
    ),
    "truncated weights": (_truncate_weights, "is truncated: tensor"),
    "corrupt header": (_corrupt_header, "header is not valid JSON"),
    "garbage header length": (_garbage_header_length, "truncated or not a safetensors file"),
    "no tokenizer": (lambda f: (f / "tokenizer.json").unlink(), "has no tokenizer files"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_CASES))
def test_broken_folder_gives_one_clear_sentence(tmp_path: Path, case: str) -> None:
    folder = make_tiny_folder(tmp_path / "broken")
    damage, expected = BROKEN_CASES[case]
    damage(folder)
    with pytest.raises(ModelError) as caught:
        inspect_model_folder(folder)
    message = str(caught.value)
    assert expected in message
    assert str(folder) in message
    assert "\n" not in message


def test_not_a_folder(tmp_path: Path) -> None:
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"x")
    with pytest.raises(ModelError, match="is a file, not a model folder"):
        inspect_model_folder(a_file)
    with pytest.raises(ModelError, match="does not exist"):
        inspect_model_folder(tmp_path / "missing")


def test_load_model_wraps_mlx_failures_in_one_sentence(tmp_path: Path) -> None:
    # Passes the cheap checks, but the weights do not match the declared shapes: mlx-lm fails while loading.
    folder = make_tiny_folder(tmp_path / "mismatch")
    (folder / "config.json").write_text(json.dumps({**TINY_CONFIG, "intermediate_size": 96}))
    with pytest.raises(ModelError) as caught:
        load_model(folder)
    message = str(caught.value)
    assert message.startswith(f"The model in {folder} could not be loaded: ")
    assert "\n" not in message


def test_load_model_validates_before_calling_mlx(tmp_path: Path) -> None:
    folder = make_tiny_folder(tmp_path / "t")
    _truncate_weights(folder)
    with pytest.raises(ModelError, match="is truncated"):
        load_model(folder)


# ---------------------------------------------------------------------------------- listing & resolving


def test_list_models_shows_every_source_without_downloading(isolated_dirs: dict[str, Path]) -> None:
    from engine.paths import models_dir

    make_tiny_folder(models_dir() / "my-local")
    broken = models_dir() / "half-copied"
    broken.mkdir()
    (models_dir() / "SmolLM2-135M-Instruct.partial").mkdir()  # a conversion in progress is not listed
    registered = add_model_folder(make_tiny_folder(isolated_dirs["data"].parent / "elsewhere")).path
    snapshot = make_hf_snapshot(isolated_dirs["hub"], "some-org/tiny-llama")

    models = list_models()
    by_name = {info.name: info for info in models}
    default = models[0]
    assert default.source == "embedded" and not default.ready
    assert default.note == DEFAULT_DOWNLOAD_NOTE
    assert default.kv_bytes_per_token() == 23040  # known before download, for fit verdicts
    assert not (isolated_dirs["data"] / "downloads").exists()

    assert by_name["my-local"].ready and by_name["my-local"].source == "local"
    assert not by_name["half-copied"].ready and "no config.json" in by_name["half-copied"].note
    assert by_name["elsewhere"].path == registered and by_name["elsewhere"].ready
    hf = by_name["some-org/tiny-llama"]
    assert hf.source == "hf-cache" and hf.ready and hf.path == snapshot
    assert hf.parameters == TINY_PARAMETERS
    assert not any(name.endswith(".partial") for name in by_name)
    assert len(models) == 5


def test_list_models_extra_folders_and_no_duplicates(isolated_dirs: dict[str, Path]) -> None:
    from engine.paths import models_dir

    local = make_tiny_folder(models_dir() / "dup")
    extra = make_tiny_folder(isolated_dirs["data"].parent / "extra")
    models = list_models(extra_folders=[local, extra])
    names = [info.name for info in models]
    assert names.count("dup") == 1
    assert "extra" in names


def test_registering_folders_validates_and_persists(isolated_dirs: dict[str, Path], tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        add_model_folder(bad)
    assert registered_model_folders() == []

    good = make_tiny_folder(tmp_path / "good")
    add_model_folder(good)
    add_model_folder(good)  # twice is harmless
    assert registered_model_folders() == [good.resolve()]
    saved = json.loads((isolated_dirs["data"] / "model_folders.json").read_text())
    assert saved == [str(good.resolve())]

    # A registered folder that later breaks is listed, not raised.
    shutil.rmtree(good)
    entry = next(info for info in list_models() if info.name == "good")
    assert not entry.ready and "does not exist" in entry.note

    assert remove_model_folder(good) is True
    assert remove_model_folder(good) is False
    assert registered_model_folders() == []


def test_damaged_registry_file_reads_as_empty(isolated_dirs: dict[str, Path]) -> None:
    isolated_dirs["data"].mkdir()
    (isolated_dirs["data"] / "model_folders.json").write_text("[not json")
    assert registered_model_folders() == []
    assert len(list_models()) == 1


def test_resolve_model_specs(isolated_dirs: dict[str, Path], tmp_path: Path) -> None:
    from engine.paths import models_dir

    snapshot = make_hf_snapshot(isolated_dirs["hub"], "some-org/tiny-llama")
    assert resolve_model("some-org/tiny-llama") == snapshot
    with pytest.raises(ModelError, match="is not downloaded"):
        resolve_model("other-org/absent-model")

    folder = make_tiny_folder(tmp_path / "by-path")
    assert resolve_model(str(folder)) == folder
    named = make_tiny_folder(models_dir() / "by-name")
    assert resolve_model("by-name") == named

    _truncate_weights(folder)
    with pytest.raises(ModelError, match="truncated"):
        resolve_model(str(folder))
    with pytest.raises(ModelError, match="does not exist"):
        resolve_model(str(tmp_path / "nowhere" / "deep" / "x"))
    with pytest.raises(ModelError, match="No model folder or cached model named nothing-here"):
        resolve_model("nothing-here")

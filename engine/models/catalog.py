"""The model catalogue: which models Velox can use, what they are, and loading one safely.

Sources, in the order `list_models` shows them:
  1. the embedded default (SmolLM2-135M-Instruct, converted once into the user models folder);
  2. MLX model folders the user placed in `models_dir()`;
  3. folders the user registered (a JSON list in `data_dir()/model_folders.json`);
  4. snapshots in the Hugging Face hub cache (`models--org--name/snapshots/<rev>/`).

Everything here is checked *before* MLX sees a file: `inspect_model_folder` reads `config.json` and only the
JSON headers of the `.safetensors` files (never the tensors), so a picker can list dozens of models in
milliseconds, and a broken folder gives one clear `ModelError` sentence instead of a traceback from C++.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import struct
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from math import prod
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx_lm
from mlx.utils import tree_flatten
from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

from engine.errors import ModelError
from engine.kvcache.quant.vq import FINGERPRINT_ATTRIBUTE, sampled_fingerprint
from engine.models.default_model import (
    DEFAULT_MODEL_NAME,
    default_model_dir,
    ensure_default_model,
    is_default_model_ready,
)
from engine.models.gguf import ProgressCallback
from engine.paths import data_dir, models_dir
from engine.runtime.cpu.weights import dequantize_model_to_fp32, prefer_fp32_weights

try:
    from mlx_lm.utils import MODEL_REMAPPING
except ImportError:  # mlx-lm moved its renaming table: fall back to the model_type names themselves
    MODEL_REMAPPING = {}

REGISTERED_FOLDERS_FILE = "model_folders.json"

# The default model's architecture, known before it is downloaded so a picker can already show what it is
# and how much KV cache it needs per token. tests/test_catalog.py checks these against the converted folder.
DEFAULT_MODEL_SPEC = {
    "model_type": "llama",
    "parameters": 134_515_008,
    "layers": 30,
    "attention_heads": 9,
    "kv_heads": 3,
    "head_dim": 64,
    "hidden_size": 576,
    "vocab_size": 49152,
    "max_context": 8192,
    "dtype": "float16",
    "quantization": "4-bit g32 (1 tensor at 8-bit)",
}
DEFAULT_DOWNLOAD_NOTE = "downloads ~93 MB on first use"

# Bytes per element of each safetensors dtype. Sub-byte float types (F4, F6_*) are not listed: for them we
# skip the exact size check and only check that the offsets lie inside the file.
_SAFETENSORS_ITEM_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}
_SAFETENSORS_DTYPE_NAMES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}
# A safetensors header is a few hundred KB even for huge models; anything bigger means a damaged file.
_MAX_SAFETENSORS_HEADER_BYTES = 100 * 1024 * 1024
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")
_MODEL_TYPE_PATTERN = re.compile(r"^[A-Za-z0-9_]+$")
_HF_REPO_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass
class ModelInfo:
    """What a picker and the memory planner need to know about one model, read without loading it.

    Broken entries keep their name, path and source, have `ready=False` and carry the reason in `note`.
    """

    name: str
    path: Path | None
    source: str  # 'embedded' | 'local' | 'hf-cache'
    model_type: str = ""
    parameters: int = 0
    bytes_on_disk: int = 0
    layers: int = 0
    attention_heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    max_context: int = 0
    dtype: str = ""
    quantization: str = "none"
    ready: bool = False
    note: str = ""
    hidden_size: int = 0
    vocab_size: int = 0
    # Bits of the floats the loaded model computes in, which its uncompressed KV cache holds: 32 where activations
    # stay float32 (the Linux CPU fast path, or a float32 checkpoint on a GPU), else 16. `load_model` reads it from
    # the prepared weights; a folder inspected without loading says 16.
    compute_bits: int = 16

    def kv_bytes_per_token(self, bits: float = 16) -> int:
        """Bytes of KV cache one token occupies: K and V, in every layer, for every KV head.

        2 (K and V) * layers * kv_heads * head_dim * bits / 8. With grouped-query attention only the KV heads
        are cached, not the query heads. It is an upper bound for models whose layers do not all keep a
        full-length cache (sliding-window layers) and ignores the small per-group scales a quantized cache adds.
        """
        return int(2 * self.layers * self.kv_heads * self.head_dim * bits / 8)


# --------------------------------------------------------------------------------------------- inspection


def _read_config(folder: Path) -> dict[str, Any]:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelError(f"The folder {folder} has no config.json, so it is not a model folder.")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise ModelError(f"The config.json in {folder} cannot be read: {error}.") from error
    except ValueError as error:
        raise ModelError(f"The config.json in {folder} is not valid JSON ({error}).") from error
    if not isinstance(config, dict):
        raise ModelError(f"The config.json in {folder} does not hold a JSON object.")
    return config


def _mlx_lm_module_name(model_type: str) -> str:
    """The mlx-lm module that implements `model_type`, following mlx-lm's own renaming table."""
    return MODEL_REMAPPING.get(model_type, model_type)


def _check_architecture(folder: Path, config: dict[str, Any]) -> str:
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelError(f"The config.json in {folder} does not say which architecture it is (no model_type).")
    if config.get("model_file"):
        raise ModelError(
            f"The model in {folder} needs its own Python code ({config['model_file']}) to run; "
            "Velox does not execute code shipped with models."
        )
    module_name = _mlx_lm_module_name(model_type)
    supported = False
    if _MODEL_TYPE_PATTERN.match(module_name):
        try:
            supported = importlib.util.find_spec(f"mlx_lm.models.{module_name}") is not None
        except (ImportError, ValueError):
            supported = False
    if not supported:
        raise ModelError(
            f"The model in {folder} is of architecture '{model_type}', which the installed mlx-lm does not support."
        )
    return model_type


def _config_value(config: dict[str, Any], *keys: str) -> Any:
    """The first of `keys` found in the text sub-config (multimodal models nest it) or else the top level."""
    text_config = config.get("text_config")
    scopes = [text_config, config] if isinstance(text_config, dict) else [config]
    for scope in scopes:
        for key in keys:
            value = scope.get(key)
            if value is not None:
                return value
    return None


def _int_value(config: dict[str, Any], *keys: str) -> int:
    value = _config_value(config, *keys)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _find_weight_files(folder: Path) -> list[Path]:
    """The weight files mlx-lm will load: `model*.safetensors` (its glob), all shards of an index present."""
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            shard_names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise ModelError(f"The weight index {index_path.name} in {folder} is damaged ({error}).") from error
        missing = [name for name in shard_names if not (folder / name).is_file()]
        if missing:
            raise ModelError(
                f"The model in {folder} is incomplete: {len(missing)} of {len(shard_names)} weight shards "
                f"are missing (first: {missing[0]})."
            )
    files = sorted(path for path in folder.glob("model*.safetensors") if path.is_file())
    if files:
        return files
    others = sorted(path.name for path in folder.glob("*.safetensors"))
    if others:
        raise ModelError(
            f"The folder {folder} has weights named {others[0]}, but mlx-lm only loads files named "
            "model*.safetensors; convert the model with mlx_lm.convert."
        )
    if any(folder.glob("*.bin")) or any(folder.glob("*.pth")) or any(folder.glob("*.gguf")):
        raise ModelError(
            f"The folder {folder} has no .safetensors weights (only PyTorch or GGUF files); "
            "convert it to MLX with mlx_lm.convert."
        )
    raise ModelError(f"The folder {folder} has no model weights (no model*.safetensors file).")


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """The tensor table of a safetensors file, checked against the file's size, without reading tensors.

    Layout: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets}},
    then the data. Offsets are relative to the data start; every tensor must fit in the bytes actually
    present, which is what catches a truncated download. Raises ModelError naming the file.
    """
    try:
        file_size = path.stat().st_size
        with path.open("rb") as stream:
            prefix = stream.read(8)
            if len(prefix) < 8:
                raise ModelError(f"The weight file {path} is truncated (only {file_size} bytes).")
            (header_bytes,) = struct.unpack("<Q", prefix)
            if header_bytes > min(file_size - 8, _MAX_SAFETENSORS_HEADER_BYTES):
                raise ModelError(f"The weight file {path} is truncated or not a safetensors file (bad header size).")
            raw_header = stream.read(header_bytes)
    except OSError as error:
        raise ModelError(f"The weight file {path} cannot be read: {error}.") from error
    try:
        header = json.loads(raw_header)
    except (UnicodeDecodeError, ValueError) as error:
        raise ModelError(f"The weight file {path} is corrupt: its header is not valid JSON.") from error
    if not isinstance(header, dict):
        raise ModelError(f"The weight file {path} is corrupt: its header is not a JSON object.")
    header.pop("__metadata__", None)
    data_bytes = file_size - 8 - header_bytes
    for name, entry in header.items():
        try:
            dtype, shape = entry["dtype"], [int(dim) for dim in entry["shape"]]
            begin, end = (int(offset) for offset in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as error:
            raise ModelError(f"The weight file {path} is corrupt: tensor {name} has a malformed entry.") from error
        if not 0 <= begin <= end:
            raise ModelError(f"The weight file {path} is corrupt: tensor {name} has invalid offsets.")
        if end > data_bytes:
            raise ModelError(
                f"The weight file {path} is truncated: tensor {name} ends at byte {end} of the data "
                f"but only {data_bytes} bytes are present (an incomplete download?)."
            )
        item_bytes = _SAFETENSORS_ITEM_BYTES.get(dtype)
        if item_bytes is not None and (end - begin) != prod(shape) * item_bytes:
            raise ModelError(f"The weight file {path} is corrupt: tensor {name} has the wrong size for its shape.")
    return header


def _quantization_settings(config: dict[str, Any]) -> dict[str, Any] | None:
    quantization = config.get("quantization")
    if not isinstance(quantization, dict):
        text_config = config.get("text_config")
        if isinstance(text_config, dict) and isinstance(text_config.get("quantization"), dict):
            quantization = text_config["quantization"]
    return quantization if isinstance(quantization, dict) else None


def _count_parameters(
    tensors: dict[str, dict[str, Any]], quantization: dict[str, Any] | None
) -> tuple[int, Counter[int], int]:
    """(logical parameter count, how many quantized tensors use each bit width, default bits).

    MLX quantized layers store `<path>.weight` packed into uint32 words plus `<path>.scales` (and
    `<path>.biases` in affine mode) per group of `group_size` inputs; scales and biases are not parameters.
    mlx-lm infers each layer's (bits, group_size) from the module's logical input size, which we do not
    have without building the model. We use, in order: a per-path entry in config `quantization`; otherwise
    the default group size, which gives in_features = scale_columns * group_size and then
    bits = packed_columns * 32 / in_features. Mixed-precision MLX conversions vary bits per layer and keep
    the group size, which is exactly the case this recovers (SmolLM2's 8-bit embedding among 4-bit layers).
    If that does not give a valid width we fall back to the default bits.
    """
    default_group = int(quantization.get("group_size", 64)) if quantization else 64
    default_bits = int(quantization.get("bits", 4)) if quantization else 4
    quantized_paths = {
        name[: -len(".weight")]
        for name, entry in tensors.items()
        if name.endswith(".weight") and entry.get("dtype") == "U32" and f"{name[:-len('.weight')]}.scales" in tensors
    }
    auxiliary_names = {
        f"{path}.{suffix}" for path in quantized_paths for suffix in ("scales", "biases", "global_scale")
    }
    total = 0
    bits_used: Counter[int] = Counter()
    for name, entry in tensors.items():
        if name in auxiliary_names:
            continue
        shape = [int(dim) for dim in entry["shape"]]
        path = name[: -len(".weight")] if name.endswith(".weight") else None
        if path not in quantized_paths:
            total += prod(shape)
            continue
        packed_columns = shape[-1]
        override = quantization.get(path) if quantization else None
        if isinstance(override, dict) and "bits" in override:
            bits = int(override["bits"])
        else:
            scale_columns = int(tensors[f"{path}.scales"]["shape"][-1])
            group = int(override.get("group_size", default_group)) if isinstance(override, dict) else default_group
            in_features = scale_columns * group
            bits = packed_columns * 32 // in_features if in_features else 0
            if bits not in (1, 2, 3, 4, 5, 6, 8) or packed_columns * 32 % in_features:
                bits = default_bits
        bits_used[bits] += 1
        total += prod(shape[:-1]) * packed_columns * 32 // bits
    return total, bits_used, default_bits


def _describe_quantization(config: dict[str, Any], bits_used: Counter[int], default_bits: int) -> str:
    quantization = _quantization_settings(config)
    if quantization is None:
        legacy = config.get("quantization_config")
        if isinstance(legacy, dict):
            method = legacy.get("quant_method", "quantized")
            bits = legacy.get("bits")
            return f"{method} {bits}-bit" if bits else str(method)
        return "none"
    group = quantization.get("group_size", 64)
    mode = quantization.get("mode", "affine")
    text = f"{default_bits}-bit g{group}" + ("" if mode == "affine" else f" {mode}")
    others = {bits: count for bits, count in sorted(bits_used.items()) if bits != default_bits}
    if others:
        parts = ", ".join(f"{count} tensor{'s' if count > 1 else ''} at {bits}-bit" for bits, count in others.items())
        text += f" ({parts})"
    return text


def _dtype_name(config: dict[str, Any], tensors: dict[str, dict[str, Any]]) -> str:
    declared = _config_value(config, "torch_dtype", "dtype")
    if isinstance(declared, str) and declared:
        return declared
    # Otherwise the most common float type among the stored tensors (packed uint32 weights excluded).
    counts = Counter(entry["dtype"] for entry in tensors.values() if entry["dtype"] in _SAFETENSORS_DTYPE_NAMES)
    return _SAFETENSORS_DTYPE_NAMES[counts.most_common(1)[0][0]] if counts else "unknown"


def _tokenizer_auto_map_entry(folder: Path, config: dict[str, Any]) -> tuple[str, str | None] | None:
    """(where, class reference) when the folder asks transformers to build its tokenizer from code it ships
    (an `auto_map` with an AutoTokenizer entry in tokenizer_config.json or config.json); else None."""
    sources: list[tuple[str, Any]] = [("config.json", config.get("auto_map"))]
    try:
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        tokenizer_config = None
    if isinstance(tokenizer_config, dict):
        sources.insert(0, ("tokenizer_config.json", tokenizer_config.get("auto_map")))
    for where, auto_map in sources:
        entry = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
        # transformers accepts a [slow, fast] pair, a bare string, or even a bare list as the auto_map.
        if entry is None and isinstance(auto_map, list | tuple):
            entry = auto_map
        references = [item for item in (entry if isinstance(entry, list | tuple) else [entry]) if item]
        if references:
            declared = tokenizer_config.get("tokenizer_class") if isinstance(tokenizer_config, dict) else None
            return where, declared if isinstance(declared, str) else None
    return None


def _is_builtin_tokenizer_class(name: str | None) -> bool:
    """Whether transformers itself implements the tokenizer class `name` (then an auto_map is ignored)."""
    if not name or not _MODEL_TYPE_PATTERN.match(name):
        return False
    for candidate in (name, name.removesuffix("Fast"), name + "Fast"):
        found = tokenizer_class_from_name(candidate)
        if found is not None and found.__module__.startswith("transformers."):
            return True
    return False


def _check_no_custom_code(folder: Path, config: dict[str, Any]) -> None:
    """Refuse a folder whose tokenizer is Python code it ships: transformers would ask "run the custom
    code? [y/N]" and, on y, import the folder's .py file. Velox never runs code from a model folder (the
    loader also passes trust_remote_code=False, so nothing is ever asked)."""
    found = _tokenizer_auto_map_entry(folder, config)
    if found is None:
        return
    where, declared_class = found
    if _is_builtin_tokenizer_class(declared_class):
        return  # transformers uses its own class and ignores the folder's code
    raise ModelError(
        f"The model in {folder} needs its own Python code to build its tokenizer (auto_map in {where}); "
        "Velox does not execute code shipped with models."
    )


def _check_tokenizer(folder: Path) -> None:
    if any((folder / name).is_file() for name in _TOKENIZER_FILES) or any(folder.glob("*.tiktoken")):
        return
    raise ModelError(
        f"The model in {folder} has no tokenizer files (tokenizer.json, tokenizer.model or vocab.json)."
    )


def _folder_bytes(folder: Path) -> int:
    """Bytes of the model's own files: the folder's top-level files (symlinks followed, as in the HF cache).

    Sub-folders are left out on purpose: HF repositories often carry duplicate original checkpoints there.
    """
    total = 0
    for entry in folder.iterdir():
        try:
            if entry.is_file():
                total += entry.stat().st_size
        except OSError:
            continue
    return total


def inspect_model_folder(path: str | Path, *, name: str | None = None, source: str = "local") -> ModelInfo:
    """Describe the model folder at `path` after checking it can be loaded, without loading any tensor.

    Raises ModelError (one sentence naming the folder) for: not a folder, missing or invalid config.json, an
    architecture the installed mlx-lm lacks, no weights, a truncated or corrupt safetensors file, or no
    tokenizer.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        if folder.exists():
            raise ModelError(f"{folder} is a file, not a model folder.")
        raise ModelError(f"The model folder {folder} does not exist.")
    config = _read_config(folder)
    model_type = _check_architecture(folder, config)
    tensors: dict[str, dict[str, Any]] = {}
    for weight_file in _find_weight_files(folder):
        tensors.update(read_safetensors_header(weight_file))
    if not tensors:
        raise ModelError(f"The weight files in {folder} hold no tensors.")
    _check_tokenizer(folder)
    _check_no_custom_code(folder, config)

    quantization = _quantization_settings(config)
    parameters, bits_used, default_bits = _count_parameters(tensors, quantization)
    attention_heads = _int_value(config, "num_attention_heads", "n_head", "n_heads")
    hidden_size = _int_value(config, "hidden_size", "n_embd", "d_model", "dim")
    kv_heads = _int_value(config, "num_key_value_heads", "n_kv_heads", "num_kv_heads") or attention_heads
    head_dim = _int_value(config, "head_dim") or (hidden_size // attention_heads if attention_heads else 0)
    return ModelInfo(
        name=name or folder.name,
        path=folder,
        source=source,
        model_type=model_type,
        parameters=parameters,
        bytes_on_disk=_folder_bytes(folder),
        layers=_int_value(config, "num_hidden_layers", "n_layer", "n_layers", "num_layers"),
        attention_heads=attention_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_context=_int_value(
            config, "max_position_embeddings", "max_sequence_length", "n_positions", "seq_length", "n_ctx"
        ),
        dtype=_dtype_name(config, tensors),
        quantization=_describe_quantization(config, bits_used, default_bits),
        ready=True,
        note="",
        hidden_size=hidden_size,
        vocab_size=_int_value(config, "vocab_size"),
    )


def _inspect_or_broken(folder: Path, name: str, source: str) -> ModelInfo:
    """inspect_model_folder, but a broken folder becomes a not-ready entry carrying the reason."""
    try:
        return inspect_model_folder(folder, name=name, source=source)
    except ModelError as error:
        return ModelInfo(name=name, path=folder, source=source, ready=False, note=str(error))


# --------------------------------------------------------------------------------------- user-registered


def _registered_folders_path() -> Path:
    return data_dir() / REGISTERED_FOLDERS_FILE


def registered_model_folders() -> list[Path]:
    """The folders the user added, in the order added. A damaged list file reads as empty."""
    try:
        entries = json.loads(_registered_folders_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(entries, list):
        return []
    return [Path(entry) for entry in entries if isinstance(entry, str) and entry]


def _save_registered_folders(folders: Sequence[Path]) -> None:
    target = _registered_folders_path()
    partial = target.with_suffix(".json.partial")
    partial.write_text(json.dumps([str(folder) for folder in folders], indent=2), encoding="utf-8")
    partial.replace(target)  # atomic: a crash never leaves a half-written list


def add_model_folder(path: str | Path) -> ModelInfo:
    """Validate the model folder at `path` and remember it; returns its description. Adding twice is harmless."""
    folder = Path(path).expanduser().resolve()
    info = inspect_model_folder(folder)
    folders = registered_model_folders()
    if folder not in folders:
        _save_registered_folders([*folders, folder])
    return info


def remove_model_folder(path: str | Path) -> bool:
    """Forget a registered folder (its files are untouched). Returns whether it was registered."""
    folder = Path(path).expanduser().resolve()
    folders = registered_model_folders()
    remaining = [entry for entry in folders if entry != folder and entry.expanduser().resolve() != folder]
    if len(remaining) == len(folders):
        return False
    _save_registered_folders(remaining)
    return True


# ------------------------------------------------------------------------------------ Hugging Face cache


def hf_hub_cache_dir() -> Path:
    """Where huggingface_hub keeps downloads, following its environment variables."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _hf_snapshot(repo_dir: Path) -> Path | None:
    """The snapshot of a cached repo to use: the one `refs/main` points at, else the newest with a config."""
    snapshots = repo_dir / "snapshots"
    main_ref = repo_dir / "refs" / "main"
    try:
        revision = main_ref.read_text(encoding="utf-8").strip() if main_ref.is_file() else ""
    except OSError:
        revision = ""
    if revision and (snapshots / revision / "config.json").is_file():
        return snapshots / revision
    try:
        candidates = [entry for entry in snapshots.iterdir() if (entry / "config.json").is_file()]
    except OSError:
        return None
    return max(candidates, key=lambda entry: entry.stat().st_mtime) if candidates else None


def _hf_cached_repos() -> list[tuple[str, Path]]:
    """(repo id 'org/name', snapshot folder) for every cached model repo that has a config.json."""
    cache = hf_hub_cache_dir()
    try:
        repo_dirs = sorted(entry for entry in cache.iterdir() if entry.name.startswith("models--") and entry.is_dir())
    except OSError:
        return []
    found = []
    for repo_dir in repo_dirs:
        snapshot = _hf_snapshot(repo_dir)
        if snapshot is not None:
            # huggingface_hub writes repo 'org/name' as 'models--org--name'.
            found.append((repo_dir.name[len("models--"):].replace("--", "/", 1), snapshot))
    return found


def hf_cached_snapshot(repo_id: str) -> Path | None:
    """The local snapshot folder of the Hugging Face repo `repo_id`, or None if it is not downloaded."""
    for cached_id, snapshot in _hf_cached_repos():
        if cached_id == repo_id:
            return snapshot
    return None


# ------------------------------------------------------------------------------------------- catalogue


def _default_entry() -> ModelInfo:
    folder = default_model_dir()
    if is_default_model_ready():
        return _inspect_or_broken(folder, DEFAULT_MODEL_NAME, "embedded")
    return ModelInfo(
        name=DEFAULT_MODEL_NAME, path=folder, source="embedded", ready=False, note=DEFAULT_DOWNLOAD_NOTE,
        **DEFAULT_MODEL_SPEC,
    )


def _same_folder(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def list_models(extra_folders: Iterable[str | Path] = ()) -> list[ModelInfo]:
    """Every model Velox knows of, default first; broken ones are included with ready=False and the reason.

    Never downloads anything: a default model not yet fetched is listed as not ready with a note.
    """
    entries = [_default_entry()]
    seen = [entries[0].path] if entries[0].path is not None else []

    def add(folder: Path, name: str, source: str) -> None:
        if any(_same_folder(folder, known) for known in seen):
            return
        seen.append(folder)
        entries.append(_inspect_or_broken(folder, name, source))

    try:
        local_folders = sorted(models_dir().iterdir())
    except OSError:
        local_folders = []
    for folder in local_folders:
        # Hidden folders and '.partial' ones (a conversion in progress) are not models yet.
        if folder.is_dir() and not folder.name.startswith(".") and not folder.name.endswith(".partial"):
            add(folder, folder.name, "local")
    for folder in [*registered_model_folders(), *(Path(extra).expanduser() for extra in extra_folders)]:
        add(folder, folder.name, "local")
    for repo_id, snapshot in _hf_cached_repos():
        add(snapshot, repo_id, "hf-cache")
    return entries


def resolve_model(spec: str | None, progress: ProgressCallback | None = None) -> Path:
    """The model folder meant by `spec`, validated.

    None or 'default' (or the default's name): the embedded default, fetched and converted on first use.
    A folder path: that folder. A bare name: a folder of that name in the models folder. 'org/name': its
    Hugging Face cache snapshot; there is no network download here, so an uncached repo is an error.
    """
    if spec is None or spec.strip() in ("", "default", DEFAULT_MODEL_NAME):
        return ensure_default_model(progress)
    spec = spec.strip()
    candidate = Path(spec).expanduser()
    if candidate.exists():
        return inspect_model_folder(candidate).path or candidate
    named = models_dir() / spec
    if "/" not in spec and named.is_dir():
        return inspect_model_folder(named).path or named
    if _HF_REPO_PATTERN.match(spec) and not spec.startswith((".", "~")):
        snapshot = hf_cached_snapshot(spec)
        if snapshot is None:
            raise ModelError(
                f"The model {spec} is not downloaded (not in the Hugging Face cache at {hf_hub_cache_dir()}); "
                f"Velox downloads only when asked: run `velox models download {spec}` (or add --download)."
            )
        inspect_model_folder(snapshot, name=spec, source="hf-cache")
        return snapshot
    if "/" in spec or os.sep in spec or spec.startswith((".", "~")):
        raise ModelError(f"The model folder {candidate} does not exist.")
    raise ModelError(f"No model folder or cached model named {spec} was found in {models_dir()}.")


def load_model(
    path_or_info: str | Path | ModelInfo, progress: ProgressCallback | None = None
) -> tuple[Any, Any, ModelInfo]:
    """Load a model folder with mlx-lm after validating it: (model, tokenizer, info), the info saying the bits the
    prepared model computes in (`ModelInfo.compute_bits`).

    Every failure, including ones raised deep inside MLX, becomes a one-sentence ModelError.
    """
    report = progress or (lambda message, fraction: None)
    if isinstance(path_or_info, ModelInfo):
        if path_or_info.path is None:
            raise ModelError(f"The model {path_or_info.name} has no folder to load from.")
        report(f"Checking {path_or_info.name}", 0.0)
        info = inspect_model_folder(path_or_info.path, name=path_or_info.name, source=path_or_info.source)
    else:
        report("Checking the model folder", 0.0)
        info = inspect_model_folder(path_or_info)
    assert info.path is not None  # inspect_model_folder always sets it
    report(f"Loading {info.name}", 0.1)
    try:
        # trust_remote_code=False: transformers raises instead of asking whether to run the folder's code.
        model, tokenizer = mlx_lm.load(str(info.path), tokenizer_config={"trust_remote_code": False})
    except Exception as error:  # mlx / mlx-lm / transformers raise many types with multi-line messages
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ModelError(f"The model in {info.path} could not be loaded: {reason}") from error

    # The weights' fingerprint as the checkpoint gives them, before this device prepares them (see FINGERPRINT_ATTRIBUTE).
    fingerprint = sampled_fingerprint(model)
    # On CPU, fp32 weights are much faster than dequantizing 4-bit weights at every step.
    if prefer_fp32_weights():
        report("Converting weights to fp32 for the CPU", 0.8)
        try:
            model = dequantize_model_to_fp32(model)
        except Exception as error:  # e.g. out of memory inside mx.dequantize
            reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ModelError(f"The model in {info.path} could not be prepared for the CPU: {reason}") from error
    _compute_in_declared_dtype_on_gpu(model, info)
    setattr(model, FINGERPRINT_ATTRIBUTE, fingerprint)
    report("Model ready", 1.0)
    return model, tokenizer, replace(info, compute_bits=compute_bits(model))


def compute_bits(model: Any) -> int:
    """32 if any of the model's unquantized float parameters is float32, else 16: one float32 weight (a norm, say)
    promotes every activation after it to float32, and the uncompressed KV cache then holds float32 keys and values
    (mlx-lm's KVCache keeps the dtype it is given; the Linux CPU fast path's own cache is float32 on purpose)."""
    floats = [value.dtype for _, value in tree_flatten(model.parameters()) if mx.issubdtype(value.dtype, mx.floating)]
    return 32 if mx.float32 in floats else 16


def _compute_in_declared_dtype_on_gpu(model: Any, info: ModelInfo) -> None:
    """On a GPU, cast the model's unquantized float parameters to its declared 16-bit dtype.

    Why: a checkpoint may keep some small tensors in float32 (GGUF files store the norms as F32, so the
    embedded default model does), and one float32 norm weight promotes every activation after it to
    float32: twice the activation and KV traffic, and MLX's CUDA quantized_matmul has no float32 kernel
    for many shapes (measured: prefill failed for KIVI and mlx-lm's quantized caches). Packed weights are
    integers and are left alone. On the CPU nothing changes: there activations stay float32 on purpose.
    """
    dtype = {"float16": mx.float16, "bfloat16": mx.bfloat16}.get(info.dtype)
    if dtype is None or mx.default_device() != mx.gpu:
        return
    model.set_dtype(dtype)

"""Convert a llama-architecture GGUF file into a normal MLX model folder that `mlx_lm.load` reads.

The folder holds `config.json`, `model.safetensors` (MLX affine-quantized weights, group 32, as MLX's
GGUF reader produces them), `tokenizer.json`, `tokenizer_config.json` (with the chat template) and
`generation_config.json`.

Why we read the GGUF header ourselves before handing the file to `mx.load`: MLX's reader silently
dequantizes or rejects tensor types it does not know deep inside C++, and a truncated file can fail in
unhelpful ways. Parsing the (small) header first lets us give one clear error for unsupported quant
types, unsupported architectures and corrupt files.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import mlx.core as mx
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from engine.errors import ModelError

GGUF_MAGIC = b"GGUF"

# ggml tensor types we convert (MLX's GGUF reader maps Q4_0/Q4_1/Q8_0 to affine quantization, group 32).
GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS",
    24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16",
}
SUPPORTED_TENSOR_TYPES = {"F32", "F16", "Q4_0", "Q4_1", "Q8_0"}
SUPPORTED_ARCHITECTURES = {"llama"}

# GGUF metadata value types.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_TYPE_STRING, _TYPE_ARRAY = 8, 9

# GGUF tensor name -> mlx-lm llama parameter name (per block, then global).
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]
    type_name: str


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))


class _Reader:
    def __init__(self, stream: BinaryIO, path: Path) -> None:
        self.stream = stream
        self.path = path

    def read(self, n: int) -> bytes:
        data = self.stream.read(n)
        if len(data) != n:
            raise ModelError(f"{self.path.name} is truncated or corrupt (the GGUF header ends early).")
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        length = self.scalar("<Q")
        if length > 1 << 26:
            raise ModelError(f"{self.path.name} is corrupt (a GGUF string claims {length} bytes).")
        return self.read(length).decode("utf-8", errors="replace")

    def value(self, value_type: int) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[value_type])
        if value_type == _TYPE_STRING:
            return self.string()
        if value_type == _TYPE_ARRAY:
            item_type = self.scalar("<I")
            count = self.scalar("<Q")
            if count > 1 << 24:
                raise ModelError(f"{self.path.name} is corrupt (a GGUF array claims {count} items).")
            if item_type in _SCALAR_FORMATS:
                fmt = _SCALAR_FORMATS[item_type]
                size = struct.calcsize(fmt)
                raw = self.read(size * count)
                return list(struct.unpack(f"<{count}{fmt[1:]}", raw))
            return [self.value(item_type) for _ in range(count)]
        raise ModelError(f"{self.path.name} is corrupt (unknown GGUF value type {value_type}).")


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse the GGUF header (metadata and tensor table) without loading any tensor data."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"Model file not found: {path}")
    with path.open("rb") as stream:
        reader = _Reader(stream, path)
        magic = stream.read(4)
        if magic != GGUF_MAGIC:
            raise ModelError(f"{path.name} is not a GGUF model file (it does not start with 'GGUF').")
        version = reader.scalar("<I")
        if version not in (2, 3):
            raise ModelError(f"{path.name} uses GGUF version {version}; only versions 2 and 3 are supported.")
        n_tensors = reader.scalar("<Q")
        n_kv = reader.scalar("<Q")
        if n_tensors > 1 << 20 or n_kv > 1 << 20:
            raise ModelError(f"{path.name} is corrupt (implausible tensor or metadata count).")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = reader.string()
            metadata[key] = reader.value(reader.scalar("<I"))
        tensors = []
        for _ in range(n_tensors):
            name = reader.string()
            n_dims = reader.scalar("<I")
            if n_dims > 8:
                raise ModelError(f"{path.name} is corrupt (tensor {name} claims {n_dims} dimensions).")
            dims = tuple(reader.scalar("<Q") for _ in range(n_dims))
            type_id = reader.scalar("<I")
            reader.scalar("<Q")  # data offset
            tensors.append(GGUFTensorInfo(name, tuple(reversed(dims)), GGML_TYPE_NAMES.get(type_id, f"type {type_id}")))
    return GGUFHeader(version, metadata, tensors)


def _check_supported(header: GGUFHeader, path: Path) -> None:
    if header.architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"{path.name} is a '{header.architecture}' model; Velox converts only llama-architecture GGUF files."
        )
    unsupported = sorted({t.type_name for t in header.tensors} - SUPPORTED_TENSOR_TYPES)
    if unsupported:
        raise ModelError(
            f"{path.name} uses tensor types {', '.join(unsupported)}; Velox converts GGUF files quantized as "
            f"{', '.join(sorted(SUPPORTED_TENSOR_TYPES))} only."
        )


def _meta_int(meta: dict[str, Any], key: str, default: int | None = None) -> int:
    if key in meta:
        return int(meta[key])
    if default is None:
        raise ModelError(f"The GGUF file lacks the required field '{key}'.")
    return default


def model_config_from_header(header: GGUFHeader) -> dict[str, Any]:
    """An mlx-lm/HF style llama config.json from GGUF metadata."""
    meta = header.metadata
    arch = header.architecture
    n_heads = _meta_int(meta, f"{arch}.attention.head_count")
    hidden = _meta_int(meta, f"{arch}.embedding_length")
    tensor_names = {t.name for t in header.tensors}
    tokens = meta.get("tokenizer.ggml.tokens") or []
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": _meta_int(meta, f"{arch}.block_count"),
        "intermediate_size": _meta_int(meta, f"{arch}.feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": _meta_int(meta, f"{arch}.attention.head_count_kv", n_heads),
        "head_dim": _meta_int(meta, f"{arch}.rope.dimension_count", hidden // n_heads),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": _meta_int(meta, f"{arch}.context_length", 2048),
        "vocab_size": _meta_int(meta, f"{arch}.vocab_size", len(tokens)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _meta_int(meta, "tokenizer.ggml.bos_token_id", 1),
        "eos_token_id": _meta_int(meta, "tokenizer.ggml.eos_token_id", 2),
        "torch_dtype": "float16",
        # Per-tensor bits are inferred by mlx-lm from the array shapes; this is only the default.
        "quantization": {"group_size": 32, "bits": 4},
        "velox_source": {"format": "gguf", "name": str(meta.get("general.name", ""))},
    }


def _unpermute_rows(array: Any, n_heads: int) -> Any:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> half-split pairs) on any row-major
    array whose first axis is the output features: weights, quantized words, scales and biases alike."""
    rows = array.shape[0]
    half = rows // n_heads // 2
    rest = array.shape[1:]
    return array.reshape(n_heads, half, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def convert_weights(weights: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Rename GGUF tensors to mlx-lm llama names and un-permute Q/K rows."""
    converted: dict[str, Any] = {}
    for name, array in weights.items():
        stem, _, suffix = name.rpartition(".")  # suffix: weight | scales | biases
        parts = stem.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _BLOCK_NAMES:
            target = f"model.layers.{int(parts[1])}.{_BLOCK_NAMES[parts[2]]}"
            if parts[2] == "attn_q":
                array = _unpermute_rows(array, config["num_attention_heads"])
            elif parts[2] == "attn_k":
                array = _unpermute_rows(array, config["num_key_value_heads"])
        elif stem in _GLOBAL_NAMES:
            target = _GLOBAL_NAMES[stem]
        elif stem == "rope_freqs":
            continue  # llama-3 style RoPE scaling factors; config carries the scaling instead
        else:
            raise ModelError(f"Unexpected tensor '{name}' in the GGUF file; it does not look like a llama model.")
        converted[f"{target}.{suffix}"] = array
    return converted


def build_tokenizer_json(meta: dict[str, Any]) -> str:
    """A Hugging Face `tokenizers` JSON for a gpt2-style BPE vocabulary stored in GGUF metadata."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ModelError(
            f"The GGUF tokenizer is '{meta.get('tokenizer.ggml.model')}'; only gpt2-style BPE is supported."
        )
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    token_types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]
    if meta.get("tokenizer.ggml.pre") in {"smollm", "llama3", "llama-bpe"} or meta.get("tokenizer.ggml.pre") is None:
        # SmolLM's tokenizer splits every digit on its own before byte-level BPE.
        pre.insert(0, pre_tokenizers.Digits(individual_digits=True))
    elif meta.get("tokenizer.ggml.pre") == "default":
        pass
    else:
        pre.insert(0, pre_tokenizers.Split(Regex(r"\d"), behavior="isolated"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(pre)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # Control tokens (type 3) and user-defined tokens (type 4) are atomic and never split by BPE.
    specials = [AddedToken(tokens[i], special=(t == 3), normalized=False) for i, t in enumerate(token_types) if t in (3, 4)]
    tokenizer.add_tokens(specials)
    return tokenizer.to_str()


def _token(meta: dict[str, Any], key: str) -> str | None:
    tokens = meta.get("tokenizer.ggml.tokens") or []
    index = meta.get(key)
    if index is None or not 0 <= int(index) < len(tokens):
        return None
    return tokens[int(index)]


def tokenizer_config(meta: dict[str, Any], context_length: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": False,
    }
    for field, key in [
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ]:
        token = _token(meta, key)
        if token is not None:
            config[field] = token
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


ProgressCallback = Callable[[str, float], None]


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, progress: ProgressCallback | None = None) -> Path:
    """Convert `gguf_path` into an MLX model folder at `out_dir` (written atomically). Returns `out_dir`."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    report = progress or (lambda message, fraction: None)
    report("Reading GGUF header", 0.0)
    header = read_gguf_header(gguf_path)
    _check_supported(header, gguf_path)
    config = model_config_from_header(header)
    report("Loading GGUF tensors", 0.1)
    try:
        weights = mx.load(str(gguf_path))
    except Exception as error:  # MLX raises RuntimeError/ValueError with C++ messages
        raise ModelError(f"{gguf_path.name} could not be read as GGUF: {error}") from error
    expected = {t.name.rsplit(".", 1)[0] for t in header.tensors}
    found = {name.rsplit(".", 1)[0] for name in weights}
    if expected != found:
        raise ModelError(f"{gguf_path.name} is inconsistent: its tensor table and tensor data disagree.")
    report("Converting weights", 0.4)
    converted = convert_weights(weights, config)
    if not any(name.endswith(".scales") for name in converted):
        config.pop("quantization")
    tmp_dir = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    report("Writing safetensors", 0.6)
    mx.save_safetensors(str(tmp_dir / "model.safetensors"), converted, metadata={"format": "mlx"})
    report("Writing tokenizer", 0.85)
    (tmp_dir / "tokenizer.json").write_text(build_tokenizer_json(header.metadata), encoding="utf-8")
    tok_config = tokenizer_config(header.metadata, config["max_position_embeddings"])
    (tmp_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2), encoding="utf-8")
    (tmp_dir / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (tmp_dir / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp_dir.rename(out_dir)
    report("Done", 1.0)
    return out_dir

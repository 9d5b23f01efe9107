"""The GGUF converter: header parsing, clear errors, and logits identical to a direct GGUF load."""

from __future__ import annotations

import json
import struct

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama

from engine.errors import ModelError
from engine.models.default_model import GGUF_SHA256, default_gguf_path
from engine.models.gguf import _BLOCK_NAMES, _GLOBAL_NAMES, convert_gguf, read_gguf_header


def test_header_of_the_real_file(default_model_path):
    header = read_gguf_header(default_gguf_path())
    assert header.architecture == "llama"
    assert header.metadata["llama.block_count"] == 30
    types = {t.type_name for t in header.tensors}
    assert types <= {"F32", "Q4_1", "Q8_0"} and "Q4_1" in types
    embed = next(t for t in header.tensors if t.name == "token_embd.weight")
    assert embed.shape == (49152, 576) and embed.type_name == "Q8_0"


def test_converted_folder_has_what_mlx_lm_needs(default_model_path):
    names = {p.name for p in default_model_path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    config = json.loads((default_model_path / "config.json").read_text())
    assert config["num_key_value_heads"] == 3 and config["tie_word_embeddings"] is True
    assert "chat_template" in json.loads((default_model_path / "tokenizer_config.json").read_text())


def _direct_gguf_model():
    """SmolLM2 built straight from the GGUF tensors with llama.cpp's own layout: Q/K rows left permuted
    and traditional (interleaved) RoPE instead."""
    weights, meta = mx.load(str(default_gguf_path()), return_metadata=True)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
        num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, vocab_size=49152,
        rope_theta=100000.0, rope_traditional=True, tie_word_embeddings=True, head_dim=64,
    )
    model = llama.Model(args)
    renamed = {}
    for name, array in weights.items():
        stem, _, suffix = name.rpartition(".")
        parts = stem.split(".")
        target = (f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}" if parts[0] == "blk"
                  else _GLOBAL_NAMES[stem])
        renamed[f"{target}.{suffix}"] = array

    def predicate(path, module):
        if f"{path}.scales" not in renamed:
            return False
        bits = renamed[f"{path}.weight"].shape[-1] * 32 // (renamed[f"{path}.scales"].shape[-1] * 32)
        return {"group_size": 32, "bits": bits}

    nn.quantize(model, group_size=32, bits=4, class_predicate=predicate)
    model.load_weights(list(renamed.items()))
    return model


def test_converted_logits_equal_direct_gguf_logits(default_model_path, smollm):
    from mlx_lm import load

    converted, tokenizer = load(str(default_model_path))
    direct = _direct_gguf_model()
    tokens = mx.array(tokenizer.encode("The lighthouse keeper walked up the stairs and lit the lamp.")[:16])[None]
    a = converted(tokens).astype(mx.float32)
    b = direct(tokens).astype(mx.float32)
    assert a.shape == (1, tokens.shape[1], 49152)
    assert mx.max(mx.abs(a - b)).item() < 2e-2 * mx.max(mx.abs(a)).item()
    assert mx.array_equal(mx.argmax(a, axis=-1), mx.argmax(b, axis=-1)).item()


def test_tokenizer_round_trips(smollm):
    _, tokenizer, _ = smollm
    for text in ["Hello world 12345", "café ünïcode 🎉  two  spaces\n\nnew paragraph", "<|im_start|>user\nhi"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode("2024", add_special_tokens=False) == [
        tokenizer.encode(d, add_special_tokens=False)[0] for d in "2024"]
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [2]


def _write_gguf(path, arch="llama", tensor_type=3, truncate_at=None):
    def string(s):
        b = s.encode()
        return struct.pack("<Q", len(b)) + b

    data = b"GGUF" + struct.pack("<IQQ", 3, 1, 1)
    data += string("general.architecture") + struct.pack("<I", 8) + string(arch)
    data += string("blk.0.attn_q.weight") + struct.pack("<I", 2) + struct.pack("<QQ", 64, 64)
    data += struct.pack("<IQ", tensor_type, 0)
    if truncate_at is not None:
        data = data[:truncate_at]
    path.write_bytes(data)
    return path


def test_clear_errors_for_bad_files(tmp_path):
    with pytest.raises(ModelError, match="not a GGUF"):
        (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 not gguf")
        convert_gguf(tmp_path / "x.gguf", tmp_path / "out")
    with pytest.raises(ModelError, match="truncated"):
        convert_gguf(_write_gguf(tmp_path / "t.gguf", truncate_at=40), tmp_path / "out")
    with pytest.raises(ModelError, match="'gemma3' model"):
        convert_gguf(_write_gguf(tmp_path / "g.gguf", arch="gemma3"), tmp_path / "out")
    with pytest.raises(ModelError, match="Q4_K"):
        convert_gguf(_write_gguf(tmp_path / "k.gguf", tensor_type=12), tmp_path / "out")
    with pytest.raises(ModelError, match="not found"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_checksum_is_pinned(default_model_path):
    import hashlib

    assert hashlib.sha256(default_gguf_path().read_bytes()).hexdigest() == GGUF_SHA256

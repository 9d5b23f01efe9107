"""The benchmark harness's own logic (engine/bench): chunked teacher forcing, statistics, effective bits
from held bytes, spec parsing, needle prompts, result files and the report. No timings are asserted."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from benchmarks.harness.common import (
    SCHEMA,
    effective_bits_from_bytes,
    paired_difference,
    pareto_front,
    read_result,
    summarize,
    windows,
    write_result,
)
from benchmarks.harness.quality import combine_agreement, combine_needle, combine_perplexity, needle_prompt
from benchmarks.harness.specs import QUALITY_SPECS, SPEED_SPECS, parse_spec, parse_specs
from engine.errors import ConfigError
from engine.kvcache import KVCacheConfig
from engine.kvcache.evaluate import teacher_forced_token_stats
from engine.planning.memory import array_bytes
from tests.kvcache_helpers import TINY_VOCAB, random_kv, tiny_llama


def _tokens(n: int, seed: int = 3) -> list[int]:
    return np.random.default_rng(seed).integers(0, TINY_VOCAB, n).tolist()


# ----- teacher forcing through the cache ---------------------------------------------------------------------


def test_chunk_size_1_and_64_agree_for_a_stateless_cache() -> None:
    """fp32 storage holds exactly what the model made, so feeding one token at a time or 64 at a time must
    give the same per-token NLL (to float rounding), while a 2-bit cache on the same tokens is far off."""
    model = tiny_llama(head_dim=32, n_layers=2)
    tokens = _tokens(150)
    factories = {"fp32": parse_spec("fp32").factory(model),
                 "affine:k2v2:g32": parse_spec("affine:k2v2:g32").factory(model)}
    one = teacher_forced_token_stats(model, tokens, factories, "fp32", chunk_tokens=1)
    many = teacher_forced_token_stats(model, tokens, factories, "fp32", chunk_tokens=64)
    assert one["fp32"].nll.shape == many["fp32"].nll.shape == (149,)
    gap = np.max(np.abs(one["fp32"].nll - many["fp32"].nll))
    assert gap < 1e-4
    assert np.max(np.abs(many["affine:k2v2:g32"].nll - many["fp32"].nll)) > 100 * max(gap, 1e-6)


def test_token_stats_against_the_reference_and_scoring_window() -> None:
    model = tiny_llama(head_dim=32, n_layers=2)
    tokens = _tokens(130)
    factories = {"fp16": parse_spec("fp16").factory(model),
                 "rotated:k3v3:g32": parse_spec("rotated:k3v3:g32").factory(model)}
    full = teacher_forced_token_stats(model, tokens, factories, "fp16", chunk_tokens=64)
    tail = teacher_forced_token_stats(model, tokens, factories, "fp16", chunk_tokens=64, score_from=70)
    reference = full["fp16"]
    assert np.all(reference.kl == 0) and reference.top1_agrees.all()
    assert (full["rotated:k3v3:g32"].kl > 0).any() and (full["rotated:k3v3:g32"].kl >= -1e-6).all()
    # Scoring from token 70 keeps exactly the predictions of tokens 71.. (the same numbers: the caches saw
    # the same chunks), and every cache held all 129 fed tokens.
    assert tail["fp16"].nll.shape == (129 - 70,)
    np.testing.assert_allclose(tail["rotated:k3v3:g32"].nll, full["rotated:k3v3:g32"].nll[70:], rtol=0, atol=1e-5)
    fp16_bytes = 129 * 2 * 2 * 2 * 32 * 2  # tokens x (K, V) x layers x kv heads x head_dim x 2 bytes
    assert reference.held_bytes == 256 * fp16_bytes // 129  # buffers grow in steps of 256 tokens
    with pytest.raises(ValueError, match="reference"):
        teacher_forced_token_stats(model, tokens, factories, "fp32")


def test_token_stats_read_the_bytes_a_decoding_cache_holds() -> None:
    """Fed in chunks of more than 256 tokens, a compressed store grows room for the next chunks; the bytes a
    teacher-forced pass reports are read after that room is given back (as a first decode step would): affine:4
    over 1,200 tokens (4 chunks of 300) holds exactly its formula at 1,280 token slots."""
    from engine.kvcache import get_method

    model = tiny_llama(head_dim=32, n_layers=2)
    factories = {"fp16": parse_spec("fp16").factory(model),
                 "affine:k4v4:g32": parse_spec("affine:k4v4:g32").factory(model)}
    stats = teacher_forced_token_stats(model, _tokens(1201), factories, "fp16", chunk_tokens=300)
    config = KVCacheConfig.parse("affine:k4v4:g32")
    assert stats["affine:k4v4:g32"].held_bytes == 2 * get_method("affine").expected_nbytes(config, 32, 1280, 2)


# ----- bits, bytes and statistics ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "input_dtype", "bits"),
    [
        ("fp16", mx.float32, 16.0),
        ("affine:k4v4:g64", mx.float32, 4.5),  # 4 bits + an fp16 scale and bias per 64 values
        ("affine:k3v2:g32", mx.float32, 3.5),
        ("mlx-q:k4v4", mx.float32, 5.0),  # mlx-lm keeps scales and biases in the input dtype: fp32 here
        ("mlx-q:k4v4", mx.bfloat16, 4.5),
        ("mlx-kv", mx.float32, 32.0),
    ],
)
def test_effective_bits_from_the_bytes_actually_held(spec: str, input_dtype: mx.Dtype, bits: float) -> None:
    keys, values = random_kv(n_kv_heads=2, n_tokens=512, head_dim=64, dtype=input_dtype)
    caches = parse_spec(spec).factory_for_shape(n_layers=3, head_dim=64)()
    for cache in caches:
        cache.update_and_fetch(keys, values)
    mx.eval([cache.state for cache in caches])
    held = array_bytes(caches)
    assert effective_bits_from_bytes(held, 512, n_layers=3, n_kv_heads=2, head_dim=64) == pytest.approx(bits)


def test_the_memory_benchmark_reads_a_cache_as_it_holds_it_while_decoding() -> None:
    """`memory.fill` feeds 1,024-token chunks and then the checkpoint's last token on its own (as mlx-lm's generate_step
    feeds a prompt), so the room a compressed store grows for the next chunks during a prefill is given back, and the
    room it then keeps for the next decode steps is given back before the bytes are read: at 2,048 tokens affine:4
    holds exactly what its formula gives (a whole number of 256-token steps), not the room of three more chunks nor
    an eighth more tokens."""
    from benchmarks.harness.memory import held_bytes_curve
    from engine.kvcache import get_method

    keys, values = random_kv(n_kv_heads=2, n_tokens=2048, head_dim=64, dtype=mx.bfloat16)
    spec = parse_spec("affine:k4v4:g64")
    rows = held_bytes_curve(spec, [keys], [values], [1024, 2048], mx.bfloat16)
    config = spec.factory_for_shape(n_layers=1, head_dim=64)()[0].config
    for row in rows:
        assert row["held_bytes"] == get_method("affine").expected_nbytes(config, 64, row["tokens"], 2)



def test_paired_difference_uses_block_means() -> None:
    reference = np.zeros(256)
    values = np.repeat([0.1, 0.3, 0.1, 0.3], 64)  # four blocks with means 0.1, 0.3, 0.1, 0.3
    result = paired_difference(values, reference, block=64)
    assert result["mean"] == pytest.approx(0.2)
    assert result["blocks"] == 4
    assert result["se"] == pytest.approx(np.std([0.1, 0.3, 0.1, 0.3], ddof=1) / 2)
    few = paired_difference(np.array([1.0, 2.0, 3.0]), np.zeros(3), block=64)
    assert few["blocks"] == 0 and few["se"] == pytest.approx(np.std([1, 2, 3], ddof=1) / np.sqrt(3))


def test_pareto_front() -> None:
    points = [(16.0, 0.0), (8.5, 0.001), (5.0, 0.14), (4.5, 0.06), (4.0, 0.2), (3.3, 0.25), (3.5, 0.28), (4.5, 0.06)]
    front = pareto_front(points)
    assert front == [5, 4, 3, 1, 0]  # sorted by bits; (5.0, 0.14) and (3.5, 0.28) are dominated
    assert pareto_front([]) == []


def test_summarize() -> None:
    assert summarize([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert summarize([])["n"] == 0


# ----- specs --------------------------------------------------------------------------------------------------


def test_spec_parsing_and_labels() -> None:
    spec = parse_spec("rotated:k3v2:g32:w128:s4")
    assert (spec.family, spec.method, spec.key_bits, spec.value_bits, spec.group_size) == ("velox", "rotated", 3, 2, 32)
    assert (spec.residual_window, spec.sink_tokens) == (128, 4)
    assert spec.label == "rotated K3/V2 g32 w128 s4"
    assert spec.options == {"prefill_attention": "auto"}  # the harness's default for compressed caches
    assert spec.velox_config() == KVCacheConfig.parse("rotated:k3v2:g32:w128:s4:prefill_attention=auto")
    assert spec.canonical == "rotated:k3v2:g32:w128:s4"
    assert parse_spec("affine:k4v4:prefill_attention=fused").options == {"prefill_attention": "fused"}
    assert parse_spec("fp16").options == {} and parse_spec("fp16").nominal_bits == 16
    assert parse_spec("mlx-q:k4v4").label == "mlx-lm Q4 g64" and parse_spec("mlx-q:k4v4:g32").group_size == 32
    assert parse_spec("vq:turboquant_rvq:k2v2").label == "veloxquant turboquant_rvq 2-bit"
    assert parse_spec("turboquant:k4v3").nominal_bits == 3.5
    assert parse_spec("turboquant").label == "turboquant 4"  # no bits: the method's default
    for bad, fragment in (("rotated:x", "'x' is not a setting"), ("nosuchmethod:k4", "Unknown KV cache method"),
                          ("rotated:k4v4:q3", "'q3' is not a setting"), ("kivi:4:64", "'4' is not a setting"),
                          ("mlx-q:k4v2", "equal key and value bits"), ("mlx-q:k4v4:w8", "equal key and value bits"),
                          ("vq:kivi:k4v4:g32", "equal key and value bits")):
        with pytest.raises(ConfigError, match=fragment):
            parse_spec(bad)
    with pytest.raises(ConfigError, match="twice"):
        parse_specs("fp16,fp16")


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("fp16", "fp16"),
        ("kivi:4:64", "kivi:k4v4:g64"),
        ("kivi:4/4:64", "kivi:k4v4:g64"),
        ("rotated:3/2:32+w128+s4", "rotated:k3v2:g32:w128:s4"),
        ("turboquant:3", "turboquant:k3v3"),
        ("rvq:2", "rvq:k2v2"),
        ("kivi", "kivi"),
        ("mlx-q:4", "mlx-q:k4v4"),
        ("mlx-q:4:32", "mlx-q:k4v4:g32"),
        ("mlx-kv", "mlx-kv"),
        ("vq:turboquant_rvq:2", "vq:turboquant_rvq:k2v2"),
    ],
)
def test_old_result_specs_read_as_the_cache_they_named(old: str, new: str) -> None:
    """Result files written before the one spec syntax name caches the old way; they read as the same cache, with
    the same label, as today's spelling (old compressed specs got prefill_attention=auto, as today's do)."""
    from benchmarks.harness.specs import read_legacy_spec, read_result_spec

    then, now = read_result_spec(old), parse_spec(new)
    assert then == read_legacy_spec(old) if old not in ("fp16", "mlx-kv", "kivi") else then == parse_spec(old)
    assert (then.family, then.config, then.label, then.nominal_bits) == (now.family, now.config, now.label,
                                                                         now.nominal_bits)
    assert then.text == old and then.canonical == now.canonical == parse_spec(now.canonical).canonical
    with pytest.raises(ConfigError, match="not a cache spec of the old syntax"):
        read_legacy_spec(new + ":g32" if ":" in new else new + "!")


def test_every_committed_result_spec_reads_and_round_trips() -> None:
    """Every spec named in benchmarks/results reads (old syntax or new) and its canonical spelling builds the same
    cache; the harness's default lists use today's syntax only."""
    from benchmarks.harness import specs as spec_lists
    from benchmarks.harness.common import ROOT
    from benchmarks.harness.specs import read_legacy_spec, read_result_spec

    def spec_texts(node: object, in_switch: bool = False) -> set[str]:
        found: set[str] = set()
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "spec" and isinstance(value, str):
                    found.add(value)
                if in_switch and isinstance(value, dict) and "label" in value:
                    found.add(key)
                found |= spec_texts(value, in_switch or key == "switch")
        elif isinstance(node, list):
            for item in node:
                found |= spec_texts(item, in_switch)
        return found

    texts: set[str] = set()
    for path in (ROOT / "benchmarks" / "results").rglob("*.json"):
        texts |= spec_texts(json.loads(path.read_text()))
    texts.discard("no-history")  # decode.py's ceiling row: no cache at all (benchmarks/decode.py, NO_HISTORY)
    assert len(texts) > 40 and "kivi:4:64" in texts and "mlx-q:4" in texts
    for text in texts:
        spec = read_result_spec(text)
        again = parse_spec(spec.canonical)
        assert (again.family, again.config, again.label) == (spec.family, spec.config, spec.label), text
    lists = [getattr(spec_lists, name) for name in dir(spec_lists) if name.endswith("_SPECS") or name.endswith("_QUICK")]
    for text in {text for names in lists for text in names} - {"fp16", "fp32", "mlx-kv"}:
        assert parse_spec(parse_spec(text).canonical).config == parse_spec(text).config
        with pytest.raises(ConfigError):
            read_legacy_spec(text)  # today's syntax only


def test_default_spec_lists_are_valid_for_the_default_model() -> None:
    for spec in parse_specs(sorted(set(QUALITY_SPECS + SPEED_SPECS))):
        if spec.family == "velox":
            spec.velox_config().validate(64)


def test_level_specs_follow_the_level_table() -> None:
    """The sweep runs each level as the rule chose it: LEVEL_TABLE's spec without the options it takes on a GPU."""
    from benchmarks.harness.cli import level_specs
    from benchmarks.harness.levels import DEVICE_OPTIONS
    from engine.planning.recommend import LEVELS

    specs = level_specs()
    compressed = [level for level in LEVELS if level.config.method not in ("fp16", "fp32")]
    assert len(specs) == len(compressed)
    for text, level in zip(specs, compressed, strict=True):
        spec = parse_spec(text)
        chosen = {k: v for k, v in level.config.options.items() if DEVICE_OPTIONS.get(k) != v}
        assert spec.config == replace(level.config, options={**chosen, "prefill_attention": "auto"})
    assert any("rope" in level.config.options for level in compressed)  # the table does carry device options


# ----- quality bookkeeping ------------------------------------------------------------------------------------


class _DigitTokenizer:
    """Characters as token ids (enough for building needle prompts)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(i) for i in ids]


def test_needle_prompt_places_the_needle_and_keeps_the_length() -> None:
    tokenizer = _DigitTokenizer()
    haystack = tokenizer.encode("Some words here. " * 200)
    for depth in (0.0, 0.5, 1.0):
        prompt, answer, facts = needle_prompt(tokenizer, haystack, 1500, depth, seed=7)
        text = "".join(chr(t) for t in prompt)
        assert len(prompt) == 1500
        needle = f"The special magic number for {facts['key']} is {facts['number']}."
        assert text.count(needle) == 1
        assert text.endswith(f"Answer: The special magic number for {facts['key']} is")
        assert "".join(chr(t) for t in answer) == f" {facts['number']}"
        position = text.index(needle) - 1  # the needle starts with a newline
        assert facts["needle_token"] == position
        n_hay = len(text) - len(needle) - 2 - (len(text) - text.index("\n\nQuestion:"))
        if depth == 0.0:
            assert position == 0
        elif depth == 0.5:  # just after the first sentence end at or past the middle
            assert text[position - 1] == "." and n_hay // 2 <= position <= n_hay // 2 + 64
        else:
            assert position == n_hay and text[position + len(needle) + 2 :].startswith("\n\nQuestion:")
    same_seed = [needle_prompt(tokenizer, haystack, n, 0.5, seed=7)[2]["number"] for n in (800, 1200)]
    assert same_seed[0] == same_seed[1]


def test_combine_needle_and_agreement() -> None:
    specs = parse_specs("fp16,rotated:k4v4:g64")
    trials = [
        {"length": 1024, "depth": d, "seed": 0, "text": "t",
         "results": {"fp16": {"answer_logprob": -1.0, "exact": True},
                     "rotated:k4v4:g64": {"answer_logprob": lp, "exact": ok}}}
        for d, lp, ok in ((0.0, -1.5, True), (1.0, -3.0, False))
    ]
    summary = {row["spec"]: row for row in combine_needle(trials, specs)["summary"]}
    assert summary["fp16"]["recall"] == 1.0 and summary["rotated:k4v4:g64"]["recall"] == 0.5
    assert summary["rotated:k4v4:g64"]["delta_logprob"] == pytest.approx(-1.25)
    assert summary["rotated:k4v4:g64"]["by_depth"]["1"]["recall"] == 0.0

    generations = {"fp16": [[1, 2, 3, 4], [5, 6, 7, 8]], "rotated:k4v4:g64": [[1, 2, 9, 4], [5, 6, 7, 8]]}
    rows = {row["spec"]: row for row in combine_agreement(generations, specs)}
    assert rows["rotated:k4v4:g64"]["match_rate"] == pytest.approx((2 / 4 + 1) / 2)
    assert rows["rotated:k4v4:g64"]["mean_first_divergence"] == pytest.approx(3.0)
    assert rows["rotated:k4v4:g64"]["identical"] == 0.5
    assert rows["rotated:k4v4:g64"]["positionwise_agreement"] == pytest.approx((3 / 4 + 1) / 2)


def test_combine_perplexity_pools_windows() -> None:
    specs = parse_specs("fp16,affine:k4v4:g64")
    rng = np.random.default_rng(0)
    window_list = []
    for _ in range(2):
        base = rng.normal(3.0, 1.0, 128)
        window_list.append({
            "fp16": {"nll": base.tolist(), "kl": [0.0] * 128, "top1": [1] * 128, "seconds": 1.0,
                     "held_bytes": 1000 * 2 * 16 // 8, "tokens": 1000},
            "affine:k4v4:g64": {"nll": (base + 0.05).tolist(), "kl": [0.01] * 128, "top1": [1, 0] * 64, "seconds": 1.0,
                            "held_bytes": 1000 * 2 * 4.5 // 8, "tokens": 1000},
        })
    rows = {row["spec"]: row for row in combine_perplexity(window_list, specs, n_layers=1, n_kv_heads=1, head_dim=1)}
    row = rows["affine:k4v4:g64"]
    assert row["scored_tokens"] == 256
    assert row["delta_nll"] == pytest.approx(0.05) and row["delta_nll_se"] == pytest.approx(0.0, abs=1e-12)
    assert row["ppl_ratio"] == pytest.approx(np.exp(0.05))
    assert row["top1_agreement"] == 0.5 and row["mean_kl"] == pytest.approx(0.01)
    assert row["effective_bits"] == pytest.approx(4.5)  # bytes x 8 / (tokens x K,V x layers x heads x dim)


def test_windows_are_evenly_spaced_and_full_length() -> None:
    streams = {"a": list(range(10_000)), "b": list(range(500))}
    chosen = windows(streams, 1000, per_text=3)
    assert [name for name, _, _ in chosen] == ["a", "a", "a"]  # b is too short for a window
    assert all(len(tokens) == 1000 for _, _, tokens in chosen)
    assert chosen[0][1] == 500 and chosen[-1][1] == 9000


# ----- result files and the report ----------------------------------------------------------------------------


def test_result_files_and_report(tmp_path: Path) -> None:
    quality = {
        "machine": {"platform": "test"}, "model": {"name": "tiny"},
        "perplexity": {
            "settings": {"window": 256, "score_from": 128, "chunk": 64, "windows": [{"text": "t", "start": 0, "tokens": 256}],
                         "se": "batch means"},
            "rows": [
                {"spec": "fp16", "label": "fp16", "family": "velox", "method": "fp16", "effective_bits": 16.0,
                 "delta_nll": 0.0, "delta_nll_se": 0.0, "ppl_ratio": 1.0, "mean_kl": 0.0, "top1_agreement": 1.0,
                 "scored_tokens": 127},
                {"spec": "affine:4:64", "label": "affine 4 g64", "family": "velox", "method": "affine",
                 "effective_bits": 4.5, "delta_nll": 0.07, "delta_nll_se": 0.01, "ppl_ratio": 1.0725,
                 "mean_kl": 0.06, "top1_agreement": 0.86, "scored_tokens": 127},
            ],
        },
    }
    path = write_result(tmp_path, "quality", True, quality)
    assert path.name == "quality-quick.json"
    record = json.loads(path.read_text())
    assert record["schema"] == SCHEMA and record["kind"] == "quality" and record["quick"] is True
    assert record["created"].endswith("Z")
    write_result(tmp_path, "quality", False, {**quality, "model": {"name": "full"}})
    assert read_result(tmp_path, "quality")["model"]["name"] == "full"  # full runs win over quick ones
    assert read_result(tmp_path, "quality", prefer_full=False)["quick"] is True
    assert read_result(tmp_path, "speed") is None

    from benchmarks.harness.report import write_report

    markdown = tmp_path / "BENCHMARKS.md"
    written = write_report(tmp_path, markdown, tmp_path / "figures")
    text = markdown.read_text()
    assert written[0] == markdown
    assert "| **affine 4 g64** ★ | 4.50 |" in text
    assert "+0.0700 ± 0.0100" in text and "+7.25 %" in text
    assert "Not run yet (`velox bench speed`)." in text


# ----- the report on the committed results, and README's quoted numbers -------------------------------------------

COMMITTED = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
README = Path(__file__).resolve().parents[1] / "README.md"


def _prefill_run(name: str) -> tuple[list[dict], float]:
    """A committed GPU run's prefill rows and its fp16 row's prefill tok/s."""
    rows = json.loads((COMMITTED / name).read_text())["prefill"]
    return rows, next(r for r in rows if r["spec"] == "fp16")["prefill_tok_s"]


def _assert_gpu_level(row: dict, key: str) -> None:
    """The row's spec is the app's level `key` as a GPU builds it for the 8B shape (its wide layers, keys before RoPE
    where the level stores them so), device options aside."""
    from benchmarks.harness.levels import without_device_options
    from engine.planning.recommend import level_by_key

    spec = row["spec"].replace(":wide_layers=L1.10.18", "").replace(":rope=pre", "")
    assert KVCacheConfig.parse(spec) == without_device_options(level_by_key(key).config), (row["spec"], key)


def _check_tables(text: str) -> int:
    """Every markdown table has the same number of cells in each line (a stray '|' breaks a table)."""
    tables = 0
    block: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if block:
            widths = {row.count("|") for row in block}
            assert len(widths) == 1, f"ragged table starting {block[0]!r}"
            assert set(block[1].replace("|", "")) == {"-"}, f"no header rule under {block[0]!r}"
            tables += 1
            block = []
    return tables


def _write_committed_report(tmp_path: Path) -> str:
    from benchmarks.harness.report import write_report

    markdown = tmp_path / "BENCHMARKS.md"
    write_report(COMMITTED, markdown, tmp_path / "figures")
    return markdown.read_text()


def test_report_on_the_committed_results_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    text = _write_committed_report(tmp_path)
    assert not (tmp_path / "figures").exists()
    assert "Figure not drawn: matplotlib is not installed" in text
    assert "![" not in text
    assert _check_tables(text) >= 10
    # Each section names the file it reads: the best available one (a full run over a quick one).
    from benchmarks.harness.report import load_results

    results = load_results(COMMITTED)
    for kind, part in (("quality", "perplexity"), ("quality", "needle"), ("quality", "agreement"), ("memory", None),
                       ("gpu", None), ("speed", None)):
        source = results.best(kind, part) if part else results.best(kind)
        assert source is not None, (kind, part)
        assert source.path.name in text, (kind, part)
        assert part != "needle" or not source.quick  # the full needle run (H200) is committed
    assert "Not run yet" not in text
    assert "## How to reproduce" in text and "benchmarks/bench.py report" in text
    # Peers appear with the bits they really hold, side by side with Velox and mlx-lm.
    assert "| veloxquant kivi 4-bit | 32.01 |" in text
    assert "veloxquant-mlx (peer)" in text and "## Peers side by side" in text


def test_report_on_the_committed_results_with_figures(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks.harness.report import FIGURE_NAMES

    text = _write_committed_report(tmp_path)
    for name in FIGURE_NAMES:
        figure = tmp_path / "figures" / name
        assert figure.is_file() and figure.stat().st_size > 20_000, name
        assert f"](figures/{name})" in text
    assert "Figure not drawn" not in text


def test_report_prefers_full_runs_and_says_which_file(tmp_path: Path) -> None:
    from benchmarks.harness.report import load_results, write_report

    committed = json.loads((COMMITTED / "quality.json").read_text())
    quick = json.loads((COMMITTED / "quick" / "quality-quick.json").read_text())
    (tmp_path / "quick").mkdir()
    (tmp_path / "quality.json").write_text(json.dumps({k: v for k, v in committed.items() if k != "needle"}))
    (tmp_path / "quick" / "quality-quick.json").write_text(json.dumps(quick))
    speed_quick = json.loads((COMMITTED / "quick" / "speed-quick.json").read_text())
    (tmp_path / "quick" / "speed-quick.json").write_text(json.dumps(speed_quick))
    (tmp_path / "quick" / "speed-other.json").write_text(json.dumps(speed_quick))
    results = load_results(tmp_path)
    assert results.best("quality", "perplexity").path.name == "quality.json"
    assert results.best("quality", "needle").path.name == "quality-quick.json"  # the full run has no needle yet
    assert [s.path.name for s in results.preferred("speed")] == ["speed-quick.json", "speed-other.json"]
    # A full speed run, once written, replaces every quick one.
    (tmp_path / "speed.json").write_text(json.dumps({**speed_quick, "quick": False}))
    results = load_results(tmp_path)
    assert [s.path.name for s in results.preferred("speed")] == ["speed.json"]
    markdown = tmp_path / "BENCHMARKS.md"
    write_report(tmp_path, markdown, tmp_path / "figures")
    text = markdown.read_text()
    speed_part = text[text.index("## Speed (CPU)"):text.index("## Speed (GPU")]
    assert "`speed.json` (full run" in speed_part and "speed-quick.json" not in speed_part
    assert "`quick/quality-quick.json` (**quick run**" in text
    assert "Not run yet (`python -m benchmarks.harness.gpu`" in text


def _readme_section() -> str:
    text = README.read_text()
    start = text.index("\n## Benchmarks\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def test_readme_benchmark_block_is_what_the_report_generates() -> None:
    from benchmarks.harness.report import load_results, readme_block, readme_section

    block = readme_block(README.read_text())
    assert block, "README.md lost its benchmark markers"
    assert block == "\n".join(readme_section(load_results(COMMITTED))), (
        "README's benchmark block is stale: run `python benchmarks/bench.py report`")


def test_readme_quoted_numbers_match_the_committed_json() -> None:
    """Parse every number README's benchmark section quotes and check it against the committed JSON through
    report.py's own look-ups; a number no check accounts for fails the test."""
    import re

    from benchmarks.harness import report
    from engine.planning.recommend import level_by_key

    results = report.load_results(COMMITTED)
    quality = results.best("quality", "perplexity")
    rows = report.quality_rows(quality)
    section = _readme_section()
    checked: list[str] = []

    def close(text: str, value: float) -> bool:  # the printed digits are the value rounded
        decimals = len(text.split(".")[1]) if "." in text else 0
        return abs(float(text.replace(",", "")) - value) <= 0.51 * 10 ** -decimals

    intro = re.search(r"fed (\d+) windows of ([\d,]+) prose tokens and scored on their second halves \(([\d,]+) tokens\)",
                      section)
    assert intro, "the README no longer says what was measured"
    settings = quality.data["perplexity"]["settings"]
    assert int(intro[1]) == len(settings["windows"]) and close(intro[2], settings["window"])
    assert close(intro[3], rows[0]["scored_tokens"])
    checked.append(intro[0])

    row_pattern = re.compile(
        r"^\| (\d+)-bit \| ([^|]+?) \| (\d+\.\d+) \| ([+-]\d+\.\d+) ± (\d+\.\d+) \| ([^|]+?) \| (\d+\.\d+) \| "
        r"([+-]\d+\.\d+) ± (\d+\.\d+) \|$", re.MULTILINE)
    levels = {entry["level"].key: entry for entry in report.app_levels(rows)}
    found = row_pattern.findall(section)
    assert {key for key, *_ in found} == set(levels), "every compressed app level must be quoted"
    for key, label, bits, delta, se, mlx_label, mlx_bits, mlx_delta, mlx_se in found:
        row = report.row_by_label(rows, label)
        mlx = report.row_by_label(rows, mlx_label)
        assert row is not None and mlx is not None, (label, mlx_label)
        assert report.level_matches(row["spec"], level_by_key(key)), f"{label} is not the app's {key}-bit level"
        assert mlx["family"] == "mlx-lm" and mlx["effective_bits"] >= row["effective_bits"]
        assert levels[key]["mlx"]["spec"] == mlx["spec"]  # the cheapest mlx-lm cache with at least as many bits
        for text, value in ((bits, row["effective_bits"]), (delta, row["delta_nll"]), (se, row["delta_nll_se"]),
                            (mlx_bits, mlx["effective_bits"]), (mlx_delta, mlx["delta_nll"]),
                            (mlx_se, mlx["delta_nll_se"])):
            assert close(text, value), (label, text, value)
    checked += [m[0] for m in row_pattern.finditer(section)]

    scales = re.search(
        r"so (mlx-lm Q\d+ g\d+) holds (\d+\.\d+) bits here \((\d+\.\d+) with the 16-bit keys/values of the ([\w.-]+) "
        r"shape\)\. Velox's (.+?) is the same quantizer with fp16 scales: (\d+\.\d+) bits, Δ NLL ([+-]\d+\.\d+) ± "
        r"(\d+\.\d+)\.", section)
    assert scales
    mlx, same = report.row_by_label(rows, scales[1]), report.row_by_label(rows, scales[5])
    model, bf16_bits = report.large_shape_bits(results.best("memory"), mlx["spec"])
    assert scales[4] == model and close(scales[3], bf16_bits) and close(scales[2], mlx["effective_bits"])
    assert same["method"] == "affine" and same["spec"].split(":")[1] == mlx["spec"].split(":")[1]
    assert close(scales[6], same["effective_bits"]) and close(scales[7], same["delta_nll"])
    assert close(scales[8], same["delta_nll_se"])
    checked.append(scales[0])

    gpu = re.search(r"over a ([\d,]+)-token cache in (\d+) Llama-3\.1-8B-shaped layers takes ([\d,.]+) ms with fp16, "
                    r"([\d,.]+) ms with (.+?) and ([\d,.]+) ms with (.+?) \(", section)
    assert gpu
    context = int(gpu[1].replace(",", ""))
    _, at_context = report.gpu_rows_at(results.best("gpu"), context)
    by_label = {r["label"]: r for r in at_context}
    assert int(gpu[2]) == results.best("gpu").data["shape"]["layers"]
    for text, label in ((gpu[3], "fp16"), (gpu[4], gpu[5]), (gpu[6], gpu[7])):
        assert close(text, by_label[label]["ms_median"]), (label, text)
    assert by_label[gpu[5]]["ms_median"] == min(r["ms_median"] for r in at_context if r["spec"] != "fp16"
                                                and not r["spec"].startswith("mlx-"))
    checked.append(gpu[0])

    speed = re.search(r"Chat speed with MLX on the CPU \((.+?), ([\d,]+)-token prompt\): prefill (\d+\.\d) tok/s and "
                      r"decode (\d+\.\d) tok/s through Velox's CPU fast path, against (\d+\.\d) and (\d+\.\d) for stock "
                      r"MLX, with the same generated text", section)
    assert speed
    core = results.best("engine_core").data
    fast, stock = core["runs"]["fast path"], core["runs"]["stock"]
    assert speed[1] == core["machine"] and core["identical_text"] is True
    assert close(speed[2], fast["prompt_tokens"])
    for text, value in ((speed[3], fast["prefill_tok_s"]), (speed[4], fast["decode_tok_s"]),
                        (speed[5], stock["prefill_tok_s"]), (speed[6], stock["decode_tok_s"])):
        assert close(text, value), (text, value)
    checked.append(speed[0])

    def recall(data: dict, spec: str) -> float:
        """Needle recall in % of the cache named `spec` (either syntax) in a committed needle run."""
        trials = data["needle"]["trials"]
        name = next(n for n in trials[0]["results"]
                    if n == "fp16" == spec or n != "fp16" != spec and KVCacheConfig.parse(n) == KVCacheConfig.parse(spec))
        return 100 * sum(t["results"][name]["exact"] for t in trials) / len(trials)

    def held_out(name: str, spec: str) -> float:
        rows = json.loads((COMMITTED / name).read_text())["rows"]
        return 100 * next(r["ppl_change"] for r in rows if KVCacheConfig.parse(r["spec"]) == KVCacheConfig.parse(spec))

    from benchmarks.harness.levels import without_device_options

    plain_needle = results.best("quality", "needle").data
    two = re.search(r"On the embedded model it\s+loses ([+\d.]+) % perplexity on (\d)k-token windows of held-out prose with "
                    r"keys as given and ([+\d.]+) % before RoPE, where\s+the 2-bit level it replaced lost ([+\d.]+) % and "
                    r"([+\d.]+) % .+? On an H200 its needle recall is ([\d.]+) % \(fp16: ([\d.]+) %; the level it "
                    r"replaced: ([\d.]+) %\),\s+and it decodes .+? at (\d\.\d\d)×, (\d\.\d\d)× and (\d\.\d\d)× of "
                    r"the 16-bit cache's\s+speed at 8k, 32k and 131k tokens, where the level it replaced ran at "
                    r"(\d\.\d\d)×, (\d\.\d\d)× and (\d\.\d\d)× in the same run\s+"
                    r"\(`benchmarks/results/decode-key-widths-r6-h200.json`; BENCHMARKS.md, \*round 15\*\)\. The 4-bit "
                    r"level keeps its\s+keys as given on every device: in that run it decoded at "
                    r"(\d\.\d\d)× with keys before RoPE and (\d\.\d\d)× as given at 8k\s+tokens.+? A (\d\d),(\d\d\d)-token "
                    r"prefill into the 4-bit level\s+ran at (\d\.\d\d)× of the 16-bit cache's speed there, against "
                    r"(\d\.\d\d)× for the 4-bit level it replaced\..+? the 4-bit level prefills at (\d\.\d\d)× "
                    r"\((\d\.\d\d)× without that room, in the same run; the 3-bit level, keys before RoPE,\s+"
                    r"at (\d\.\d\d)×, `benchmarks/results/prefill-room-ahead-h200.json`; BENCHMARKS.md, \*round 16\*\)\. "
                    r"On a GPU the levels' encode\s+now runs compiled into fused kernels: the 3-bit level prefills at "
                    r"(\d\.\d\d)× \((\d\.\d\d)× with its encode eager, in the same run\)\s+and the 2-bit level at "
                    r"(\d\.\d\d)× \((\d\.\d\d)×\), the 4-bit level at (\d\.\d\d)× in that run\s+"
                    r"\(`benchmarks/results/prefill-compiled-encode-h200.json`; BENCHMARKS.md, \*round 17\*\): every "
                    r"level's prefill is still\s+short of 0\.8× \(issue 11\)\. KIVI's history is now decoded in tiles on "
                    r"a GPU, and in the last run the 4-bit level\s+prefilled at (\d\.\d\d)× \((\d\.\d\d)× with the former "
                    r"kernel, in the same run\), the 3-bit level at (\d\.\d\d)× \((\d\.\d\d)×\) and the 2-bit\s+level at "
                    r"(\d\.\d\d)× \((\d\.\d\d)×\) \(`benchmarks/results/prefill-tiled-history-h200.json`; "
                    r"BENCHMARKS.md, \*round 18\*\)\. Ratios\s+drift between runs by more than that kernel's gain: the 3- "
                    r"and 2-bit levels are still short of 0\.8×\.", section, re.S)
    assert two, "README no longer quotes the 2-bit level's figures (held out, needle, decode) and the levels' GPU speed"
    level2 = level_by_key("2").config
    assert level2.options["rope"] == "auto" == level_by_key("3").config.options["rope"]
    assert "rope" not in level_by_key("4").config.options
    replaced2 = "kivi:k2v2:g64:s4:key_block=128:clip_search=true:rotate_values=true:wide=0.1"
    assert KVCacheConfig.parse(replaced2 + ":key_widths=calibrated") == without_device_options(level2)
    for text, name, spec in ((two[1], "near_lossless_2bit_widths_twomeans_4k.json", replaced2 + ":key_widths=calibrated"),
                             (two[3], "near_lossless_2bit_widths_twomeans_4k.json",
                              replaced2 + ":rope=pre:key_widths=calibrated"),
                             (two[4], "near_lossless_2bit_4k.json", replaced2),
                             (two[5], "near_lossless_2bit_4k.json", replaced2 + ":rope=pre")):
        assert close(text, held_out(name, spec)), (text, spec)
    assert int(two[2]) * 1024 == 4096
    use2 = json.loads((COMMITTED / "quality-use-widths-pre-h200.json").read_text())
    ran2 = next(n for n in use2["needle"]["trials"][0]["results"] if n != "fp16")
    assert "rope=pre" in ran2 and KVCacheConfig.parse(ran2).key_bits == 2 and "key_widths" in ran2
    assert close(two[6], recall(use2, ran2)) and close(two[6], recall(plain_needle, str(without_device_options(level2))))
    assert close(two[7], recall(use2, "fp16")) and close(two[7], recall(plain_needle, "fp16"))
    old2 = json.loads((COMMITTED / "quality-use-2bit-rope-h200.json").read_text())
    assert close(two[8], recall(old2, replaced2 + ":wide_layers=L1.2.10:rope=pre"))
    r6 = json.loads((COMMITTED / "decode-key-widths-r6-h200.json").read_text())
    for index, context in enumerate((8193, 32769, 131073)):
        at = [r for r in r6["rows"] if r["context"] == context and KVCacheConfig.parse(r["spec"]).key_bits == 2]
        mine = next(r["vs_fp16"] for r in at if "key_widths" in r["spec"])
        before = next(r["vs_fp16"] for r in at if "key_widths" not in r["spec"])
        assert all("rope=pre" in r["spec"] for r in at)
        assert close(two[9 + index], mine) and close(two[12 + index], before), (context, at)
    four = {("rope=pre" in r["spec"]): r["vs_fp16"] for r in r6["rows"]
            if r["context"] == 8193 and KVCacheConfig.parse(r["spec"]).key_bits == 4}
    assert close(two[15], four[True]) and close(two[16], four[False])
    prefill = {(("key_widths" in r["spec"]), ("rope=pre" in r["spec"]), tuple(r.get("kernel_constants", {}))): r
               for r in r6["prefill"] if r["spec"] != "fp16" and KVCacheConfig.parse(r["spec"]).key_bits == 4}
    fp16_prefill = next(r for r in r6["prefill"] if r["spec"] == "fp16")
    assert fp16_prefill["context"] == int(two[17] + two[18])
    # the level as a GPU runs it now: keys as given, the history decoded by the widths kernel (admitted since)
    from engine.kvcache.kernels.dequantize import WIDTH_HISTORY_BACKENDS

    assert "cuda" in WIDTH_HISTORY_BACKENDS
    level_row = prefill[(True, False, ("WIDTH_HISTORY_BACKENDS",))]
    assert close(two[19], level_row["prefill_tok_s"] / fp16_prefill["prefill_tok_s"])
    assert close(two[20], prefill[(False, True, ())]["prefill_tok_s"] / fp16_prefill["prefill_tok_s"])
    # with room grown ahead for prefill chunks (PREFILL_AHEAD_CHUNKS), and without it in the same run
    ahead, ahead_fp16 = _prefill_run("prefill-room-ahead-h200.json")
    as_levels = {(KVCacheConfig.parse(r["spec"]).key_bits, "rope=pre" in r["spec"],
                  r.get("kernel_constants", {}).get("PREFILL_AHEAD_CHUNKS")): r for r in ahead if r["spec"] != "fp16"}
    for bits, pre in ((4, False), (3, True)):  # the levels' layouts as a GPU builds them (wide layers of the 8B shape)
        _assert_gpu_level(as_levels[bits, pre, None], str(bits))
    assert close(two[21], as_levels[4, False, None]["prefill_tok_s"] / ahead_fp16)
    assert close(two[22], as_levels[4, False, 0]["prefill_tok_s"] / ahead_fp16)
    assert close(two[23], as_levels[3, True, None]["prefill_tok_s"] / ahead_fp16)
    # the encode compiled on a GPU, and eager in the same run (COMPILE_ENCODE=false)
    compiled, compiled_fp16 = _prefill_run("prefill-compiled-encode-h200.json")
    by_bits = {(KVCacheConfig.parse(r["spec"]).key_bits, r.get("kernel_constants", {}).get("COMPILE_ENCODE", True)): r
               for r in compiled if r["spec"].startswith("kivi")}
    for bits in (4, 3, 2):  # the levels as a GPU builds them
        _assert_gpu_level(by_bits[bits, True], str(bits))
    for text, key in ((two[24], (3, True)), (two[25], (3, False)), (two[26], (2, True)), (two[27], (2, False)),
                      (two[28], (4, True))):
        assert close(text, by_bits[key]["prefill_tok_s"] / compiled_fp16), (text, key)
    # KIVI's history decoded in tiles, and its former per-thread kernel in the same run (KIVI_TILED_HISTORY=false)
    tiled, tiled_fp16 = _prefill_run("prefill-tiled-history-h200.json")
    by_kernel = {(KVCacheConfig.parse(r["spec"]).key_bits, r.get("kernel_constants", {}).get("KIVI_TILED_HISTORY", True)):
                 r for r in tiled if r["spec"].startswith("kivi")}
    for bits in (4, 3, 2):
        _assert_gpu_level(by_kernel[bits, True], str(bits))
    for index, key in enumerate(((4, True), (4, False), (3, True), (3, False), (2, True), (2, False))):
        assert close(two[29 + index], by_kernel[key]["prefill_tok_s"] / tiled_fp16), (two[29 + index], key)
    checked.append(two[0])

    encoded = re.search(r"KIVI's chunks\s+are now encoded in one launch on a GPU: in the last run the 3-bit level prefilled "
                        r"at (\d\.\d\d)× of the 16-bit cache's speed\s+\((\d\.\d\d)× with MLX's encode, in the same "
                        r"run\) and the 4-bit level at (\d\.\d\d)× \((\d\.\d\d)×\)\s+"
                        r"\(`benchmarks/results/prefill-kivi-encode-h200.json`;", section, re.S)
    assert encoded, "README no longer quotes the levels' prefill with KIVI's encode kernel"
    run, run_fp16 = _prefill_run("prefill-kivi-encode-h200.json")
    by_encode = {(KVCacheConfig.parse(r["spec"]).key_bits, "KIVI_ENCODE_BACKENDS" in r.get("kernel_constants", {})): r
                 for r in run if r["spec"].startswith("kivi")}
    for index, key in enumerate(((3, True), (3, False), (4, True), (4, False))):
        _assert_gpu_level(by_encode[key], str(key[0]))
        assert close(encoded[1 + index], by_encode[key]["prefill_tok_s"] / run_fp16), (encoded[1 + index], key)
    from engine.kvcache.kernels.kivi_encode import CLIP_SEARCH_BACKENDS, KIVI_ENCODE_BACKENDS

    assert "cuda" in KIVI_ENCODE_BACKENDS and "cuda" in CLIP_SEARCH_BACKENDS
    round19 = re.match(r"\s*BENCHMARKS.md, \*round 19\*\)\.", section[encoded.end():])
    assert round19
    checked.append(section[encoded.start():encoded.end() + round19.end()])

    clip = re.search(r"The kernel now runs the 2-bit\s+level's clip search too \(its GPU parity test holds every group's "
                     r"error to the reference's\): that level then\s+prefilled at (\d\.\d\d)× of the 16-bit cache's "
                     r"speed, (\d\.\d\d)× before \(`benchmarks/results/prefill-clip-admitted-h200.json`;\s+"
                     r"BENCHMARKS.md, \*round 20\*\)\.", section, re.S)
    assert clip, "README no longer quotes the 2-bit level's prefill with the kernel's clip search"
    admitted, admitted_fp16 = _prefill_run("prefill-clip-admitted-h200.json")
    with_clip = next(r for r in admitted if r.get("kernel_constants", {}).get("CLIP_SEARCH_BACKENDS") == ["cuda"])
    _assert_gpu_level(with_clip, "2")
    assert close(clip[1], with_clip["prefill_tok_s"] / admitted_fp16)
    assert close(clip[2], by_encode[(2, False)]["prefill_tok_s"] / run_fp16)
    checked.append(clip[0])

    chunk = re.search(r"On a GPU the app now prefills in chunks of 2,048 tokens where the memory\s+check allows, not 512: "
                      r"fed the app's pipelined way, the 4-, 3- and 2-bit levels then prefilled at (\d\.\d\d)×, "
                      r"(\d\.\d\d)× and\s+(\d\.\d\d)× of the 16-bit cache's speed, against (\d\.\d\d)×, "
                      r"(\d\.\d\d)× and (\d\.\d\d)× in 512-token chunks\s+"
                      r"\(`benchmarks/results/prefill-app-chunk-h200.json`; BENCHMARKS.md, \*round 21\*\)\.", section, re.S)
    assert chunk, "README no longer quotes the app's GPU prefill chunk against 512"
    from engine.planning.recommend import GPU_PREFILL_CHUNKS

    quoted = iter(chunk.groups())
    for size in (GPU_PREFILL_CHUNKS[0], 512):
        (rows,) = (run["prefill"] for run in json.loads((COMMITTED / "prefill-app-chunk-h200.json").read_text())["runs"]
                   if {r["prefill_chunk"] for r in run["prefill"]} == {size})
        fp16 = next(r for r in rows if r["spec"] == "fp16")["pipelined_prefill_tok_s"]
        for key, row in zip(("4", "3", "2"), (r for r in rows if r["spec"] != "fp16"), strict=True):
            _assert_gpu_level(row, key)
            assert close(next(quoted), row["pipelined_prefill_tok_s"] / fp16), (size, key)
    checked.append(chunk[0])

    sketch = re.search(r"qjl, whose keys are a sketch's sign\s+bits, now rebuilds the history a prefill chunk attends over "
                       r"on the GPU's matrix units: qjl:k4v4:g64 then prefilled at\s+(\d\.\d\d)× of the 16-bit cache's "
                       r"speed, (\d\.\d\d)× through float32 sign rows in the same run\s+"
                       r"\(`benchmarks/results/prefill-sketch-mma-h200.json`; BENCHMARKS.md, \*round 22\*\)\.", section,
                       re.S)
    assert sketch, "README no longer quotes qjl's prefill with its history on the matrix units"
    from engine.kvcache.kernels.dequantize import SKETCH_MMA_BACKENDS

    assert "cuda" in SKETCH_MMA_BACKENDS
    run, run_fp16 = _prefill_run("prefill-sketch-mma-h200.json")
    by_path = {tuple(r.get("kernel_constants", {})): r for r in run if r["spec"] == "qjl:k4v4:g64"}
    assert close(sketch[1], by_path["SKETCH_MMA_BACKENDS",]["prefill_tok_s"] / run_fp16)
    assert close(sketch[2], by_path[()]["prefill_tok_s"] / run_fp16)
    checked.append(sketch[0])

    copy_now = re.search(r"A growth of a cache's buffers now\s+copies one layer at a time, and the 16-bit cache grows "
                         r"ahead for the next chunks too: in the run that timed it the\s+4-bit level prefilled at "
                         r"(\d\.\d\d)× of the 16-bit cache's speed \((\d\.\d\d)× fed the app's pipelined way\), "
                         r"against (\d\.\d\d)×\s+\((\d\.\d\d)×\) with both caches as they were "
                         r"\(`benchmarks/results/prefill-copy-now-h200.json`; BENCHMARKS.md, \*round 28\*\)\.",
                         section, re.S)
    assert copy_now, "README no longer quotes the levels' prefill with a growth's copies made one layer at a time"
    run, _ = _prefill_run("prefill-copy-now-h200.json")
    by_way = {(r["spec"].split(":")[0], tuple(r.get("kernel_constants", {}))): r for r in reversed(run)}
    new_fp16, old_fp16 = by_way["fp16", ()], by_way["fp16", ("COPY_BUFFERS_NOW", "PREFILL_AHEAD_CHUNKS")]
    new_level, old_level = by_way["kivi", ()], by_way["kivi", ("COPY_BUFFERS_NOW",)]
    assert run[0] is new_fp16  # the first of the run's two rows as shipped
    _assert_gpu_level(new_level, "4")
    _assert_gpu_level(old_level, "4")
    for quoted, (level, fp16, key) in zip(copy_now.groups(), (
            (new_level, new_fp16, "prefill_tok_s"), (new_level, new_fp16, "pipelined_prefill_tok_s"),
            (old_level, old_fp16, "prefill_tok_s"), (old_level, old_fp16, "pipelined_prefill_tok_s")), strict=True):
        assert close(quoted, level[key] / fp16[key]), (quoted, key)
    checked.append(copy_now[0])

    def check_level_ratios(run: dict, context: int, ratios: list[str] | tuple[str, ...], name: str,
                           keys: tuple[str, ...] = ("4", "3", "2")) -> None:
        """The levels' (`keys`) loop ratios to fp16 quoted at `context`, against their rows of `run`."""
        levels = [r for r in run["rows"] if r["context"] == context and r["spec"].startswith("kivi:")]
        for key, text, row in zip(keys, ratios, levels, strict=True):
            _assert_gpu_level(row, key)
            assert close(text, row["gen_vs_fp16"]), (name, context, key)

    loop = re.search(r"In mlx-lm's own decode loop, the one the app runs, over 128 tokens \(a key block's cycle\): on an "
                     r"H200 the 4-, 3- and\s+2-bit levels decoded at (\d\.\d\d)×, (\d\.\d\d)× and (\d\.\d\d)× of the "
                     r"16-bit cache's tokens per second at (\d),(\d\d\d) tokens, (\d\.\d\d)×, (\d\.\d\d)×\s+and "
                     r"(\d\.\d\d)× at (\d\d),(\d\d\d) and (\d\.\d\d)×, (\d\.\d\d)× and (\d\.\d\d)× at (\d\d\d),(\d\d\d) "
                     r"\(`benchmarks/results/decode-long-tile-h200.json`\); a second\s+run, in another lease, had "
                     r"(\d\.\d\d)×, (\d\.\d\d)× and (\d\.\d\d)× at (\d\d),(\d\d\d) "
                     r"\(`benchmarks/results/decode-long-tile-r2-h200.json`\):\s+the ratios move between leases "
                     r"\(below\)\. At long contexts the GPU is the bound, and the levels' decode kernel\s+decides: "
                     r"on CUDA it "
                     r"now takes (\d+)-token tiles from (\d+)k tokens, and the 4-bit level's takes (\d\.\d\d) ms for 32 "
                     r"layers at\s+(\d\d\d),(\d\d\d) tokens against (\d\.\d\d) ms with (\d+)-token tiles "
                     r"\(`benchmarks/results/gpu-timeline-tile128-131k-h200.json`;\s+BENCHMARKS.md, \*round 25\*\), still "
                     r"more than cuDNN's attention over the 16-bit cache \(~(\d\.\d) ms\)\. That kernel is what\s+issue "
                     r"11's long-context targets in mlx-lm's loop now wait on\.", section, re.S)
    assert loop, "README no longer quotes the levels' speed in mlx-lm's decode loop"
    quoted = iter(loop.groups())
    for name, runs in (("decode-long-tile-h200.json", 3), ("decode-long-tile-r2-h200.json", 1)):
        run = json.loads((COMMITTED / name).read_text())
        assert run["steps"] == 128 and not run["kernel_constants"]
        for _ in range(runs):
            ratios = [next(quoted) for _ in range(3)]
            check_level_ratios(run, int(next(quoted) + next(quoted)), ratios, name)
    from engine.kvcache.kernels.decode import TILED_LONG_TILES, TILED_MAX_TILE

    long_tile, _, long_from = TILED_LONG_TILES["cuda"]
    assert (int(next(quoted)), int(next(quoted)) * 1024) == (long_tile, long_from)
    with_long, context, without, short_tile = float(next(quoted)), int(next(quoted) + next(quoted)), \
        float(next(quoted)), int(next(quoted))
    assert short_tile == TILED_MAX_TILE
    rows = json.loads((COMMITTED / "gpu-timeline-tile128-131k-h200.json").read_text())["rows"]

    def tiled_pass(row: dict) -> float:
        return next(v["ms"] for k, v in row["step"]["by_kernel"].items() if k.startswith("velox_decode_tiled"))

    level4 = [r for r in rows if r["spec"].startswith("kivi:k4v4")]
    plain = next(r for r in level4 if "kernel_constants" not in r)
    longer = next(r for r in level4 if r.get("kernel_constants") == {"TILED_MAX_TILE": long_tile,
                                                                    "TILED_SHARED_LIMIT": TILED_LONG_TILES["cuda"][1]})
    _assert_gpu_level(plain, "4")
    assert context == plain["context"] == 131073
    assert close(f"{with_long:.2f}", tiled_pass(longer)) and close(f"{without:.2f}", tiled_pass(plain))
    # cuDNN's attention over the 16-bit cache at 131k in round 25's other run (the matrix-unit forms' A/B)
    fp16 = next(r for r in json.loads((COMMITTED / "gpu-timeline-mma-131k-h200.json").read_text())["rows"]
                if r["spec"] == "fp16")
    assert close(next(quoted), sum(v["ms"] for k, v in fp16["step"]["by_kernel"].items() if "sdpa" in k))
    checked.append(loop[0])

    room = re.search(r"A decoding cache now grows its buffers with room for an eighth more\s+tokens \(at most ([\d,]+)\), not "
                     r"(\d+) at a time: each growth copies the whole history, and the token that grew them took\s+"
                     r"(\d+)-(\d+) ms in mlx-lm's loop on an H200 \(`benchmarks/results/decode-stalls-h200.json`\); over "
                     r"(\d+) steps at ([\d,]+)\s+tokens the 16-bit cache's stalls went from (\d+) to (\d+) and the 4-bit "
                     r"level's stalled time from (\d+) ms to (\d+) ms\s+\(`benchmarks/results/decode-growth-room-h200.json`; "
                     r"BENCHMARKS.md, \*round 26\*\)\. That session's leases ran the levels\s+further below the 16-bit "
                     r"cache: (\d\.\d\d)×, (\d\.\d\d)× and (\d\.\d\d)× at ([\d,]+) tokens and (\d\.\d\d)×, "
                     r"(\d\.\d\d)× and (\d\.\d\d)× at ([\d,]+) over\s+(\d+) steps "
                     r"\(`benchmarks/results/decode-stalls-h200.json`\), and the 4-bit level (\d\.\d\d)× at ([\d,]+) "
                     r"over (\d+) steps with the\s+room \(`benchmarks/results/decode-growth-room-h200.json`\): where "
                     r"the host records the step, a lease's host speed moves\s+the ratio by a third\.", section)
    assert room, "README no longer says what growing a decoding cache with room did"
    from engine.kvcache.base import DECODE_GROWTH_FRACTION, DECODE_GROWTH_SLOTS, VeloxKVCache

    assert DECODE_GROWTH_FRACTION == 8 and close(room[1], DECODE_GROWTH_SLOTS) and close(room[2], VeloxKVCache.step)
    stalled = json.loads((COMMITTED / "decode-stalls-h200.json").read_text())
    assert close(room[3], min(r["gen_token_ms_max"] for r in stalled["rows"]))
    assert close(room[4], max(r["gen_token_ms_max"] for r in stalled["rows"]))
    grown = json.loads((COMMITTED / "decode-growth-room-h200.json").read_text())
    assert close(room[5], grown["steps"]) and close(room[22], grown["steps"])

    def grown_at(context: str) -> dict[tuple[str, bool], dict]:
        """decode-growth-room's rows at `context` by (spec, whether it is the old growth's variant)."""
        return {(r["spec"].split("#")[0], r.get("kernel_constants") == {"DECODE_GROWTH_SLOTS": 0}): r
                for r in grown["rows"] if r["context"] == int(context.replace(",", ""))}

    at = grown_at(room[6])
    level4 = next(spec for spec, _ in at if spec.startswith("kivi:k4v4"))
    _assert_gpu_level(at[level4, False], "4")
    assert close(room[7], at["fp16", True]["gen_stalls"]) and close(room[8], at["fp16", False]["gen_stalls"])
    assert close(room[9], at[level4, True]["gen_stall_ms"]) and close(room[10], at[level4, False]["gen_stall_ms"])
    assert not stalled["kernel_constants"] and close(room[19], stalled["steps"])
    for first in (11, 15):
        check_level_ratios(stalled, int(room[first + 3].replace(",", "")), room.groups()[first - 1:first + 2],
                           "decode-stalls-h200.json")
    assert close(room[20], grown_at(room[21])[level4, False]["gen_vs_fp16"])
    checked.append(room[0])

    ceiling = re.search((r"On an H100 \(the H200 not lent\), at ([\d,]+) tokens that model's synchronous step took "
                         r"(\d+\.\d\d) ms against the 16-bit cache's (\d+\.\d\d) ms: (\d\.\d\d)× \(the median of (\d) "
                         r"rounds' ratios, (\d\.\d\d)× in the last; `benchmarks/results/decode-ceiling-131k-h100.json`; "
                         r"BENCHMARKS.md, \*round 34\*\)\. For a step, issue 11's (\d\.\d)× at 131k is past what any "
                         r"cache reaches there\. In mlx-lm's loop that ceiling is (\d\.\d\d)×, and the 4- and 2-bit "
                         r"levels ran at (\d\.\d\d)× and (\d\.\d\d)×\.").replace(" ", r"\s+"), section)
    assert ceiling, "README no longer quotes the measured ceiling of a cache's ratio"
    run = json.loads((COMMITTED / "decode-ceiling-131k-h100.json").read_text())
    assert "H100" in run["gpu"] and not run["kernel_constants"] and run["rounds"] == int(ceiling[5])
    by_spec = {row["spec"]: row for row in run["rows"]}
    no_history, fp16 = by_spec["no-history"], by_spec["fp16"]
    assert {row["context"] for row in run["rows"]} == {int(ceiling[1].replace(",", ""))}
    assert close(ceiling[2], no_history["ms"]) and close(ceiling[3], fp16["ms"])
    assert close(ceiling[4], no_history["vs_fp16"])
    assert close(ceiling[6], fp16["rounds_ms"][-1] / no_history["rounds_ms"][-1])
    # the claim itself: the model without any history, in the same run, stays under the issue's ratio
    assert no_history["vs_fp16"] < float(ceiling[7]) == 2.0
    assert close(ceiling[8], no_history["gen_vs_fp16"])
    check_level_ratios(run, no_history["context"], (ceiling[9], ceiling[10]), "decode-ceiling-131k-h100.json",
                       keys=("4", "2"))
    checked.append(ceiling[0])

    widths = re.search(r"takes the 4-bit level\s+from ([+\d.]+) % to ([+\d.]+) % perplexity on (\d)k-token windows of held-out "
                       r"prose and the 3-bit level from ([+\d.]+) % to\s+([+\d.]+) % .+? keys as given, their needle recall is "
                       r"([\d.]+) % and\s+([\d.]+) % \(fp16: ([\d.]+) %\),\s+where the levels they replaced had ([\d.]+) % and "
                       r"([\d.]+) % with keys as given, and they decode at\s+(\d\.\d\d)× and (\d\.\d\d)× of the\s+16-bit "
                       r"cache's speed "
                       r"at 8k tokens and (\d\.\d\d)× and (\d\.\d\d)× at 32k \(one run, "
                       r"`benchmarks/results/decode-key-widths-r5-h200.json`;\s+BENCHMARKS.md, \*round 14\*\)", section, re.S)
    assert widths, "README no longer quotes what key widths did for the 4- and 3-bit levels"
    level4, level3 = (str(without_device_options(level_by_key(key).config)) for key in ("4", "3"))
    assert "key_widths=calibrated" in level4 and "key_widths=calibrated" in level3

    before4, before3 = (spec.replace(":key_widths=calibrated", "") for spec in (level4, level3))
    assert close(widths[1], held_out("near_lossless_layerbits_4k.json", before4))
    assert close(widths[2], held_out("near_lossless_4bit_widths_4k.json", level4))
    assert close(widths[4], held_out("near_lossless_3bit_key_widths_heldout4.json", before3))
    assert close(widths[5], held_out("near_lossless_3bit_key_widths_heldout4.json", level3))
    assert int(widths[3]) * 1024 == 4096

    # keys as given (the run of the levels' layouts on the default model: wide_layers and key_widths digests written)
    given = json.loads((COMMITTED / "quality-use-key-widths-h200.json").read_text())
    as_given = {KVCacheConfig.parse(n).key_bits: n for n in given["needle"]["trials"][0]["results"] if n != "fp16"}
    assert all("rope" not in spec for spec in as_given.values())
    for text, spec in ((widths[6], as_given[4]), (widths[7], as_given[3]), (widths[8], "fp16")):
        assert close(text, recall(given, spec)), (text, spec)
    for text, spec in ((widths[8], "fp16"), (widths[9], before4), (widths[10], before3)):
        assert close(text, recall(plain_needle, spec)), (text, spec)
    decoded = json.loads((COMMITTED / "decode-key-widths-r5-h200.json").read_text())["rows"]
    for text, bits, context in ((widths[11], 4, 8193), (widths[12], 3, 8193), (widths[13], 4, 32769),
                                (widths[14], 3, 32769)):
        row = next(r for r in decoded if r["context"] == context and "key_widths=calibrated" in r["spec"]
                   and KVCacheConfig.parse(r["spec"]).key_bits == bits)
        assert close(text, row["vs_fp16"]), (text, bits, context)
    checked.append(widths[0])

    three = re.search(r"The 3-bit level stores keys before RoPE on a GPU too,\s+ahead there on every measure taken: "
                      r"([+\d.]+) % held out against ([+\d.]+) % as given, needle recall ([\d.]+) % against ([\d.]+) %,\s+"
                      r"greedy match ([\d.]+) % against ([\d.]+) % \(`benchmarks/results/quality-needle-3bit-pre-h200.json`,"
                      r"\s+`quality-use-widths-pre-h200.json`; BENCHMARKS.md, \*round 16\*\)", section)
    assert three, "README no longer says what keys before RoPE give the 3-bit level"
    assert close(three[1], held_out("near_lossless_3bit_key_widths_heldout4.json", level3 + ":rope=pre"))
    assert close(three[2], held_out("near_lossless_3bit_key_widths_heldout4.json", level3))
    pre3 = json.loads((COMMITTED / "quality-needle-3bit-pre-h200.json").read_text())
    ran3 = next(n for n in pre3["needle"]["trials"][0]["results"] if n != "fp16")
    assert "rope=pre" in ran3 and KVCacheConfig.parse(ran3).key_bits == 3
    assert close(three[3], recall(pre3, ran3)) and close(three[3], recall(plain_needle, level3))
    assert close(three[4], recall(given, as_given[3]))
    pre_use = json.loads((COMMITTED / "quality-use-widths-pre-h200.json").read_text())["agreement"]["rows"]
    given_use = given["agreement"]["rows"]
    assert close(three[5], 100 * next(r["match_rate"] for r in pre_use if r["spec"].startswith("kivi:k3v3")))
    assert close(three[6], 100 * next(r["match_rate"] for r in given_use if r["spec"] == as_given[3]))
    checked.append(three[0])

    metal = re.search(r"more buffer\s+arguments than the (\d+) Metal gives a kernel: the levels' tiled decode pass, "
                      r"KIVI's tiled history decode and the polar\s+pass\. They now take (\d+), (\d+) and (\d+):.*?"
                      r"BENCHMARKS\.md, \*round 29\* and \*round 30\*", section, re.DOTALL)
    assert metal, "README no longer says which kernels pass Metal's buffer arguments"
    buffers = json.loads((COMMITTED / "metal-buffers.json").read_text())
    counts = {row["kernel"]: row["buffers"] for row in buffers["rows"]}
    assert int(metal[1]) == buffers["limit"]
    assert int(metal[2]) == counts["velox_decode_tiled_kivi_affine"]
    assert {v for k, v in counts.items() if k.startswith("velox_dequantize_kivi")} == {int(metal[3])}
    assert {v for k, v in counts.items() if k.startswith("velox_decode_polar")} == {int(metal[4])}
    assert not [k for k, v in counts.items() if v > buffers["limit"]]
    checked.append(metal[0])

    rest = section
    for text in checked:
        rest = rest.replace(text, " ")
    standalone = re.findall(r"(?<![\w.,+-])[+-]?\d[\d,]*(?:\.\d+)?(?![\w-])", rest)
    assert set(standalone) <= {"8"}, f"numbers in README's benchmark section that no check covers: {standalone}"


def test_same_cache_and_with_extra() -> None:
    from benchmarks.harness.specs import same_cache, with_extra

    assert same_cache(parse_spec("turboquant:k3v3"), parse_spec("turboquant:k3v3:g64"))
    assert same_cache(parse_spec("rotated:k4v4:g64"), parse_spec("rotated:k4"))
    assert not same_cache(parse_spec("rotated:k4v4:g64"), parse_spec("rotated:k4v4:g32"))
    assert not same_cache(parse_spec("mlx-q:k4v4"), parse_spec("affine:k4v4:g64"))
    assert same_cache(parse_spec("mlx-q:k4v4"), parse_spec("mlx-q:k4v4:g64"))
    merged = with_extra(parse_specs("fp16,rotated:k4v4:g64"), parse_specs("rotated:k4,turboquant:k2v2"))
    assert [spec.text for spec in merged] == ["fp16", "rotated:k4v4:g64", "turboquant:k2v2"]


# ----- the level table follows the committed sweep ----------------------------------------------------------------


def _row(spec: str, kl: float) -> dict:
    parsed = parse_spec(spec)  # today's syntax; the committed results use the old one (the next test)
    return {"spec": spec, "family": parsed.family, "method": parsed.method, "mean_kl": kl}


def test_level_rule_budgets_eligibility_and_ties() -> None:
    from benchmarks.harness.levels import budget_bits, select_levels

    # At 4096 tokens and 8 kv heads, per-layer constants count: a rotation's 128 float32 signs add 0.0005 bits.
    assert budget_bits("affine:k4v4:g64") == 4.5
    assert budget_bits("rotated:k4v4:g64") == pytest.approx(4.5005, abs=1e-4)
    assert budget_bits("rotated:4:64") == budget_bits("rotated:k4v4:g64")  # a committed result's old spelling
    assert budget_bits("turboquant:k3v3") == pytest.approx(3.1256, abs=1e-4)
    # 16-bit sinks are paid for (their stream copies too), and 128-token key blocks halve the keys' scales.
    assert budget_bits("kivi:k4v4:g64:s4:key_block=128") == pytest.approx(
        4.375 + 4 * (16 - 4.375) / 4096 + 4 * 4.375 / 4096)
    rows = [
        _row("fp16", 0.0),
        _row("rotated:k8v8:g64", 0.0002), _row("affine:k8v8:g64", 0.0004),  # a tie: the one without a rotation wins
        _row("kivi:k4v4:g32", 0.03),  # 5.0 bits: only fits the 8-bit budget
        _row("rotated:k4v4:g64", 0.06), _row("affine:k4v4:g64", 0.11),  # rotated: 4.5005 bits, over 4.5
        _row("turboquant:k3v3", 0.01),  # best at 3.125 bits, but decodes through dequantize-per-step
        _row("rotated:k3v2:g32", 0.29), _row("kivi:k3v3:g64", 0.2),
        _row("mlx-q:k2v2", 0.0),  # not a Velox method
        # KIVI's own key blocks and sinks (the decode kernel reads both); at 3 bits a tie: the smaller wins
        _row("kivi:k4v4:g64:s4:key_block=128", 0.02), _row("kivi:k3v3:g64:key_block=128", 0.1),
        _row("kivi:k3v3:g64:s4", 0.1),
    ]
    chosen = {key: value["row"]["spec"] for key, value in select_levels(rows).items()}
    # nothing fused fits 2.5 bits
    assert chosen == {
        "8": "affine:k8v8:g64", "4": "kivi:k4v4:g64:s4:key_block=128", "3": "kivi:k3v3:g64:key_block=128"}


def _needle(recalls: dict[str, list[bool]], length: int = 4096) -> dict:
    """A needle part of the quality sweep: trial i of every spec is exact as recalls[spec][i] says."""
    n = len(next(iter(recalls.values())))
    return {"trials": [{"length": length, "results": {spec: {"exact": hits[i]} for spec, hits in recalls.items()}}
                       for i in range(n)]}


def _agreement(rates: dict[str, list[float]]) -> dict:
    return {"rows": [{"spec": spec, "match_rate": sum(r) / len(r), "match_by_prompt": r}
                     for spec, r in rates.items()]}


def test_level_rule_turns_away_a_lower_kl_cache_that_loses_the_needle() -> None:
    """4-bit allows 5 points of needle recall: a lower-KL cache 30 points behind fp16 over 40 paired trials is
    turned away; the same shortfall over 2 trials is within its standard error, so KL decides."""
    from benchmarks.harness.levels import needle_verdict, select_levels

    rows = [_row("fp16", 0.0), _row("kivi:k4v4:g64", 0.03), _row("affine:k4v4:g64", 0.11)]
    agreement = _agreement({s: [0.5, 0.5] for s in ("fp16", "kivi:k4v4:g64", "affine:k4v4:g64")})
    many = _needle({"fp16": [True] * 40, "kivi:k4v4:g64": [True] * 28 + [False] * 12,
                    "affine:k4v4:g64": [True] * 39 + [False]})
    choice = select_levels(rows, many, agreement)["4"]
    assert choice["row"]["spec"] == "affine:k4v4:g64" and choice["meets_use"]
    assert choice["use"]["kivi:k4v4:g64"]["needle"]["by_group"]["all"]["shortfall"] == pytest.approx(0.3)
    assert not choice["use"]["kivi:k4v4:g64"]["needle"]["passes"]
    few = _needle({"fp16": [True, True], "kivi:k4v4:g64": [True, False], "affine:k4v4:g64": [True, True]})
    assert select_levels(rows, few, agreement)["4"]["row"]["spec"] == "kivi:k4v4:g64"
    # The 3-bit level allows 15 points: a 10-point shortfall (4 of 40) is fine there, not at 4 bits.
    ten = _needle({"fp16": [True] * 40, "kivi:k4v4:g64": [True] * 36 + [False] * 4})
    assert needle_verdict(ten, "kivi:k4v4:g64", 15.0)["passes"]
    assert not needle_verdict(ten, "kivi:k4v4:g64", 5.0)["passes"]
    # The old result syntax names the same cache, and one haystack length may fail alone.
    lengths = {"trials": _needle({"fp16": [True] * 40, "kivi:4/4:64": [True] * 40}, 1024)["trials"]
               + _needle({"fp16": [True] * 20, "kivi:4/4:64": [False] * 20}, 8192)["trials"]}
    verdict = needle_verdict(lengths, "kivi:k4v4:g64", 15.0)
    assert verdict["by_group"]["1024"]["shortfall"] == 0 and verdict["by_group"]["8192"]["fails"]
    assert not verdict["passes"]


def test_level_rule_shows_but_does_not_weigh_the_needle_at_two_bits() -> None:
    """The 2-bit level has no needle target: its candidates' recall is measured and shown (velox levels prints it),
    a candidate 60 points behind fp16 still wins on KL, and one the needle run never measured is not turned away."""
    from benchmarks.harness.levels import measured_figures, select_levels

    rows = [_row("fp16", 0.0), _row("kivi:k2v2:g64", 0.3), _row("affine:k2v2:g64", 0.9)]
    needle = _needle({"fp16": [True] * 20, "kivi:k2v2:g64": [True] * 8 + [False] * 12})
    choice = select_levels(rows, needle, None)["2"]
    assert choice["row"]["spec"] == "kivi:k2v2:g64" and choice["meets_use"]
    shown = choice["use"]["kivi:k2v2:g64"]["needle"]
    assert shown["measured"] and shown["by_group"]["all"]["shortfall"] == pytest.approx(0.6) and shown["passes"]
    unmeasured = choice["use"]["affine:k2v2:g64"]["needle"]
    assert not unmeasured["measured"] and unmeasured["passes"]
    row = dict(choice["row"], ppl_ratio=1.5, delta_nll_se=0.01, top1_agreement=0.7, scored_tokens=100)
    assert "needle -60.0 points vs fp16 (20 trials)" in measured_figures(row, choice["use"]["kivi:k2v2:g64"])
    # Where the needle is weighed (4-bit: 5 points) the same shortfall turns the lower-KL cache away.
    four = [_row("fp16", 0.0), _row("kivi:k4v4:g64", 0.3), _row("affine:k4v4:g64", 0.9)]
    needle4 = _needle({"fp16": [True] * 20, "kivi:k4v4:g64": [True] * 8 + [False] * 12, "affine:k4v4:g64": [True] * 20})
    assert select_levels(four, needle4, None)["4"]["row"]["spec"] == "affine:k4v4:g64"


def test_level_rule_turns_away_a_cache_behind_on_greedy_agreement() -> None:
    """A lower-KL cache whose greedy match rate falls behind the best candidate's by more than the paired
    standard error is turned away; behind by less than it (noisy prompts), KL decides."""
    from benchmarks.harness.levels import select_levels

    rows = [_row("fp16", 0.0), _row("kivi:k4v4:g64", 0.03), _row("affine:k4v4:g64", 0.11)]
    needle = _needle({s: [True] * 10 for s in ("fp16", "kivi:k4v4:g64", "affine:k4v4:g64")})
    steady = _agreement({"kivi:k4v4:g64": [0.2, 0.25, 0.2, 0.15], "affine:k4v4:g64": [0.4, 0.5, 0.45, 0.4]})
    choice = select_levels(rows, needle, steady)["4"]
    assert choice["row"]["spec"] == "affine:k4v4:g64"
    verdict = choice["use"]["kivi:k4v4:g64"]["agreement"]
    assert verdict["behind"] == pytest.approx(0.2375) and verdict["behind"] > verdict["se"]
    noisy = _agreement({"kivi:k4v4:g64": [0.0, 0.9, 0.0, 0.9], "affine:k4v4:g64": [0.9, 0.0, 0.9, 0.2]})
    assert select_levels(rows, needle, noisy)["4"]["row"]["spec"] == "kivi:k4v4:g64"
    # Without per-prompt figures no difference can be told from noise; nor can it for a candidate not measured.
    bare = {"rows": [{"spec": "kivi:k4v4:g64", "match_rate": 0.1}, {"spec": "affine:k4v4:g64", "match_rate": 0.9}]}
    assert select_levels(rows, needle, bare)["4"]["row"]["spec"] == "kivi:k4v4:g64"
    only_affine = _agreement({"affine:k4v4:g64": [0.1, 0.1]})
    choice = select_levels(rows, needle, only_affine)["4"]
    assert choice["row"]["spec"] == "kivi:k4v4:g64" and not choice["use"]["kivi:k4v4:g64"]["agreement"]["measured"]
    # A candidate never measured on the needle is turned away: the needle target is absolute.
    no_kivi = _needle({"fp16": [True] * 10, "affine:k4v4:g64": [True] * 10})
    assert select_levels(rows, no_kivi, steady)["4"]["row"]["spec"] == "affine:k4v4:g64"


def test_level_rule_keeps_the_lowest_kl_where_nothing_meets_the_use_targets() -> None:
    from benchmarks.harness.levels import select_levels

    rows = [_row("fp16", 0.0), _row("kivi:k4v4:g64", 0.03), _row("affine:k4v4:g64", 0.11),
            _row("kivi:k2v2:g64", 1.0)]
    needle = _needle({"fp16": [True] * 40, "kivi:k4v4:g64": [False] * 40, "affine:k4v4:g64": [False] * 40,
                      "kivi:k2v2:g64": [False] * 40})
    chosen = select_levels(rows, needle, _agreement({s: [0.5, 0.5] for s in ("kivi:k4v4:g64", "kivi:k2v2:g64")}))
    assert chosen["4"]["row"]["spec"] == "kivi:k4v4:g64" and not chosen["4"]["meets_use"]
    assert chosen["2"]["row"]["spec"] == "kivi:k2v2:g64" and chosen["2"]["meets_use"]  # 2-bit: no needle target


def test_level_budgets_are_counted_where_the_app_counts_them() -> None:
    from benchmarks.harness import levels
    from engine.planning import recommend

    assert (levels.REFERENCE_HEAD_DIM, levels.REFERENCE_TOKENS, levels.REFERENCE_KV_HEADS) == (
        recommend.BUDGET_HEAD_DIM, recommend.BUDGET_TOKENS, recommend.BUDGET_KV_HEADS)


def test_level_table_follows_the_committed_quality_sweep() -> None:
    """engine.planning.recommend.LEVEL_TABLE must be what the rule picks from benchmarks/results/quality.json
    (KL) and the committed needle and agreement runs."""
    from benchmarks.harness.common import ROOT
    from benchmarks.harness.levels import (
        level_config,
        measured_figures,
        select_levels,
        without_device_options,
    )
    from benchmarks.harness.report import load_results
    from engine.planning.recommend import level_by_key

    results = load_results(ROOT / "benchmarks" / "results")  # the needle and agreement runs BENCHMARKS.md shows
    rows = json.loads((ROOT / "benchmarks" / "results" / "quality.json").read_text())["perplexity"]["rows"]
    needle, agreement = results.best("quality", "needle"), results.best("quality", "agreement")
    assert needle is not None and agreement is not None
    chosen = select_levels(rows, needle.data["needle"], agreement.data["agreement"])
    assert set(chosen) == {"8", "4", "3", "2"}
    for key, choice in chosen.items():
        assert without_device_options(level_by_key(key).config) == level_config(choice["row"]), key
        use = choice["use"].get(choice["row"]["spec"])
        assert level_by_key(key).measured == measured_figures(choice["row"], use), key  # what `velox levels` prints


def test_importing_the_harness_does_not_load_mlx() -> None:
    """`velox bench` imports the harness before the CPU fast path is prepared, so it must not import MLX."""
    from benchmarks.harness.common import ROOT

    # Building the parser imports benchmarks/decode.py for `velox bench decode`'s options: MLX-free too.
    code = ("import sys, argparse, benchmarks.harness.cli, benchmarks.harness.specs, benchmarks.harness.levels; "
            "benchmarks.harness.cli.add_arguments(argparse.ArgumentParser()); "
            "print('benchmarks.decode' in sys.modules, 'mlx' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "True False"


def test_add_refuses_the_needle_and_agreement_parts(tmp_path: Path) -> None:
    """`quality --add` joins rows to the perplexity sweep only: the needle and agreement parts would be rerun for the
    named specs alone and replace the committed runs of every level, so they are refused before any work."""
    done = _velox("bench", "quality", "--add", "--parts", "perplexity,agreement", "--specs", "fp16", "--out",
                  str(tmp_path))
    assert done.returncode != 0 and "--add adds perplexity rows only" in done.stderr + done.stdout
    assert not list(tmp_path.iterdir())


def test_add_reads_the_reference_of_a_run_without_an_fp16_row() -> None:
    """`bench quality --add` compares the fp16 reference of the earlier run with its own; a committed run may
    keep no fp16 row, so the reference is what the rows' paired differences imply (it was a StopIteration)."""
    from benchmarks.harness.cli import BenchmarkError, reference_nll

    def row(spec: str, nll: float, delta: float) -> dict:
        return {"spec": spec, "family": "velox", "mean_nll": nll, "delta_nll": delta}

    assert reference_nll([row("kivi:4:64", 3.7, 0.04), row("affine:8:64", 3.66, 0.0)]) == pytest.approx(3.66)
    assert reference_nll([row("fp16", 3.5, 0.0), row("kivi:4:64", 3.7, 0.04)]) == 3.5  # its own row first
    with pytest.raises(BenchmarkError, match="no fp16 row and no Velox rows"):
        reference_nll([{"spec": "mlx-q:4", "family": "mlx-lm", "mean_nll": 3.8, "delta_nll": 0.1}])
    with pytest.raises(BenchmarkError, match="imply different fp16 references"):
        reference_nll([row("kivi:4:64", 3.7, 0.04), row("affine:8:64", 3.7, 0.0)])
    committed = json.loads((Path(__file__).parents[1] / "benchmarks" / "results" / "quality.json").read_text())
    assert 3 < reference_nll(committed["perplexity"]["rows"]) < 5


# ----- velox bench decode (benchmarks/decode.py) ---------------------------------------------------------------------


def test_bench_kinds_keep_their_options_beside_decode() -> None:
    """`decode` is a sub-command with decode.py's options; the harness's kinds parse as before."""
    import argparse

    from benchmarks.harness.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["quality", "--quick", "--parts", "needle", "--specs", "fp16", "--out", "/x"])
    assert (args.what, args.quick, args.parts, args.specs, args.out) == ("quality", True, "needle", "fp16", "/x")
    assert parser.parse_args(["report", "--markdown", "B.md"]).markdown == "B.md"
    args = parser.parse_args(["decode", "--out", "d.json", "--shape", "tiny", "--contexts", "257", "--steps", "2"])
    assert (args.what, args.out, args.shape, args.contexts, args.steps) == ("decode", "d.json", "tiny", "257", 2)
    assert not hasattr(args, "quick")  # decode.py's options only
    for wrong in (["decode"], ["decode", "--out", "d.json", "--quick"], ["quality", "--shape", "tiny"], []):
        with pytest.raises(SystemExit):
            parser.parse_args(wrong)


def _velox(*argv: str) -> subprocess.CompletedProcess:
    from benchmarks.harness.common import ROOT

    return subprocess.run([sys.executable, "-m", "app.cli", *argv], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)


def test_velox_bench_decode_help_shows_decode_py_options() -> None:
    done = _velox("bench", "decode", "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: velox bench decode")
    for option in ("--out", "--contexts", "--specs", "--steps", "--warmup", "--prefill", "--profile", "--shape",
                   "--generate"):
        assert option in done.stdout
    assert "--quick" not in done.stdout


def test_velox_bench_decode_end_to_end_on_a_tiny_model(tmp_path: Path) -> None:
    """The whole command on the CPU (its reference attention path) with the tiny shape at an untidy length:
    one row per cache with its speed, ratio and held bytes; a cache that cannot be built is an error row."""
    out = tmp_path / "decode.json"
    done = _velox("bench", "decode", "--shape", "tiny", "--out", str(out), "--contexts", "257",
                  "--specs", "fp16,kivi:4:64,mlx-kv,kivi:9:64", "--steps", "2", "--warmup", "1")
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    shape = record["shape"]
    assert (shape["layers"], shape["heads"], shape["kv_heads"], shape["head_dim"]) == (2, 4, 2, 64)
    assert record["kind"] == "decode" and record["contexts"] == [257] and record["weight_bytes"] > 0
    rows = {row["spec"]: row for row in record["rows"]}
    assert list(rows) == ["fp16", "kivi:4:64", "mlx-kv", "kivi:9:64"]
    fp16_bytes = 2 * shape["layers"] * shape["kv_heads"] * 257 * shape["head_dim"] * 2  # K and V, 16-bit
    for spec in ("fp16", "kivi:4:64", "mlx-kv"):
        row = rows[spec]
        assert row["context"] == 257 and "error" not in row, row
        assert row["tok_s"] > 0 and row["tok_s"] == pytest.approx(1000 / row["ms"])
        assert row["vs_fp16"] == pytest.approx(row["tok_s"] / rows["fp16"]["tok_s"])
        assert row["bound_tok_s"] == pytest.approx(record["read_bytes_per_second"]
                                                   / (record["weight_bytes"] + row["held_bytes"]))
        # mlx-lm's own decode loop over the same caches, beside the one-step-at-a-time figure
        assert row["gen_tok_s"] > 0 and row["gen_tok_s"] == pytest.approx(1000 / row["gen_ms"])
        assert row["gen_vs_fp16"] == pytest.approx(row["gen_tok_s"] / rows["fp16"]["gen_tok_s"])
        # ... and its tokens one by one: the median and slowest token, the stalls
        assert 0 < row["gen_token_ms_median"] <= row["gen_token_ms_max"] and row["gen_stalls"] in (0, 1)
        assert len(row["gen_stall_offsets"]) == row["gen_stalls"] and all(o > 257 for o in row["gen_stall_offsets"])
    assert rows["fp16"]["vs_fp16"] == 1.0
    assert rows["fp16"]["held_bytes"] >= fp16_bytes and rows["mlx-kv"]["held_bytes"] >= fp16_bytes
    assert 0 < rows["kivi:4:64"]["held_bytes"] < fp16_bytes / 2  # 4-bit codes and their scales
    failed = rows["kivi:9:64"]
    assert failed["context"] == 257 and failed["error"].startswith("ConfigError: ") and "tok_s" not in failed


def test_velox_bench_decode_times_a_chunked_prefill(tmp_path: Path) -> None:
    """--prefill N: a prompt of N tokens fed in chunks (decode.chunked_prefill) into fresh caches of each
    --prefill-specs cache, timed on its second run, with a decode step after it; a constant set per spec is recorded
    (two chunks of --prefill-chunk tokens here: the CPU's reference path is slow)."""
    out = tmp_path / "prefill.json"
    done = _velox("bench", "decode", "--shape", "tiny", "--out", str(out), "--specs", "", "--no-generate",
                  "--prefill", "300", "--prefill-chunk", "256",
                  "--prefill-specs", "fp16,kivi:k4v4:g64#PREFILL_AHEAD_CHUNKS=0")
    assert done.returncode == 0, done.stderr
    fp16, kivi = json.loads(out.read_text())["prefill"]
    assert [fp16["spec"], kivi["spec"]] == ["fp16", "kivi:k4v4:g64"]
    assert kivi["kernel_constants"] == {"PREFILL_AHEAD_CHUNKS": 0} and "kernel_constants" not in fp16
    for row in (fp16, kivi):
        assert row["context"] == 300 and row["prefill_tok_s"] == pytest.approx(300 / row["prefill_s"])
        assert row["prefill_chunk"] == 256
        assert row["first_prefill_s"] > 0 and row["first_pipelined_prefill_s"] > 0
        assert row["pipelined_prefill_tok_s"] == pytest.approx(300 / row["pipelined_prefill_s"])
        assert row["decode_tok_s_after"] > 0


def test_velox_bench_decode_rounds_time_every_cache_in_turn(tmp_path: Path) -> None:
    """--rounds N: each cache's step is timed once per round (fp16 and the cache minutes apart, not a whole run),
    and its ratio to fp16 is the median of the per-round ratios, with their range; the no-history row's ratio is
    printed as the run's ceiling."""
    out = tmp_path / "decode.json"
    done = _velox("bench", "decode", "--shape", "tiny", "--out", str(out), "--contexts", "129",
                  "--specs", "fp16,kivi:k4v4:g64,no-history", "--steps", "2", "--warmup", "1", "--rounds", "3",
                  "--no-generate")
    assert done.returncode == 0, done.stderr
    record = json.loads(out.read_text())
    assert record["rounds"] == 3
    fp16, kivi, ceiling = record["rows"]
    assert ceiling["spec"] == "no-history" and ceiling["held_bytes"] == 0 and len(ceiling["rounds_ms"]) == 3
    assert f"ceiling at 129: no cache passes x{ceiling['vs_fp16']:.2f} of fp16's step in this run" in done.stdout
    assert [fp16["spec"], kivi["spec"]] == ["fp16", "kivi:k4v4:g64"]
    for row in (fp16, kivi):
        assert len(row["rounds_ms"]) == 3 and "gen_tok_s" not in row
        assert row["ms"] == sorted(row["rounds_ms"])[1] and row["tok_s"] == pytest.approx(1000 / row["ms"])
    ratios = sorted(a / b for a, b in zip(fp16["rounds_ms"], kivi["rounds_ms"], strict=True))
    assert kivi["vs_fp16"] == pytest.approx(ratios[1]) and kivi["vs_fp16_range"] == pytest.approx([ratios[0], ratios[2]])
    assert fp16["vs_fp16"] == 1.0


def test_velox_bench_decode_merges_runs_of_one_context_each(tmp_path: Path) -> None:
    """--merge: a table timed a context or a group of caches per call (a lent GPU's call is limited) becomes one
    record, its rows in order and each run's own fields kept under `parts`; a later run's fp16 row of a context
    already merged goes to its part's `reference_rows`; a cache timed twice, or runs measured unlike, are refused."""
    parts = []
    for context, specs in (("129", "fp16,kivi:k4v4:g64"), ("67", "fp16,kivi:k4v4:g64"), ("67", "fp16,affine:k4v4:g64")):
        out = tmp_path / f"decode-{len(parts)}.json"
        done = _velox("bench", "decode", "--shape", "tiny", "--out", str(out), "--contexts", context,
                      "--specs", specs, "--steps", "2", "--warmup", "1", "--rounds", "2", "--no-generate")
        assert done.returncode == 0, done.stderr
        parts.append(out)
    merged_path = tmp_path / "decode.json"
    done = _velox("bench", "decode", "--out", str(merged_path), "--merge", *map(str, parts))
    assert done.returncode == 0, done.stderr
    merged = json.loads(merged_path.read_text())
    runs = [json.loads(path.read_text()) for path in parts]
    assert merged["contexts"] == [129, 67]
    assert merged["rows"] == runs[0]["rows"] + runs[1]["rows"] + runs[2]["rows"][1:]
    assert [(row["spec"], row["context"]) for row in merged["rows"]] == [
        ("fp16", 129), ("kivi:k4v4:g64", 129), ("fp16", 67), ("kivi:k4v4:g64", 67), ("affine:k4v4:g64", 67)]
    assert merged["parts"][2]["reference_rows"] == runs[2]["rows"][:1]
    assert [part["contexts"] for part in merged["parts"]] == [[129], [67], [67]]
    assert [part["loadavg_start"] for part in merged["parts"]] == [run["loadavg_start"] for run in runs]
    assert merged["rounds"] == 2 and merged["shape"] == runs[0]["shape"] and "loadavg_start" not in merged

    from benchmarks import decode

    with pytest.raises(ValueError, match="kivi:k4v4:g64 at 129 tokens is in more than one run"):
        decode.merge_records([runs[0], runs[0]])
    with pytest.raises(ValueError, match="steps"):
        decode.merge_records([runs[0], {**runs[1], "steps": 3}])
    # a run its time limit cut short says so in its part
    assert decode.merge_records([runs[0], {**runs[1], "partial": True}])["parts"][1]["partial"] is True

def test_decode_no_history_row_reads_only_each_steps_own_token() -> None:
    """`no-history`, the ceiling row of decode.py: its caches hold nothing (no arrays, no bytes) and hand back each
    step's own keys and values while the offset moves on as a decoding cache's, so a step's logits do not depend on
    what was fed before it, where a real cache's do."""
    from benchmarks import decode

    shape = decode.SHAPES["tiny"]
    model = decode.build_model(shape)
    logits = {}
    for seed in (0, 1):  # two different histories of 70 tokens
        for spec in (decode.NO_HISTORY, "fp16"):
            mx.random.seed(seed)
            caches = decode.make_caches(spec, shape["layers"], shape)
            decode.fill(caches, 70, shape)
            logits[spec, seed] = model(mx.array([[5]]), cache=caches)
            assert all(cache.offset == 71 for cache in caches)
            if spec == decode.NO_HISTORY:
                assert decode.cache_bytes(caches) == 0 and caches[0].state == []
                keys, values = random_kv(1, shape["kv_heads"], 3, shape["head_dim"])
                fetched_keys, fetched_values = caches[0].update_and_fetch(keys, values)
                assert fetched_keys is keys and fetched_values is values and caches[0].offset == 74
    assert mx.array_equal(logits[decode.NO_HISTORY, 0], logits[decode.NO_HISTORY, 1])
    assert not mx.allclose(logits["fp16", 0], logits["fp16", 1])


def test_decode_calibrates_vq_codebooks_on_its_own_model() -> None:
    """A `vq` spec without codebooks gets codebooks calibrated on the benchmark's model (once per bit width), so
    product VQ has its row in the whole-model table; its caches decode through the model like any other's."""
    from benchmarks import decode

    shape = decode.SHAPES["tiny"]
    decode._CALIBRATION_MODEL[:] = [decode.build_model(shape)]
    try:
        caches = decode.make_caches("vq:k2v2:g64", shape["layers"], shape)
        again = decode.make_caches("vq:k2v2:g64", shape["layers"], shape)
        folder = caches[0].config.options["codebooks"]
        assert again[0].config.options["codebooks"] == folder and Path(folder).is_dir()
        decode.fill(caches, 70, shape)
        logits = decode._CALIBRATION_MODEL[0](mx.array([[5]]), cache=caches)
        assert logits.shape[:2] == (1, 1) and bool(mx.all(mx.isfinite(logits)).item())
        assert caches[0].offset == 71 and caches[0].nbytes > 0
    finally:
        decode._CALIBRATION_MODEL.clear()
        for made in decode._CODEBOOKS.values():
            shutil.rmtree(made, ignore_errors=True)
        decode._CODEBOOKS.clear()


def _time_rounds_as(monkeypatch: pytest.MonkeyPatch, step_seconds: dict[str, Iterator[float]]) -> None:
    """decode.interleaved_rows without a model: each spec's caches are its name, and each round's step takes the next
    of `step_seconds[spec]`."""
    from benchmarks import decode

    monkeypatch.setattr(decode, "make_caches", lambda spec, n_layers, shape: [spec])
    monkeypatch.setattr(decode, "fill", lambda caches, context, shape: None)
    monkeypatch.setattr(decode, "cache_bytes", lambda caches: 1)
    monkeypatch.setattr(decode, "time_decode", lambda model, caches, steps, warmup: [next(step_seconds[caches[0]])])


def test_velox_bench_decode_even_rounds_take_the_middle_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    """With an even number of rounds the median is the mean of the middle two, for the step and for the ratio
    alike (taking the upper middle gave a row the slower step but the higher ratio: two different rounds)."""
    import argparse

    from benchmarks import decode

    step_seconds = {"fp16": iter([0.010, 0.010]), "kivi:k4v4:g64": iter([0.020, 0.010])}  # per round
    _time_rounds_as(monkeypatch, step_seconds)
    args = argparse.Namespace(rounds=2, steps=1, warmup=0, generate=False)
    _, kivi = decode.interleaved_rows(None, ["fp16", "kivi:k4v4:g64"], 129, args, {"layers": 1}, 1.0, 1)
    assert kivi["ms"] == pytest.approx(15.0) and kivi["tok_s"] == pytest.approx(1000 / 15.0)
    assert kivi["vs_fp16"] == pytest.approx(0.75) and kivi["vs_fp16_range"] == pytest.approx([0.5, 1.0])
    assert "slow_rounds" not in kivi  # 2x its fastest round: not past the factor


def test_velox_bench_decode_names_a_round_far_slower_than_the_spec_s_fastest(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A round whose step took over SLOW_ROUND_FACTOR times the spec's fastest round's is named in the row and the
    printed line (with two rounds it is half the reported median: an H100's first 16-bit round at 131k, round 34)."""
    import argparse

    from benchmarks import decode

    step_seconds = {"fp16": iter([0.360, 0.015, 0.015]), "no-history": iter([0.008, 0.008, 0.008])}
    _time_rounds_as(monkeypatch, step_seconds)
    args = argparse.Namespace(rounds=3, steps=1, warmup=0, generate=False)
    fp16, ceiling = decode.interleaved_rows(None, ["fp16", "no-history"], 131073, args, {"layers": 1}, 1.0, 1)
    assert fp16["slow_rounds"] == [1] and "slow_rounds" not in ceiling
    assert ceiling["vs_fp16"] == pytest.approx(0.015 / 0.008)  # the median of three leaves the slow round out
    printed = capsys.readouterr().out
    assert "fp16" in printed and "SLOW ROUNDS [1]" in printed and printed.count("SLOW ROUNDS") == 1


def test_velox_bench_decode_rounds_hand_over_each_finished_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """on_round gets the rows of the rounds done so far after every round but the last (decode.py writes them, so a
    call that its time limit cuts short keeps them); the rows returned are the whole run's."""
    import argparse

    from benchmarks import decode

    step_seconds = {"fp16": iter([0.010, 0.012, 0.011]), "kivi:k4v4:g64": iter([0.020, 0.024, 0.022])}
    _time_rounds_as(monkeypatch, step_seconds)
    handed: list[list[dict]] = []
    args = argparse.Namespace(rounds=3, steps=1, warmup=0, generate=False)
    rows = decode.interleaved_rows(None, ["fp16", "kivi:k4v4:g64"], 129, args, {"layers": 1}, 1.0, 1,
                                   on_round=handed.append)
    assert [[len(row["rounds_ms"]) for row in partial] for partial in handed] == [[1, 1], [2, 2]]
    assert handed[0][1]["ms"] == pytest.approx(20.0) and handed[0][1]["vs_fp16"] == pytest.approx(0.5)
    assert handed[1][1]["ms"] == pytest.approx(22.0) and "vs_fp16_range" in handed[1][1]
    assert [len(row["rounds_ms"]) for row in rows] == [3, 3] and rows[1]["ms"] == pytest.approx(22.0)


def test_decode_spec_constants_hold_for_their_spec_only() -> None:
    """`spec#NAME=VALUE`: the kernel constant is set while that spec's caches are made and timed, then restored,
    so a variant and the default are timed in one run; an unknown name is an error, not a silent no-op."""
    from benchmarks.decode import spec_constants, spec_row
    from engine.kvcache.kernels import decode as decode_kernels

    default = decode_kernels.TILED_PREFETCH
    with spec_constants(f"kivi:k2v2:g64#TILED_PREFETCH={json.dumps(not default)}#TILED_MAX_TILE=32") as text:
        assert text == "kivi:k2v2:g64"
        assert decode_kernels.TILED_PREFETCH is (not default) and decode_kernels.TILED_MAX_TILE == 32
    assert decode_kernels.TILED_PREFETCH is default and decode_kernels.TILED_MAX_TILE == 64
    with spec_constants("fp16") as text:
        assert text == "fp16"
    # Its result rows hold the cache spec (the one spec syntax) and the constants apart.
    assert spec_row("kivi:k2v2:g64#TILED_PREFETCH=false", 9) == {
        "spec": "kivi:k2v2:g64", "context": 9, "kernel_constants": {"TILED_PREFETCH": False}}
    assert spec_row("fp16", 9) == {"spec": "fp16", "context": 9}
    from engine.kvcache.kernels import dequantize

    held = dequantize.BACKENDS
    with spec_constants('turboquant:k4v4:g64#BACKENDS=["emulate"]') as text:
        assert text == "turboquant:k4v4:g64" and dequantize.BACKENDS == ["emulate"]
    assert dequantize.BACKENDS is held
    # The caches' own constants too (a same-run A/B of the room a prefill grows).
    from engine.kvcache import base

    with spec_constants("kivi:k4v4:g64#PREFILL_AHEAD_CHUNKS=0"):
        assert base.PREFILL_AHEAD_CHUNKS == 0
    assert base.PREFILL_AHEAD_CHUNKS == 3
    with pytest.raises(SystemExit, match="no constant 'NOT_A_CONSTANT'"), spec_constants("kivi:k2v2#NOT_A_CONSTANT=1"):
        pass


def test_median_ms_times_only_the_runs_after_the_warmup() -> None:
    """benchmarks' one timing helper: `warmup` untimed runs, then `repeats` timed ones, each followed by `after`
    (untimed: the undo of what the run changed), and what a run returns evaluated inside its time."""
    from benchmarks.harness.common import median_ms

    calls: list[str] = []
    ms = median_ms(lambda: calls.append("run") or mx.ones(4) * 2, 3, warmup=2, after=lambda: calls.append("after"))
    assert calls == ["run", "after"] * 5 and ms >= 0
    sleeps = median_ms(lambda: None, 3, after=lambda: time.sleep(0.05))
    assert sleeps < 50  # the after step is outside the timed span


def test_prefill_layer_times_each_part_of_a_chunk_in_one_layer(tmp_path: Path) -> None:
    """benchmarks/prefill_layer.py on the tiny shape: a row per spec with each part's time; a compressed cache's parts
    include its encode and history decode, and the timed updates are trimmed back (the cache the attention runs on
    holds the history and one chunk)."""
    from benchmarks import prefill_layer

    out = tmp_path / "layer.json"
    specs = "fp16,kivi:k3v3:g64:s4:key_block=128:key_outliers=1:key_widths=uniform"
    assert prefill_layer.main(["--shape", "tiny", "--history", "384", "--chunk", "256", "--repeats", "1",
                               "--specs", specs, "--out", str(out)]) == 0
    fp16, kivi = json.loads(out.read_text())["rows"]
    assert set(fp16) == {"spec", "history", "chunk", "update_ms", "attend_ms", "nbytes"}
    assert all(kivi[f"{part}_ms"] > 0 for part in ("encode", "update", "history", "attend"))
    assert kivi["spec"].endswith("key_widths=uniform") and kivi["history"] == 384 and kivi["chunk"] == 256
    assert fp16["nbytes"] == 2 * 2 * 64 * 2 * 768  # K and V, 2 kv heads of 64, bf16, 640 tokens held in 768 slots
    from engine.kvcache.quant import fused

    assert prefill_layer.main(["--shape", "tiny", "--history", "384", "--chunk", "256", "--repeats", "1",
                               "--specs", "kivi:k4v4:g64#COMPILE_ENCODE=false", "--parts", "encode",
                               "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    # --parts: only the parts asked for; SPEC#NAME=VALUE: the constant recorded, and set back after the row
    assert set(row) == {"spec", "history", "chunk", "encode_ms", "nbytes", "kernel_constants"}
    assert row["spec"] == "kivi:k4v4:g64" and row["kernel_constants"] == {"COMPILE_ENCODE": False}
    assert fused.COMPILE_ENCODE is True


def _decode_record(rows: list[dict]) -> dict:
    shape = {"layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 64, "hidden": 256, "mlp": 512, "vocab": 512,
             "weight_bits": 4, "weight_group": 64, "dtype": "bfloat16"}
    return {"kind": "decode", "device": "Device(cpu, 0)", "gpu": "unknown (FileNotFoundError)", "mlx": "0.32.4",
            "shape": shape, "steps": 2, "warmup": 1, "rows": rows}


def test_plot_decode_draws_one_series_per_spec(tmp_path: Path) -> None:
    """benchmarks/plot_decode.py: valid SVG, one series per spec (a failed one too), bar heights in proportion to
    tok/s, the memory bound only where the rows carry it."""
    import xml.etree.ElementTree as ET

    from benchmarks import plot_decode

    rows = [
        {"spec": "fp16", "context": 257, "tok_s": 90.0, "vs_fp16": 1.0, "bound_tok_s": 900.0},
        {"spec": "fp16", "context": 1025, "tok_s": 60.0, "vs_fp16": 1.0, "bound_tok_s": 600.0},
        {"spec": "kivi:4:64", "context": 257, "tok_s": 45.0, "vs_fp16": 0.5, "bound_tok_s": 1000.0},
        {"spec": "kivi:4:64", "context": 1025, "tok_s": 30.0, "vs_fp16": 0.5, "bound_tok_s": 800.0},
        {"spec": "mlx-q:4", "context": 257, "error": "RuntimeError: no kernel"},
        {"spec": "mlx-q:4", "context": 1025, "error": "RuntimeError: no kernel"},
    ]
    source = tmp_path / "decode.json"
    source.write_text(json.dumps(_decode_record(rows)))
    out = tmp_path / "figure.svg"
    assert plot_decode.main(["--rows", str(source), "--out", str(out)]) == 0
    ns = "{http://www.w3.org/2000/svg}"
    svg = ET.parse(out).getroot()
    assert svg.tag == f"{ns}svg"
    series = {g.get("data-spec"): g for g in svg.iter(f"{ns}g") if g.get("class") == "series"}
    assert list(series) == ["fp16", "kivi:4:64", "mlx-q:4"]
    texts = "".join(t.text or "" for t in svg.iter(f"{ns}text"))
    assert "Whole-model decode, Device(cpu, 0), 2-layer model, 4-bit weights" in texts
    assert "failed at every context (RuntimeError)" in texts

    def bars(spec: str) -> list[float]:  # bar heights per context: the tok/s panel's, then the bound panel's
        return [float(r.get("height")) for r in series[spec].iter(f"{ns}rect") if r.find(f"{ns}title") is not None]

    fp16, kivi = bars("fp16"), bars("kivi:4:64")
    assert len(fp16) == len(kivi) == 4 and bars("mlx-q:4") == []
    assert kivi[0] / fp16[0] == pytest.approx(0.5, abs=0.01) and fp16[2] / fp16[0] == pytest.approx(60 / 90, abs=0.01)
    assert kivi[1] / fp16[1] == pytest.approx(0.045 / 0.1, abs=0.01)  # shares of the bound: 4.5 % against 10 %
    assert any(line.get("class") == "bound" for line in svg.iter(f"{ns}line"))

    for row in rows:
        row.pop("bound_tok_s", None)
    svg = ET.fromstring(plot_decode.render_svg(_decode_record(rows), "decode.json", title="T"))
    assert not any(line.get("class") == "bound" for line in svg.iter(f"{ns}line"))
    assert len([r for r in svg.iter(f"{ns}rect") if r.find(f"{ns}title") is not None]) == 4  # top panel only


def test_plot_decode_draws_the_loop_series_where_the_run_timed_it(tmp_path: Path) -> None:
    """--series loop: the bars are mlx-lm's loop (gen_tok_s) and say so; a run made with --no-generate is refused."""
    import xml.etree.ElementTree as ET

    from benchmarks import plot_decode

    rows = [
        {"spec": "fp16", "context": 257, "tok_s": 90.0, "gen_tok_s": 120.0, "gen_vs_fp16": 1.0},
        {"spec": "kivi:4:64", "context": 257, "tok_s": 45.0, "gen_tok_s": 90.0, "gen_vs_fp16": 0.75},
        {"spec": "mlx-q:4", "context": 257, "error": "RuntimeError: no kernel"},
    ]
    source = tmp_path / "decode.json"
    source.write_text(json.dumps(_decode_record(rows)))
    out = tmp_path / "figure.svg"
    assert plot_decode.main(["--rows", str(source), "--out", str(out), "--series", "loop"]) == 0
    ns = "{http://www.w3.org/2000/svg}"
    svg = ET.parse(out).getroot()
    series = {g.get("data-spec"): g for g in svg.iter(f"{ns}g") if g.get("class") == "series"}
    heights = {spec: [float(r.get("height")) for r in g.iter(f"{ns}rect") if r.find(f"{ns}title") is not None]
               for spec, g in series.items()}
    assert heights["kivi:4:64"][0] / heights["fp16"][0] == pytest.approx(0.75, abs=0.01) and heights["mlx-q:4"] == []
    titles = "".join(t.text or "" for t in svg.iter(f"{ns}title"))
    assert "90.0 tok/s, 0.75× fp16" in titles
    assert "mlx-lm's decode loop" in "".join(t.text or "" for t in svg.iter(f"{ns}text"))
    for row in rows:
        row.pop("gen_tok_s", None)
    with pytest.raises(ValueError, match="--no-generate"):
        plot_decode.render_svg(_decode_record(rows), "decode.json", series="loop")


def test_committed_decode_table_is_what_decode_table_writes(tmp_path: Path) -> None:
    """BENCHMARKS.md's whole-model decode table is decode_table.py's output for the committed run, so its figures are
    the JSON's; rewriting it changes nothing."""
    from benchmarks import decode_table

    text = decode_table.BENCHMARKS_MD.read_text(encoding="utf-8")
    copy = tmp_path / "BENCHMARKS.md"
    copy.write_text(text, encoding="utf-8")
    record = json.loads(decode_table.DEFAULT_ROWS.read_text())
    decode_table.write_section(record, "benchmarks/results/decode-h200.json", copy)
    assert copy.read_text(encoding="utf-8") == text, (
        "BENCHMARKS.md's decode table is stale: run `python benchmarks/decode_table.py`")
    assert text.count(decode_table.SECTION_START) == 1


def test_decode_table_shows_the_loop_failures_and_the_levels(tmp_path: Path) -> None:
    from benchmarks import decode_table

    level = "kivi:k3v3:g64:s4:key_block=128:rope=pre:rope_dims=128:rope_base=500000.0:rope_scale=1.0:rope_traditional=false"
    rows = [
        {"spec": "fp16", "context": 8193, "tok_s": 100.0, "vs_fp16": 1.0, "gen_tok_s": 140.0, "gen_vs_fp16": 1.0},
        {"spec": level, "context": 8193, "tok_s": 80.0, "vs_fp16": 0.8, "vs_fp16_range": [0.75, 0.85],
         "gen_tok_s": 126.0, "gen_vs_fp16": 0.9, "gen_vs_fp16_range": [0.9, 0.9]},
        {"spec": "mlx-q:4:64", "context": 8193,
         "error": "RuntimeError: [quantized_matmul] No implementation for problem shape: 4x8193x128x8"},
        {"spec": "fp16", "context": 131073, "tok_s": 70.0, "vs_fp16": 1.0, "gen_tok_s": 90.0, "gen_vs_fp16": 1.0},
        {"spec": "no-history", "context": 8193, "tok_s": 150.0, "vs_fp16": 1.5, "gen_tok_s": 168.0, "gen_vs_fp16": 1.2},
    ]
    lines = decode_table.table_lines({"rows": rows})
    assert lines[0] == "| cache | 8,193: step | loop | 131,073: step | loop |"
    assert lines[2] == "| `fp16` | 100.0 (1.00) | 140.0 (1.00) | 70.0 (1.00) | 90.0 (1.00) |"
    assert lines[3] == ("| 3-bit level (`kivi:k3v3:g64:s4:key_block=128:rope=pre`) | 80.0 (0.80; 0.75–0.85) "
                        "| 126.0 (0.90) |  |  |")
    assert lines[4] == ("| `mlx-q:4:64` (mlx-lm QuantizedKVCache) "
                        "| fails (`[quantized_matmul] No implementation for problem shape`) |  |  |  |")
    assert lines[5] == "| `no-history` (no cache: the most any cache reaches) | 150.0 (1.50) | 168.0 (1.20) |  |  |"
    unmarked = tmp_path / "notes.md"
    unmarked.write_text("# Notes\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no decode table markers"):
        decode_table.write_section({"rows": rows}, "x.json", unmarked)
    assert unmarked.read_text(encoding="utf-8") == "# Notes\n"


def test_decode_figure_legend_wraps_long_specs_and_leaves_out_the_models_rope() -> None:
    from benchmarks import plot_decode

    spec = ("kivi:k4v4:g64:s4:key_block=128:rotate_values=true:wide=0.1:wide_layers=L1.10.18:rope=pre:rope_dims=128:"
            "rope_base=500000.0:rope_scale=1.0:rope_traditional=false")
    lines = plot_decode.legend_lines(spec)
    assert "".join(lines) == "kivi:k4v4:g64:s4:key_block=128:rotate_values=true:wide=0.1:wide_layers=L1.10.18:rope=pre"
    assert len(lines) > 1 and all(len(line) <= plot_decode.LEGEND_CHARS for line in lines)
    assert plot_decode.legend_lines("affine:k4v4:g64") == ["affine:k4v4:g64"]
    assert plot_decode.legend_lines("mlx-q:4:64") == ["mlx-q:4:64 (mlx-lm QuantizedKVCache)"]
    assert plot_decode.legend_lines("no-history") == ["no-history (no cache: the ceiling)"]


def test_committed_decode_figure_is_what_plot_decode_draws() -> None:
    from benchmarks import plot_decode

    record = json.loads(plot_decode.DEFAULT_ROWS.read_text())
    expected = plot_decode.render_svg(record, "benchmarks/results/decode-h200.json")
    assert plot_decode.DEFAULT_OUT.read_text(encoding="utf-8") == expected, (
        "docs/figures/decode-h200.svg is stale: run `python benchmarks/plot_decode.py`")


def test_needle_grid_is_sized_from_the_command_line() -> None:
    """`--needle-seeds 4 --needle-lengths 1024,4096` give 40 trials per cache (4 seeds x 5 depths x 2 lengths)."""
    import argparse

    from benchmarks.harness.cli import Context, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    plan = Context(parser.parse_args(["quality", "--needle-seeds", "4", "--needle-lengths", "1024,4096"])).plan
    assert plan.needle_seeds == (0, 1, 2, 3) and plan.needle_lengths == (1024, 4096)
    assert len(plan.needle_seeds) * len(plan.needle_depths) * len(plan.needle_lengths) == 40
    assert Context(parser.parse_args(["quality"])).plan.needle_seeds == (0, 1)


def test_a_needle_grid_without_the_16bit_cache_is_refused_before_its_trials() -> None:
    """Recall is reported against fp16's own trials: without fp16 among the specs the run would spend its trials (minutes
    each on a GPU) and fail when it combines them, so it is refused first."""
    from types import SimpleNamespace

    from benchmarks.harness.cli import BenchmarkError, _quality_needle

    with pytest.raises(BenchmarkError, match="needs 'fp16'"):
        _quality_needle(None, [SimpleNamespace(text="kivi:k4v4:g64")])  # type: ignore[arg-type]


def test_workers_started_together_share_one_engine_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench quality --jobs N` starts its workers at once, each making the engine link in the temporary folder: made
    aside and renamed into place, none of them fails on another's link (a needle run on the H200 stopped so)."""
    import os
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from benchmarks.harness import worker

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # A link left by another checkout: every worker finds it wrong and replaces it at once.
    stale = tmp_path / f"velox-bench-{os.getuid()}" / "pythonpath" / "engine"
    stale.parent.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    stale.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with ThreadPoolExecutor(8) as pool:
        folders = list(pool.map(lambda _: worker.engine_pythonpath(), range(64)))
    assert len(set(folders)) == 1
    link = Path(folders[0]) / "engine"
    assert link.is_symlink() and (link / "__init__.py").is_file()
    assert sorted(p.name for p in Path(folders[0]).iterdir()) == ["engine"]  # nothing left aside

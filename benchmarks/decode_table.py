"""BENCHMARKS.md's whole-model decode table (issue 11), written from the committed run rather than by hand.

    python benchmarks/decode_table.py [--rows benchmarks/results/decode-h200.json] [--markdown BENCHMARKS.md]

The table sits between the markers SECTION_START and SECTION_END; this rewrites what is between them from the
rows file (`velox bench decode`'s JSON, or several runs merged with `decode.py --merge`), so the figures there are the
JSON's by construction (tests/test_bench.py checks that the committed section is what this writes). A row per cache
in the run's order; per context the step's tok/s and, in brackets, its ratio to fp16 in the same run (with --rounds:
the median of the per-round ratios and their range); where the run also timed mlx-lm's own loop (`gen_tok_s`), a
second column per context with the loop's. A cache that failed says why.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ROWS = ROOT / "benchmarks" / "results" / "decode-h200.json"
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
SECTION_START = ("<!-- decode_table:start: written by `python benchmarks/decode_table.py` from "
                 "benchmarks/results/decode-h200.json -->")
SECTION_END = "<!-- decode_table:end -->"

# The spec's model RoPE, which the builder writes after `rope=pre`, is the same for every row of a run: left out.
_ROPE_FIELDS = ("rope_dims=", "rope_base=", "rope_scale=", "rope_traditional=")
_PEERS = {"mlx-kv": "mlx-lm KVCache", "mlx-q": "mlx-lm QuantizedKVCache"}
# The app's levels as decode.py runs them start so (recommend.LEVEL_TABLE, with the GPU's options written in).
_LEVEL_PREFIX = "kivi:k{bits}v{bits}:g64:s4:"


def cache_label(spec: str) -> str:
    """A row's first cell: the spec (its model RoPE left out) in backticks, named where it is a peer or an app level."""
    shown = ":".join(part for part in spec.split(":") if not part.startswith(_ROPE_FIELDS))
    label = f"`{shown}`"
    if spec == "no-history":  # decode.py's ceiling row
        return f"{label} (no cache: the most any cache reaches)"
    family = spec.split(":")[0]
    if family in _PEERS:
        return f"{label} ({_PEERS[family]})"
    if spec == "kivi:k8v8:g64":
        return f"{label} (8-bit level)"
    for bits in (4, 3, 2):
        if spec.startswith(_LEVEL_PREFIX.format(bits=bits)):
            return f"{bits}-bit level ({label})"
    return label


def _speed(row: dict[str, Any], speed: str, ratio: str) -> str:
    if speed not in row:
        return ""
    text = f"{row[speed]:.1f}"
    if row["spec"] == "fp16":
        return f"{text} (1.00)"
    if ratio not in row:
        return text
    low_high = row.get(f"{ratio}_range")
    spread = f"; {low_high[0]:.2f}–{low_high[1]:.2f}" if low_high and low_high[0] != low_high[1] else ""
    return f"{text} ({row[ratio]:.2f}{spread})"


def failure(error: str) -> str:
    """What a failed row's cells say: the error's message without its type, cut before its details."""
    kind, _, rest = error.partition(" ")
    message = (rest if kind.endswith(":") else error).split(": ")[0].strip()  # "RuntimeError: ..." -> "..."
    return f"fails (`{message}`)"


def table_lines(record: dict[str, Any]) -> list[str]:
    """The table's markdown lines for one decode record."""
    rows = record["rows"]
    contexts = list(dict.fromkeys(row["context"] for row in rows))
    specs = list(dict.fromkeys(row["spec"] for row in rows))
    by_key = {(row["spec"], row["context"]): row for row in rows}
    loop = any("gen_tok_s" in row for row in rows)
    header = ["cache"]
    for context in contexts:
        header += [f"{context:,}: step", "loop"] if loop else [f"{context:,}"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for spec in specs:
        cells = [cache_label(spec)]
        for context in contexts:
            row = by_key.get((spec, context))
            if row is None:
                cells += ["", ""] if loop else [""]
            elif "error" in row:
                cells += [failure(row["error"]), ""] if loop else [failure(row["error"])]
            else:
                cells.append(_speed(row, "tok_s", "vs_fp16"))
                if loop:
                    cells.append(_speed(row, "gen_tok_s", "gen_vs_fp16"))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def section_lines(record: dict[str, Any], source: str) -> list[str]:
    """The whole section between (and with) its markers."""
    steps, warmup, rounds = record.get("steps", "?"), record.get("warmup", "?"), record.get("rounds", 1)
    how = (f"tok/s of one whole-model step (median of {steps} after {warmup} warm-ups"
           + (f", in {rounds} interleaved rounds" if rounds > 1 else "") + ")")
    if any("gen_tok_s" in row for row in record["rows"]):
        how += f"; *loop*: mlx-lm's own decode loop over the same caches, {steps} tokens a round"
    ratio = ("in brackets the ratio to fp16 in the same run"
             + ("; the median of the per-round ratios and their range" if rounds > 1 else ""))
    intro = textwrap.wrap(f"{how}; {ratio}. Data: `{source}`.", width=118, break_on_hyphens=False)
    return [SECTION_START, "", *intro, "", *table_lines(record), "", SECTION_END]


def write_section(record: dict[str, Any], source: str, markdown: Path = BENCHMARKS_MD) -> None:
    """Rewrite the section between the markers of `markdown`; a file without them is an error, not appended to."""
    text = markdown.read_text(encoding="utf-8")
    if SECTION_START not in text or SECTION_END not in text:
        raise ValueError(f"{markdown} has no decode table markers ({SECTION_START!r} ... {SECTION_END!r}).")
    before, rest = text.split(SECTION_START, 1)
    _, after = rest.split(SECTION_END, 1)
    markdown.write_text(before + "\n".join(section_lines(record, source)) + after, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=str(DEFAULT_ROWS), help="a decode.py JSON file (default: %(default)s)")
    parser.add_argument("--markdown", default=str(BENCHMARKS_MD), help="the file to rewrite (default: %(default)s)")
    args = parser.parse_args(argv)
    rows_path = Path(args.rows)
    try:
        source = str(rows_path.resolve().relative_to(ROOT))
    except ValueError:
        source = rows_path.name
    write_section(json.loads(rows_path.read_text()), source, Path(args.markdown))
    print(f"wrote the decode table of {source} into {args.markdown}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

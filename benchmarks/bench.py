"""Run `velox bench` from a checkout without installing: the harness lives in benchmarks/harness/.

    python benchmarks/bench.py quality|memory|speed|all|report [--quick] [--out DIR] [...]
    python benchmarks/bench.py decode --out FILE [...]   (benchmarks/decode.py's options)

Same arguments as `velox bench` (see `python benchmarks/bench.py --help`). Results: benchmarks/results/*.json;
report: BENCHMARKS.md and docs/figures/*.png. The prose is `--text FILE`, else botchan.txt and areopagitica.txt
in the folder $VELOX_BENCH_DATA names, else (a developer checkout's default) in ../shared/data.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness.cli import main  # noqa: E402  (MLX-free; main prepares the CPU fast path first)

if __name__ == "__main__":
    sys.exit(main())

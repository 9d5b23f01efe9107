"""Attention only of a Llama-3.1-8B-shaped decode step on a GPU (benchmarks/harness/gpu.py), for the `device` machine.

Not a decode speed: no projections, MLP or sampling; whole-model decode is benchmarks/decode.py (`velox bench decode`).

    python benchmarks/gpu_attention.py --out benchmarks/results/gpu.json [--contexts ...] [--specs ...]
    python benchmarks/gpu_attention.py --probe --out gpu-probe.json   (which quantized shapes run at all)

On the lent H200: run `../shared/tools/mlx-cuda-wheels` here first and make its two device calls; the second
one runs `PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_attention.py --out $OUT/gpu.json`. Copy the JSON
to benchmarks/results/gpu.json and run `velox bench report`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness.gpu import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

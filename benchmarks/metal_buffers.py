"""The buffer arguments each kernel takes on Metal, as MLX's Metal front end binds them (one per input, per input shape
the body reads, per output), against the 31 a Metal kernel gets; no GPU needed.

    python benchmarks/metal_buffers.py [--out FILE]

The kernels are those the tests assemble for every backend (tests/test_kvcache_kernels.py, ALL_SOURCES); a kernel
past the limit is declined on Metal (engine/kvcache/kernels/backend.py, over_buffer_limit).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/metal-buffers.json"))
    args = parser.parse_args(argv)
    from engine.kvcache.kernels.backend import METAL_MAX_BUFFERS, buffer_arguments
    from tests.test_kvcache_kernels import ALL_SOURCES

    rows = sorted(({"kernel": s.name, "buffers": buffer_arguments(s), "inputs": len(s.input_names),
                    "outputs": len(s.output_names)} for s in ALL_SOURCES), key=lambda r: (-r["buffers"], r["kernel"]))
    for row in rows:
        mark = "  past the limit" if row["buffers"] > METAL_MAX_BUFFERS else ""
        print(f"{row['buffers']:3d} {row['kernel']}{mark}")
    record = {"schema": "velox-bench/1", "kind": "metal-buffers", "limit": METAL_MAX_BUFFERS, "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

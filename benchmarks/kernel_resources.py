"""Compile the CUDA decode kernels offline with nvcc and print each one's registers, spills and shared memory.

    python benchmarks/kernel_resources.py [--arch sm_90a] [--head-dim 128] [--rows 4] [--show NAME]
                                          [--only "LABEL;..."] [--instructions] [--out FILE]

With --instructions (needs `cuobjdump`, on PATH or from the wheel `pip install nvidia-cuda-cuobjdump`) it also
counts the machine instructions (SASS) of the tiled pass's tile loop, per stretch between its barriers: staging,
phase 1 (scores; its channel loop's body and trip count beside it), phase 2 (softmax), phase 3 (values). Static
counts of straight-line code are what every thread executes per tile; a GPU run still decides speed.

No GPU is needed, only a CUDA toolkit (`nvcc` on PATH). Each kernel is wrapped exactly as MLX's
`mx.fast.cuda_kernel` wraps a body (mlx/backend/cuda/custom_kernel.cpp: pointer arguments per input,
`<name>_shape` arguments where the body names them, template arguments as constexpr ints and type aliases)
and compiled for the H200's architecture as MLX's NVRTC does. A kernel that spills registers to local memory
or runs out of them shows here before any device time is spent; ptxas's numbers are also what sets the
occupancy (threads resident per multiprocessor) the kernel can reach.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.kvcache.kernels.backend import KernelSource, cuda_unit  # noqa: E402
from engine.kvcache.kernels.decode import (  # noqa: E402
    MERGE_SOURCE,
    TABLE_SLOTS,
    TILED_RUN,
    UNROLL,
    Codec,
    attend_source,
    choose_pass,
    rope_by_step,
    staged_tables,
    threads_for,
)

# A stand-in for "mlx/backend/cuda/device/utils.cuh": only what the wrapper and our bodies use.
_SHIM = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cstdint>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
}
"""

_CUDA_TYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half", "uint32": "uint32_t",
               "uint8": "uint8_t", "int32": "int32_t"}


def wrap(source: KernelSource, input_types: dict[str, str], output_types: dict[str, str],
         template: list[tuple[str, object]]) -> str:
    """The CUDA translation unit MLX would compile for `source` with these dtypes and template arguments."""
    names = (*source.input_names, *source.output_names)
    types = {name: _CUDA_TYPES[{**input_types, **output_types}.get(name, "float32")] for name in names}
    return cuda_unit(source, types, [(name, _CUDA_TYPES[value] if isinstance(value, str) else int(value))
                                     for name, value in template], _SHIM)


def compile_resources(unit: str, arch: str, sass: list[str] | None = None) -> dict[str, int | str]:
    """ptxas -v figures of one translation unit: registers, spill stores/loads (bytes), shared memory; with
    `sass` (a list), the cubin's disassembly lines are appended to it (cuobjdump -sass)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cu"
        path.write_text(unit)
        result = subprocess.run(
            ["nvcc", f"-arch={arch}", "-cubin", "-o", str(Path(tmp) / "kernel.cubin"), "-Xptxas", "-v",
             "--std=c++17", str(path)],
            capture_output=True, text=True,
        )
        if sass is not None and not result.returncode:
            dump = subprocess.run([cuobjdump(), "-sass", str(Path(tmp) / "kernel.cubin")], capture_output=True,
                                  text=True, check=True, env=_with_nvdisasm())
            sass.extend(dump.stdout.splitlines())
    log = result.stdout + result.stderr
    if result.returncode:
        return {"error": log[-3000:]}
    figures: dict[str, int | str] = {}
    for key, pattern in (("registers", r"Used (\d+) registers"), ("spill_stores", r"(\d+) bytes spill stores"),
                         ("spill_loads", r"(\d+) bytes spill loads"), ("stack", r"(\d+) bytes stack frame"),
                         ("shared", r"(\d+) bytes smem")):
        found = re.search(pattern, log)
        figures[key] = int(found.group(1)) if found else 0
    return figures


_NEEDS_CUOBJDUMP = ("--instructions needs cuobjdump and nvdisasm: a CUDA toolkit's, or `pip install "
                    "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`.")


def _wheel_tool(name: str) -> str | None:
    """`name` on PATH, else the one an `nvidia-cuda-<name>` wheel installed in this Python (nvidia/cu*/bin)."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in map(Path, nvidia.__path__):
        for candidate in sorted(root.glob(f"cu*/bin/{name}")):
            return str(candidate)
    return None


def cuobjdump() -> str:
    """cuobjdump on PATH, else the one of the `nvidia-cuda-cuobjdump` wheel in this Python."""
    return _wheel_tool("cuobjdump") or sys.exit(_NEEDS_CUOBJDUMP)


def _with_nvdisasm() -> dict[str, str]:
    """The environment with NVDISASM_PATH set where nvdisasm is a wheel's (cuobjdump -sass runs it)."""
    import os

    found = _wheel_tool("nvdisasm") or sys.exit(_NEEDS_CUOBJDUMP)
    return {**os.environ, "NVDISASM_PATH": str(Path(found).parent)}


_SASS_LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"BRA (0x[0-9a-f]+)")


def tile_loop_counts(sass: list[str]) -> dict[str, int]:
    """Instruction counts of the tiled pass's tile loop (first barrier to the branch back to it), per stretch
    between barriers, and the size of phase 1's inner loop (the first backward branch inside its stretch)."""
    code = [(int(m.group(1), 16), m.group(2)) for m in map(_SASS_LINE.match, sass) if m]
    barriers = [at for at, text in code if text.startswith("BAR.SYNC")]
    if len(barriers) < 4:
        return {}
    start = barriers[0]
    back = [at for at, text in code if (b := _BRANCH.search(text)) and int(b.group(1), 16) == start]
    end = back[0] if back else barriers[-1]
    inside = [at for at in barriers if start <= at <= end] + [end + 16]
    names = ("staging", "phase 1", "phase 2", "phase 3")
    counts = {name: sum(1 for at, _ in code if lo <= at < hi)
              for name, lo, hi in zip(names, inside, inside[1:], strict=False)}
    lo, hi = inside[1], inside[2]
    for at, text in code:
        b = _BRANCH.search(text)
        if lo <= at < hi and b and lo <= int(b.group(1), 16) < at:
            counts["phase 1 loop body"] = sum(1 for a, _ in code if int(b.group(1), 16) <= a <= at)
            break
    return counts


# Instruction kinds token_loop_counts reports (SASS opcodes up to their first dot, e.g. LDS for LDS.128).
_MIX = ("LDS", "LDG", "FFMA", "FADD", "FMUL", "FSEL", "SHFL", "MUFU")


def token_loop_counts(sass: list[str]) -> dict[str, Any]:
    """The per-subgroup pass's token loop (its longest backward branch: one iteration takes U tokens a subgroup):
    its instruction count and the number of each kind in _MIX, 16-byte shared reads (LDS.128) apart."""
    code = [(int(m.group(1), 16), m.group(2)) for m in map(_SASS_LINE.match, sass) if m]
    best: list[str] = []
    for at, text in code:
        b = _BRANCH.search(text)
        if b and int(b.group(1), 16) < at:
            body = [t for a, t in code if int(b.group(1), 16) <= a <= at]
            best = body if len(body) > len(best) else best
    ops = [re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for text in best]
    counts: dict[str, Any] = {"instructions": len(best)}
    counts.update({kind: sum(1 for op in ops if op.split(".")[0] == kind) for kind in _MIX})
    counts["LDS.128"] = sum(1 for op in ops if op == "LDS.128")
    return counts


# (label, key codec, value codec, group size, key block): the pairs the methods hand the decode kernel.
PAIRS = (
    ("kivi 4 (app 4-bit level)", Codec("kivi_keys", 4), Codec("affine", 4), 64, 128),
    ("kivi 3", Codec("kivi_keys", 3), Codec("affine", 3), 64, 128),
    ("kivi 2", Codec("kivi_keys", 2), Codec("affine", 2), 64, 128),
    ("kivi 2, key grid", Codec("kivi_keys", 2, grid=True), Codec("affine", 2), 64, 128),
    ("kivi 4, keys before RoPE", Codec("kivi_keys", 4), Codec("affine", 4), 64, -128),  # key block < 0: ROPE
    ("kivi 3, key outliers, scale-only values", Codec("kivi_keys", 3, outliers=True), Codec("affine", 3, symmetric=True),
     64, 128),
    ("kivi 3, key outliers before RoPE (3-bit level)", Codec("kivi_keys", 3, outliers=True),
     Codec("affine", 3, symmetric=True), 64, -128),
    # key channels at 2-5 bits averaging 3 (key_widths), keys as given, class by class and uniform (suffix), and before
    # RoPE
    ("kivi 3, key widths (3-bit layout)", Codec("kivi_keys", 3, outliers=True, widths=(2, 3, 4, 5)),
     Codec("affine", 3, symmetric=True), 64, 128),
    ("kivi 3, key widths, uniform runs", Codec("kivi_keys", 3, outliers=True, widths=(2, 3, 4, 5)),
     Codec("affine", 3, symmetric=True), 64, 128),
    ("kivi 3, key widths before RoPE", Codec("kivi_keys", 3, outliers=True, widths=(2, 3, 4, 5)),
     Codec("affine", 3, symmetric=True), 64, -128),
    ("kivi 3, key widths, no prefetch", Codec("kivi_keys", 3, outliers=True, widths=(2, 3, 4, 5)),
     Codec("affine", 3, symmetric=True), 64, 128),
    # keys before RoPE turned a run at a time (decode.ROPE_STEP_BACKENDS): the 4-bit keys and the 3-bit level's layout
    ("kivi 4, keys before RoPE, by step", Codec("kivi_keys", 4), Codec("affine", 4), 64, -128),
    ("kivi 3, key widths before RoPE, by step", Codec("kivi_keys", 3, outliers=True, widths=(2, 3, 4, 5)),
     Codec("affine", 3, symmetric=True), 64, -128),
    ("affine 4", Codec("affine", 4), Codec("affine", 4), 64, None),
    ("turboquant 4", Codec("codebook", 4), Codec("codebook", 4), 64, None),
    ("rvq 4", Codec("rvq", 2, 2), Codec("rvq", 2, 2), 64, None),
    ("qjl 4", Codec("qjl", 4), Codec("affine", 4), 64, None),
    ("turboquant_prod 4", Codec("prod", 3), Codec("codebook", 4), 64, None),
    # the centroid tables in threadgroup memory (decode.STAGED_TABLE_BACKENDS)
    ("turboquant 4, staged tables", Codec("codebook", 4), Codec("codebook", 4), 64, None),
    ("rvq 4, staged tables", Codec("rvq", 2, 2), Codec("rvq", 2, 2), 64, None),
    ("turboquant_prod 4, staged tables", Codec("prod", 3), Codec("codebook", 4), 64, None),
)


def attend_unit(key: Codec, value: Codec, group: int, key_block: int | None, head_dim: int, rows: int,
                uniform: bool = False, prefetch: bool = True, staged: bool = False, by_step: bool = False) -> str:
    rope = key_block is not None and key_block < 0  # PAIRS marks the rope=pre variant by a negative key block
    key_block = abs(key_block) if key_block is not None else None
    chosen = choose_pass(key, value, group, head_dim, key_block, rows, "cuda")  # the pass plan_decode picks
    source, tile = (attend_source(key, value), None) if chosen is None else chosen[:2]
    if staged:
        source = staged_tables(source)
    if by_step:
        source = rope_by_step(source)
    template = [("D", head_dim), ("R", rows), ("NT", threads_for(head_dim)), ("G", group),
                ("GK", key_block or group), ("CT", tile or 64), ("U", UNROLL), ("KB", key.widest),
                ("VB", value.bits), ("KGRID", int(key.grid)), ("VGRID", int(value.grid)), ("PF", int(prefetch)), ("TT", TILED_RUN),
                ("ROPE", int(rope)), ("TRAD", 0), ("KO", int(key.outliers)), ("VSYM", int(value.symmetric)), ("CS", 4), ("NS", 4),
                ("KCLS", len(key.widths)), ("KBLO", key.widths[0] if key.widths else key.bits),
                ("KUNI", int(uniform)), ("KMEAN", key.bits),
                ("TD", "bfloat16")]
    types = {"qry": "bfloat16", "qry2": "float32", "qscale": "float32", "sink_k": "bfloat16", "sink_v": "bfloat16",
             "win_k": "bfloat16", "win_v": "bfloat16", "n_comp_r": "uint8", "n_win_r": "uint8", "grids": "float32",
             "rfreq": "float32", "kout": "float16", "kidx": "uint8", "kends": "int32", "kord": "uint8", "kinv": "uint8",
             **{f"w{c}c": "uint32" for c in range(1, 4)}}
    for prefix, codec in (("k", key), ("v", value)):
        for slot in range(codec.slots):
            codes = slot == 0 or (codec.kind == "rvq" and slot == 3) or (codec.kind == "prod" and slot == 4)
            small = slot in (table for table, _ in TABLE_SLOTS.get(codec.kind, ()))  # float32 centroids
            types[f"{prefix}{slot}"] = "uint32" if codes else ("float32" if small else "bfloat16")
    return wrap(source, types, {}, template)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rows", type=int, default=4, help="query heads per kv head (GQA)")
    parser.add_argument("--show", help="print the translation unit of the pair whose label starts with this")
    parser.add_argument("--only", help="compile only the pairs whose labels are among these (separated by semicolons)")
    parser.add_argument("--instructions", action="store_true",
                        help="also count SASS instructions: the tiled pass's per phase, the per-subgroup pass's token "
                             "loop (needs cuobjdump and nvdisasm)")
    parser.add_argument("--out", help="also write the figures to this JSON file")
    args = parser.parse_args()
    if shutil.which("nvcc") is None:
        sys.exit("nvcc is not on PATH: a CUDA toolkit is needed to compile the kernels offline.")
    units = [(label, attend_unit(k, v, g, kb, args.head_dim, args.rows, uniform="uniform" in label,
                                 prefetch="no prefetch" not in label, staged="staged tables" in label,
                                 by_step="by step" in label))
             for label, k, v, g, kb in PAIRS
             if not args.only or label in {name.strip() for name in args.only.split(";")}]
    units.append(("merge", wrap(MERGE_SOURCE, {}, {"out": "bfloat16"},
                                [("D", args.head_dim), ("R", args.rows), ("NM", max(32, args.head_dim)),
                                 ("MAXS", 256), ("ROT", 1), ("TO", "bfloat16")])))
    rows = []
    for label, unit in units:
        if args.show and label.startswith(args.show):
            print(unit)
        sass: list[str] | None = [] if args.instructions and label != "merge" else None
        figures = compile_resources(unit, args.arch, sass)
        if sass and "tiled" in unit.split("__global__ void ")[1][:40]:
            figures["tile loop"] = tile_loop_counts(sass)
        elif sass:
            figures["token loop"] = token_loop_counts(sass)
        print(f"{label:28s} {figures}")
        rows.append({"kernel": label, **figures})
    if args.out:
        record = {"schema": "velox-bench/1", "kind": "kernel-resources", "arch": args.arch, "head_dim": args.head_dim,
                  "rows_per_kv_head": args.rows, "command": " ".join(["python benchmarks/kernel_resources.py",
                                                                      *sys.argv[1:]]), "kernels": rows}
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()

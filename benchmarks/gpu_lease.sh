#!/usr/bin/env bash
# One call's work on the lent GPU (the device tool), once MLX's CUDA build is installed there. The install comes from
# ../shared/tools/mlx-cuda-wheels (run here first; it rewrites .devwhl/): 1st call `bash .devwhl/a/stage.sh` carrying
# .devwhl/a; 2nd call carrying .devwhl/b (and .devwhl/c for pytest-xdist, below), within ~30 s:
#
#   bash .devwhl/b/install.sh && bash benchmarks/gpu_lease.sh parity [PYTEST -k EXPRESSION]
#   bash .devwhl/b/install.sh && bash benchmarks/gpu_lease.sh levels 8193,32769 [--prefill 32768]
#   bash .devwhl/b/install.sh && bash benchmarks/gpu_lease.sh methods 131073
#   bash .devwhl/b/install.sh && bash benchmarks/gpu_lease.sh ceiling [8193,32769,131073]
#   bash .devwhl/b/install.sh && bash benchmarks/gpu_lease.sh buffers [32769]
#   bash .devwhl/b/install.sh && bash benchmarks/gpu_lease.sh timeline 131073
#
# parity:   the GPU parity tests of tests/test_kvcache_kernels.py (default: every one), 12 processes where
#           pytest-xdist's wheels are in .devwhl/c (`pip download --no-deps --only-binary=:all: --python-version 3.12
#           --implementation cp -d .devwhl/c pytest-xdist execnet`); each failure is written to $OUT/fail.txt as it
#           happens, so a call cut short by its time limit still names them.
# levels:   decode.py's whole-model table of the app's three levels beside fp16, mlx-lm's KVCache and the ceiling row
#           (no-history: the model without reading any history) at CONTEXTS
#           (2 interleaved rounds of 128 steps: a key block's cycle, so the loop's mean holds one block's encode);
#           extra arguments go to decode.py (--prefill 32768 adds the 32k prefill of the same caches).
# methods:  the same for every other method of the canonical table (BENCHMARKS.md, whole-model decode), beside fp16.
# ceiling:  issue 11's ratio targets against what any cache can reach: fp16, the no-history row (no cache: the model
#           without reading any history) and the 4- and 2-bit levels, at CONTEXTS (default 8k, 32k and 131k), as levels.
# buffers:  how often MLX's CUDA backend hands the GPU a graph of the recorded kernels (a launch every 100 operations
#           or ~1,000 M elements of inputs on an H100/H200: MLX_MAX_OPS_PER_BUFFER, MLX_MAX_MB_PER_BUFFER, read once per
#           process) against fp16's, the 4-bit level's and the no-history row's step and loop at CONTEXT: the default,
#           fewer and larger graphs (1,000 ops / 8,000), smaller ones (25 ops) and none (MLX_USE_CUDA_GRAPHS=0: each
#           kernel launched as it is evaluated), one process each (BUFFERS_LIMITS picks some, e.g. "default no-graphs").
# timeline: the GPU's own record of fp16's and the 4-bit level's step and loop (gpu_timeline.py: weights_busy_ms,
#           ratio_ceiling) at one context.
# Everything is written under $OUT; MLX's PTX cache is kept at /tmp/mlx for the calls of one warm machine. A fresh
# machine compiles every kernel first (tens of seconds a level): give a call's first part room for it.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/site:$PWD
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/mlx}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

# The app's levels as a GPU builds them for decode.py's 8B shape (wide layers named for that synthetic model; the key
# widths calibrated on it by decode.make_caches; keys before RoPE where the level takes rope=auto on a GPU).
L4='kivi:k4v4:g64:s4:key_block=128:rotate_values=true:wide=0.1:wide_layers=L1.10.18:key_widths=calibrated'
L3='kivi:k3v3:g64:s4:key_block=128:rotate_values=true:symmetric_values=true:key_outliers=1:wide=0.1:wide_layers=L1.10.18:key_widths=calibrated:rope=pre'
L2='kivi:k2v2:g64:s4:clip_search=true:key_block=128:rotate_values=true:wide=0.1:wide_layers=L1.10.18:key_widths=calibrated:rope=pre'
LEVELS="fp16,no-history,mlx-kv,$L4,$L3,$L2"
METHODS='fp16,mlx-q:4:64,affine:k4v4:g64,rotated:k4v4:g64,kivi:k4v4:g64,kivi:k8v8:g64,turboquant:k4v4:g64,turboquant:k3v3:g64,rvq:k4v4:g64,rvq:k3v3:g64'

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
git log -1 --format=%h > "$OUT/commit.txt" 2>/dev/null || true

case "${1:-}" in
  parity)
    workers=()
    if ls .devwhl/c/pytest_xdist-*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .devwhl/c/*.whl >/dev/null 2>&1 && workers=(-n 12)
    fi
    mkdir -p /tmp/velox-failnow
    cat > /tmp/velox-failnow/failnow.py <<'EOF'
"""pytest plugin: each failure written to $OUT/fail.txt the moment it happens."""
import os


def pytest_runtest_logreport(report):
    if report.failed:
        with open(os.path.join(os.environ["OUT"], "fail.txt"), "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")
EOF
    expression=${2:-}
    PYTHONPATH=$PYTHONPATH:/tmp/velox-failnow OUT=$OUT timeout "${PARITY_SECONDS:-480}" python3 -m pytest -p failnow \
      "${workers[@]}" -q --no-header -p no:cacheprovider tests/test_kvcache_kernels.py ${expression:+-k "$expression"} \
      > "$OUT/parity.log" 2>&1
    echo "parity rc=$?" | tee -a "$OUT/parity.log"
    tail -8 "$OUT/parity.log"
    ;;
  levels|methods|ceiling)
    kind=$1
    specs=$LEVELS contexts=${2:-}
    case $kind in
      methods) specs=$METHODS ;;
      ceiling) specs="fp16,no-history,$L4,$L2" contexts=${contexts:-8193,32769,131073} ;;
    esac
    [ -n "$contexts" ] || { echo "contexts?" >&2; exit 2; }
    shift $(( $# < 2 ? $# : 2 ))
    name="decode-$kind-${contexts//,/-}"
    timeout "${DECODE_SECONDS:-560}" python3 benchmarks/decode.py --out "$OUT/$name.json" --contexts "$contexts" \
      --specs "$specs" --rounds 2 --steps 128 "$@" 2>&1 | tee "$OUT/$name.log" | grep -v "^ " | tail -30
    ;;
  buffers)
    context=${2:-32769}
    for limits in ${BUFFERS_LIMITS:-default 1000:8000 25:1000 no-graphs}; do
      name="decode-buffers-${limits/:/-}-$context"
      ops=${limits%%:*} mb=${limits##*:}
      case $limits in
        default) settings=() ;;
        no-graphs) settings=(MLX_USE_CUDA_GRAPHS=0) ;;  # each kernel launched on the stream as it is evaluated
        *) settings=("MLX_MAX_OPS_PER_BUFFER=$ops" "MLX_MAX_MB_PER_BUFFER=$mb") ;;
      esac
      env "${settings[@]}" \
        timeout "${BUFFERS_SECONDS:-140}" python3 benchmarks/decode.py --out "$OUT/$name.json" --contexts "$context" \
        --specs "fp16,no-history,$L4" --rounds 2 --steps 128 > "$OUT/$name.log" 2>&1
      echo "$limits rc=$?"; grep -v "^ " "$OUT/$name.log" | grep -E "tok/s|ceiling" | tail -4
    done
    ;;
  timeline)
    context=${2:?context}
    timeout "${TIMELINE_SECONDS:-400}" python3 benchmarks/gpu_timeline.py --specs "fp16,$L4" --context "$context" \
      --steps 16 --top 8 --out "$OUT/gpu-timeline-$context.json" > "$OUT/gpu-timeline-$context.log" 2>&1
    echo "timeline rc=$?" >> "$OUT/gpu-timeline-$context.log"
    grep -v "^    " "$OUT/gpu-timeline-$context.log" | tail -8
    ;;
  *)
    sed -n '2,25p' "$0"
    exit 2
    ;;
esac

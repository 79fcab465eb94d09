#!/usr/bin/env bash
# The real-GPU check of numba_fused: versions, the GPU tests on hardware (simulator
# off), then the GPU benchmark (bf16 and f32; 32768x4096, 8192x32768, 1024x262144;
# fwd and bwd of each op; GB/s of minimal traffic vs a device-to-device copy of the
# same run and vs torch's own kernels). Needs no network.
#
# Usage: benchmarks/gpu_check.sh OUT.md [extra benchmarks/gpu_bench.py arguments]
#   OUT.md        the benchmark table (Markdown) is written here; the log of the
#                 tests goes to OUT.md.tests.log, the `numba-fused bench --device gpu`
#                 table (when that CLI exists) to OUT.md.cli.md (to OUT.md with
#                 GPU_CHECK_BENCH=cli)
# Environment:
#   GPU_CHECK_SIMULATOR=1   dry run in the CUDA simulator (tiny shapes, no tests):
#                           exercises the script, argument parsing and table output
#   GPU_CHECK_SKIP_TESTS=1  benchmark only
#   NUMBA_FUSED_GPU_BIG=0   skip the 2^31-element tests (default: run them)
#   GPU_CHECK_BENCH=own|cli|both  which benchmark(s) to run (default both: this
#                           repository's gpu_bench.py first, then `numba-fused bench
#                           --device gpu` when that CLI exists; `own` for a short
#                           device budget -- the CLI checks every case against a
#                           float64 host reference, which takes minutes at these sizes)
#   GPU_CHECK_JOBS=N        pytest-xdist workers for the tests when xdist is installed
#                           (default 8: compiling the kernels is most of their time)
#   GPU_CHECK_TEST_TIMEOUT / GPU_CHECK_BENCH_TIMEOUT   seconds for each stage (default
#                           none), so a short device lease still returns the later stages
#   GPU_CHECK_PROFILE=1     also benchmarks/gpu_profile.py host: per-call host cost, replayed
#                           and general path (host_times.md, host_profile.txt beside OUT.md)
#   GPU_CHECK_FALLBACK=DIR  a folder holding an unpacked numba-cuda >= 0.30 wheel, put on
#                           PYTHONPATH when the machine's numba-cuda is older or missing
# The PTX/SASS test (tests/test_gpu_ptx.py) needs no GPU and is not run here.
# Exit status: non-zero if a test failed, the benchmark failed its accuracy check,
# or the benchmark could not run.
set -uo pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 OUT.md [gpu_bench.py arguments]" >&2
    exit 2
fi
OUT=$1
shift
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-$(command -v python || command -v python3)}
status=0
STAGE_T() { # STAGE_T SECONDS cmd...: run with a time limit when SECONDS > 0
    local t=$1; shift
    if [ "${t:-0}" -gt 0 ] 2>/dev/null; then timeout --kill-after=10 "$t" "$@"; else "$@"; fi
}
if [ -n "${GPU_CHECK_FALLBACK:-}" ] && ! "$PY" - <<'EOF' 2>/dev/null
import numba_cuda, sys
v = tuple(int(p) for p in numba_cuda.__version__.split(".")[:2])
sys.exit(0 if v >= (0, 30) else 1)
EOF
then
    echo "numba-cuda missing or < 0.30: using $GPU_CHECK_FALLBACK"
    export PYTHONPATH="$GPU_CHECK_FALLBACK:$PYTHONPATH"
fi

if [ "${GPU_CHECK_SIMULATOR:-0}" = "1" ]; then
    export NUMBA_ENABLE_CUDASIM=1
    BENCH_ARGS=(--shapes 3x33 --repeat 1 --samples 1 --peers none)
else
    unset NUMBA_ENABLE_CUDASIM
    BENCH_ARGS=()
fi

echo "== versions"
"$PY" - <<'EOF'
import platform, sys
print("python", platform.python_version(), sys.executable)
import numba
print("numba", numba.__version__)
from numba import cuda
print("numba.cuda implementation:", getattr(cuda, "implementation", "built-in (unsupported)"))
try:
    import numba_cuda
    print("numba-cuda", numba_cuda.__version__)
except Exception as e:
    print("numba-cuda version unknown:", e)
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda,
          "available", torch.cuda.is_available())
except Exception as e:
    print("torch unavailable:", e)
EOF
if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv
else
    echo "nvidia-smi: not found"
fi

if [ "${GPU_CHECK_SIMULATOR:-0}" != "1" ] && [ "${GPU_CHECK_SKIP_TESTS:-0}" != "1" ]; then
    echo "== GPU tests on hardware"
    XDIST=()
    if "$PY" -c "import xdist" 2>/dev/null && [ "${GPU_CHECK_JOBS:-8}" -gt 1 ]; then
        XDIST=(-n "${GPU_CHECK_JOBS:-8}")
    fi
    "$PY" -c "import pytest_timeout" 2>/dev/null && XDIST+=(--timeout 300)
    NUMBA_FUSED_GPU_BIG=${NUMBA_FUSED_GPU_BIG:-1} STAGE_T "${GPU_CHECK_TEST_TIMEOUT:-0}" \
        "$PY" -m pytest tests/gpu_cases.py "${XDIST[@]}" \
        -q -p no:cacheprovider -o addopts= -rfEs --durations=15 \
        2>&1 | tee "$OUT.tests.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "GPU tests FAILED (log: $OUT.tests.log)"; status=1; }
fi

if [ "${GPU_CHECK_PROFILE:-0}" = "1" ] && [ "${GPU_CHECK_SIMULATOR:-0}" != "1" ]; then
    echo "== host cost per call (benchmarks/gpu_profile.py host)"
    STAGE_T "${GPU_CHECK_BENCH_TIMEOUT:-0}" "$PY" benchmarks/gpu_profile.py host \
        "$(dirname "$OUT")" 2>/dev/null || status=1
fi

BENCH=${GPU_CHECK_BENCH:-both}
if [ "$BENCH" != "cli" ]; then
    echo "== benchmark (benchmarks/gpu_bench.py -> $OUT)"
    STAGE_T "${GPU_CHECK_BENCH_TIMEOUT:-0}" "$PY" benchmarks/gpu_bench.py "$OUT" \
        "${BENCH_ARGS[@]}" "$@" 2> >(tee "$OUT.bench.log" >&2) || status=1
    [ -s "$OUT" ] && cat "$OUT" || { echo "no table written"; status=1; }
fi

if [ "$BENCH" != "own" ] && "$PY" -m numba_fused bench --help 2>/dev/null | grep -q -- "--device"; then
    CLI_OUT=$OUT
    [ "$BENCH" = "cli" ] || CLI_OUT=$OUT.cli.md
    echo "== numba-fused bench --device gpu (-> $CLI_OUT)"
    if [ "${GPU_CHECK_SIMULATOR:-0}" = "1" ]; then
        echo "(skipped in the simulator)"
    else
        "$PY" -m numba_fused bench --device gpu --dtypes float32,bfloat16 \
            --shapes 32768x4096,8192x32768,1024x262144 --direction fwd,bwd \
            --markdown > "$CLI_OUT" || status=1
        cat "$CLI_OUT"
    fi
fi
exit $status

"""Where a numba_fused GPU call spends its time, on a real GPU (run by hand or from
benchmarks/gpu_check.sh with GPU_CHECK_PROFILE=1).

    python benchmarks/gpu_profile.py host OUT_DIR
        Host side: microseconds per call of each public function on small
        (1x1024 float32) and large (32768x4096 bfloat16) device arrays, against a bare
        numba-cuda launch and torch's own calls; each also through the general path
        (replay of recorded launches off, see gpu.Replay); event-timed device time per
        call both ways (OUT_DIR/host_times.md); cProfile of the small calls
        (OUT_DIR/host_profile.txt).

    ncu ... python benchmarks/gpu_profile.py kernels
        One launch of each kernel worth a look (the cases below), for Nsight Compute;
        the case order is printed to stderr (kernel names are numba-mangled).
"""
import contextlib
import cProfile
import io
import os
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from numba import cuda  # noqa: E402

import numba_fused as nf  # noqa: E402
from numba_fused import gpu  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_bench import ours  # noqa: E402

# (op, direction, dtype, rows, cols): the kernels the first hardware benchmark
# (2026-12-04) put furthest from the copy roofline, and softmax fwd f32 at 98% as the
# yardstick
KERNEL_CASES = [
    ("softmax", "fwd", "float32", 32768, 4096),
    ("softmax", "fwd", "bfloat16", 32768, 4096),
    ("rms_norm", "fwd", "bfloat16", 32768, 4096),
    ("layer_norm", "fwd", "bfloat16", 32768, 4096),
    ("rms_norm", "bwd", "float32", 32768, 4096),
    ("layer_norm", "bwd", "bfloat16", 32768, 4096),
    ("layer_norm", "bwd", "bfloat16", 8192, 32768),
    ("softmax", "fwd", "float32", 8192, 32768),
]
#: GPU_PROFILE_TRY=1: tiny shapes and few calls, to try the script in the simulator
TRY = os.environ.get("GPU_PROFILE_TRY") == "1"
if TRY:
    KERNEL_CASES = [(o, d, t, 3, 70) for o, d, t, _, _ in KERNEL_CASES]


def arrays(dtype, rows, cols, seed=0):
    """Device x, dy, weight, bias (bfloat16 as uint16 bits) and the dtype tag."""
    rng = np.random.default_rng(seed)
    f32 = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
    if dtype == "bfloat16":
        import ml_dtypes
        cast = lambda a: cuda.to_device(a.astype(ml_dtypes.bfloat16).view(np.uint16))  # noqa
        tag = "bfloat16"
    else:
        cast = lambda a: cuda.to_device(a.astype(dtype))  # noqa: E731
        tag = None
    return (cast(f32(rows, cols)), cast(f32(rows, cols)), cast(1 + 0.1 * f32(cols)),
            cast(0.1 * f32(cols)), tag)


def calls(op, direction, dtype, rows, cols):
    """A zero-argument function making one public call (out= given), on fresh data:
    gpu_bench's own call of the op, on the default stream."""
    x, dy, w, b, tag = arrays(dtype, rows, cols)
    return ours(op, direction, dict(x=x, dy=dy, weight=w, bias=b), tag, None)[0]


def host_us(fn, n):
    """Host microseconds per call of n back-to-back calls (sync before and after)."""
    fn()
    cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    cuda.synchronize()
    return (t1 - t0) / n * 1e6


def device_us(fn, n):
    """Event-timed microseconds per call on the default stream (NaN in the simulator,
    whose events record no time)."""
    fn()
    if gpu.SIM:
        return float("nan")
    a, b = cuda.event(timing=True), cuda.event(timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return cuda.event_elapsed_time(a, b) * 1e3 / n


@contextlib.contextmanager
def general_path():
    """Calls inside take the general path (no replay of recorded launches)."""
    r = gpu.REPLAY
    if r is None:
        yield
        return
    r.enabled = False
    try:
        yield
    finally:
        r.enabled = True


def host(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    lines = ["| case | host us/call | host us/call, general path | device us/call "
             "| device us/call, general path |", "|---|---:|---:|---:|---:|"]

    @cuda.jit
    def bare(a, b):
        i = cuda.grid(1)
        if i < a.size:
            b[i] = a[i]
    a = cuda.to_device(np.ones(1024, np.float32))
    c = cuda.device_array_like(a)
    launch = lambda: bare[4, 256](a, c)  # noqa: E731
    nl = 5 if TRY else 2000
    lines.append(f"| bare numba-cuda launch, 2 arrays | {host_us(launch, nl):.1f} | - | - | - |")
    try:
        import torch
        import torch.nn.functional as F
        t = torch.randn(1, 1024, device="cuda")
        lines.append(f"| torch F.softmax 1x1024 f32 | "
                     f"{host_us(lambda: F.softmax(t, -1), 2000):.1f} | - | - | - |")
        wt = torch.ones(1024, device="cuda")
        lines.append(f"| torch F.layer_norm 1x1024 f32 | "
                     f"{host_us(lambda: F.layer_norm(t, (1024,), wt), 2000):.1f} | - | - | - |")
    except Exception as e:  # pragma: no cover - torch is optional
        lines.append(f"| torch unavailable ({type(e).__name__}) | - | - | - | - |")
    small, big = ("float32", 1, 1024), ("bfloat16", 32768, 4096)
    if TRY:
        small, big = ("float32", 1, 64), ("bfloat16", 4, 64)
    for op in ("softmax", "rms_norm", "layer_norm"):
        for direction in ("fwd", "bwd"):
            for dtype, rows, cols in (small, big):
                fn = calls(op, direction, dtype, rows, cols)
                n = 3 if TRY else 500 if rows == 1 else 20
                h = host_us(fn, n)
                d = device_us(fn, n)
                with general_path():
                    hd = host_us(fn, n)
                    dd = device_us(fn, n)
                lines.append(f"| {op} {direction} {dtype} {rows}x{cols} | {h:.1f} | {hd:.1f} "
                             f"| {d:.1f} | {dd:.1f} |")
                print(lines[-1], file=sys.stderr, flush=True)
    table = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "host_times.md"), "w") as f:
        f.write(table)
    print(table)
    report = io.StringIO()
    for op, direction in (("softmax", "fwd"), ("rms_norm", "fwd"), ("layer_norm", "bwd")):
        fn = calls(op, direction, "float32", 1, 1024)
        fn()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(3 if TRY else 300):
            fn()
        pr.disable()
        cuda.synchronize()
        report.write(f"\n===== {op} {direction} float32 1x1024, 300 calls\n")
        st = pstats.Stats(pr, stream=report)
        st.sort_stats("tottime").print_stats(25)
    with open(os.path.join(out_dir, "host_profile.txt"), "w") as f:
        f.write(report.getvalue())


def kernels():
    for i, case in enumerate(KERNEL_CASES):
        fn = calls(*case)
        print(f"case {i}: {case}", file=sys.stderr, flush=True)
        fn()
        cuda.synchronize()


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "host":
        host(sys.argv[2])
    elif len(sys.argv) == 2 and sys.argv[1] == "kernels":
        kernels()
    else:
        print(__doc__, file=sys.stderr)
        sys.exit(2)

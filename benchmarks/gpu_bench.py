"""GPU benchmark of numba_fused's CUDA kernels (run by benchmarks/gpu_check.sh).

For each op x direction x dtype x shape: CUDA-event timing of numba_fused (public
API, out= buffers, on one stream), of a device-to-device copy of the same byte
count (half read, half written) and of torch's own kernels (eager F.softmax /
F.rms_norm / F.layer_norm; backward = torch.autograd.grad of a retained graph).

GB/s = minimal traffic / time, where minimal traffic reads every input once and
writes every output once at its own dtype (softmax fwd: x -> y; bwd: y, dy -> dx;
rms_norm fwd: x, w -> y, rstd; bwd: dy, x, w, rstd -> dx, dw; layer_norm fwd:
x, w, b -> y, mean, rstd; bwd: dy, x, w, mean, rstd -> dx, dw, db).
%copy = copy time / kernel time. Targets: forward >= 85% of the copy, backward
>= 70%, and at least as fast as torch. Each case's first rows are checked against
the float64 reference.

Usage: python benchmarks/gpu_bench.py OUT.md [--dtypes float32,bfloat16]
       [--shapes 32768x4096,8192x32768,1024x262144] [--ops ...] [--directions fwd,bwd]
       [--repeat 20] [--peers torch|none]

Under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1) it runs with wall-clock timing
(the simulator's events record no time) so the argument parsing and the table can
be tested; the numbers mean nothing there.
"""
import argparse
import datetime
import os
import platform
import subprocess
import sys
import time

import ml_dtypes
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from numba import cuda  # noqa: E402

import numba_fused as nf  # noqa: E402
from numba_fused import gpu, reference as R  # noqa: E402

OPS = ("softmax", "rms_norm", "layer_norm")
DIRECTIONS = ("fwd", "bwd")
SHAPES = ((32768, 4096), (8192, 32768), (1024, 262144))
DTYPES = ("float32", "bfloat16")
TARGET = {"fwd": 0.85, "bwd": 0.70}
TOL = {"float32": 1e-5, "bfloat16": 2 * 2.0 ** -7, "float16": 2 * 2.0 ** -10,
       "float64": 1e-12}
BF16 = np.dtype(ml_dtypes.bfloat16)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="Markdown file the table is written to")
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--shapes", default=",".join(f"{r}x{c}" for r, c in SHAPES),
                   help="ROWSxCOLS list")
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--directions", default=",".join(DIRECTIONS))
    p.add_argument("--repeat", type=int, default=20, help="timed calls per sample")
    p.add_argument("--samples", type=int, default=5, help="samples (median is reported)")
    p.add_argument("--peers", default="torch", choices=("torch", "none"))
    a = p.parse_args(argv)
    a.dtypes = [np.dtype(d).name if d != "bfloat16" else "bfloat16" for d in _split(a.dtypes)]
    for d in a.dtypes:
        if d not in TOL:
            p.error(f"unsupported dtype {d!r}")
    try:
        a.shapes = [tuple(int(v) for v in s.lower().split("x")) for s in _split(a.shapes)]
    except ValueError:
        p.error(f"--shapes must be ROWSxCOLS items, got {a.shapes!r}")
    if any(len(s) != 2 or min(s) < 1 for s in a.shapes):
        p.error("--shapes must be ROWSxCOLS items with positive sizes")
    a.ops = _split(a.ops)
    a.directions = _split(a.directions)
    if set(a.ops) - set(OPS) or set(a.directions) - set(DIRECTIONS):
        p.error(f"--ops from {OPS}, --directions from {DIRECTIONS}")
    if a.repeat < 1 or a.samples < 1:
        p.error("--repeat and --samples must be >= 1")
    return a


def _split(s):
    return [v.strip() for v in s.split(",") if v.strip()]


# ------------------------------------------------------------------ timing
class Timer:
    def __init__(self, stream):
        self.stream = stream

    def __call__(self, fn, repeat, samples):
        """Median seconds per call of ``fn`` (``repeat`` calls per sample)."""
        fn()
        fn()                                   # compile + warm-up
        out, host = [], []
        for _ in range(samples):
            if gpu.SIM:
                t0 = time.perf_counter()
                for _ in range(repeat):
                    fn()
                out.append((time.perf_counter() - t0) / repeat)
                host.append(out[-1])
                continue
            a, b = cuda.event(timing=True), cuda.event(timing=True)
            a.record(self.stream)
            t0 = time.perf_counter()
            for _ in range(repeat):
                fn()
            host.append((time.perf_counter() - t0) / repeat)
            b.record(self.stream)
            b.synchronize()
            out.append(cuda.event_elapsed_time(a, b) / 1e3 / repeat)
        #: host seconds per call (Python + launch); when it reaches the device time
        #: the case is host-bound and the GB/s understate the kernel
        self.host = float(np.median(host))
        return float(np.median(out))


# ------------------------------------------------------------------ cases
_ROWS_CACHE = {}


def _rows_data(dtype, shape, rng):
    """x and dy, drawn once per (dtype, shape) and shared by the ops."""
    key = (dtype, shape)
    if key not in _ROWS_CACHE:
        _ROWS_CACHE.clear()
        dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
        x = rng.standard_normal(shape, dtype=np.float32).astype(dt)
        dy = rng.standard_normal(shape, dtype=np.float32).astype(dt)
        _ROWS_CACHE[key] = (x, dy, dev(x), dev(dy))
    return _ROWS_CACHE[key]


def host_inputs(op, direction, dtype, shape, rng):
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    rows, cols = shape
    x, dy, _, _ = _rows_data(dtype, shape, rng)
    d = {"x": x}
    if op != "softmax":
        d["weight"] = (1 + 0.1 * rng.standard_normal(cols, dtype=np.float32)).astype(dt)
    if op == "layer_norm":
        d["bias"] = (0.1 * rng.standard_normal(cols, dtype=np.float32)).astype(dt)
    if direction == "bwd":
        d["dy"] = dy
    return d


def dev(a):
    return cuda.to_device(a.view(np.uint16) if a.dtype == BF16 else a)


def traffic(op, direction, d):
    """Minimal bytes: inputs read once, outputs written once."""
    x = d["x"]
    rows = x.shape[0]
    row_b = x.size * x.itemsize
    stat = 8 if x.dtype == np.float64 else 4
    par = sum(d[k].nbytes for k in ("weight", "bias") if k in d)
    if op == "softmax":
        return 2 * row_b if direction == "fwd" else 3 * row_b
    nstats = 1 if op == "rms_norm" else 2
    if direction == "fwd":
        return 2 * row_b + par + nstats * rows * stat
    return 3 * row_b + nstats * rows * stat + 2 * par   # params read, grads written


def ours(op, direction, D, tagd, stream):
    """(call, check) for numba_fused on device arrays D."""
    x = D["x"]
    out = cuda.device_array_like(x)
    kw = dict(dtype=tagd, stream=stream)
    if op == "softmax":
        y = nf.softmax_fwd(x, **kw)
        if direction == "fwd":
            return lambda: nf.softmax_fwd(x, out=out, **kw), lambda: (out,)
        return (lambda: nf.softmax_bwd(y, D["dy"], out=out, **kw)), lambda: (out,)
    if op == "rms_norm":
        if direction == "fwd":
            res = {}

            def call():
                res["r"] = nf.rms_norm_fwd(x, D["weight"], out=out, **kw)
            return call, lambda: res["r"]
        _, rstd = nf.rms_norm_fwd(x, D["weight"], **kw)
        res = {}

        def call():
            res["r"] = nf.rms_norm_bwd(D["dy"], x, D["weight"], rstd, out=out, **kw)
        return call, lambda: res["r"]
    if direction == "fwd":
        res = {}

        def call():
            res["r"] = nf.layer_norm_fwd(x, D["weight"], D["bias"], out=out, **kw)
        return call, lambda: res["r"]
    _, mean, rstd = nf.layer_norm_fwd(x, D["weight"], D["bias"], **kw)
    res = {}

    def call():
        res["r"] = nf.layer_norm_bwd(D["dy"], x, D["weight"], D["bias"], mean, rstd,
                                     out=out, **kw)
    return call, lambda: res["r"]


def check(op, direction, d, got, dtype, nrows=2):
    """max relative error of the first rows' dx/y against float64."""
    sl = slice(0, nrows)
    first = got[0][sl].copy_to_host()
    if dtype == "bfloat16":
        first = first.view(BF16)
    x = d["x"][sl]
    if op == "softmax":
        y = R.softmax_fwd(x)
        want = y if direction == "fwd" else R.softmax_bwd(
            R.softmax_fwd(d["x"][sl]).astype(x.dtype), d["dy"][sl])
    elif op == "rms_norm":
        y, rstd = R.rms_norm_fwd(x, d["weight"])
        want = y if direction == "fwd" else R.rms_norm_bwd(d["dy"][sl], x, d["weight"],
                                                          rstd.astype(np.float32))[0]
    else:
        y, m, r = R.layer_norm_fwd(x, d["weight"], d["bias"])
        want = y if direction == "fwd" else R.layer_norm_bwd(
            d["dy"][sl], x, d["weight"], d["bias"], m.astype(np.float32),
            r.astype(np.float32))[0]
    if op == "softmax" and direction == "bwd":
        return None       # y was recomputed in the input dtype: checked by the tests
    err = np.max(np.abs(first.astype(np.float64) - want)) / max(np.max(np.abs(want)), 1e-30)
    return float(err)


def torch_peer(op, direction, D, dtype):
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None, "torch not installed"
    if gpu.SIM or not torch.cuda.is_available():
        return None, "torch has no CUDA device"
    tdt = torch.bfloat16 if dtype == "bfloat16" else getattr(torch, dtype)

    def T(a):
        t = torch.as_tensor(a, device="cuda")
        return t.view(tdt) if dtype == "bfloat16" else t
    x = T(D["x"]).detach().requires_grad_(direction == "bwd")
    w = T(D["weight"]).detach().requires_grad_(direction == "bwd") if "weight" in D else None
    b = T(D["bias"]).detach().requires_grad_(direction == "bwd") if "bias" in D else None
    cols = x.shape[-1]
    if op == "softmax":
        f = lambda: F.softmax(x, dim=-1)  # noqa: E731
    elif op == "rms_norm":
        if not hasattr(F, "rms_norm"):
            return None, "torch < 2.4 has no F.rms_norm"
        f = lambda: F.rms_norm(x, (cols,), w, eps=1e-6)  # noqa: E731
    else:
        f = lambda: F.layer_norm(x, (cols,), w, b, eps=1e-5)  # noqa: E731
    if direction == "fwd":
        return (lambda: f()), f"torch {torch.__version__} eager"
    y = f()
    dy = T(D["dy"])
    params = [p for p in (x, w, b) if p is not None]
    return (lambda: torch.autograd.grad(y, params, dy, retain_graph=True)), \
        f"torch {torch.__version__} autograd"


def copy_impl(nbytes):
    n = max(1, nbytes // 2)
    src = cuda.to_device(np.ones(n, np.uint8))
    dst = cuda.device_array(n, np.uint8)
    return lambda: dst.copy_to_device(src)


# ------------------------------------------------------------------- main
def versions():
    import numba
    lines = [f"python {platform.python_version()}", f"numba {numba.__version__}",
             f"numba-cuda implementation {getattr(cuda, 'implementation', '?')}"]
    try:
        import numba_cuda
        lines.append(f"numba-cuda {numba_cuda.__version__}")
    except Exception:
        pass
    if gpu.SIM:
        lines.append("device: CUDA SIMULATOR (timings meaningless)")
    else:
        dev_ = cuda.get_current_device()
        lines.append(f"device: {dev_.name.decode() if isinstance(dev_.name, bytes) else dev_.name}"
                     f" cc {dev_.compute_capability} SMs {dev_.MULTIPROCESSOR_COUNT}")
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=30).stdout.strip()
            lines.append(f"nvidia-smi: {smi}")
        except Exception as e:
            lines.append(f"nvidia-smi unavailable ({e})")
    return lines


def run(args):
    stream = cuda.stream()
    timer = Timer(stream)
    rng = np.random.default_rng(0)
    rows_out = []
    for shape in args.shapes:
        for dtype in args.dtypes:
            for op in args.ops:
                for direction in args.directions:
                    d = host_inputs(op, direction, dtype, shape, rng)
                    _, _, xd, dyd = _rows_data(dtype, shape, rng)
                    D = {k: (xd if k == "x" else dyd if k == "dy" else dev(v))
                         for k, v in d.items()}
                    tagd = "bfloat16" if dtype == "bfloat16" else None
                    call, result = ours(op, direction, D, tagd, stream)
                    t = timer(call, args.repeat, args.samples)
                    host_t = timer.host
                    stream.synchronize()
                    err = check(op, direction, d, result(), dtype)
                    nbytes = traffic(op, direction, d)
                    tc = timer(copy_impl(nbytes), args.repeat, args.samples)
                    tt, tnote = (None, "peers: none")
                    if args.peers == "torch":
                        fn, tnote = torch_peer(op, direction, D, dtype)
                        if fn is not None:
                            import torch
                            torch.cuda.synchronize()
                            tt = _time_torch(fn, args)
                    rows_out.append(dict(op=op, dir=direction, dtype=dtype, shape=shape,
                                         t=t, gbs=nbytes / t / 1e9, copy=tc / t,
                                         torch=tt, tnote=tnote, err=err, host=host_t))
                    print(_row(rows_out[-1]), file=sys.stderr, flush=True)
                    del D
    return rows_out


def _time_torch(fn, args):
    import torch
    fn()
    fn()
    out = []
    for _ in range(args.samples):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(args.repeat):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / args.repeat)
    return float(np.median(out))


HEADER = ("| op | dir | dtype | shape | ms | GB/s | % copy | target | torch ms | vs torch "
          "| max err | host us/call |\n|---|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|")


def _row(r):
    tgt = TARGET[r["dir"]]
    ok = r["copy"] >= tgt and (r["torch"] is None or r["torch"] >= r["t"])
    vs = "-" if r["torch"] is None else f"{r['torch'] / r['t']:.2f}x"
    tms = "-" if r["torch"] is None else f"{r['torch'] * 1e3:.3f}"
    err = "-" if r["err"] is None else f"{r['err']:.1e}"
    if r["err"] is not None and r["err"] > TOL[r["dtype"]]:
        err += " FAIL"
    return (f"| {r['op']} | {r['dir']} | {r['dtype']} | {r['shape'][0]}x{r['shape'][1]} | "
            f"{r['t'] * 1e3:.3f} | {r['gbs']:.0f} | {100 * r['copy']:.0f}% | "
            f">={100 * tgt:.0f}%: {'met' if ok else 'MISSED'} | {tms} | {vs} | {err} | "
            f"{r['host'] * 1e6:.0f}{' HOST-BOUND' if r['host'] >= 0.9 * r['t'] else ''} |")


def write_table(path, rows, info):
    with open(path, "w") as f:
        f.write(f"# numba_fused GPU benchmark ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)\n\n")
        for line in info:
            f.write(f"- {line}\n")
        f.write("\nGB/s of minimal traffic; % copy = device-to-device copy time of the same "
                "bytes / kernel time (same run); vs torch = torch time / ours (>1: faster); "
                "host us/call = Python + launch time per call (HOST-BOUND: >= 90% of the "
                "device time, so the GB/s understate the kernel).\n\n")
        f.write(HEADER + "\n")
        for r in rows:
            f.write(_row(r) + "\n")
        notes = sorted({r["tnote"] for r in rows})
        f.write("\n" + "; ".join(notes) + "\n")


def main(argv=None):
    args = parse_args(argv)
    info = versions()
    for line in info:
        print(line, file=sys.stderr)
    rows = run(args)
    write_table(args.out, rows, info)
    bad = [r for r in rows if r["err"] is not None and r["err"] > TOL[r["dtype"]]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

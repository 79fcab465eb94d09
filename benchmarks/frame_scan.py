"""Kernel time against the page offset of the threads' stack frames.

Every CPU driver moves its threads' stacks to ``cpu.FRAME_OFFSET`` within a 4 KiB
page before the row work (``cpu._frame_on_page``): a stage function whose stack
slot for a vector accumulator straddles a page boundary runs 2.5-4x slower. Which
offsets are bad depends on how the compiler laid out the frames, so re-run this
after changes to the kernels, to LLVM/numba, or on another CPU, and move
FRAME_OFFSET clear of every op's bad offsets:

    python benchmarks/frame_scan.py --dtypes float32,float64 --step 16

It compiles the kernels once into a private cache with the offset read from
memory at run time, then times every op at every offset (two rounds, in opposite
orders; the minimum of each). Prints, per op, the median and the offsets that
ran more than --slow times it, then the offsets clear of all of them.
"""
import argparse
import ctypes
import json
import os
import sys
import tempfile
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--shape", default="4096x4096")
    ap.add_argument("--ops", default="softmax_fwd,softmax_bwd,rms_norm_fwd,rms_norm_bwd,"
                                     "layer_norm_fwd,layer_norm_bwd")
    ap.add_argument("--step", type=int, default=16)
    ap.add_argument("--lo", type=lambda v: int(v, 0), default=0)
    ap.add_argument("--hi", type=lambda v: int(v, 0), default=4096)
    ap.add_argument("--slow", type=float, default=1.25)
    ap.add_argument("--json", help="write {dtype: {op: {offset: ms}}} here")
    args = ap.parse_args(argv)

    # a private cache: the scanning build reads the offset from this process's memory
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="frame_scan_")
    import numpy as np
    from llvmlite import ir
    import numba_fused as nf
    from numba_fused import cpu
    from numba_fused import _dtypes as D

    cell = ctypes.c_int64(cpu.FRAME_OFFSET)
    i64 = ir.IntType(64)
    cpu._frame_target = lambda builder: builder.load(
        builder.inttoptr(ir.Constant(i64, ctypes.addressof(cell)), i64.as_pointer()))

    shape = tuple(int(v) for v in args.shape.split("x"))
    offsets = list(range(args.lo, args.hi, args.step))
    report = {}
    for name in args.dtypes.split(","):
        dt = D.bfloat16 if name == "bfloat16" else np.dtype(name)
        rng = np.random.default_rng(1)
        x = rng.standard_normal(shape, np.float32).astype(dt)
        dy = rng.standard_normal(shape, np.float32).astype(dt)
        w = rng.standard_normal(shape[-1]).astype(dt)
        b = rng.standard_normal(shape[-1]).astype(dt)
        out = nf.empty_like(x, x, dy)
        y = nf.softmax_fwd(x)
        _, mean, rstd = nf.layer_norm_fwd(x, w, b)
        _, rms_rstd = nf.rms_norm_fwd(x, w)
        calls = dict(
            softmax_fwd=lambda: nf.softmax_fwd(x, out=out),
            softmax_bwd=lambda: nf.softmax_bwd(y, dy, out=out),
            rms_norm_fwd=lambda: nf.rms_norm_fwd(x, w, out=out),
            rms_norm_bwd=lambda: nf.rms_norm_bwd(dy, x, w, rms_rstd, out=out),
            layer_norm_fwd=lambda: nf.layer_norm_fwd(x, w, b, out=out),
            layer_norm_bwd=lambda: nf.layer_norm_bwd(dy, x, w, b, mean, rstd, out=out))
        calls = {op: calls[op] for op in args.ops.split(",")}
        for fn in calls.values():
            fn()                                   # compile
        times = {op: {o: [] for o in offsets} for op in calls}
        for order in (offsets, offsets[::-1]):
            for o in order:
                cell.value = o
                for op, fn in calls.items():
                    fn()
                    t0 = time.perf_counter()
                    fn()
                    fn()
                    times[op][o].append((time.perf_counter() - t0) / 2 * 1e3)
        best = {op: {o: min(v) for o, v in d.items()} for op, d in times.items()}
        report[name] = {op: {hex(o): round(t, 3) for o, t in d.items()} for op, d in best.items()}
        bad = set()
        print(f"{name} {args.shape}, offsets {hex(args.lo)}-{hex(args.hi)} step {args.step}:")
        for op, d in best.items():
            med = float(np.median(list(d.values())))
            slow = [o for o, t in d.items() if t > args.slow * med]
            bad.update(slow)
            here = d.get(cpu.FRAME_OFFSET)
            at = f", at FRAME_OFFSET {hex(cpu.FRAME_OFFSET)} {here / med:.2f}x" if here else ""
            print(f"  {op:15s} median {med:7.3f} ms{at}"
                  f"; slow at {len(slow)}: {' '.join(hex(o) for o in slow)}")
        print(f"  clear of all: {' '.join(hex(o) for o in offsets if o not in bad)}")
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

"""In-process A/B timing of the CPU kernels: a git revision against the working tree.

    python benchmarks/ab.py --base HEAD~1 --ops softmax_fwd,rms_bwd \
        --shapes 4096x4096,65536x1024 --dtypes float32,bfloat16 --rounds 25

Why in one process: on this project's VMs the speed of a whole process moves by
up to ±35% (CPU frequency, neighbours, page placement), so two separate runs of the
same code disagree more than most changes differ. Here the base revision is
exported (``git archive``) as the package ``numba_fused_base`` and imported beside
the working tree's ``numba_fused``; every round calls base then new on the same
arrays, and the report gives both minima and the median of the per-round ratios
(base time / new time: above 1, the working tree is faster). Read the median
ratio: same-code controls (``--base HEAD``, clean tree, 15 rounds) gave median
ratios 0.98-1.05 and min ratios 0.81-1.07 on 2026-12-03.

Both packages call the public functions with preallocated ``out=`` buffers, as
``numba-fused bench`` does; ``--alloc`` calls them without ``out=`` (the path a
plain call takes, which allocates its results). For small calls, ``--calls N``
times N back-to-back calls per sample and reports per call. The base package
compiles into its own cache entries (another module name), so its first call
may compile.

Caches: by default the same arrays are called again and again, so inputs that
fit the last-level cache are read from it, not from memory (2026-12-04: rms_norm
bwd 16x262144 float32 took 2.4 ms here against 4.2-4.4 ms in ``numba-fused
bench``, whose copy and peers run between its calls). ``--evict MIB`` writes a
buffer of that many MiB before every timed call (not timed), which leaves each
call to start from memory, as in the benchmark.
"""
import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = ("softmax_fwd", "softmax_bwd", "rms_fwd", "rms_bwd", "ln_fwd", "ln_bwd",
       "softmax_fb", "rms_fb", "ln_fb")


def export_base(rev, dest):
    """Write revision ``rev``'s numba_fused/ to dest/numba_fused_base/."""
    tar = subprocess.run(["git", "-C", ROOT, "archive", rev, "numba_fused"],
                         check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        try:
            t.extractall(dest, filter="data")
        except TypeError:           # Python without extraction filters
            t.extractall(dest)
    os.rename(os.path.join(dest, "numba_fused"), os.path.join(dest, "numba_fused_base"))


def calls(nf, x, dy, w, b, y, rstd, mean, ln_rstd, out, out2):
    """The timed calls by op name; *_fb: the forward, then the backward on its
    results (out2: the backward's out=), as the benchmark's fwd+bwd."""
    def fb(fwd, bwd):
        def call():
            r = fwd()
            bwd(r if isinstance(r, tuple) else (r,))
        return call
    return dict(
        softmax_fwd=lambda: nf.softmax_fwd(x, out=out),
        softmax_bwd=lambda: nf.softmax_bwd(y, dy, out=out),
        rms_fwd=lambda: nf.rms_norm_fwd(x, w, out=out),
        rms_bwd=lambda: nf.rms_norm_bwd(dy, x, w, rstd, out=out),
        ln_fwd=lambda: nf.layer_norm_fwd(x, w, b, out=out),
        ln_bwd=lambda: nf.layer_norm_bwd(dy, x, w, b, mean, ln_rstd, out=out),
        softmax_fb=fb(lambda: nf.softmax_fwd(x, out=out),
                      lambda r: nf.softmax_bwd(r[0], dy, out=out2)),
        rms_fb=fb(lambda: nf.rms_norm_fwd(x, w, out=out),
                  lambda r: nf.rms_norm_bwd(dy, x, w, r[1], out=out2)),
        ln_fb=fb(lambda: nf.layer_norm_fwd(x, w, b, out=out),
                 lambda r: nf.layer_norm_bwd(dy, x, w, b, r[1], r[2], out=out2)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default="HEAD", help="git revision to compare against")
    p.add_argument("--ops", default=",".join(OPS[:6]),
                   help="comma-separated; *_fb: forward then backward (default: the six single ops)")
    p.add_argument("--shapes", default="4096x4096,65536x1024")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=1, help="calls per timed sample")
    p.add_argument("--alloc", action="store_true",
                   help="call without out= (results allocated per call)")
    p.add_argument("--weight-dtype", choices=("same", "float32"), default="same",
                   help="weight and bias in the input's dtype (default) or float32")
    p.add_argument("--evict", type=int, default=0, metavar="MIB",
                   help="write MIB MiB before every timed call (not timed): calls start "
                        "with their inputs out of cache (default 0: off)")
    a = p.parse_args(argv)
    ops = a.ops.split(",")
    unknown = set(ops) - set(OPS)
    if unknown:
        p.error(f"--ops: unknown {sorted(unknown)}; choose from {','.join(OPS)}")

    if a.evict < 0:
        p.error("--evict: MiB must be >= 0")
    evict = np.empty(a.evict << 17)      # float64 words

    tmp = tempfile.mkdtemp(prefix="nf-ab-")
    export_base(a.base, tmp)
    sys.path.insert(0, tmp)
    sys.path.insert(0, ROOT)
    import numba_fused as new
    import numba_fused_base as base
    from numba_fused import _dtypes as D

    print(f"base {a.base} vs working tree {ROOT}; {a.rounds} interleaved rounds"
          f" of {a.calls} call(s){' without out=' if a.alloc else ''}"
          f"{f', {a.evict} MiB written before each' if a.evict else ''}"
          f"{'; float32 weight and bias' if a.weight_dtype == 'float32' else ''}; "
          "ratio = base time / new time")
    rng = np.random.default_rng(0)
    for dtname in a.dtypes.split(","):
        dt = D.as_dtype(dtname)
        for shape in a.shapes.split(","):
            shape = tuple(int(s) for s in shape.split("x"))
            x = rng.standard_normal(shape).astype(dt)
            dy = rng.standard_normal(shape).astype(dt)
            pdt = dt if a.weight_dtype == "same" else np.float32
            w = rng.standard_normal(shape[-1]).astype(pdt)
            b = rng.standard_normal(shape[-1]).astype(pdt)
            y = new.softmax_fwd(x)
            _, rstd = new.rms_norm_fwd(x, w)
            _, mean, ln_rstd = new.layer_norm_fwd(x, w, b)
            out = None if a.alloc else new.empty_like(x, x, dy)   # as the benchmark's
            out2 = None if a.alloc else new.empty_like(x, x, dy, out)
            fb = calls(base, x, dy, w, b, y, rstd, mean, ln_rstd, out, out2)
            fn = calls(new, x, dy, w, b, y, rstd, mean, ln_rstd, out, out2)
            for op in ops:
                fb[op]()
                fn[op]()
                tb, tn = [], []
                for _ in range(a.rounds):
                    for f, ts in ((fb[op], tb), (fn[op], tn)):
                        if evict.size:
                            evict.fill(len(ts))
                        t0 = time.perf_counter()
                        for _ in range(a.calls):
                            f()
                        ts.append((time.perf_counter() - t0) / a.calls)
                tb, tn = np.array(tb), np.array(tn)
                unit, scale = ("us", 1e6) if tn.min() < 1e-4 else ("ms", 1e3)
                print(f"{op:12s} {dtname:9s} {'x'.join(map(str, shape)):>11s}  "
                      f"base {tb.min() * scale:8.3f} {unit}  new {tn.min() * scale:8.3f} {unit}  "
                      f"min ratio {tb.min() / tn.min():5.2f}  "
                      f"median ratio {np.median(tb / tn):5.2f}", flush=True)


if __name__ == "__main__":
    main()

"""Calls that allocate their results: the output pool from one size against another.

    python benchmarks/pool_ab.py --from 33554432,1048576 --shapes 256x1024,4096x1024

Each round runs every pattern with ``_alloc.POOL_MIN_BYTES`` set to each ``--from``
value in turn (outputs of that many bytes or more come from the pool, smaller ones
from ``np.empty`` or torch's allocator, that is glibc's malloc), in one process, and
prints per pattern the median microseconds per repetition for each value and the
median ratio of the first value's time to the others' (above 1: faster).

Why patterns: whether malloc hands back memory that faults again depends on what
else is alive. glibc gives the top of its heap back to the OS once more than its
trim threshold lies free there (twice its mmap threshold, which rises with the
largest block freed, up to 32 MiB), and a fresh page costs ~0.3 us to fault and
zero, more than a kernel's pass over it. A loop whose output dies before the next
call reuses one hot block; a training step keeps its forwards' outputs until
their backwards, and frees them together:

* ``fb``     -- forward then backward, each result dropped at once;
* ``step4``  -- four forwards kept alive, then the four backwards, newest first;
* ``torch``  -- ``numba_fused.torch``'s differentiable op and ``torch.autograd.grad``
  (needs torch); ``torch.nn.functional``'s own op as a control, which does not
  depend on the setting.
"""
import argparse
import importlib.util
import time

import numpy as np


def _patterns(nf, op, x, g, w, b):
    if op == "softmax":
        fwd = lambda: (nf.softmax_fwd(x),)                          # noqa: E731
        bwd = lambda r: nf.softmax_bwd(r[0], g)                      # noqa: E731
    elif op == "rms_norm":
        fwd = lambda: nf.rms_norm_fwd(x, w)                          # noqa: E731
        bwd = lambda r: nf.rms_norm_bwd(g, x, w, r[1])               # noqa: E731
    else:
        fwd = lambda: nf.layer_norm_fwd(x, w, b)                     # noqa: E731
        bwd = lambda r: nf.layer_norm_bwd(g, x, w, b, r[1], r[2])    # noqa: E731

    def fb():
        bwd(fwd())

    def step4():
        kept = [fwd() for _ in range(4)]
        for r in kept[::-1]:
            bwd(r)
    return {"fb": fb, "step4": step4}


def _torch_patterns(op, x, g, w, b):
    import torch
    import numba_fused.torch as nft
    def tensor(a):
        if a.dtype.itemsize == 2 and a.dtype != np.float16:        # ml_dtypes.bfloat16
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    xt, gt = tensor(x).requires_grad_(True), tensor(g)
    wt, bt = tensor(w).requires_grad_(True), tensor(b).requires_grad_(True)
    n = x.shape[-1]
    if op == "softmax":
        ours = lambda: torch.autograd.grad(nft.softmax(xt), (xt,), gt)             # noqa: E731
        theirs = lambda: torch.autograd.grad(torch.softmax(xt, -1), (xt,), gt)     # noqa: E731
    elif op == "rms_norm":
        ours = lambda: torch.autograd.grad(nft.rms_norm(xt, wt), (xt, wt), gt)     # noqa: E731
        theirs = lambda: torch.autograd.grad(                                       # noqa: E731
            torch.nn.functional.rms_norm(xt, (n,), wt, 1e-6), (xt, wt), gt)
    else:
        ours = lambda: torch.autograd.grad(                                       # noqa: E731
            nft.layer_norm(xt, wt, bt), (xt, wt, bt), gt)
        theirs = lambda: torch.autograd.grad(                                       # noqa: E731
            torch.nn.functional.layer_norm(xt, (n,), wt, bt), (xt, wt, bt), gt)
    return {"torch": ours, "torch's own": theirs}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--from", dest="sizes", default=f"{1 << 25},{1 << 20}",
                   help="comma-separated POOL_MIN_BYTES values; the first is the baseline")
    p.add_argument("--shapes", default="256x1024,1024x1024,4096x1024")
    p.add_argument("--ops", default="softmax,layer_norm")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--elements", type=float, default=2e7,
                   help="elements per timed sample (repetitions = this / the shape's)")
    p.add_argument("--no-torch", action="store_true")
    a = p.parse_args(argv)
    import numba_fused as nf
    from numba_fused import _alloc
    from numba_fused import _dtypes as D
    sizes = [int(s) for s in a.sizes.split(",")]
    dt = D.as_dtype(a.dtype)
    with_torch = not a.no_torch and importlib.util.find_spec("torch") is not None
    rng = np.random.default_rng(0)
    saved = _alloc.POOL_MIN_BYTES
    print(f"median us per repetition, POOL_MIN_BYTES = {' / '.join(map(str, sizes))}; "
          f"ratio: first / each other; {a.rounds} interleaved rounds, {a.dtype}")
    try:
        for shape in a.shapes.split(","):
            shape = tuple(int(v) for v in shape.split("x"))
            x = rng.standard_normal(shape, dtype=np.float32).astype(dt)
            g = rng.standard_normal(shape, dtype=np.float32).astype(dt)
            w = rng.standard_normal(shape[-1], dtype=np.float32).astype(dt)
            b = rng.standard_normal(shape[-1], dtype=np.float32).astype(dt)
            reps = max(3, int(a.elements // (shape[0] * shape[1])))
            for op in a.ops.split(","):
                pats = _patterns(nf, op, x, g, w, b)
                if with_torch:
                    pats.update(_torch_patterns(op, x, g, w, b))
                for name, f in pats.items():
                    times = {s: [] for s in sizes}
                    for _ in range(a.rounds):
                        for s in sizes:
                            _alloc.POOL_MIN_BYTES = s
                            f()
                            t0 = time.perf_counter()
                            for _ in range(reps):
                                f()
                            times[s].append((time.perf_counter() - t0) / reps * 1e6)
                    med = [np.median(times[s]) for s in sizes]
                    ratios = [np.median(np.array(times[sizes[0]]) / np.array(times[s]))
                              for s in sizes[1:]]
                    print(f"{'x'.join(map(str, shape)):>10s} {op:10s} {name:12s} "
                          + " / ".join(f"{m:8.0f}" for m in med) + "   "
                          + " ".join(f"{r:5.2f}x" for r in ratios), flush=True)
    finally:
        _alloc.POOL_MIN_BYTES = saved


if __name__ == "__main__":
    main()

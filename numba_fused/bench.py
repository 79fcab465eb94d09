"""The benchmark behind ``numba-fused bench``: numba_fused against the composed
NumPy formulation and the installed peers (PyTorch eager, JAX jit; CuPy and
PyTorch on a GPU), checked against the float64 reference.

One *case* is (device, op, direction, dtype, shape). For each case the inputs are
drawn fresh (normal random numbers, never zeros), every implementation is called
once (the *first call*: compile or cache load) and its outputs are compared with
``numba_fused.reference`` in float64; after a warm-up the implementations and a
parallel copy of the case's byte count are timed *interleaved*, round-robin,
``repeat`` samples each, so slow drifts (clock, other processes) hit all alike.
Each sample starts with an untimed call of its implementation: the timed calls
all run in the steady state of back-to-back calls (see ``_sample``).

Minimal traffic of a case (the bytes behind GB/s and the copy roofline): every
input read once and every output written once, at its own dtype:

* softmax  fwd: x -> y;                         bwd: y, dy -> dx
* rms_norm fwd: x, weight -> y, rstd;           bwd: dy, x, weight, rstd -> dx, dweight
* layer_norm fwd: x, weight, bias -> y, mean, rstd;
             bwd: dy, x, weight, mean, rstd -> dx, dweight, dbias
* fwd+bwd: the sum of the two (two kernels, each reading its inputs once).

The copy roofline is a parallel copy (numba prange on the CPU, with the same
threads and the kernels' stores: non-temporal from ``cpu.STREAM_BYTES`` of output,
see ``make_copy_kernel``; a device-to-device copy on a GPU) of half that byte
count, so it moves (reads + writes) exactly the case's bytes: ``% copy = copy
time / kernel time``.

Max error is relative to scale: for each output ``max|out - ref| / max|ref|``,
the maximum over the outputs; any NaN/inf where the reference is finite counts as
infinite. The gate (``TOLERANCES``) applies to numba_fused only; peers' errors
are recorded for comparison.
"""
import datetime
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from . import _alloc, _dtypes as D
from . import reference as R

OPS = ("softmax", "rms_norm", "layer_norm")
DIRECTIONS = ("fwd", "bwd", "fwd+bwd")
DEFAULT_DTYPES = ("float32", "bfloat16")
#: The default sweep: 2**22 elements (16 MiB of float32) at four row lengths.
DEFAULT_SHAPES = ((16384, 256), (4096, 1024), (1024, 4096), (256, 16384))
#: The CPU-speed targets (``--shapes targets``).
TARGET_SHAPES = ((4096, 4096), (65536, 1024), (16, 262144))
DEFAULT_REPEAT = 7

#: Error gate, relative to scale (see the module docstring). float32: 1e-5;
#: float16/bfloat16: two ulps at the scale (2 * eps: 2**-9 and 2**-6);
#: float64: 1e-12.
TOLERANCES = {"float32": 1e-5, "float64": 1e-12,
              "float16": 2 * 2.0 ** -10, "bfloat16": 2 * 2.0 ** -7}

CPU_PEERS = ("numpy", "torch", "jax")
GPU_PEERS = ("cupy", "torch")
OURS = "numba_fused"
COPY = "copy"
EPS = {"rms_norm": 1e-6, "layer_norm": 1e-5}

#: Test hook: an object with the six public functions to benchmark instead of
#: ``numba_fused``'s (tests plant a deliberately wrong kernel here).
KERNELS = None

#: Sample length the auto ``number`` (calls per sample) aims for, seconds.
MIN_SAMPLE_S = 2e-3
#: Pause before each timed sample (see ``time_interleaved``), seconds.
SETTLE_S = 3e-3
#: Pause after a sample of an implementation whose runtime keeps worker threads
#: busy after its calls return (``Impl.settle``: JAX), seconds.
SPIN_SETTLE_S = 20e-3
#: Warm-up: at least this many calls and this long after the first call.
WARM_CALLS, WARM_S = 2, 0.02


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------- config
@dataclass
class Config:
    ops: tuple = OPS
    directions: tuple = DIRECTIONS
    dtypes: tuple = DEFAULT_DTYPES
    shapes: tuple = DEFAULT_SHAPES
    devices: tuple = ("cpu",)
    peers: tuple = None          # None: every peer of the device
    repeat: int = DEFAULT_REPEAT
    threads: int = None
    seed: int = None
    alloc: bool = False          # numba_fused allocates its outputs (no out=)
    weight_dtype: str = "same"   # weight/bias dtype: "same" as x, or "float32"
    quiet: bool = False
    argv: list = field(default_factory=list)


# ------------------------------------------------------------------- inputs
def _np_dtype(name):
    return np.dtype(D.bfloat16 if name == "bfloat16" else name)


def make_inputs(op, direction, dtype, shape, rng, param_dtype=None):
    """Fresh random inputs of a case and the float64 reference outputs.

    Returns (inputs, ref): inputs holds every array any implementation needs
    (x, dy, weight, bias and the forward's y / saved statistics for bwd), in
    the case's dtype (statistics float32); ref maps output names to float64.
    """
    dt = _np_dtype(dtype)
    pdt = dt if param_dtype is None else np.dtype(param_dtype)
    cols = shape[-1]
    x = rng.standard_normal(shape, np.float32).astype(dt)
    dy = rng.standard_normal(shape, np.float32).astype(dt)
    inp = {"x": x, "dy": dy}
    ref = {}
    if op != "softmax":
        inp["weight"] = (1.0 + 0.5 * rng.standard_normal(cols, np.float32)).astype(pdt)
        if op == "layer_norm":
            inp["bias"] = rng.standard_normal(cols, np.float32).astype(pdt)
    stat = D.acc_dtype(dt)
    if op == "softmax":
        y = R.softmax_fwd(x)
        inp["y"] = y.astype(dt)
        fwd_ref = {"y": y}
        dx = R.softmax_bwd(y if direction == "fwd+bwd" else inp["y"], dy)
        bwd_ref = {"dx": dx}
    elif op == "rms_norm":
        y, rstd = R.rms_norm_fwd(x, inp["weight"], EPS[op])
        inp["rstd"] = rstd.astype(stat)
        fwd_ref = {"y": y, "rstd": rstd}
        dx, dw = R.rms_norm_bwd(dy, x, inp["weight"],
                                rstd if direction == "fwd+bwd" else inp["rstd"])
        bwd_ref = {"dx": dx, "dweight": dw}
    else:
        y, mean, rstd = R.layer_norm_fwd(x, inp["weight"], inp["bias"], EPS[op])
        inp["mean"], inp["rstd"] = mean.astype(stat), rstd.astype(stat)
        fwd_ref = {"y": y, "mean": mean, "rstd": rstd}
        s_mean, s_rstd = ((mean, rstd) if direction == "fwd+bwd"
                          else (inp["mean"], inp["rstd"]))
        dx, dw, db = R.layer_norm_bwd(dy, x, inp["weight"], inp["bias"], s_mean, s_rstd)
        bwd_ref = {"dx": dx, "dweight": dw, "dbias": db}
    if direction in ("fwd", "fwd+bwd"):
        ref.update(fwd_ref)
    if direction in ("bwd", "fwd+bwd"):
        ref.update(bwd_ref)
    return inp, ref


def traffic_bytes(op, direction, inp):
    """Minimal traffic in bytes: each input read once, each output written once."""
    x = inp["x"]
    n = x.nbytes
    rows = x.size // x.shape[-1]
    stat = D.acc_dtype(x.dtype).itemsize * rows
    p = inp["weight"].nbytes if "weight" in inp else 0
    if op == "softmax":
        fwd, bwd = 2 * n, 3 * n
    elif op == "rms_norm":
        fwd = 2 * n + p + stat                   # x, w -> y, rstd
        bwd = 3 * n + 2 * p + stat               # dy, x, w, rstd -> dx, dw
    else:
        fwd = 2 * n + 2 * p + 2 * stat           # x, w, b -> y, mean, rstd
        bwd = 3 * n + 3 * p + 2 * stat           # dy, x, w, mean, rstd -> dx, dw, db
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[direction]


def max_error(outs, ref):
    """max over outputs of max|out - ref| / max|ref| (float64); inf on non-finite.

    The scale of ``mean`` is at least max(1/rstd), the rows' std: the mean of a
    row is a sum of values of that size, whose rounding (~eps * std / sqrt(n)
    for a plain sum) no algorithm avoids, so a (1, n) row whose mean is near 0
    cannot meet a tolerance relative to the mean itself (the float32 gate failed
    twice that way on 2026-12-03, on a random (1, 300) row)."""
    worst, where = 0.0, None
    for name, r in ref.items():
        if name not in outs or outs[name] is None:
            continue
        o = np.asarray(outs[name]).astype(np.float64)
        if o.shape != r.shape:
            return math.inf, name
        fin = np.isfinite(r)
        if not np.array_equal(np.isfinite(o), fin):
            return math.inf, name
        scale = float(np.max(np.abs(r[fin]), initial=0.0))
        if name == "mean" and "rstd" in ref:
            rstd = ref["rstd"][np.isfinite(ref["rstd"]) & (ref["rstd"] > 0)]
            scale = max(scale, float(np.max(1.0 / rstd, initial=0.0)))
        scale = scale or 1.0
        err = float(np.max(np.abs(o[fin] - r[fin]), initial=0.0)) / scale
        if err > worst or where is None:
            worst, where = err, name
    return worst, where


# ------------------------------------------------------- the copy roofline
_COPY_KERNEL = None


def make_copy_kernel(cache=True):
    """The CPU copy roofline: dst = src over float32 rows, one contiguous chunk
    per thread (chunks start on 128-byte steps), in the kernels' lanes and with
    their stores (``_lanes.lanes_store``): non-temporal where dst has
    ``cpu.STREAM_BYTES`` or more and a block starts on a cache line, as the
    kernels write their large outputs, ordinary (cached) stores below.

    Why the kernels' stores: the roofline is what moving the case's bytes costs
    with the stores the kernels use. Ordinary stores read each line before they
    write it; non-temporal stores do not, and moved 54 against 38 GB/s at 64 MiB
    per buffer and 39 against 29 at 256 MiB (2 threads, AMD EPYC, 2026-12-06).
    A copy with other stores than the kernels' misjudged them before: the
    memcpy that LLVM makes of ``dst[i] = src[i]`` switches to non-temporal stores
    above a glibc size threshold, so until 2026-12-04 the cases above ~700 MiB of
    traffic were judged against a streaming copy and the others against a cached
    one."""
    import numba
    from ._lanes import data, lanes_count, lanes_load, lanes_store, lanes_zeros, streaming
    from .cpu import _streams

    @numba.njit(parallel=True, nogil=True, cache=cache)
    def par_copy(src, dst, threads):
        n = src.shape[0]
        out = streaming(data(dst), _streams(dst))
        step = lanes_count(lanes_zeros(src))
        for t in numba.prange(threads):
            lo = t * n // threads // step * step
            hi = n if t == threads - 1 else (t + 1) * n // threads // step * step
            for c in range(lo, hi - step + 1, step):
                lanes_store(out, c, lanes_load(src, c, step), step)
            if (hi - lo) % step:
                c = hi - (hi - lo) % step
                lanes_store(out, c, lanes_load(src, c, hi - c), hi - c)
    return par_copy


def _cpu_copy_kernel():
    global _COPY_KERNEL
    if _COPY_KERNEL is None:
        _COPY_KERNEL = make_copy_kernel()
    return _COPY_KERNEL


def cpu_copy_impl(nbytes, rng):
    """A parallel copy that reads nbytes/2 and writes nbytes/2, its dst placed as
    numba_fused places outputs (``_alloc``: on a cache line, clear of src's
    2**28-byte aliases, taken as rows of 4 KiB)."""
    import numba
    n = max(1, nbytes // 8)
    src = rng.standard_normal(n, dtype=np.float32)
    rows = np.empty((1, 1024), np.float32)
    buf = np.empty(src.nbytes + _alloc.padding(rows, (src,)), np.uint8)
    o = _alloc.clear_offset(buf.ctypes.data, rows, (src,))
    dst = buf[o:o + src.nbytes].view(np.float32)
    kern = _cpu_copy_kernel()
    threads = np.int64(numba.get_num_threads())
    return Impl(COPY, lambda: kern(src, dst, threads), bytes=8 * n)


# ------------------------------------------------------------ implementations
class Impl:
    """One implementation of one case: ``fn()`` runs it (synchronously: device
    work is complete when ``sync()`` returns) and returns its raw outputs;
    ``fetch(raw)`` turns them into {name: host array}."""

    def __init__(self, name, fn, fetch=None, sync=None, bytes=None, note=None):
        self.name, self.fn = name, fn
        self.fetch = fetch or (lambda raw: raw)
        self.sync = sync or (lambda: None)
        self.bytes = bytes
        self.note = note
        self.first_s = None
        self.settle = 0.0
        self.samples = []
        self.number = 1
        self.err, self.err_output = None, None


class Unavailable(Exception):
    """A peer cannot run this case (not installed, dtype unsupported): a note."""


def _kernels():
    if KERNELS is not None:
        return KERNELS
    import numba_fused
    return numba_fused


def ours_impl(op, direction, inp, ctx):
    """numba_fused through its public functions (host or device arrays)."""
    K = _kernels()
    dev = ctx["device"]
    if dev == "cpu":
        put = lambda a: a                                      # noqa: E731
        tag = {}
        # out= buffers as a user gets them from numba_fused.empty_like: clear of
        # the inputs' 2**28-byte aliases (``_alloc``), and of each other
        rows = [v for v in inp.values() if isinstance(v, np.ndarray) and v.ndim > 1]

        def empty(a):
            rows.append(_alloc.empty_like(a, *rows))
            return rows[-1]
        fetch_one = lambda a: a                               # noqa: E731
        sync = None
    else:
        from numba import cuda

        def bits(dt):       # bfloat16 travels as uint16 bits (+ dtype="bfloat16")
            return np.dtype(np.uint16) if dt == D.bfloat16 else dt
        put = lambda a: cuda.to_device(a.view(bits(a.dtype)))  # noqa: E731
        tag = {"dtype": "bfloat16"} if inp["x"].dtype == D.bfloat16 else {}
        empty = lambda a: cuda.device_array(a.shape, bits(a.dtype))  # noqa: E731
        fetch_one = lambda a, dt=inp["x"].dtype: _host(a, dt)  # noqa: E731
        sync = cuda.synchronize
    d = {k: put(v) for k, v in inp.items()}
    alloc = ctx["alloc"]
    ybuf = None if alloc else empty(inp["x"])
    dxbuf = None if alloc else empty(inp["x"])
    eps = EPS.get(op)
    names = {"softmax": (("y",), ("dx",)), "rms_norm": (("y", "rstd"), ("dx", "dweight")),
             "layer_norm": (("y", "mean", "rstd"), ("dx", "dweight", "dbias"))}[op]

    if op == "softmax":
        def fwd():
            return (K.softmax_fwd(d["x"], out=ybuf, **tag),)

        def bwd(saved=None):
            y = d["y"] if saved is None else saved[0]
            return (K.softmax_bwd(y, d["dy"], out=dxbuf, **tag),)
    elif op == "rms_norm":
        def fwd():
            return K.rms_norm_fwd(d["x"], d["weight"], eps, out=ybuf, **tag)

        def bwd(saved=None):
            rstd = d["rstd"] if saved is None else saved[1]
            return K.rms_norm_bwd(d["dy"], d["x"], d["weight"], rstd, out=dxbuf, **tag)
    else:
        def fwd():
            return K.layer_norm_fwd(d["x"], d["weight"], d["bias"], eps, out=ybuf, **tag)

        def bwd(saved=None):
            mean, rstd = ((d["mean"], d["rstd"]) if saved is None
                          else (saved[1], saved[2]))
            return K.layer_norm_bwd(d["dy"], d["x"], d["weight"], d["bias"], mean, rstd,
                                    out=dxbuf, **tag)

    if direction == "fwd":
        fn, outn = fwd, names[0]
    elif direction == "bwd":
        fn, outn = bwd, names[1]
    else:
        def fn():
            s = fwd()
            return tuple(s) + tuple(bwd(s))
        outn = names[0] + names[1]

    def fetch(raw):
        return {n: None if a is None else fetch_one(a) for n, a in zip(outn, raw)}
    return Impl(OURS, fn, fetch, sync)


def _host(a, dtype=None):
    """A host NumPy copy of a device/tensor array, viewed as ``dtype`` if bits."""
    if a is None:
        return None
    if hasattr(a, "copy_to_host"):
        h = a.copy_to_host()
    elif type(a).__module__.startswith("torch"):
        t = a.detach()
        h = (t.float() if str(t.dtype) in ("torch.bfloat16",) else t).cpu().numpy()
        return h
    elif hasattr(a, "get") and type(a).__module__.startswith("cupy"):
        h = a.get()
    else:
        h = np.asarray(a)
    if dtype is not None and h.dtype != dtype and h.dtype == D.storage_dtype(dtype):
        h = h.view(dtype)
    return h


# --- composed NumPy (also CuPy): the formulas a NumPy user writes, computed in
# the benchmark's dtype (float32 for float16/bfloat16 inputs, as NumPy has no
# bfloat16 arithmetic), results cast back to the dtype.
def _composed(xp, op, direction, inp, ct, out_dt):
    eps = EPS.get(op)
    cols = inp["x"].shape[-1]
    o = lambda v: v.astype(out_dt, copy=False)  # noqa: E731

    def f32(v):
        return v.astype(ct, copy=False)

    if op == "softmax":
        def fwd(x):
            e = xp.exp(f32(x) - f32(x).max(axis=-1, keepdims=True))
            e /= e.sum(axis=-1, keepdims=True)
            return {"y": o(e)}

        def bwd(y, dy, s=None):
            y, dy = f32(y), f32(dy)
            return {"dx": o(y * (dy - (dy * y).sum(axis=-1, keepdims=True)))}
        run_f = lambda: fwd(inp["x"])                                  # noqa: E731
        run_b = lambda: bwd(inp["y"], inp["dy"])                       # noqa: E731
        run_fb = lambda: (lambda f: {**f, **bwd(f["y"], inp["dy"])})(fwd(inp["x"]))  # noqa
    elif op == "rms_norm":
        def fwd(x, w):
            x = f32(x)
            rstd = 1.0 / xp.sqrt((x * x).mean(axis=-1) + ct.type(eps))
            return {"y": o(x * rstd[..., None] * f32(w)), "rstd": rstd}

        def bwd(dy, x, w, rstd):
            dy, x, r = f32(dy), f32(x), rstd[..., None]
            xhat = x * r
            g = dy * f32(w)
            dx = r * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))
            dw = (dy * xhat).reshape(-1, cols).sum(axis=0)
            return {"dx": o(dx), "dweight": dw.astype(w.dtype)}
        run_f = lambda: fwd(inp["x"], inp["weight"])                   # noqa: E731
        run_b = lambda: bwd(inp["dy"], inp["x"], inp["weight"], inp["rstd"])  # noqa
        run_fb = lambda: (lambda f: {**f, **bwd(inp["dy"], inp["x"], inp["weight"],  # noqa
                                              f["rstd"])})(run_f())
    else:
        def fwd(x, w, b):
            x = f32(x)
            mean = x.mean(axis=-1)
            c = x - mean[..., None]
            rstd = 1.0 / xp.sqrt((c * c).mean(axis=-1) + ct.type(eps))
            return {"y": o(c * rstd[..., None] * f32(w) + f32(b)), "mean": mean,
                    "rstd": rstd}

        def bwd(dy, x, w, mean, rstd):
            dy, x, r = f32(dy), f32(x), rstd[..., None]
            xhat = (x - mean[..., None]) * r
            g = dy * f32(w)
            dx = r * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True)
                      - g.mean(axis=-1, keepdims=True))
            dw = (dy * xhat).reshape(-1, cols).sum(axis=0)
            db = dy.reshape(-1, cols).sum(axis=0)
            return {"dx": o(dx), "dweight": dw.astype(w.dtype), "dbias": db.astype(w.dtype)}
        run_f = lambda: fwd(inp["x"], inp["weight"], inp["bias"])      # noqa: E731
        run_b = lambda: bwd(inp["dy"], inp["x"], inp["weight"], inp["mean"],  # noqa: E731
                            inp["rstd"])
        run_fb = lambda: (lambda f: {**f, **bwd(inp["dy"], inp["x"], inp["weight"],  # noqa
                                              f["mean"], f["rstd"])})(run_f())
    return {"fwd": run_f, "bwd": run_b, "fwd+bwd": run_fb}[direction]


def numpy_impl(op, direction, inp, ctx):
    dt = inp["x"].dtype
    ct = np.dtype(np.float64 if dt == D.float64 else np.float32)
    return Impl("numpy", _composed(np, op, direction, inp, ct, dt))


def cupy_impl(op, direction, inp, ctx):
    try:
        import cupy as cp
    except ImportError:
        raise Unavailable("not installed (pip install cupy-cuda13x)") from None
    dt = inp["x"].dtype
    if dt == D.bfloat16:
        raise Unavailable("CuPy has no bfloat16")
    ct = np.dtype(np.float64 if dt == D.float64 else np.float32)
    d = {k: cp.asarray(v) for k, v in inp.items()}
    fn = _composed(cp, op, direction, d, ct, dt)
    return Impl("cupy", fn, lambda raw: {k: _host(v) for k, v in raw.items()},
                sync=lambda: cp.cuda.Device().synchronize())


# --- PyTorch eager: F.softmax / F.rms_norm / F.layer_norm; bwd is the autograd
# backward (torch.autograd.grad) of a forward run once at setup with the graph
# retained, i.e. backward given the saved forward; fwd+bwd runs both each call.
def torch_impl(op, direction, inp, ctx):
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        raise Unavailable("not installed (pip install torch)") from None
    import warnings    # bf16 x with float32 weight: "Cannot dispatch to fused ..."
    warnings.filterwarnings("ignore", message="Mismatch dtype between input and weight")
    dev = "cuda" if ctx["device"] == "gpu" else "cpu"
    if dev == "cuda" and not torch.cuda.is_available():
        raise Unavailable("this torch build has no CUDA")
    tdt = {"float32": torch.float32, "float64": torch.float64,
           "float16": torch.float16, "bfloat16": torch.bfloat16}

    def t(a):
        name = "bfloat16" if a.dtype == D.bfloat16 else str(a.dtype)
        return torch.from_numpy(np.ascontiguousarray(a.astype(np.float32)
                                                     if name == "bfloat16" else a)
                                ).to(device=dev, dtype=tdt[name])

    cols = inp["x"].shape[-1]
    x, dy = t(inp["x"]), t(inp["dy"])
    w = t(inp["weight"]) if "weight" in inp else None
    b = t(inp["bias"]) if "bias" in inp else None
    eps = EPS.get(op)
    if op == "softmax":
        f = lambda x, w, b: F.softmax(x, dim=-1)                    # noqa: E731
    elif op == "rms_norm":
        f = lambda x, w, b: F.rms_norm(x, (cols,), w, eps)          # noqa: E731
    else:
        f = lambda x, w, b: F.layer_norm(x, (cols,), w, b, eps)     # noqa: E731
    gnames = ["dx", "dweight", "dbias"][:1 + (w is not None) + (b is not None)]
    sync = torch.cuda.synchronize if dev == "cuda" else None
    if direction == "fwd":
        def fn():
            with torch.no_grad():
                return {"y": f(x, w, b)}
    else:
        xr = x.clone().requires_grad_()
        wr = None if w is None else w.clone().requires_grad_()
        br = None if b is None else b.clone().requires_grad_()
        leaves = [a for a in (xr, wr, br) if a is not None]
        if direction == "bwd":
            y = f(xr, wr, br)

            def fn():
                return dict(zip(gnames, torch.autograd.grad(y, leaves, dy,
                                                            retain_graph=True)))
        else:
            def fn():
                y = f(xr, wr, br)
                g = torch.autograd.grad(y, leaves, dy)
                return {"y": y.detach(), **dict(zip(gnames, g))}
    return Impl("torch", fn, lambda raw: {k: _host(v) for k, v in raw.items()}, sync)


# --- JAX jit: jax.nn.softmax and jitted RMSNorm/LayerNorm formulas (float32
# statistics, like flax); bwd is a jitted call of the jax.vjp function of a
# forward run once at setup (backward given the saved residuals); fwd+bwd is one
# jitted function returning the forward and the vjp.
def jax_impl(op, direction, inp, ctx):
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        raise Unavailable("not installed (pip install jax jaxlib)") from None
    if ctx["device"] != "cpu":
        raise Unavailable("GPU JAX is not benchmarked")
    eps = EPS.get(op)
    d = {k: jnp.asarray(v) for k, v in inp.items() if k in ("x", "dy", "weight", "bias")}
    x, dy, w, b = d["x"], d["dy"], d.get("weight"), d.get("bias")

    if op == "softmax":
        def f(x, w, b):
            return jax.nn.softmax(x, axis=-1)
    elif op == "rms_norm":
        def f(x, w, b):
            xf = x.astype(jnp.float32)
            r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
            return (xf * r * w.astype(jnp.float32)).astype(x.dtype)
    else:
        def f(x, w, b):
            xf = x.astype(jnp.float32)
            mean = jnp.mean(xf, axis=-1, keepdims=True)
            c = xf - mean
            r = jax.lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + eps)
            return (c * r * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)
    gnames = ["dx", "dweight", "dbias"]
    nargs = {"softmax": 1, "rms_norm": 2, "layer_norm": 3}[op]
    args = (x, w, b)[:nargs]

    def g(*a):
        return f(*(a + (None,) * (3 - len(a))))

    def ready(out):
        return jax.block_until_ready(out)

    if direction == "fwd":
        jf = jax.jit(g)

        def fn():
            return {"y": ready(jf(*args))}
    elif direction == "bwd":
        _, vjp = jax.vjp(g, *args)
        jb = jax.jit(lambda vjp, ct: vjp(ct))

        def fn():
            return dict(zip(gnames, ready(jb(vjp, dy))))
    else:
        def both(ct, *a):
            y, vjp = jax.vjp(g, *a)
            return y, vjp(ct)
        jfb = jax.jit(both)

        def fn():
            y, grads = ready(jfb(dy, *args))
            return {"y": y, **dict(zip(gnames, grads))}

    def fetch(raw):
        return {k: np.asarray(v) for k, v in raw.items()}
    impl = Impl("jax", fn, fetch)
    impl.settle = SPIN_SETTLE_S
    return impl


PEER_BUILDERS = {"numpy": numpy_impl, "torch": torch_impl, "jax": jax_impl,
                 "cupy": cupy_impl}


# ----------------------------------------------------------------- devices
def gpu_available():
    """(available, note)."""
    try:
        from numba import cuda
    except ImportError:
        return False, "numba-cuda is not installed (pip install numba-fused[cuda])"
    if getattr(cuda, "implementation", None) != "NVIDIA":
        return False, ("numba-cuda is not installed (pip install numba-fused[cuda]); "
                       "numba's built-in CUDA target is not supported")
    try:
        if not cuda.is_available():
            return False, "no CUDA GPU is available"
    except Exception as e:  # driver errors
        return False, f"no CUDA GPU is available ({e})"
    try:
        from . import gpu  # noqa: F401
    except ImportError as e:
        return False, f"numba_fused.gpu cannot be imported ({e})"
    return True, None


def gpu_copy_impl(nbytes, rng):
    from numba import cuda
    words = max(1, nbytes // 16)
    src = cuda.to_device(rng.integers(1, 2 ** 62, words, dtype=np.int64))
    dst = cuda.device_array_like(src)
    return Impl(COPY, lambda: dst.copy_to_device(src), sync=cuda.synchronize,
                bytes=16 * words)


# ------------------------------------------------------------------ timing
def _call(impl):
    impl.sync()
    t0 = time.perf_counter()
    raw = impl.fn()
    impl.sync()
    return raw, time.perf_counter() - t0


def _sample(impl):
    """Seconds per call of ``impl.number`` calls, after one untimed call: every
    timed call follows a call of its own implementation, so all of them, the
    copy included, are timed in the same steady state (a case whose data fits
    the last-level cache runs from it). Without the lead-in the state depended on
    ``number``: at 16x262144 the copy's 3-7 calls per sample ran mostly in cache
    after its first, a kernel's 1-2 mostly from memory after the copy's sample
    (2026-12-05: rms_norm bwd float32 3.65 ms in the benchmark, 1.8 ms back to
    back, 2.7-3.8 ms from memory)."""
    fn, n = impl.fn, impl.number
    fn()
    impl.sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    impl.sync()
    return (time.perf_counter() - t0) / n


def _warm(impl):
    """Warm-up calls after the first; sets ``number`` (calls per sample)."""
    t_end = time.perf_counter() + WARM_S
    best = math.inf
    calls = 0
    while calls < WARM_CALLS or (time.perf_counter() < t_end and calls < 1000):
        _, t = _call(impl)
        best = min(best, t)
        calls += 1
    impl.number = max(1, min(10000, int(math.ceil(MIN_SAMPLE_S / max(best, 1e-7)))))


def time_interleaved(impls, repeat):
    """``repeat`` rounds; each round samples every implementation once, starting
    from a different one each round. A pause before each sample lets the
    previous runtime's worker threads (OpenMP) stop spinning, so they do not
    steal the cores from the next implementation: SETTLE_S, and SPIN_SETTLE_S
    after JAX's samples (``Impl.settle``), whose XLA pool went on taking cores
    for longer. AMD EPYC VM, 2026-12-06, 4096x4096 fwd+bwd,
    OMP_WAIT_POLICY=PASSIVE: numba_fused's bfloat16 layer_norm took 5.3-5.8 ms
    with no peers, or with torch or NumPy beside it, 6.7-7.4 ms with JAX beside
    it (3 ms pauses). With every peer: 7.3-7.6 ms after 3 ms pauses, 6.9-7.2 ms
    with 20 ms after JAX's samples, 5.6-5.7 ms with 20 ms before every sample
    (bfloat16 rms_norm 8.1-8.3, 4.5-4.8 and 4.3-4.4 ms). Not 20 ms everywhere: in
    a ``--peers none`` targets run it cost numba_fused's kernels ~9% (sum of
    medians 238 against 218 ms at 3 ms; the copy 147 against 144 ms: an idle
    VM wakes slowly), and 100 ms pauses slowed every implementation, the copy
    too (1.4-2x). Each sample's untimed lead-in call (``_sample``) takes part
    of that wake-up cost. SETTLE_S = 0 turns every pause off (the tests)."""
    k = len(impls)
    prev = None
    for r in range(repeat):
        for j in range(k):
            impl = impls[(r + j) % k]
            pause = max(SETTLE_S, prev.settle) if SETTLE_S and prev is not None else SETTLE_S
            if pause:
                time.sleep(pause)
            impl.samples.append(_sample(impl))
            prev = impl


# -------------------------------------------------------------- machine info
def machine_info(commit=None):
    import numba
    info = {"cpu": _cpu_model(), "cores": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version(),
            "numpy": np.__version__, "numba": numba.__version__,
            "numba_threads": numba.get_num_threads(), "loadavg": _loadavg()}
    try:
        info["threading_layer"] = numba.threading_layer()
    except ValueError:
        info["threading_layer"] = None
    try:
        from . import __version__
        info["numba_fused"] = __version__
    except ImportError:
        pass
    info["commit"] = commit or _git_commit()
    for mod in ("torch", "jax", "cupy"):
        m = sys.modules.get(mod)
        if m is not None:
            info[mod] = getattr(m, "__version__", "?")
    if sys.modules.get("torch") is not None:
        info["torch_threads"] = sys.modules["torch"].get_num_threads()
    return info


def _loadavg():
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                             capture_output=True, text=True, timeout=5).stdout.strip()
        if not sha:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no",
                                "--", "."], cwd=here, capture_output=True, text=True,
                               timeout=5).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


# --------------------------------------------------------------------- run
def set_threads(n):
    """numba's and torch's thread counts (JAX keeps its own pool)."""
    import numba
    numba.set_num_threads(n)
    if sys.modules.get("torch") is not None:
        sys.modules["torch"].set_num_threads(n)


def _peer_list(cfg, device):
    avail = CPU_PEERS if device == "cpu" else GPU_PEERS
    if cfg.peers is None:
        return list(avail), []
    want = [p for p in cfg.peers if p in avail]
    other = [p for p in cfg.peers if p not in avail]
    return want, other


def run(cfg):
    """Run the benchmark. Returns {"meta": ..., "records": [...], "notes": [...]}."""
    log = (lambda m: None) if cfg.quiet else _log
    notes = []

    def note(msg):
        if msg not in notes:
            notes.append(msg)
            log("note: " + msg)

    load = _loadavg()
    if load and load[0] > 0.5 * (os.cpu_count() or 1):
        note(f"load average {load[0]:.2f} on {os.cpu_count()} cores at the start: "
             "other processes may disturb the timings")
    seed = cfg.seed if cfg.seed is not None else int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    devices = []
    for dev in cfg.devices:
        if dev == "gpu":
            ok, why = gpu_available()
            if not ok:
                note(f"device gpu skipped: {why}")
                continue
        devices.append(dev)

    # Import the peers up front so a missing one is one note, and so --threads
    # reaches torch.
    wanted = set()
    for dev in devices:
        want, other = _peer_list(cfg, dev)
        for p in other:
            note(f"peer {p}: not available on device {dev}; skipped")
        wanted.update(want)
    missing = {}
    for p, mod, hint in (("torch", "torch", "pip install torch"),
                         ("jax", "jax", "pip install jax jaxlib"),
                         ("cupy", "cupy", "pip install cupy-cuda13x")):
        if p in wanted:
            try:
                __import__(mod)
            except ImportError:
                missing[p] = f"not installed ({hint})"
                note(f"peer {p}: not installed ({hint}); skipped")
    import numba
    saved_threads = numba.get_num_threads()
    torch_mod = sys.modules.get("torch")
    saved_torch = torch_mod.get_num_threads() if torch_mod is not None else None
    try:
        return _run(cfg, log, note, notes, devices, wanted, missing, seed, rng, load)
    finally:
        numba.set_num_threads(saved_threads)
        if saved_torch is not None:
            torch_mod.set_num_threads(saved_torch)


def _run(cfg, log, note, notes, devices, wanted, missing, seed, rng, load):
    if cfg.threads is not None:
        set_threads(cfg.threads)
        if "jax" in wanted and "jax" not in missing:
            note("--threads does not limit JAX (XLA keeps its own thread pool)")

    cases = [(dev, op, direction, dtype, tuple(shape))
             for dev in devices for dtype in cfg.dtypes for op in cfg.ops
             for direction in cfg.directions for shape in cfg.shapes]
    records, failures = [], []
    commit = _git_commit()          # the code that runs: HEAD at the start
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    t_start = time.perf_counter()
    for i, (dev, op, direction, dtype, shape) in enumerate(cases, 1):
        label = f"{dev} {op} {direction} {dtype} {'x'.join(map(str, shape))}"
        log(f"[{i}/{len(cases)}] {label}")
        inp, ref = make_inputs(op, direction, dtype, shape, rng,
                               None if cfg.weight_dtype == "same" else cfg.weight_dtype)
        nbytes = traffic_bytes(op, direction, inp)
        ctx = {"device": dev, "alloc": cfg.alloc}
        want, _ = _peer_list(cfg, dev)
        impls = []
        builders = [(OURS, ours_impl)] + [(p, PEER_BUILDERS[p]) for p in want
                                          if p not in missing]
        for name, build in builders:
            try:
                impl = build(op, direction, inp, ctx)
            except Unavailable as e:
                note(f"peer {name}: {e}; skipped for {dtype} on {dev}")
                continue
            try:
                raw, impl.first_s = _call(impl)
                impl.err, impl.err_output = max_error(impl.fetch(raw), ref)
                del raw
                _warm(impl)
            except Exception as e:  # a peer failing a case is a note, ours an error
                if name == OURS:
                    failures.append(f"{label}: {type(e).__name__}: {e}")
                    log(f"    numba_fused FAILED: {type(e).__name__}: {e}")
                    break
                note(f"peer {name} failed on {label}: {type(e).__name__}: {e}")
                continue
            impls.append(impl)
        del ref
        if not impls or impls[0].name != OURS:
            continue
        copy = (cpu_copy_impl if dev == "cpu" else gpu_copy_impl)(nbytes, rng)
        copy.first_s = _call(copy)[1]
        _warm(copy)
        impls.append(copy)
        time_interleaved(impls, cfg.repeat)
        copy_t = float(np.median(copy.samples))
        copy_gbps = copy.bytes / copy_t / 1e9
        ours = next(im for im in impls if im.name == OURS)
        ours_t = float(np.median(ours.samples))
        tol = TOLERANCES[dtype]
        for im in impls:
            med = float(np.median(im.samples))
            b = im.bytes if im.name == COPY else nbytes
            gbps = b / med / 1e9
            rec = {"device": dev, "op": op, "direction": direction, "dtype": dtype,
                   "shape": "x".join(map(str, shape)), "rows": int(math.prod(shape[:-1])),
                   "cols": int(shape[-1]), "impl": im.name,
                   "median_s": med, "min_s": float(np.min(im.samples)),
                   "max_s": float(np.max(im.samples)), "runs": len(im.samples),
                   "calls_per_run": im.number, "first_call_s": im.first_s,
                   "compile_s": max(0.0, im.first_s - med),
                   "bytes": int(b), "gbps": gbps, "copy_gbps": copy_gbps,
                   "roofline_pct": 100.0 * gbps / copy_gbps,
                   "speedup": (med / ours_t) if im.name != COPY else None,
                   "max_err": im.err, "err_output": im.err_output,
                   "tol": tol if im.name == OURS else None,
                   "ok": (im.err <= tol) if im.name == OURS else None,
                   "param_dtype": str(inp["weight"].dtype) if "weight" in inp else None,
                   "threads": _threads(), "alloc": cfg.alloc}
            records.append(rec)
        r = next(rr for rr in records[-len(impls):] if rr["impl"] == OURS)
        log(f"    {_fmt_t(r['median_s'])}  {r['gbps']:.1f} GB/s  "
            f"{r['roofline_pct']:.0f}% copy  err {r['max_err']:.1e}"
            + ("" if r["ok"] else "  FAIL"))
        del inp, impls, ours, copy
    meta = {"schema": 1,
            "date": date,
            "command": " ".join(["numba-fused"] + list(cfg.argv)),
            "seed": seed, "repeat": cfg.repeat, "alloc": cfg.alloc,
            "weight_dtype": cfg.weight_dtype, "loadavg_start": load,
            "wall_s": time.perf_counter() - t_start,
            "tolerances": dict(TOLERANCES), "machine": machine_info(commit)}
    return {"meta": meta, "records": records, "notes": notes, "failures": failures}


def _threads():
    import numba
    return numba.get_num_threads()


# ------------------------------------------------------------------ output
def _fmt_t(s):
    if s >= 1.0:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def peers_in(records):
    seen = []
    for r in records:
        if r["impl"] not in (OURS, COPY) and r["impl"] not in seen:
            seen.append(r["impl"])
    return seen


#: Printed table columns (one row per case: numba_fused's numbers).
def table_rows(records):
    peers = peers_in(records)
    head = (["device", "op", "dir", "dtype", "shape", "median", "min-max", "GB/s",
             "% copy"] + [f"vs {p}" for p in peers] + ["max err", "ok"])
    by_case = {}
    for r in records:
        key = (r["device"], r["op"], r["direction"], r["dtype"], r["shape"])
        by_case.setdefault(key, {})[r["impl"]] = r
    rows = []
    for key, impls in by_case.items():
        o = impls[OURS]
        row = list(key) + [_fmt_t(o["median_s"]),
                           f"{_fmt_t(o['min_s'])}-{_fmt_t(o['max_s'])}",
                           f"{o['gbps']:.1f}", f"{o['roofline_pct']:.0f}%"]
        for p in peers:
            row.append(f"{impls[p]['speedup']:.2f}x" if p in impls else "-")
        row += [f"{o['max_err']:.1e}", "ok" if o["ok"] else "FAIL"]
        rows.append(row)
    return head, rows


def format_table(records, markdown=False):
    head, rows = table_rows(records)
    if markdown:
        lines = ["| " + " | ".join(head) + " |",
                 "|" + "|".join("---" if i < 5 else "---:" for i in range(len(head))) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(  # noqa: E731
        c.ljust(w) if i < 5 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def format_compile(records):
    """First call vs steady state of numba_fused, per (device, op, direction, dtype):
    the first shape's first call holds the compile (or cache load)."""
    lines = ["first call (compile or cache load) vs steady state, numba_fused:"]
    seen = set()
    for r in records:
        key = (r["device"], r["op"], r["direction"], r["dtype"])
        if r["impl"] != OURS or key in seen:
            continue
        seen.add(key)
        lines.append(f"  {' '.join(key):32s} first {_fmt_t(r['first_call_s']):>9s}  "
                     f"steady {_fmt_t(r['median_s']):>9s}  "
                     f"compile ~{_fmt_t(r['compile_s'])}")
    return "\n".join(lines)


CSV_KEYS = ("device", "op", "direction", "dtype", "shape", "rows", "cols", "impl",
            "median_s", "min_s", "max_s", "runs", "calls_per_run", "first_call_s",
            "compile_s", "bytes", "gbps", "copy_gbps", "roofline_pct", "speedup",
            "max_err", "err_output", "tol", "ok", "param_dtype", "threads", "alloc")


def write_csv(path, records):
    import csv
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_KEYS)
        w.writeheader()
        for r in records:
            w.writerow({k: r.get(k) for k in CSV_KEYS})


def write_json(path, result):
    import json
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
        f.write("\n")


_COLORS = {OURS: "tab:red", "numpy": "tab:blue", "torch": "tab:orange",
           "jax": "tab:green", "cupy": "tab:purple", COPY: "black"}


def write_plot(path, records):
    """GB/s vs columns, one panel per (op, direction), one line per implementation
    and dtype (one colour per implementation, one line style per dtype; the copy
    roofline in black)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = []
    for r in records:
        k = (r["device"], r["op"], r["direction"])
        if k not in panels:
            panels.append(k)
    ncol = min(3, len(panels))
    nrow = int(math.ceil(len(panels) / ncol))
    fig, axes = plt.subplots(nrow, ncol, figsize=(5 * ncol, 3.6 * nrow), squeeze=False)
    styles = ["-", "--", ":", "-."]
    dtypes = sorted({r["dtype"] for r in records})
    for ax, (dev, op, direction) in zip(axes.flat, panels):
        lines = {}
        for r in records:
            if (r["device"], r["op"], r["direction"]) == (dev, op, direction):
                lines.setdefault((r["impl"], r["dtype"]), []).append((r["cols"], r["gbps"]))
        for (impl, dt), pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts],
                    marker="." if impl == COPY else "o",
                    linestyle=styles[dtypes.index(dt) % 4],
                    color=_COLORS.get(impl, "tab:olive"),
                    linewidth=1.0 if impl == COPY else 1.6,
                    label=f"{impl} {dt}" if len(dtypes) > 1 else impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{op} {direction} ({dev})")
        ax.set_xlabel("columns")
        ax.set_ylabel("GB/s (minimal traffic)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""Shared helpers for the numba_fused CPU test suite.

Comparison policy (used by every numerical test, see ``assert_close``):

* float64 / float32 outputs: ``|got - ref| <= TOL[dtype] * scale`` with
  TOL = 1e-12 (f64) and 1e-5 (f32). ``scale`` is a *per-row* (or, for dweight and
  dbias, per-column) magnitude, not the element itself: outputs such as
  layer-norm y, dx, or a dweight column can be near zero through cancellation,
  and no accumulator-precision kernel can make those elements relatively
  accurate. For row outputs the scale is the row's max-abs reference value; for
  dweight/dbias it is sum(|terms|) over the rows of that column (the spec).
* float16 / bfloat16 outputs: ``|got - ref| <= 1 ulp(ref)`` in the output dtype
  (the one rounding at the store; spacing at |ref| with the subnormal floor),
  plus the float32 allowance above (``1e-5 * scale``) for the float32 arithmetic
  that precedes the rounding. That allowance is <= 3% of an ulp for elements
  near the row's largest, so it only matters for elements near zero, where the
  half ulp is finer than float32 arithmetic on O(1) terms can resolve.
* ``cond`` (optional, per row): an additional ``8 * eps(acc) * cond`` for
  ill-conditioned rows, where ``cond`` is the size of the terms the result is
  computed from (for layer-norm y: max|x| * rstd * max|weight|). This is the
  forward error of a backward-stable kernel whose inputs are perturbed by a few
  accumulator ulps; for ordinary rows it is ~10x below the TOL term, and it only
  dominates for large-mean rows (mean 1e4, std 1: the float32 mean itself is
  only known to 5e-4).

The reference results always come from ``numba_fused.reference`` evaluated in
float64 on the same (already quantized) inputs.
"""
import numpy as np
import ml_dtypes
import numba
import pytest

import numba_fused as nf
from numba_fused import reference as ref

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
DTYPES = [F32, F64, F16, BF16]
HALVES = (F16, BF16)
DTYPE_IDS = {F32: "f32", F64: "f64", F16: "f16", BF16: "bf16"}

TOL = {F64: 1e-12, F32: 1e-5}
EPS = {F64: float(np.finfo(np.float64).eps), F32: float(np.finfo(np.float32).eps),
       F16: float(ml_dtypes.finfo(F16).eps), BF16: float(ml_dtypes.finfo(BF16).eps)}


def dtype_id(dt):
    return DTYPE_IDS[np.dtype(dt)]


def acc_dtype(dt):
    return F64 if np.dtype(dt) == F64 else F32


def is_half(dt):
    return np.dtype(dt) in HALVES


# ------------------------------------------------------------- random inputs
@pytest.fixture
def rng(request):
    """A generator seeded from the test's node id: reproducible, and different
    for every parametrization."""
    import zlib
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def draw(rng, shape, dtype, scale=1.0, loc=0.0):
    """loc + scale * N(0,1), quantized to dtype, never zero (values within
    0.05*scale of loc are pushed out), so a kernel that skips or zeroes elements
    cannot hide."""
    v = rng.standard_normal(shape)
    v = v + np.copysign(0.05, v)
    a = np.asarray(loc + scale * v).astype(dtype)
    assert np.all(a != 0)
    return a


def draw_param(rng, cols, kind, xdtype, loc=1.0, scale=0.5):
    """A weight/bias: kind None, "x" (x's dtype) or "f32"."""
    if kind is None:
        return None
    dt = xdtype if kind == "x" else F32
    return draw(rng, (cols,), dt, scale=scale, loc=loc)


def poisoned(shape, dtype):
    """An out buffer full of NaN: every element a kernel fails to write stays NaN."""
    return np.full(shape, np.nan, dtype)


def at_line_offset(shape, dtype, offset, fill):
    """(buffer, view): a C-contiguous view of ``shape`` starting ``offset`` bytes
    past a 64-byte boundary inside a byte buffer of ``fill`` with 256 bytes to
    spare (a line offset decides whether stores may be non-temporal)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = np.full(nbytes + 256, fill, np.uint8)
    o = -buf.ctypes.data % 64 + offset
    return buf, buf[o:o + nbytes].view(dtype).reshape(shape)


def bits(a):
    """The raw bytes of ``a`` in C order (bit comparison that treats NaN == NaN)."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint8).tobytes()


def assert_bits_equal(a, b, what=""):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    if bits(a) != bits(b):
        av = np.ascontiguousarray(a).view(np.uint8).reshape(-1, a.itemsize)
        bv = np.ascontiguousarray(b).view(np.uint8).reshape(-1, b.itemsize)
        bad = np.nonzero((av != bv).any(axis=1))[0]
        raise AssertionError(f"{what}: {bad.size} elements differ in bits, first at flat "
                             f"{bad[:5]}: {a.reshape(-1)[bad[:5]]} vs {b.reshape(-1)[bad[:5]]}")


def copies(*arrays):
    return [None if a is None else a.copy() for a in arrays]


def assert_unmodified(originals, arrays, names):
    for o, a, n in zip(originals, arrays, names):
        if o is not None:
            assert_bits_equal(np.ascontiguousarray(a), np.ascontiguousarray(o),
                              f"input {n} was modified")


# --------------------------------------------------------------- layouts
LAYOUTS = ["C", "rows2", "cols2", "negcols", "negrows", "transpose", "F"]


def as_layout(a, layout, fill=np.nan):
    """A view with ``a``'s values and the requested memory layout. Gaps of
    strided views are filled with ``fill`` (NaN): a kernel reading them shows."""
    if layout == "C":
        return np.array(a, order="C")
    if layout == "F":
        return np.array(a, order="F")
    if layout == "rows2":          # x[::2] over the first axis
        buf = np.full((2 * a.shape[0],) + a.shape[1:], fill, a.dtype)
        buf[::2] = a
        return buf[::2]
    if layout == "cols2":          # x[..., ::2]
        buf = np.full(a.shape[:-1] + (2 * a.shape[-1],), fill, a.dtype)
        buf[..., ::2] = a
        return buf[..., ::2]
    if layout == "negcols":
        return np.ascontiguousarray(a[..., ::-1])[..., ::-1]
    if layout == "negrows":
        return np.ascontiguousarray(a[::-1])[::-1]
    if layout == "transpose":      # x.transpose(1, 0, 2)-like: swap the first two axes
        assert a.ndim >= 2
        return np.ascontiguousarray(np.swapaxes(a, 0, 1)).swapaxes(0, 1)
    raise ValueError(layout)


# ------------------------------------------------------------- comparisons
def ulp(v, dtype):
    """Spacing of ``dtype`` at |v| (float64 array), with the subnormal floor."""
    fi = ml_dtypes.finfo(np.dtype(dtype))
    v = np.abs(np.asarray(v, np.float64))
    _, e = np.frexp(v)              # v = m * 2**e, m in [0.5, 1)
    e = np.where(v == 0, fi.minexp, np.maximum(e - 1, fi.minexp))   # frexp(0) = (0, 0)
    return np.ldexp(1.0, (e - fi.nmant).astype(np.int32))


def row_scale(r):
    """Per-row max |r| (keepdims), NaN ignored."""
    r = np.asarray(r, np.float64)
    if r.ndim == 0 or r.size == 0:
        return np.abs(r)
    with np.errstate(invalid="ignore"):
        return np.nanmax(np.where(np.isfinite(r), np.abs(r), 0.0), axis=-1, keepdims=True)


def bound(reference, dtype, scale, cond=None):
    dt = np.dtype(dtype)
    r = np.asarray(reference, np.float64)
    if dt in HALVES:
        b = ulp(r, dt) + TOL[F32] * scale
        acc = F32
    else:
        b = TOL[dt] * scale + 0 * r
        acc = dt
    if cond is not None:
        b = b + 8 * EPS[acc] * cond
    return b


def assert_close(got, reference, *, scale=None, cond=None, dtype=None, what="result"):
    """Compare a kernel output against a float64 reference (policy: module doc).

    NaN and +-inf must appear exactly where the reference has them."""
    got = np.asarray(got)
    dtype = got.dtype if dtype is None else np.dtype(dtype)
    assert got.dtype == dtype, f"{what}: dtype {got.dtype}, expected {dtype}"
    r = np.asarray(reference, np.float64)
    assert got.shape == r.shape, f"{what}: shape {got.shape}, expected {r.shape}"
    g = got.astype(np.float64)
    nan_r, nan_g = np.isnan(r), np.isnan(g)
    assert np.array_equal(nan_r, nan_g), (
        f"{what}: NaN mismatch at {np.argwhere(nan_r != nan_g)[:5].tolist()}")
    inf_r = np.isinf(r)
    assert np.array_equal(inf_r, np.isinf(g)) and np.array_equal(r[inf_r], g[inf_r]), \
        f"{what}: inf mismatch"
    if scale is None:
        scale = row_scale(r)
    b = np.broadcast_to(bound(r, dtype, scale, cond), r.shape)
    fin = np.isfinite(r)
    err = np.where(fin, np.abs(g - np.where(fin, r, 0)), 0.0)
    bad = err > b
    if bad.any():
        idx = np.argwhere(bad)[:5]
        worst = np.unravel_index(np.argmax(np.where(b > 0, err / np.where(b > 0, b, 1), np.inf)),
                                 r.shape)
        raise AssertionError(
            f"{what} ({dtype}): {bad.sum()} of {r.size} elements out of tolerance; "
            f"first {idx.tolist()}: got {g[tuple(idx.T)]}, ref {r[tuple(idx.T)]}, "
            f"bound {b[tuple(idx.T)]}; worst at {worst}: err {err[worst]:.3e} "
            f"bound {b[worst]:.3e} ({err[worst] / b[worst] if b[worst] else np.inf:.2f}x)")


def assert_rel_elementwise(got, reference, tol, floor=0.0, what="result"):
    """|got - ref| <= tol * max(|ref|, floor) elementwise (for softmax, whose
    entries are all relatively well conditioned)."""
    g = np.asarray(got, np.float64)
    r = np.asarray(reference, np.float64)
    fin = np.isfinite(r)
    err = np.abs(g[fin] - r[fin])
    b = tol * np.maximum(np.abs(r[fin]), floor)
    bad = err > b
    assert not bad.any(), (f"{what}: {bad.sum()} elements relatively off; worst "
                           f"{np.max(err / np.maximum(b, 1e-300)):.2f}x of bound")


def stats_close(got, reference, xdtype, *, scale, what):
    """mean/rstd: accumulator dtype and the f32/f64 tolerance."""
    acc = acc_dtype(xdtype)
    assert got.dtype == acc, f"{what}: dtype {got.dtype}, expected {acc}"
    assert_close(got, reference, scale=scale, dtype=acc, what=what)


# ---------------------------------------------------- condition estimates
def ln_fwd_cond(x, weight, rstd_ref):
    """max|x| * rstd * max|weight| per row (keepdims)."""
    x64 = np.abs(np.asarray(x, np.float64))
    w = 1.0 if weight is None else np.max(np.abs(np.asarray(weight, np.float64)), initial=0)
    return np.max(x64, axis=-1, keepdims=True, initial=0) * np.asarray(rstd_ref)[..., None] * w


def norm_bwd_cond(dy, x, weight, mean, rstd):
    """Size of the terms of dx = rstd * (g - xhat * mean(g xhat) - mean(g))."""
    dy = np.asarray(dy, np.float64)
    x = np.asarray(x, np.float64)
    r = np.asarray(rstd, np.float64)[..., None]
    m = 0.0 if mean is None else np.asarray(mean, np.float64)[..., None]
    xhat = np.abs((x - m) * r)
    g = np.abs(dy if weight is None else dy * np.asarray(weight, np.float64))
    return r * (g.max(-1, keepdims=True, initial=0)
                + xhat.max(-1, keepdims=True, initial=0) * (g * xhat).mean(-1, keepdims=True)
                + g.mean(-1, keepdims=True))


def softmax_bwd_cond(y, dy):
    y = np.abs(np.asarray(y, np.float64))
    dy = np.abs(np.asarray(dy, np.float64))
    return y.max(-1, keepdims=True, initial=0) * (dy.max(-1, keepdims=True, initial=0)
                                                   + (y * dy).sum(-1, keepdims=True))


def param_grad_scale(terms, cols):
    """sum over rows of |terms| per column (the dweight/dbias scale)."""
    return np.abs(np.asarray(terms, np.float64)).reshape(-1, cols).sum(axis=0)


# ------------------------------------------------------ per-op checking
def stats_scale(x):
    """mean's per-row scale: the row's max |x|."""
    return row_scale(x)[..., 0]


def check_param_grad(got, reference, param, scale, what):
    if param is None:
        assert got is None, f"{what} must be None when its parameter is None"
        return
    assert got is not None, f"{what} is None"
    assert got.dtype == param.dtype and got.shape == param.shape, (got.dtype, got.shape)
    assert_close(got, reference, scale=scale, what=what)


def call_op(op, d, out=None):
    f = getattr(nf, op)
    if op == "softmax_fwd":
        r = f(d["x"], out=out)
    elif op == "softmax_bwd":
        r = f(d["y"], d["dy"], out=out)
    elif op == "rms_norm_fwd":
        r = f(d["x"], d["weight"], out=out)
    elif op == "rms_norm_bwd":
        r = f(d["dy"], d["x"], d["weight"], d["rstd"], out=out)
    elif op == "layer_norm_fwd":
        r = f(d["x"], d["weight"], d["bias"], out=out)
    else:
        r = f(d["dy"], d["x"], d["weight"], d["bias"], d["mean"], d["rstd"], out=out)
    return r if isinstance(r, tuple) else (r,)


def check_op(op, d, got):
    """Every output of ``op`` on the named inputs ``d`` against the reference."""
    x = d.get("x")
    if op == "softmax_fwd":
        assert_close(got[0], ref.softmax_fwd(x), what="y")
    elif op == "softmax_bwd":
        y, dy = d["y"], d["dy"]
        assert_close(got[0], ref.softmax_bwd(y, dy), cond=softmax_bwd_cond(y, dy), what="dx")
    elif op == "rms_norm_fwd":
        yr, rr = ref.rms_norm_fwd(x, d["weight"])
        assert_close(got[0], yr, what="y")
        stats_close(got[1], rr, x.dtype, scale=np.abs(rr), what="rstd")
    elif op == "layer_norm_fwd":
        yr, mr, rr = ref.layer_norm_fwd(x, d["weight"], d["bias"])
        assert_close(got[0], yr, cond=ln_fwd_cond(x, d["weight"], rr), what="y")
        stats_close(got[1], mr, x.dtype, scale=stats_scale(x), what="mean")
        stats_close(got[2], rr, x.dtype, scale=np.abs(rr), what="rstd")
    else:
        dy, w, rstd = d["dy"], d["weight"], d["rstd"]
        mean = d.get("mean")
        m = 0.0 if mean is None else np.asarray(mean, np.float64)[..., None]
        xhat = (x.astype(np.float64) - m) * np.asarray(rstd, np.float64)[..., None]
        cols = x.shape[-1]
        if op == "rms_norm_bwd":
            dxr, dwr = ref.rms_norm_bwd(dy, x, w, rstd)
            dbr = None
        else:
            dxr, dwr, dbr = ref.layer_norm_bwd(dy, x, w, d["bias"], mean, rstd)
        assert_close(got[0], dxr, cond=norm_bwd_cond(dy, x, w, mean, rstd), what="dx")
        check_param_grad(got[1], dwr, w,
                          param_grad_scale(dy.astype(np.float64) * xhat, cols), "dweight")
        if op == "layer_norm_bwd":
            check_param_grad(got[2], dbr, d["bias"],
                              param_grad_scale(dy.astype(np.float64), cols), "dbias")



# ------------------------------------------------------------- fixtures
@pytest.fixture
def restore_threads():
    n = numba.get_num_threads()
    yield numba.config.NUMBA_NUM_THREADS
    numba.set_num_threads(n)


# ------------------------------------------------- the CUDA simulator child
def _simulator_module(session):
    for item in session.items:
        if item.name == "test_gpu_cases_in_simulator":
            return item.module
    return None


def pytest_collection_finish(session):
    """Start the CUDA simulator cases (tests/test_gpu_sim.py) in the background as
    soon as they are collected: ~2.5 min of one core beside the rest of the run."""
    module = _simulator_module(session)
    if module is not None and not session.config.option.collectonly:
        module.start_cases()


def pytest_sessionfinish(session):
    module = _simulator_module(session)
    if module is not None:
        module.stop_cases()


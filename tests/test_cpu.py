"""CPU kernels vs the float64 reference, finite differences, layouts, in-place,
special values, empty inputs and determinism. Comparison policy: conftest.py."""
import numba
import numpy as np
import pytest

import numba_fused as nf
from numba_fused import cpu
from numba_fused import reference as ref
from conftest import (BF16, DTYPES, F16, F32, F64, HALVES, LAYOUTS, TOL, acc_dtype,
                      as_layout, assert_bits_equal, assert_close, assert_rel_elementwise,
                      assert_unmodified, copies, draw, draw_param, dtype_id, is_half,
                      ln_fwd_cond, norm_bwd_cond, param_grad_scale, poisoned, row_scale,
                      softmax_bwd_cond, stats_close, stats_scale, check_param_grad, call_op,
                      check_op, at_line_offset)

SHAPES = [(7,), (1, 1), (3, 5, 129), (64, 1000), (2, 4099),
          (4, 1), (4, 2), (5, 7), (4, 64), (3, 1000),
          (133, 1024)]          # 4-5 rows per dweight chunk (float32's row path backwards)
SHAPE_IDS = ["x".join(map(str, s)) for s in SHAPES]
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
shapes = pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
W_KINDS = [None, "x", "f32"]
WB_KINDS = [(None, None), ("x", "x"), ("f32", "f32"), ("x", None), (None, "f32")]
RMS_EPS, LN_EPS = 1e-6, 1e-5


# ==================================================================== softmax
@dtypes
@shapes
def test_softmax_fwd(rng, dtype, shape):
    x = draw(rng, shape, dtype, scale=3.0)
    (x0,) = copies(x)
    out = poisoned(shape, dtype)
    y = nf.softmax_fwd(x, out=out)
    assert y is out
    assert_unmodified([x0], [x], ["x"])
    r = ref.softmax_fwd(x)
    assert_close(y, r, what="y")
    if not is_half(dtype):
        # softmax entries are relatively well conditioned: also elementwise
        assert_rel_elementwise(y, r, TOL[dtype], floor=1e-30, what="y")
    assert_bits_equal(nf.softmax_fwd(x), y, "softmax_fwd without out")
    assert_bits_equal(nf.softmax(x), y, "softmax")


@dtypes
@shapes
def test_softmax_bwd(rng, dtype, shape):
    y = nf.softmax_fwd(draw(rng, shape, dtype, scale=2.0))
    dy = draw(rng, shape, dtype)
    y0, dy0 = copies(y, dy)
    out = poisoned(shape, dtype)
    dx = nf.softmax_bwd(y, dy, out=out)
    assert dx is out
    assert_unmodified([y0, dy0], [y, dy], ["y", "dy"])
    assert_close(dx, ref.softmax_bwd(y, dy), cond=softmax_bwd_cond(y, dy), what="dx")
    assert_bits_equal(nf.softmax_bwd(y, dy), dx, "softmax_bwd without out")


# ==================================================================== RMSNorm
@pytest.mark.parametrize("wkind", W_KINDS, ids=str)
@dtypes
@shapes
def test_rms_norm_fwd(rng, dtype, shape, wkind):
    x = draw(rng, shape, dtype)
    w = draw_param(rng, shape[-1], wkind, dtype)
    x0, w0 = copies(x, w)
    out = poisoned(shape, dtype)
    y, rstd = nf.rms_norm_fwd(x, w, RMS_EPS, out=out)
    assert y is out
    assert_unmodified([x0, w0], [x, w], ["x", "weight"])
    yr, rr = ref.rms_norm_fwd(x, w, RMS_EPS)
    assert rstd.shape == shape[:-1]
    stats_close(rstd, rr, dtype, scale=np.abs(rr), what="rstd")
    assert_close(y, yr, what="y")
    y2, rstd2 = nf.rms_norm_fwd(x, w, RMS_EPS)
    assert_bits_equal(y2, y, "rms_norm_fwd without out")
    assert_bits_equal(rstd2, rstd, "rstd")
    assert_bits_equal(nf.rms_norm(x, w, RMS_EPS), y, "rms_norm")


@pytest.mark.parametrize("wkind", W_KINDS, ids=str)
@dtypes
@shapes
def test_rms_norm_bwd(rng, dtype, shape, wkind):
    x = draw(rng, shape, dtype)
    w = draw_param(rng, shape[-1], wkind, dtype)
    _, rstd = nf.rms_norm_fwd(x, w, RMS_EPS)
    dy = draw(rng, shape, dtype)
    ins = [dy, x, w, rstd]
    orig = copies(*ins)
    out = poisoned(shape, dtype)
    dx, dw = nf.rms_norm_bwd(dy, x, w, rstd, out=out)
    assert dx is out
    assert_unmodified(orig, ins, ["dy", "x", "weight", "rstd"])
    dxr, dwr = ref.rms_norm_bwd(dy, x, w, rstd)
    assert_close(dx, dxr, cond=norm_bwd_cond(dy, x, w, None, rstd), what="dx")
    xhat = x.astype(np.float64) * np.asarray(rstd, np.float64)[..., None]
    check_param_grad(dw, dwr, w, param_grad_scale(dy.astype(np.float64) * xhat, shape[-1]),
                      "dweight")
    dx2, dw2 = nf.rms_norm_bwd(dy, x, w, rstd)
    assert_bits_equal(dx2, dx, "rms_norm_bwd without out")
    if w is not None:
        assert_bits_equal(dw2, dw, "dweight rerun")


# ================================================================== LayerNorm
@pytest.mark.parametrize("wb", WB_KINDS, ids=str)
@dtypes
@shapes
def test_layer_norm_fwd(rng, dtype, shape, wb):
    x = draw(rng, shape, dtype, loc=0.5)
    w = draw_param(rng, shape[-1], wb[0], dtype)
    b = draw_param(rng, shape[-1], wb[1], dtype, loc=0.0)
    ins = [x, w, b]
    orig = copies(*ins)
    out = poisoned(shape, dtype)
    y, mean, rstd = nf.layer_norm_fwd(x, w, b, LN_EPS, out=out)
    assert y is out
    assert_unmodified(orig, ins, ["x", "weight", "bias"])
    yr, mr, rr = ref.layer_norm_fwd(x, w, b, LN_EPS)
    assert mean.shape == rstd.shape == shape[:-1]
    stats_close(mean, mr, dtype, scale=stats_scale(x), what="mean")
    stats_close(rstd, rr, dtype, scale=np.abs(rr), what="rstd")
    assert_close(y, yr, cond=ln_fwd_cond(x, w, rr), what="y")
    y2, mean2, rstd2 = nf.layer_norm_fwd(x, w, b, LN_EPS)
    assert_bits_equal(y2, y, "layer_norm_fwd without out")
    assert_bits_equal(mean2, mean, "mean")
    assert_bits_equal(rstd2, rstd, "rstd")
    assert_bits_equal(nf.layer_norm(x, w, b, LN_EPS), y, "layer_norm")


def _ln_bwd_check(dtype, shape, dy, x, w, b, mean, rstd):
    ins = [dy, x, w, b, mean, rstd]
    orig = copies(*ins)
    out = poisoned(shape, dtype)
    dx, dw, db = nf.layer_norm_bwd(dy, x, w, b, mean, rstd, out=out)
    assert dx is out
    assert_unmodified(orig, ins, ["dy", "x", "weight", "bias", "mean", "rstd"])
    dxr, dwr, dbr = ref.layer_norm_bwd(dy, x, w, b, mean, rstd)
    assert_close(dx, dxr, cond=norm_bwd_cond(dy, x, w, mean, rstd), what="dx")
    dy64 = dy.astype(np.float64)
    xhat = ((x.astype(np.float64) - np.asarray(mean, np.float64)[..., None])
            * np.asarray(rstd, np.float64)[..., None])
    cols = shape[-1]
    check_param_grad(dw, dwr, w, param_grad_scale(dy64 * xhat, cols), "dweight")
    check_param_grad(db, dbr, b, param_grad_scale(dy64, cols), "dbias")
    return dx, dw, db


@pytest.mark.parametrize("wb", WB_KINDS, ids=str)
@dtypes
@shapes
def test_layer_norm_bwd(rng, dtype, shape, wb):
    x = draw(rng, shape, dtype, loc=0.5)
    w = draw_param(rng, shape[-1], wb[0], dtype)
    b = draw_param(rng, shape[-1], wb[1], dtype, loc=0.0)
    _, mean, rstd = nf.layer_norm_fwd(x, w, b, LN_EPS)
    dy = draw(rng, shape, dtype)
    dx, dw, db = _ln_bwd_check(dtype, shape, dy, x, w, b, mean, rstd)
    dx2, dw2, db2 = nf.layer_norm_bwd(dy, x, w, b, mean, rstd)
    assert_bits_equal(dx2, dx, "layer_norm_bwd without out")
    for g, g2, n in ((dw, dw2, "dweight"), (db, db2, "dbias")):
        if g is not None:
            assert_bits_equal(g2, g, n + " rerun")


# ========================================================= finite differences
FD_SHAPES = [(5,), (3, 7), (2, 2, 4), (4, 1), (2, 33)]
FD_IDS = ["x".join(map(str, s)) for s in FD_SHAPES]


def _fd_grad(f, a, h=1e-6):
    """Central differences of the scalar f at a (float64), element by element."""
    g = np.empty(a.shape)
    for idx in np.ndindex(a.shape):
        ap, am = a.copy(), a.copy()
        ap[idx] += h
        am[idx] -= h
        g[idx] = (f(ap) - f(am)) / (2 * h)
    return g


def _fd_close(numeric, analytic, what):
    # f64 central differences with h = 1e-6: truncation ~h^2 = 1e-12, rounding
    # ~1e-16 * |f| / h ~ 1e-9; a wrong gradient term is off by O(0.1).
    analytic = np.asarray(analytic, np.float64)
    scale = max(1.0, float(np.max(np.abs(analytic), initial=0)))
    err = float(np.max(np.abs(numeric - analytic), initial=0))
    assert err <= 1e-6 * scale, f"{what}: finite differences differ by {err:.3e}"


@pytest.mark.parametrize("shape", FD_SHAPES, ids=FD_IDS)
def test_softmax_grad_fd(rng, shape):
    x = draw(rng, shape, F64)
    dy = draw(rng, shape, F64)
    num = _fd_grad(lambda a: float(np.sum(dy * nf.softmax_fwd(a))), x)
    _fd_close(num, nf.softmax_bwd(nf.softmax_fwd(x), dy), "softmax dx")


@pytest.mark.parametrize("with_w", [False, True])
@pytest.mark.parametrize("shape", FD_SHAPES, ids=FD_IDS)
def test_rms_norm_grad_fd(rng, shape, with_w):
    x = draw(rng, shape, F64)
    w = draw_param(rng, shape[-1], "x" if with_w else None, F64)
    dy = draw(rng, shape, F64)
    _, rstd = nf.rms_norm_fwd(x, w)
    dx, dw = nf.rms_norm_bwd(dy, x, w, rstd)
    _fd_close(_fd_grad(lambda a: float(np.sum(dy * nf.rms_norm_fwd(a, w)[0])), x), dx,
              "rms_norm dx")
    if with_w:
        _fd_close(_fd_grad(lambda p: float(np.sum(dy * nf.rms_norm_fwd(x, p)[0])), w), dw,
                  "rms_norm dweight")


@pytest.mark.parametrize("wb", [(False, False), (True, True), (True, False), (False, True)],
                         ids=str)
@pytest.mark.parametrize("shape", FD_SHAPES, ids=FD_IDS)
def test_layer_norm_grad_fd(rng, shape, wb):
    x = draw(rng, shape, F64)
    w = draw_param(rng, shape[-1], "x" if wb[0] else None, F64)
    b = draw_param(rng, shape[-1], "x" if wb[1] else None, F64, loc=0.0)
    dy = draw(rng, shape, F64)
    _, mean, rstd = nf.layer_norm_fwd(x, w, b)
    dx, dw, db = nf.layer_norm_bwd(dy, x, w, b, mean, rstd)

    def f(a=x, p=w, q=b):
        return float(np.sum(dy * nf.layer_norm_fwd(a, p, q)[0]))
    _fd_close(_fd_grad(lambda a: f(a=a), x), dx, "layer_norm dx")
    if w is not None:
        _fd_close(_fd_grad(lambda p: f(p=p), w), dw, "layer_norm dweight")
    if b is not None:
        _fd_close(_fd_grad(lambda q: f(q=q), b), db, "layer_norm dbias")


# ================================================================ layouts
def _make_case(op, rng, shape, dtype):
    """Named inputs of one op (stats from the library's own forward)."""
    cols = shape[-1]
    x = draw(rng, shape, dtype, loc=0.3)
    w = draw_param(rng, cols, "x", dtype)
    b = draw_param(rng, cols, "f32", dtype, loc=0.0)
    dy = draw(rng, shape, dtype)
    if op == "softmax_fwd":
        return dict(x=x)
    if op == "softmax_bwd":
        return dict(y=nf.softmax_fwd(x), dy=dy)
    if op == "rms_norm_fwd":
        return dict(x=x, weight=w)
    if op == "rms_norm_bwd":
        return dict(dy=dy, x=x, weight=w, rstd=nf.rms_norm_fwd(x, w)[1])
    if op == "layer_norm_fwd":
        return dict(x=x, weight=w, bias=b)
    _, mean, rstd = nf.layer_norm_fwd(x, w, b)
    return dict(dy=dy, x=x, weight=w, bias=b, mean=mean, rstd=rstd)


OPS = ["softmax_fwd", "softmax_bwd", "rms_norm_fwd", "rms_norm_bwd",
       "layer_norm_fwd", "layer_norm_bwd"]
BWD_OPS = ["softmax_bwd", "rms_norm_bwd", "layer_norm_bwd"]
ROW_ARGS = ("x", "y", "dy")
LAYOUT_SHAPES = [(6, 4, 33), (40, 8, 130)]     # serial and parallel kernels


def _relayout(d, layout):
    out = {}
    for k, v in d.items():
        if k in ROW_ARGS:
            out[k] = as_layout(v, layout)
        elif k in ("mean", "rstd"):
            out[k] = as_layout(v, {"cols2": "rows2", "negcols": "negrows"}.get(layout, layout))
        elif layout in ("cols2", "negcols"):         # weight/bias strided as well
            out[k] = as_layout(v, layout)
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("layout", LAYOUTS[1:])
@pytest.mark.parametrize("shape", LAYOUT_SHAPES, ids=["serial", "parallel"])
@pytest.mark.parametrize("dtype", [F32, BF16, F16, F64], ids=dtype_id)
@pytest.mark.parametrize("op", OPS)
def test_strided_inputs(rng, op, dtype, shape, layout):
    """Non-contiguous / negative-stride inputs give the contiguous computation's
    results (to the suite's tolerance: non-C layouts run a different numba
    specialization, whose reassociated reductions may differ in the last bit),
    and are not modified. Gaps of strided views hold NaN, so a kernel reading
    outside the view shows."""
    d = _make_case(op, rng, shape, dtype)
    v = _relayout(d, layout)
    orig = copies(*v.values())
    got = call_op(op, v)
    check_op(op, d, got)
    assert_unmodified(orig, list(v.values()), list(v))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", LAYOUT_SHAPES, ids=["serial", "parallel"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
@pytest.mark.parametrize("op", OPS)
def test_strided_out(rng, op, dtype, shape, layout):
    """out= with any layout: every element written, gaps of the buffer untouched."""
    d = _make_case(op, rng, shape, dtype)
    out = as_layout(poisoned(shape, dtype), layout)
    base = out.base if out.base is not None else out
    nan_before = np.isnan(base.astype(np.float32)).sum()
    got = call_op(op, d, out=out)
    assert got[0] is out
    check_op(op, d, got)
    # exactly out's elements were overwritten, nothing else in the buffer
    assert np.isnan(base.astype(np.float32)).sum() == nan_before - out.size


def _check_like_general(op, d, got, general, path):
    """``path``'s results: the general path's bits, in fresh C-contiguous writable
    NumPy-owned arrays of NumPy's canonical dtypes, and right against the reference."""
    for f, g in zip(got, general):
        if g is None:
            assert f is None
            continue
        assert_bits_equal(f, g, f"{op} {path} vs general path")
        assert f.flags.c_contiguous and f.flags.owndata and f.flags.writeable
        assert f.dtype is np.dtype(g.dtype.name)
        assert not any(np.shares_memory(f, v) for v in d.values() if v is not None)
    check_op(op, d, got)


# ============================================================ host fast path
FAST_SHAPES = [(1, 1024), (7,), (6, 4, 33), (40, 8, 130), (1, 70000)]


@pytest.mark.parametrize("params", ["x+f32", "none"])
@pytest.mark.parametrize("shape", FAST_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", OPS)
def test_fast_path_matches_general_path(rng, monkeypatch, op, dtype, shape, params):
    """A call of C-contiguous NumPy arrays without out= takes the dispatcher's
    fast path (it never builds a context): the same bits as the general path
    (out=), correct against the reference, inputs untouched, fresh outputs."""
    from numba_fused import _dispatch
    d = _make_case(op, rng, shape, dtype)
    if params == "none":
        d = {k: (None if k in ("weight", "bias") else v) for k, v in d.items()}
        if op in ("rms_norm_bwd", "layer_norm_bwd"):      # stats of the unweighted forward
            fwd = call_op(op.replace("bwd", "fwd"), d)
            d.update(zip(("mean", "rstd") if op == "layer_norm_bwd" else ("rstd",), fwd[1:]))
    orig = copies(*d.values())
    general = call_op(op, d, out=poisoned(shape, dtype))

    def no_context(*a, **k):
        raise AssertionError("the fast path built a context")
    monkeypatch.setattr(_dispatch, "_context", no_context)
    fast = call_op(op, d)
    monkeypatch.undo()
    assert_unmodified(orig, list(d.values()), list(d))
    _check_like_general(op, d, fast, general, "fast path")


@pytest.mark.parametrize("shape", [(1, 1024), (3, 300), (40, 8, 130)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op,in_place", [(op, False) for op in OPS]
                         + [(op, True) for op in OPS if op.endswith("bwd")],
                         ids=lambda v: {False: "out", True: "out=dy"}.get(v, v))
def test_fast_path_with_out(rng, monkeypatch, op, dtype, shape, in_place):
    """An out= laid out as x (C-contiguous NumPy, x's dtype), or out=dy in a
    backward, takes the fast paths too (small entries included): no context is
    built, the result is written into out and returned as it, with the bits of the
    call without out=; the inputs other than an in-place dy are untouched."""
    from numba_fused import _dispatch
    d = _make_case(op, rng, shape, dtype)
    want = call_op(op, d)
    out = d["dy"] if in_place else poisoned(shape, dtype)
    names = [k for k, v in d.items() if v is not None and v is not out]
    orig = copies(*(d[k] for k in names))

    def no_context(*a, **k):
        raise AssertionError("the fast path built a context")
    monkeypatch.setattr(_dispatch, "_context", no_context)
    got = call_op(op, d, out=out)
    monkeypatch.undo()
    assert got[0] is out
    assert_unmodified(orig, [d[k] for k in names], names)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            assert_bits_equal(g, w, f"{op} out= vs no out=")


# ========================================================= small-call entries
SMALL_SHAPES = [(1, 1024), (5, 300), (3, 1)]


@pytest.mark.parametrize("params", ["x+f32", "f32", "none"])
@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", OPS)
def test_small_call_entry(rng, monkeypatch, op, dtype, shape, params):
    """A small 2-D call runs the compiled entry (cpu.SMALL; float16/bfloat16 as
    their bits): once its signature is compiled, no Python check runs (``_host_ok``
    and the general path are poisoned), and the results are the bits of the path
    without the entries, in fresh NumPy-owned arrays of NumPy's canonical dtypes."""
    from numba_fused import _dispatch
    d = _make_case(op, rng, shape, dtype)
    if params != "x+f32":
        keep = {"none": (), "f32": ("weight", "bias")}[params]
        d = {k: (None if k in ("weight", "bias") and k not in keep else v)
             for k, v in d.items()}
        if params == "f32":
            d = {k: (v.astype(F32) if k in ("weight", "bias") else v) for k, v in d.items()}
        if op in ("rms_norm_bwd", "layer_norm_bwd"):       # stats of this forward
            fwd = call_op(op.replace("bwd", "fwd"), d)
            d.update(zip(("mean", "rstd") if op == "layer_norm_bwd" else ("rstd",), fwd[1:]))
    orig = copies(*d.values())
    with monkeypatch.context() as m:
        m.setattr(_dispatch._SmallCall, "takes", lambda self, x: False)
        general = call_op(op, d, out=poisoned(shape, dtype))
    call_op(op, d)                                     # compiles the signature

    def poison(*a, **k):
        raise AssertionError("the small call took a Python path")
    monkeypatch.setattr(_dispatch, "_host_ok", poison)
    monkeypatch.setattr(_dispatch, "_context", poison)
    small = call_op(op, d)
    monkeypatch.undo()
    assert_unmodified(orig, list(d.values()), list(d))
    _check_like_general(op, d, small, general, "small call")


def test_compiled_callees_take_no_literal_types(rng):
    """The small-call entries and the row functions call the serial drivers and the
    backward store with plain int64/bool arguments (``cpu._serial_threads``): a
    literal 1, 0 or False in a call from compiled code compiled the callee once
    more per signature (one suite run, 2026-12-06: 54 of 289 driver signatures,
    62 of the store's 78). Fresh copies of the callers are typed here, so the
    callees see the argument types whether or not the cache had them."""
    from numba import njit
    from numba.core import types
    x, w, mean, rstd = _small_args(rng)
    nf.softmax_bwd(nf.softmax_fwd(x), x)
    for p in (w, None):
        nf.rms_norm_bwd(x, x, p, nf.rms_norm_fwd(x, p)[1])
        _, mean, rstd = nf.layer_norm_fwd(x, p, p)
        nf.layer_norm_bwd(x, x, p, p, mean, rstd)
    for entry in cpu.SMALL.values():
        # this test's own (float32) signatures, with and without weight/bias: the
        # arguments the entries pass on do not depend on the dtype, and typing every
        # signature the worker had compiled so far cost ~30 s of a CI run
        sigs = [sig for sig in entry.signatures if sig[0].dtype == types.float32]
        assert sigs
        for sig in sigs:
            njit(error_model="numpy")(entry.py_func).compile(sig)
    rows = x.reshape(1, *x.shape)
    njit(error_model="numpy")(cpu._norm_bwd_two_passes.py_func)(
        rows, rows.copy(), w, mean, rstd, None, w.copy(), w.copy(), 0, True, False)
    # the pipeline's last store reaches _norm_bwd_store_at: typed here too, since a
    # cached driver or _norm_bwd_rows loads without typing its callees
    njit(error_model="numpy")(cpu._norm_bwd_rows.py_func)(
        rows, rows.copy(), w, mean, rstd, np.empty_like(rows), np.empty((1, w.size), F32),
        np.empty((1, w.size), F32), 1, 0, 1)
    callees = [*cpu.SERIAL.values(), cpu._norm_bwd_store_at, cpu._norm_bwd_row_at]
    assert all(k.signatures for k in callees)
    literal = [(k.py_func.__name__, sig) for k in callees for sig in k.signatures
               if any(isinstance(t, types.Literal) for t in sig)]
    assert not literal


def test_small_call_publishes_only_compiled_entries():
    """A first call above the size limit binds the limit but no entry: an entry
    is used only once a signature is compiled and compilation is disabled again
    (a published entry with compilation enabled compiled any argument types)."""
    from numba_fused import _dispatch
    small = _dispatch._SmallCall("softmax_fwd", lambda x, y: True)
    big = np.ones((4, cpu.SMALL_BELOW["softmax_fwd"]), F32)
    assert small.takes(big)                  # limit unknown before first use
    assert not small.run(big, (big, np.empty_like(big)))
    assert small.kernel is None and not small.takes(big)
    x = np.ones((2, 8), F32)
    assert small.run(x, (x, np.empty_like(x)))
    assert small.kernel is not None and not small.kernel._can_compile


def _small_args(rng, dtype=F32, cols=64):
    x = draw(rng, (2, cols), dtype)
    w = draw_param(rng, cols, "x", dtype)
    _, mean, rstd = nf.layer_norm_fwd(x, w, w)
    return x, w, mean, rstd


def test_small_call_bad_arguments_take_the_general_path(rng):
    """Calls of the entry's types but wrong shapes or values, and calls of other
    types, fail in the entry or in numba's dispatcher without compiling: the
    general path then raises its own error, every time."""
    x, w, mean, rstd = _small_args(rng)
    nf.layer_norm_bwd(x, x, w, w, mean, rstd)          # compiles the good signature
    nf.rms_norm_fwd(x, w)
    cases = [
        (ValueError, "weight has shape",
         lambda: nf.layer_norm_bwd(x, x, w[:-1], w, mean, rstd)),
        (ValueError, "mean has shape",
         lambda: nf.layer_norm_bwd(x, x, w, w, mean[:1].copy(), rstd)),
        (ValueError, "dy has shape", lambda: nf.layer_norm_bwd(x[:1], x, w, w, mean, rstd)),
        (TypeError, "dy has dtype",
         lambda: nf.layer_norm_bwd(x.astype(F64), x, w, w, mean, rstd)),
        (TypeError, "rstd has dtype",
         lambda: nf.layer_norm_bwd(x, x, w, w, mean, rstd.astype(F64))),
        (TypeError, "weight must be", lambda: nf.rms_norm_fwd(x, list(w))),
        (ValueError, "eps must be finite", lambda: nf.rms_norm_fwd(x, w, -1.0)),
        (ValueError, "eps must be finite", lambda: nf.rms_norm_fwd(x, w, float("nan"))),
        (TypeError, "eps must be a real", lambda: nf.rms_norm_fwd(x, w, True)),
    ]
    from numba_fused import cpu
    before = {k: len(v.signatures) for k, v in cpu.SMALL.items()}
    for _ in range(2):
        for exc, msg, call in cases:
            with pytest.raises(exc, match=msg):
                call()
    assert {k: len(v.signatures) for k, v in cpu.SMALL.items()} == before


@pytest.mark.parametrize("dtype", HALVES, ids=dtype_id)
def test_small_half_call_takes_no_raw_bits(rng, dtype):
    """A float16/bfloat16 small call reaches its entry as integer bits: a caller's
    own 16-bit integer array must not pass for them. It takes the general path,
    which names it, and compiles nothing."""
    x, w, mean, rstd = _small_args(rng, dtype)
    nf.layer_norm_bwd(x, x, w, w, mean, rstd)          # compiles the half signatures
    nf.rms_norm_fwd(x, w)
    bits = w.view(np.int16 if dtype == F16 else np.uint16)
    before = {k: len(v.signatures) for k, v in cpu.SMALL.items()}
    for _ in range(2):
        with pytest.raises(TypeError, match="weight"):
            nf.rms_norm_fwd(x, bits)
        with pytest.raises(TypeError, match="weight"):
            nf.layer_norm_bwd(x, x, bits, w, mean, rstd)
        with pytest.raises(TypeError, match="dy"):
            nf.layer_norm_bwd(x.view(bits.dtype), x, w, w, mean, rstd)
    assert {k: len(v.signatures) for k, v in cpu.SMALL.items()} == before


@pytest.mark.parametrize("layout", ["F", "cols2", "readonly"])
def test_small_call_other_layouts(rng, layout):
    """Non-C or read-only 2-D inputs give the C computation's results."""
    x, w, mean, rstd = _small_args(rng, cols=48)
    dy = draw(rng, x.shape, F32)
    want = [nf.layer_norm_bwd(dy, x, w, w, mean, rstd, out=poisoned(x.shape, F32))[0],
            nf.softmax_fwd(x, out=poisoned(x.shape, F32))]
    if layout == "F":
        xs, dys = np.asfortranarray(x), np.asfortranarray(dy)
    elif layout == "cols2":
        xs, dys = as_layout(x, "cols2"), as_layout(dy, "cols2")
    else:
        xs, dys = x.copy(), dy.copy()
        xs.flags.writeable = dys.flags.writeable = False
    got = [nf.layer_norm_bwd(dys, xs, w, w, mean, rstd)[0], nf.softmax_fwd(xs)]
    for g, e in zip(got, want):
        assert_close(g, e.astype(np.float64), what=f"{layout} small call")


def test_param_grad_buffers_are_not_reused_across_calls(rng):
    """One-row backward writes dweight directly (its one partial row); that
    buffer belongs to the caller and must never come back from the scratch pool
    as another call's partials (a bfloat16 weight takes float32 partials of the
    same shape from the pool)."""
    cols = 70000                      # partials above the pool's small-buffer size
    x = draw(rng, (1, cols), F32)
    w = draw_param(rng, cols, "x", F32)
    dx, dw = nf.rms_norm_bwd(x, x, w, nf.rms_norm_fwd(x, w)[1])
    _, _, db = nf.layer_norm_bwd(x, x, w, w, *nf.layer_norm_fwd(x, w, w)[1:])
    keep_w, keep_b = dw.copy(), db.copy()
    xb = draw(rng, (1, cols), BF16)
    wb = draw_param(rng, cols, "x", BF16)
    for _ in range(2):
        nf.rms_norm_bwd(xb, xb, wb, nf.rms_norm_fwd(xb, wb)[1])
        nf.layer_norm_bwd(xb, xb, wb, wb, *nf.layer_norm_fwd(xb, wb, wb)[1:])
    assert_bits_equal(dw, keep_w, "dweight overwritten by a later call")
    assert_bits_equal(db, keep_b, "dbias overwritten by a later call")


# ===================================================== non-temporal stores
#: outputs of cpu.STREAM_BYTES and more: 1,024 and 4,096 columns (row pipeline and
#: pairs), 1,000 (4,000-byte rows: every other row starts on a cache line), 3,001
#: (rows start at every 4-byte offset in a line; the elementwise store loops store
#: a head up to the line first: _lanes.stream_head); bfloat16 one row a pass and
#: (8,192 columns) two
STREAM_CASES = [((4096, 1024), F32), ((4200, 1000), F32), ((1024, 4096), F32),
                ((1400, 3001), F32), ((8192, 1024), BF16), ((1024, 8192), BF16)]


@pytest.mark.parametrize("shape, dtype", STREAM_CASES,
                         ids=[f"{dtype_id(d)}-{r}x{c}" for (r, c), d in STREAM_CASES])
@pytest.mark.parametrize("op", OPS)
def test_streamed_outputs_hold_the_bits_of_ordinary_stores(rng, op, shape, dtype):
    """Outputs of cpu.STREAM_BYTES and more go out in non-temporal stores where a
    block starts on a cache line (``_lanes.streaming``); in a buffer 16 bytes off
    the line the pipelined stages take ordinary stores, and the elementwise store
    loops (``_lanes.stream_head``) stream after a short head. Both hold the same
    bits, right against the reference, and nothing outside ``out`` is written.
    (The store itself, and its ``vmovnt`` instructions: tests/test_lanes.py.)"""
    d = _make_case(op, rng, shape, dtype)
    assert np.prod(shape) * np.dtype(dtype).itemsize >= cpu.STREAM_BYTES
    got = {}
    for offset in (0, 16):
        buf, out = at_line_offset(shape, dtype, offset, 0xFF)    # all-ones bytes: NaN
        r = call_op(op, d, out=out)
        assert r[0] is out
        o = out.ctypes.data - buf.ctypes.data
        assert (buf[:o] == 0xFF).all() and (buf[o + out.nbytes:] == 0xFF).all(), op
        got[offset] = r
    for a, b in zip(got[0], got[16]):
        assert_bits_equal(a, b, f"{op}: streamed vs ordinary stores")
    check_op(op, d, got[0])


#: calls of cpu.STREAM_BYTES and more whose pipelined stages prefetch, on the
#: paths they take only at that size: float32 1,024-column norm backwards pipelined
#: (cpu.STREAMED_BWD_PIPELINE_BYTES), 3,001-column LayerNorm forwards pipelined (not
#: cpu._ln_fwd_two_passes), 4,096 columns two rows a pass, bfloat16 rows
PREFETCH_CASES = [((4096, 1024), F32), ((1400, 3001), F32), ((1024, 4096), F32),
                  ((4100, 2048), BF16)]


@pytest.mark.parametrize("shape, dtype", PREFETCH_CASES,
                         ids=[f"{dtype_id(d)}-{r}x{c}" for (r, c), d in PREFETCH_CASES])
@pytest.mark.parametrize("op", OPS)
def test_prefetching_calls_hold_the_bits_of_rows_alone(rng, restore_threads, op, shape,
                                                       dtype):
    """A call of cpu.STREAM_BYTES and more (its stages prefetch the rows ahead, and
    the norm backwards and LayerNorm forwards take the pipeline on rows they
    would not pipeline in a smaller call), on two threads and on one: each row's
    outputs have the bits of the same row called alone, dweight/dbias those of the
    documented order, and the values match the reference."""
    from numba_fused import _dtypes as D
    rows, cols = shape
    assert rows * cols * np.dtype(dtype).itemsize >= cpu.STREAM_BYTES
    storage = np.empty((1, rows, cols), D.storage_dtype(dtype))
    if op in ("rms_norm_bwd", "layer_norm_bwd") and dtype == F32:
        rule = numba.njit(lambda a, shared: cpu._rows_pipelined(a, shared))
        assert rule(storage, False) and rule(storage, True)
        assert rule(storage[:, :64], True) == (cols * 4 >= cpu.BWD_PIPELINE_BYTES)
    if op == "softmax_bwd" and dtype == F32:      # pipelined on one thread too
        rule = numba.njit(lambda a, shared: cpu._softmax_bwd_pipelined(a, shared))
        assert rule(storage, False) == (cols * 4 >= cpu.SOFTMAX_BWD_PIPELINE_BYTES)
        assert not rule(storage[:, :64], False)
    if op == "layer_norm_fwd" and cols == 3001:
        two = numba.njit(lambda a: cpu._ln_fwd_two_passes(a))
        assert not two(storage) and two(storage[:, :64])
    d = _make_case(op, rng, shape, dtype)
    picks = [0, 1, 2, rows // 2, rows // 2 + 1, rows - 2, rows - 1]
    for threads in (2, 1):
        numba.set_num_threads(min(threads, restore_threads))
        got = call_op(op, d, out=poisoned(shape, dtype))
        for r in picks:
            alone = {k: (v[r:r + 1] if k in ("x", "y", "dy", "mean", "rstd") else v)
                     for k, v in d.items()}
            for g, a in zip(got, call_op(op, alone)):
                if op.endswith("_fwd") or g is got[0]:
                    assert_bits_equal(a[:1], g[r:r + 1], f"{op} row {r} alone, {threads} threads")
        if op in ("rms_norm_bwd", "layer_norm_bwd"):
            for k, (g, p) in enumerate(zip(got[1:], ("weight", "bias"))):
                want = _param_grads_in_kernel_order(op, d["dy"], d["x"], d["rstd"], d.get("mean"),
                                                    d[p].dtype)[k]
                assert_bits_equal(g, want, f"d{p}, {threads} threads")
    check_op(op, d, got)


def test_prefetch_distance():
    """cpu._ahead: nothing under cpu.STREAM_BYTES; from there PREFETCH_L2_BYTES (32
    KiB) ahead within rows of twice that, else whole passes of rows (one or two
    rows a pass) that cover it, by the array's row stride."""
    assert cpu.PREFETCH_L2_BYTES == 1 << 15
    ahead = numba.njit(lambda a, per: cpu._ahead(a, per))
    big = lambda rows, cols, dt=np.float32: np.empty((1, rows, cols), dt)  # noqa: E731
    assert ahead(big(64, 4096), 1) == 0 and ahead(big(1023, 4096), 2) == 0
    assert ahead(big(1024, 4096), 1) == 2 * 4096         # 16 KiB rows: 2 rows, 1 a pass
    assert ahead(big(1024, 4096), 2) == 2 * 4096         # one pass of two rows
    assert ahead(big(2048, 8192), 1) == 8192             # 32 KiB rows: the next row
    assert ahead(big(2048, 8192), 2) == 2 * 8192         # never the pass's other row
    assert ahead(big(256, 16384), 2) == (1 << 15) // 4   # 64 KiB rows: within the row
    assert ahead(big(4200, 1000), 1) == 9 * 1000         # 9 rows of 4,000 bytes
    assert ahead(big(8192, 1024, np.uint16), 1) == 16 * 1024
    padded = np.empty((1, 8192, 1100), np.float32)[:, :, :1024]
    assert ahead(padded, 1) == 8 * 1100                  # by the row stride


# ============================================================= in-place bwd
@pytest.mark.parametrize("layout", ["C", "cols2", "transpose", "negrows"])
@pytest.mark.parametrize("shape", LAYOUT_SHAPES + [(2, 17, 4111)],
                         ids=["serial", "parallel", "pipelined"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", BWD_OPS)
def test_inplace_backward_bit_identical(rng, op, dtype, shape, layout):
    d = _make_case(op, rng, shape, dtype)
    d = {k: (as_layout(v, layout) if k in ROW_ARGS else v) for k, v in d.items()}
    want = call_op(op, d, out=poisoned(shape, dtype))
    dy = d["dy"]
    others = {k: v.copy() for k, v in d.items() if k != "dy" and v is not None}
    got = call_op(op, d, out=dy)
    assert got[0] is dy
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            assert_bits_equal(np.ascontiguousarray(g), np.ascontiguousarray(w),
                              f"{op} in place")
    for k, v in others.items():
        assert_bits_equal(np.ascontiguousarray(d[k]), np.ascontiguousarray(v),
                          f"{k} modified by in-place {op}")


_DX_ARG = {"softmax_bwd": 2, "rms_norm_bwd": 4, "layer_norm_bwd": 5}


@pytest.mark.parametrize("layout", ["C", "transpose", "cols2"])
@pytest.mark.parametrize("op", BWD_OPS)
def test_inplace_backward_takes_the_inplace_kernel(rng, monkeypatch, op, layout):
    """out=dy reaches the kernels as dx None (written through dy: one pointer,
    which LLVM vectorizes; dy passed twice failed LLVM's overlap test and ran the
    scalar loop). An out that no kernel layout fits (cols2) gets a fresh buffer
    instead, and a plain out= is never mistaken for in-place."""
    from numba_fused import cpu
    d = _make_case(op, rng, (40, 8, 130), F32)
    d = {k: (as_layout(v, layout) if k in ROW_ARGS else v) for k, v in d.items()}
    seen, run, threaded = [], cpu._run, cpu._run_threaded
    if op == "softmax_bwd":        # a pipelined driver: it takes the thread count
        monkeypatch.setattr(cpu, "_run_threaded",
                            lambda name, x, *a: seen.append(a) or threaded(name, x, *a))
    else:
        monkeypatch.setattr(cpu, "_run",
                            lambda name, key, x, *a: seen.append(a) or run(name, key, x, *a))
    want = call_op(op, d, out=poisoned(d["dy"].shape, F32))
    got = call_op(op, d, out=d["dy"])
    assert got[0] is d["dy"]
    assert seen[0][_DX_ARG[op]] is not None
    assert (seen[1][_DX_ARG[op]] is None) == (layout != "cols2")
    assert_bits_equal(np.ascontiguousarray(got[0]), np.ascontiguousarray(want[0]), op)


@pytest.mark.parametrize("op", BWD_OPS)
def test_inplace_backward_kernel_is_vectorized(op):
    """The in-place (dx None) row function (softmax: its store pass; the pipelined
    stages are explicit vectors) compiles to packed ymm/zmm arithmetic for float32
    and bfloat16 storage (read in the assembly; no timing)."""
    from numba import njit
    from numba_fused import cpu
    import re
    fn = {"softmax_bwd": cpu._softmax_bwd_store, "rms_norm_bwd": cpu._norm_bwd_two_passes,
          "layer_norm_bwd": cpu._norm_bwd_two_passes}[op]
    for st in (np.float32, np.uint16):
        row = np.ones(256, st)
        rows = row.reshape(1, 1, 256)
        w = np.ones(256, np.float32)
        stat = np.ones(1, np.float32)
        args = {"softmax_bwd": (row, row.copy(), np.float32(0.5), None, False),
                "rms_norm_bwd": (rows, rows.copy(), w, None, stat, None, w.copy(), None, 0,
                                 True, False),
                "layer_norm_bwd": (rows, rows.copy(), w, stat * 0, stat, None, w.copy(),
                                   w.copy(), 0, True, False)}[op]
        fresh = njit(error_model="numpy")(fn.py_func)   # cached code cannot be inspected
        fresh(*args)
        asm = fresh.inspect_asm(fresh.signatures[0])
        packed = re.findall(r"\bv(?:mul|add|sub|fmadd\w*)ps\s+%?[yz]mm", asm)
        # softmax's store is y * (dy - dot): one packed sub and mul per vector
        need = 2 if op == "softmax_bwd" else 4
        assert len(packed) >= need, f"{op} {st.__name__}: no packed arithmetic in place"


# ============================================================ special values
SPECIAL_COLS = [1, 37, 1000, 4099]


def _softmax_special_rows(rng, dtype, cols):
    rows = 16 if cols > 1000 else 8           # 16 x 4099 runs the parallel kernel
    x = draw(rng, (rows, cols), dtype, scale=2.0)
    ninf = [0, cols // 2, cols - 1]
    x[0, ninf] = -np.inf                        # -inf entries in a finite row
    x[1, :] = -np.inf                           # all -inf
    x[2, cols // 3] = np.nan                    # a NaN
    x[3, cols - 1] = np.inf                     # +inf: NaN row (documented)
    x[4, : max(1, cols // 2)] = -np.inf         # half -inf
    return x, ninf


@pytest.mark.parametrize("cols", SPECIAL_COLS)
@dtypes
def test_softmax_inf_nan_rows(rng, dtype, cols):
    x, ninf = _softmax_special_rows(rng, dtype, cols)
    y = nf.softmax_fwd(x, out=poisoned(x.shape, dtype))
    r = ref.softmax_fwd(x)
    if cols > 1:
        assert np.all(y[0, ninf] == 0) and not np.any(np.signbit(y[0, ninf])), \
            "-inf entries of a finite row must be exactly +0"
        assert np.all(np.isfinite(y[0]))
    assert np.all(np.isnan(y[1])), "an all -inf row must be NaN"
    assert np.all(np.isnan(y[2])), "a row with a NaN must be all NaN"
    assert np.all(np.isnan(y[3])), "a row with +inf is NaN"
    assert_close(y, r, what="y")                # the other rows are unaffected
    # backward through the same rows: zeros stay zeros, NaN rows stay NaN
    dy = draw(rng, x.shape, dtype)
    dx = nf.softmax_bwd(y, dy, out=poisoned(x.shape, dtype))
    assert_close(dx, ref.softmax_bwd(y, dy), cond=softmax_bwd_cond(y, dy), what="dx")
    if cols > 1:
        assert np.all(dx[0, ninf] == 0)


#: thread counts the forward drivers are called with directly (more than this
#: machine has: prange runs the chunks on the threads there are)
DRIVER_THREADS = (2, 3, 5)


def _chunk_edges(rows, chunks_of):
    """First/last rows and the rows on either side of every chunk boundary, for
    each thread count of DRIVER_THREADS (``chunks_of(threads)`` chunks)."""
    edges = {0, 1, rows - 2, rows - 1}
    for t in DRIVER_THREADS:
        chunks = chunks_of(t)
        edges |= {k * rows // chunks for k in range(chunks)}
        edges |= {k * rows // chunks - 1 for k in range(1, chunks)}
    return sorted(edges)


def _rows_storage(x):
    """x's (1, rows, cols) storage view, as the drivers take it."""
    from numba_fused import _dtypes as D
    D.load_bfloat16()
    return D.to_storage(x)[None]


def _fwd_by_driver(op, d, threads, kernels=cpu.PARALLEL):
    """The parallel forward driver of ``op`` called with ``threads`` (2-D x); of
    ``kernels`` (cpu.BLOCKED: the column-blocked kernel)."""
    from numba_fused import _dtypes as D
    x = d["x"]
    st = lambda a: None if a is None else D.to_storage(a)
    y = np.empty_like(x)
    k, rows = kernels[op], _rows_storage
    if op == "softmax_fwd":
        k(rows(x), rows(y), threads)
        return (y,)
    stats = [np.empty(x.shape[0], acc_dtype(x.dtype)) for _ in range(op.count("layer") + 1)]
    if op == "rms_norm_fwd":
        k(rows(x), st(d["weight"]), 1e-6, rows(y), *stats, threads)
    else:
        k(rows(x), st(d["weight"]), st(d["bias"]), 1e-5, rows(y), *stats, threads)
    return (y, *stats)


@pytest.mark.parametrize("rows", [cpu.PIPELINE_ROWS, cpu.PIPELINE_ROWS + 1, 97, 130])
@pytest.mark.parametrize("cols", [1, 33, 500])     # 500: float64 rows below long_cols
@dtypes
def test_softmax_fwd_pipelined(rng, restore_threads, dtype, rows, cols):
    """The pipelined forward (rows >= PIPELINE_ROWS): special rows at the first,
    last and chunk-boundary positions behave as in a single-row call, results
    match the reference, and a row's bits do not depend on its position, the
    chunking (serial, parallel, one chunk per thread) or the thread count."""
    x = draw(rng, (rows, cols), dtype, scale=2.0)
    edges = _chunk_edges(rows, lambda t: cpu._pipeline_chunks(rows, t))
    special = {}
    for i, r in enumerate(edges):
        kind = ["ninf", "nan", "inf", "half", "finite"][i % 5]
        if kind == "ninf":
            x[r] = -np.inf
        elif kind == "nan":
            x[r, cols // 3] = np.nan
        elif kind == "inf":
            x[r, cols - 1] = np.inf
        elif kind == "half":
            x[r, : max(1, cols // 2)] = -np.inf
        special[r] = kind
    results = []
    for parallel, threads in ((False, 1), (True, 1), (True, 2)):
        numba.set_num_threads(min(threads, restore_threads))
        with cpu.forced(parallel):
            results.append(nf.softmax_fwd(x, out=poisoned(x.shape, dtype)))
    results += [_fwd_by_driver("softmax_fwd", dict(x=x), t)[0] for t in DRIVER_THREADS]
    y = results[0]
    for other in results[1:]:
        assert_bits_equal(other, y, "serial vs parallel, threads 1, 2, 3, 5")
    for r, kind in special.items():
        if kind in ("ninf", "nan", "inf") or (kind == "half" and cols == 1):
            assert np.all(np.isnan(y[r])), (r, kind)
        elif kind == "half":
            assert np.all(y[r, : cols // 2] == 0) and np.all(np.isfinite(y[r])), (r, kind)
    finite = [r for r in range(rows) if np.all(np.isfinite(ref.softmax_fwd(x[r:r + 1])))]
    assert_close(y[finite], ref.softmax_fwd(x[finite]), what="y")
    perm = rng.permutation(rows)
    assert_bits_equal(nf.softmax_fwd(x[perm]), y[perm], "rows permuted")


def _storage(dtype):
    from numba_fused import _dtypes as D
    D.load_bfloat16()
    return D.to_storage(np.empty(0, dtype)).dtype


@pytest.mark.parametrize("blocks", [0, 3], ids=["first", "more"])
@dtypes
def test_softmax_fwd_long_rows(rng, restore_threads, dtype, blocks):
    """Rows longer than cpu.long_cols (PIPELINE_COLS columns in float16/bfloat16,
    4 KiB in float32/float64) go by blocks of cpu.long_block with a max per
    block: whole blocks of -inf (the first, one inside, the partial last) give
    exact zeros beside finite values, special rows keep the documented results,
    rows of huge values do not overflow, every row matches the reference, and a
    row's bits are the same alone (the small-call entry), batched, serial,
    parallel and on any thread count."""
    B = cpu.long_block(_storage(dtype))
    cols = max(cpu.long_cols(_storage(dtype)) + 1, 3 * B + 1) + blocks * B + 4 * bool(blocks)
    x = draw(rng, (8, cols), dtype, scale=2.0)
    x[0, :B] = -np.inf                     # the first block: its max is -inf
    x[0, 2 * B:3 * B] = -np.inf
    x[0, [B + 1, cols // 2, cols - 1]] = -np.inf
    x[1, :] = -np.inf                      # all -inf: NaN
    x[2, cols // 3] = np.nan
    x[3, cols - 1] = np.inf
    x[4, cols - cols % B:] = -np.inf       # the partial last block
    x[4, 5] = x[4, 5] + 8                  # one block's max far above the others
    big = 3e4 if np.dtype(dtype) == F16 else 1e30
    x[5] = (big * (1 + (np.arange(cols) % 7) / 64.0)).astype(dtype)
    x[6, B:] = x[6, B:] - 40               # later blocks' exps scaled far down
    results = []
    for parallel, threads in ((False, 1), (True, 1), (True, 2)):
        numba.set_num_threads(min(threads, restore_threads))
        with cpu.forced(parallel):
            results.append(nf.softmax_fwd(x, out=poisoned(x.shape, dtype)))
    results += [_fwd_by_driver("softmax_fwd", dict(x=x), t, {"softmax_fwd": k})[0]
                for k in cpu.LONG.values() for t in DRIVER_THREADS]
    y = results[0]
    for other in results[1:]:
        assert_bits_equal(other, y, "serial vs parallel, threads 1, 2, 3, 5")
    for rows in (1, 3):                     # by (row, block) pieces: chunks cut rows
        for t in DRIVER_THREADS + (7,):
            got = _fwd_by_driver("softmax_fwd", dict(x=x[4:4 + rows]), t,
                                 {"softmax_fwd": cpu.LONG["blocked"]})[0]
            assert_bits_equal(got, y[4:4 + rows], f"pieces, {rows} rows, {t} threads")
    x3 = x[None]
    assert cpu._parallel_kernel("softmax_fwd", x3) is cpu.LONG["parallel"]
    assert cpu._serial_kernel("softmax_fwd", x3) is cpu.LONG["serial"]
    if dtype in (F32, F64):                 # the half types' rounding may hide it
        row_path = _fwd_by_driver("softmax_fwd", dict(x=x), 2)[0]
        assert not np.array_equal(row_path[7], y[7]), "not the long-row path"
    for r in (0, 4, 7):
        assert_bits_equal(nf.softmax_fwd(x[r:r + 1])[0], y[r], f"row {r} alone")
    zero = np.isneginf(x[0])
    assert np.all(y[0, zero] == 0) and not np.any(np.signbit(y[0, zero]))
    assert np.all(y[4, cols - cols % B:] == 0)
    for r in (1, 2, 3):
        assert np.all(np.isnan(y[r])), f"row {r}"
    finite = [0, 4, 5, 6, 7]
    assert np.all(np.isfinite(y[finite]))
    assert_close(y[finite], ref.softmax_fwd(x[finite]), what="y")


@pytest.mark.parametrize("cols", [cpu.Y_EXPS_ROW_BYTES // 4 + 513,
                                  cpu.STREAM_EXPS_ROW_BYTES // 4])
def test_softmax_fwd_streamed_long_rows(rng, restore_threads, cols):
    """float32 long rows of at most cpu.STREAM_EXPS_ROW_BYTES in an output of
    cpu.STREAM_BYTES or more keep their exps in a scratch row and stream y
    (cpu._long_streams); every row has the bits of the same row alone (exps in y),
    on a line-aligned and a misaligned output (non-temporal and ordinary stores),
    on two threads and on one, nothing outside ``out`` is written, and the values
    match the reference."""
    rows = cpu.STREAM_BYTES // (4 * cols) + 3
    rule = numba.njit(lambda y, n: cpu._long_streams(y, n))
    assert rule(np.empty((rows, cols), F32), cols)
    assert not rule(np.empty((rows, 2 * cols), F32), 2 * cols)     # longer rows: exps in y
    assert not rule(np.empty((rows // 2, cols), F32), cols)        # smaller outputs
    assert not rule(np.empty((rows, cols), F64), cols)
    x = draw(rng, (rows, cols), F32, scale=3.0)
    x[1, 100:700] = -np.inf                  # a block of -inf and part of the next
    picks = [0, 1, 2, rows // 2, rows - 1]
    alone = np.concatenate([nf.softmax_fwd(x[r:r + 1]) for r in picks])
    for threads in (2, 1):
        numba.set_num_threads(min(threads, restore_threads))
        for offset in (0, 16):
            buf, out = at_line_offset(x.shape, F32, offset, 0xFF)   # all-ones bytes: NaN
            assert nf.softmax_fwd(x, out=out) is out
            o = out.ctypes.data - buf.ctypes.data
            assert (buf[:o] == 0xFF).all() and (buf[o + out.nbytes:] == 0xFF).all()
            assert_bits_equal(out[picks], alone, f"rows alone, {threads} threads, {offset}")
    assert np.all(out[1, 100:700] == 0)
    assert_close(out, ref.softmax_fwd(x), what="y")


@pytest.mark.parametrize("rows", [4, 13, 97])
@pytest.mark.parametrize("cols", [1, 33, 1000, 1500, cpu.PAIR_BYTES // 2 + 37])
@pytest.mark.parametrize("op", ["rms_norm_fwd", "layer_norm_fwd"])
@dtypes
def test_norm_fwd_pipelined(rng, restore_threads, op, dtype, rows, cols):
    """The pipelined norm forwards (every shape; one chunk per thread; two rows at a
    time from rows of cpu.PAIR_BYTES, two or three rows left at a chunk's end;
    LayerNorm's float32/float64 rows a little shorter, 1500 columns and float64's
    1000, one row's two passes after the other: cpu._ln_fwd_two_passes):
    NaN rows and rows that take LayerNorm's second statistics pass at the first,
    last and chunk-boundary positions (chunks of 1 row, one row at a time,
    included); bits independent of position, chunking and thread count; the other
    rows match the reference."""
    x = draw(rng, (rows, cols), dtype, loc=0.5)
    edges = _chunk_edges(rows, lambda t: min(rows, t))
    points = cpu.shift_points(cols)
    nan_rows = edges[::2]
    for r in nan_rows:
        x[r, cols // 3] = np.nan
    for r in edges[1::2]:               # outliers at the shift's sample points
        x[r] = (x[r].astype(np.float64) + 100.0).astype(dtype)
        x[r, points] = x[r, points] + np.asarray(60.0, dtype)
    w = draw_param(rng, cols, "x", dtype)
    b = draw_param(rng, cols, "x", dtype, loc=0.0)
    d = dict(x=x, weight=w, bias=b)
    results = []
    for parallel, threads in ((False, 1), (True, 1), (True, 2)):
        numba.set_num_threads(min(threads, restore_threads))
        with cpu.forced(parallel):
            results.append(call_op(op, d, out=poisoned(x.shape, dtype)))
    results += [_fwd_by_driver(op, d, t) for t in DRIVER_THREADS + (rows,)]
    for other in results[1:]:
        for a, c in zip(other, results[0]):
            assert_bits_equal(a, c, "serial vs parallel, threads 1, 2, 3, 5, one per row")
    for r in nan_rows:
        assert np.all(np.isnan(results[0][0][r])) and np.isnan(results[0][-1][r])
    ok = [r for r in range(rows) if r not in nan_rows]
    check_op(op, dict(d, x=x[ok]), [a[ok] for a in results[0]])
    perm = rng.permutation(rows)
    for a, c in zip(call_op(op, dict(d, x=x[perm])), results[0]):
        assert_bits_equal(a, c[perm], "rows permuted")


@pytest.mark.parametrize("storage", [np.uint16, np.float32, np.float64])
def test_norm_fwd_pairs_rule(storage):
    """Two rows at a time (cpu._paired): rows of PAIR_BYTES and more, in chunks of at
    least 4 rows."""
    first = cpu.PAIR_BYTES // np.dtype(storage).itemsize
    paired = lambda rows, cols, lo, hi: cpu._paired(np.empty((1, rows, cols), storage),
                                                    lo, hi)   # noqa: E731
    assert paired(8, first, 0, 8) and paired(8, cpu.WIDE_COLS, 2, 6)
    assert not paired(8, first - 1, 0, 8)
    assert not paired(8, first, 0, 3) and not paired(8, first, 5, 8)


@pytest.mark.parametrize("storage", [np.uint16, np.float32, np.float64])
def test_layer_norm_fwd_two_passes_rule(storage):
    """A LayerNorm forward takes its rows' two passes in turn (cpu._ln_fwd_two_passes)
    on float32/float64 rows of more than LN_TWO_PASS_BYTES and under PAIR_BYTES;
    the 1000 and 1500 columns of test_norm_fwd_pipelined straddle the floor in
    float32, and all of float64's short rows are on this path at 1000 and 1500."""
    size = np.dtype(storage).itemsize
    two = numba.njit(lambda a: cpu._ln_fwd_two_passes(a))
    at = lambda cols: two(np.empty((1, 1, cols), storage))   # noqa: E731
    if size < 4:
        assert not any(at(c) for c in (1000, 1500, 4096, 8191))
        return
    floor, ceiling = cpu.LN_TWO_PASS_BYTES // size, cpu.PAIR_BYTES // size
    assert not at(floor) and at(floor + 1) and at(ceiling - 1) and not at(ceiling)
    assert at(1500) and at(1000) == (size == 8)


@pytest.mark.parametrize("op", ["rms_norm_fwd", "layer_norm_fwd"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
def test_norm_fwd_pairs_long_rows(rng, op, dtype):
    """Rows past WIDE_COLS two at a time: their sums by the blocks of one row at a
    time, so the same bits (9 rows: four pairs and a row left; one chunk against
    one chunk per row); the values match the reference."""
    rows, cols = 9, cpu.WIDE_COLS + cpu.WIDE_BLOCK + 37
    d = dict(x=draw(rng, (rows, cols), dtype, loc=0.5), weight=draw_param(rng, cols, "x", dtype),
             bias=draw_param(rng, cols, "x", dtype, loc=0.0))
    assert cpu._paired(_rows_storage(d["x"]), 0, rows)
    pairs, by_row = _fwd_by_driver(op, d, 1), _fwd_by_driver(op, d, rows)
    for a, c in zip(pairs, by_row):
        assert_bits_equal(a, c, "two rows at a time vs one")
    check_op(op, d, list(pairs))


@pytest.mark.parametrize("rows", [4, 13, 97])
@pytest.mark.parametrize("cols", [1, 33, 1000, 4111])
@dtypes
def test_softmax_bwd_pipelined(rng, restore_threads, dtype, rows, cols):
    """The softmax backward on both its paths (cpu._softmax_bwd_pipelined: rows in
    turn for float32/float64 rows under cpu.SOFTMAX_BWD_PIPELINE_BYTES or on one
    thread, else pipelined, one chunk per thread, chunks of one row included): NaN
    rows at the first, last and chunk-boundary positions stay in their rows; bits
    independent of position, chunking, thread count and so of the path, and the
    same in place; the other rows match the reference."""
    from numba_fused import _dtypes as D
    pipelined = numba.njit(lambda a, shared: cpu._softmax_bwd_pipelined(a, shared))
    for c in (cols, cpu.WIDE_COLS):
        storage = np.empty((1, 1, c), _storage(dtype))
        for shared in (False, True):
            long_rows = c * np.dtype(dtype).itemsize >= cpu.SOFTMAX_BWD_PIPELINE_BYTES
            rule = is_half(dtype) or long_rows and (shared or c >= cpu.WIDE_COLS)
            assert pipelined(storage, shared) == rule, (c, shared)
    assert cpu.SOFTMAX_BWD_PIPELINE_BYTES == 1 << 14  # 1000 and 4111 columns straddle it
    y = nf.softmax_fwd(draw(rng, (rows, cols), dtype, scale=2.0))
    dy = draw(rng, (rows, cols), dtype)
    nan_rows = _chunk_edges(rows, lambda t: min(rows, t))[::2]
    y[nan_rows, cols // 2] = np.nan
    results = []
    for parallel, threads in ((False, 1), (True, 1), (True, 2)):
        numba.set_num_threads(min(threads, restore_threads))
        with cpu.forced(parallel):
            results.append(nf.softmax_bwd(y, dy, out=poisoned(y.shape, dtype)))
            inplace = dy.copy()
            assert nf.softmax_bwd(y, inplace, out=inplace) is inplace
            results.append(inplace)
    for t in DRIVER_THREADS:
        dx = poisoned(y.shape, dtype)
        cpu.PARALLEL["softmax_bwd"](D.to_storage(y)[None], D.to_storage(dy)[None],
                                    D.to_storage(dx)[None], t)
        results.append(dx)
    for other in results[1:]:
        assert_bits_equal(other, results[0], "serial, parallel, in place, threads 1-5")
    dx = results[0]
    assert np.all(np.isnan(dx[nan_rows]))
    ok = [r for r in range(rows) if r not in nan_rows]
    assert_close(dx[ok], ref.softmax_bwd(y[ok], dy[ok]), cond=softmax_bwd_cond(y[ok], dy[ok]),
                 what="dx")


def _huge_rows(dtype, cols):
    if np.dtype(dtype) == F16:
        big = [1e4, 6e4, -6e4]
    elif np.dtype(dtype) == F64:
        big = [1e4, 1e30, 1e300, -1e300]
    else:
        big = [1e4, 1e30, 1e38, -1e30]
    rows = []
    k = np.arange(cols) % 5 - 2
    for c in big:
        base = np.full(cols, c)
        rows.append(base.copy())                # all equal: uniform
        alt = base.copy()
        alt[::3] = c * 0.5 if c > 0 else c * 2 / 3
        rows.append(alt)                        # mixed magnitudes
        rows.append(base + k * abs(c) * 2.0 ** -6)  # close values of huge size
    return np.array(rows).astype(dtype)


@pytest.mark.parametrize("cols", [2, 37, 1000, 4099])
@dtypes
def test_softmax_huge_values(dtype, cols):
    x = _huge_rows(dtype, cols)
    assert np.all(np.isfinite(x))
    y = nf.softmax_fwd(x, out=poisoned(x.shape, dtype))
    r = ref.softmax_fwd(x)
    assert np.all(np.isfinite(y)), "finite huge inputs overflowed"
    assert_close(y, r, what="y")


@pytest.mark.parametrize("cols", [1, 37, 1000])
@dtypes
def test_norm_nan_rows(rng, dtype, cols):
    x = draw(rng, (6, cols), dtype)
    x[1, cols // 2] = np.nan
    w = draw_param(rng, cols, "x", dtype)
    b = draw_param(rng, cols, "f32", dtype, loc=0.0)
    y, rstd = nf.rms_norm_fwd(x, w, out=poisoned(x.shape, dtype))
    yr, rr = ref.rms_norm_fwd(x, w)
    assert np.all(np.isnan(y[1])) and np.isnan(rstd[1])
    assert_close(y, yr, what="rms y")
    stats_close(rstd, rr, dtype, scale=np.abs(rr), what="rstd")
    y, mean, rstd = nf.layer_norm_fwd(x, w, b, out=poisoned(x.shape, dtype))
    yr, mr, rr = ref.layer_norm_fwd(x, w, b)
    assert np.all(np.isnan(y[1])) and np.isnan(mean[1]) and np.isnan(rstd[1])
    assert_close(y, yr, cond=ln_fwd_cond(x, w, rr), what="ln y")
    # a NaN in dy poisons its row of dx and its column of dweight/dbias only
    x = draw(rng, (6, cols), dtype)
    _, mean, rstd = nf.layer_norm_fwd(x, w, b)
    dy = draw(rng, x.shape, dtype)
    dy[2, 0] = np.nan
    dx, dw, db = _ln_bwd_check(dtype, x.shape, dy, x, w, b, mean, rstd)
    assert np.all(np.isnan(dx[2])) and np.isnan(dw[0]) and np.isnan(db[0])
    assert not np.isnan(dx[[0, 1, 3, 4, 5]]).any()


@pytest.mark.parametrize("loc", [1e4, -1e4])
@pytest.mark.parametrize("shape", [(8, 1000), (4, 4099), (64, 1000)], ids=str)
@pytest.mark.parametrize("dtype", [F32, F64], ids=dtype_id)
def test_layer_norm_large_mean(rng, dtype, shape, loc):
    """Rows with mean 1e4 and std 1: the variance must not cancel (a one-pass
    E[x^2] - E[x]^2 in float32 loses every digit of it here)."""
    x = draw(rng, shape, dtype, loc=loc, scale=1.0)
    w = draw_param(rng, shape[-1], "x", dtype)
    b = draw_param(rng, shape[-1], "x", dtype, loc=0.0)
    y, mean, rstd = nf.layer_norm_fwd(x, w, b, out=poisoned(shape, dtype))
    yr, mr, rr = ref.layer_norm_fwd(x, w, b)
    stats_close(rstd, rr, dtype, scale=np.abs(rr), what="rstd")
    stats_close(mean, mr, dtype, scale=np.abs(mr), what="mean")
    # y: the conditioned bound (conftest): ~8 accumulator ulps of |x| ~ 1e4
    assert_close(y, yr, cond=ln_fwd_cond(x, w, rr), what="y")
    # and y really is normalized (weight None): zero mean, unit variance per row
    y1 = nf.layer_norm_fwd(x)[0].astype(np.float64)
    eps_acc = float(np.finfo(acc_dtype(dtype)).eps)
    off = 8 * eps_acc * ln_fwd_cond(x, None, rr)[..., 0]
    assert np.all(np.abs(y1.mean(-1)) <= off), "normalized rows are not centred"
    want_var = x.astype(np.float64).var(-1) * rr ** 2
    assert np.all(np.abs(y1.var(-1) - want_var) <= 3 * TOL[acc_dtype(dtype)]), \
        "normalized rows do not have unit variance"
    dy = draw(rng, shape, dtype)
    _ln_bwd_check(dtype, shape, dy, x, w, b, mean, rstd)


@pytest.mark.parametrize("kind", ["outliers", "sorted", "ramp"])
@pytest.mark.parametrize("shape", [(8, 1000), (64, 4099), (16, 5)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_layer_norm_shift_fallback(rng, dtype, shape, kind):
    """The LayerNorm statistics stay accurate when the one-pass shifted sums are
    rejected (the 4 elements the shift is sampled from are outliers: the second
    pass runs; the test checks the case is one the kernel rejects, and fails
    without the second pass) and on skewed rows that pass the check (sorted
    rows, a linear ramp), all about a mean of 100."""
    from numba_fused import cpu
    cols = shape[-1]
    x = draw(rng, shape, dtype, loc=100.0, scale=1.0)
    x64 = x.astype(np.float64)
    points = cpu.shift_points(cols)
    if kind == "outliers":
        x64[:, points] += 60.0
    elif kind == "sorted":
        x64 = np.sort(x64, axis=-1)
    else:
        x64 = x64 + np.linspace(-30, 30, cols)
    x = x64.astype(dtype)
    if kind == "outliers" and cols >= 100:   # a case the one-pass sums really reject
        xd = x.astype(np.float64)
        m0 = xd[:, points].mean(-1, keepdims=True)
        assert np.all(((xd - m0) ** 2).mean(-1) > cpu.LN_SHIFT_COND * xd.var(-1))
    y, mean, rstd = nf.layer_norm_fwd(x, out=poisoned(shape, dtype))
    yr, mr, rr = ref.layer_norm_fwd(x, None, None)
    stats_close(rstd, rr, dtype, scale=np.abs(rr), what="rstd")
    stats_close(mean, mr, dtype, scale=np.sqrt((x.astype(np.float64) ** 2).mean(-1)),
                what="mean")
    assert_close(y, yr, cond=ln_fwd_cond(x, None, rr), what="y")


@pytest.mark.parametrize("cols", [300, 4096])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=dtype_id)
def test_layer_norm_mean_of_a_centered_row(rng, dtype, cols):
    """A row whose mean is ~0 while the elements the shift is sampled from sit
    at 1.5 (a case the one-pass sums accept): the mean is as accurate as a plain
    sum, within 8 eps * rms(x) / sqrt(n). The shifted form m0 + sum(x - m0)/n
    measured up to 37x that bound (m0's rounding)."""
    from numba_fused import cpu
    points = cpu.shift_points(cols)
    x64 = rng.standard_normal((64, cols))
    x64[:, points] = 1.5
    x64 = x64 - x64.mean(-1, keepdims=True) + 1e-4
    x = x64.astype(dtype)
    xd = x.astype(np.float64)
    m0 = xd[:, points].mean(-1, keepdims=True)
    assert np.all(((xd - m0) ** 2).mean(-1) <= cpu.LN_SHIFT_COND * xd.var(-1))
    _, mean, _ = nf.layer_norm_fwd(x, out=poisoned(x.shape, dtype))
    _, mr, _ = ref.layer_norm_fwd(x, None, None)
    bound = 8 * np.finfo(dtype).eps * np.sqrt((xd ** 2).mean(-1)) / np.sqrt(cols)
    assert np.all(np.abs(mean - mr) <= bound), np.max(np.abs(mean - mr) / bound)


@pytest.mark.parametrize("scale", [1e4, 1e-3])
@dtypes
def test_rms_norm_scaled_rows(rng, dtype, scale):
    x = draw(rng, (8, 1000), dtype, scale=scale)
    y, rstd = nf.rms_norm_fwd(x, out=poisoned(x.shape, dtype))
    yr, rr = ref.rms_norm_fwd(x)
    stats_close(rstd, rr, dtype, scale=np.abs(rr), what="rstd")
    assert_close(y, yr, what="y")


# ================================================================== empty
EMPTY_SHAPES = [(0, 5), (2, 0, 7), (0, 1)]


@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=str)
@dtypes
def test_empty_inputs(dtype, shape):
    cols = shape[-1]
    x = np.ones(shape, dtype)
    w = np.ones(cols, dtype)
    b = np.ones(cols, F32)
    acc = acc_dtype(dtype)
    y = nf.softmax_fwd(x)
    assert y.shape == shape and y.dtype == dtype
    dx = nf.softmax_bwd(y, x)
    assert dx.shape == shape and dx.dtype == dtype
    y, rstd = nf.rms_norm_fwd(x, w)
    assert y.shape == shape and y.dtype == dtype
    assert rstd.shape == shape[:-1] and rstd.dtype == acc
    dx, dw = nf.rms_norm_bwd(x, x, w, rstd)
    assert dx.shape == shape and dx.dtype == dtype
    assert dw.dtype == w.dtype and dw.shape == (cols,) and np.all(dw == 0)
    assert nf.rms_norm_bwd(x, x, None, rstd)[1] is None
    y, mean, rstd = nf.layer_norm_fwd(x, w, b)
    assert y.shape == shape and mean.shape == rstd.shape == shape[:-1]
    assert mean.dtype == rstd.dtype == acc
    dx, dw, db = nf.layer_norm_bwd(x, x, w, b, mean, rstd, out=np.empty(shape, dtype))
    assert dx.shape == shape
    assert dw.dtype == dtype and db.dtype == F32
    assert np.all(dw == 0) and np.all(db == 0) and dw.shape == db.shape == (cols,)


@dtypes
def test_empty_rows(dtype):
    """Zero columns: empty y; statistics of an empty row are NaN (documented)."""
    x = np.ones((3, 0), dtype)
    assert nf.softmax_fwd(x).shape == (3, 0)
    y, rstd = nf.rms_norm_fwd(x)
    assert y.shape == (3, 0) and rstd.shape == (3,) and np.all(np.isnan(rstd))
    y, mean, rstd = nf.layer_norm_fwd(x, np.ones(0, dtype))
    assert y.shape == (3, 0) and np.all(np.isnan(mean)) and np.all(np.isnan(rstd))
    dx, dw, db = nf.layer_norm_bwd(x, x, np.ones(0, dtype), None, mean, rstd)
    assert dx.shape == (3, 0) and dw.shape == (0,) and db is None


# ============================================================ determinism
@pytest.mark.parametrize("pkind", ["x", "f32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", ["rms_norm_bwd", "layer_norm_bwd"])
@pytest.mark.parametrize("shape", [(777, 100), (517, 4111)], ids=str)   # row path, pipelined
def test_param_grads_deterministic(rng, restore_threads, op, dtype, pkind, shape):
    """dweight/dbias: the same bits on every run and for 1 and 2 threads (at 4111
    columns float32/float64 take the pipeline on two threads and the row path on
    one: cpu._rows_pipelined)."""
    if restore_threads < 2:
        pytest.skip("numba has fewer than 2 threads")
    x = draw(rng, shape, dtype, loc=0.3)
    w = draw_param(rng, shape[-1], pkind, dtype)
    b = draw_param(rng, shape[-1], pkind, dtype, loc=0.0)
    dy = draw(rng, shape, dtype)
    if op == "rms_norm_bwd":
        d = dict(dy=dy, x=x, weight=w, rstd=nf.rms_norm_fwd(x, w)[1])
    else:
        _, mean, rstd = nf.layer_norm_fwd(x, w, b)
        d = dict(dy=dy, x=x, weight=w, bias=b, mean=mean, rstd=rstd)
    results = []
    with cpu.forced(parallel=True):
        for n in (1, 2, 2, 1):
            numba.set_num_threads(n)
            results.append(call_op(op, d))
    with cpu.forced(parallel=False):
        results.append(call_op(op, d))
    for other in results[1:]:
        for g, w0 in zip(other, results[0]):
            assert_bits_equal(g, w0, f"{op} across thread counts")
    # the forward too
    numba.set_num_threads(1)
    f1 = nf.layer_norm_fwd(x, w, b)
    numba.set_num_threads(2)
    f2 = nf.layer_norm_fwd(x, w, b)
    for a, c in zip(f1, f2):
        assert_bits_equal(a, c, "layer_norm_fwd across thread counts")


def _param_grads_in_kernel_order(op, dy, x, rstd, mean, pdtype):
    """dweight (and dbias) as the kernels add them, replayed in NumPy: per chunk
    of rows (cpu.param_chunks), a partial row in the accumulator type that the
    chunk's first row assigns and the others add to, one row at a time in row
    order; then the partials summed in chunk order, rounded once to the
    parameter's dtype. Products and sums are rounded
    to the accumulator type one at a time (the store loops have no reassociation
    and no contraction), so the bits must match exactly."""
    at = acc_dtype(x.dtype)
    rows, cols = x.shape
    d = dy.astype(at)
    xa = x.astype(at)
    centered = xa if mean is None else xa - mean.astype(at)[:, None]
    terms = [d * (centered * rstd.astype(at)[:, None])]
    if op == "layer_norm_bwd":
        terms.append(d)
    chunks = cpu.param_chunks(rows, cols)
    grads = []
    for term in terms:
        partials = []
        for k in range(chunks):
            start, end = k * rows // chunks, (k + 1) * rows // chunks
            part = None
            for r in range(start, end):
                part = term[r] if part is None else part + term[r]
            partials.append(part)
        total = partials[0].copy()
        for part in partials[1:]:
            total = total + part
        grads.append(total.astype(pdtype))
    return grads


def test_param_chunks_by_rows():
    """The dweight/dbias partial count by rows: one below 2 * cpu.CHUNK_ROWS rows,
    two from there, more only at cpu.MANY_CHUNK_ROWS rows each, at most
    cpu.MAX_CHUNKS, and fewer for long rows (cpu._PARTIAL_ELEMS elements in all)."""
    assert (cpu.CHUNK_ROWS, cpu.MANY_CHUNK_ROWS) == (4, 8)
    got = {rows: cpu.param_chunks(rows, 4096)
           for rows in (1, 7, 8, 15, 16, 23, 24, 60, 255, 256, 4096)}
    assert got == {1: 1, 7: 1, 8: 2, 15: 2, 16: 2, 23: 2, 24: 3, 60: 7, 255: 31, 256: 32,
                   4096: 32}
    assert cpu.param_chunks(4096, 65536) == cpu._PARTIAL_ELEMS // 65536 == 8
    assert cpu.param_chunks(16, 262144) == 2 and cpu.param_chunks(16, 1 << 20) == 1
    assert cpu._param_chunks(60, 4111) == cpu.param_chunks(60, 4111)     # the jitted copy


@pytest.mark.parametrize("cols", [40, 1024, 4096, 3 * 4096 + 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", ["rms_norm_bwd", "layer_norm_bwd"])
def test_param_grads_bits_follow_the_documented_order(rng, restore_threads, op, dtype, cols):
    """dweight/dbias bit for bit as documented (one row at a time, on the row path
    below the pipelined backwards' floors and on the pipelined rows above:
    rows of cpu.BWD_PIPELINE_BYTES for float32/float64, cpu.HALF_BWD_PIPELINE_COLS
    columns for float16/bfloat16), serial and parallel, with odd rows per chunk (the widest
    shape has cpu.PARALLEL_SUM_ELEMS partial elements or more: the parallel build
    sums them by column blocks); dx matches the reference and the in-place call
    bit for bit."""
    assert 40 < cpu.HALF_BWD_PIPELINE_COLS <= 1024                         # both paths
    assert 1024 * 4 < cpu.BWD_PIPELINE_BYTES <= 1024 * 8
    rows = {1024: 133, 4096: 165, 3 * 4096 + 5: 181}.get(cols, 101)   # 8-9 rows per chunk
    assert rows // cpu.param_chunks(rows, cols) >= 3
    if cols > cpu.SUM_BLOCK:
        assert cpu.param_chunks(rows, cols) * cols >= cpu.PARALLEL_SUM_ELEMS
    x = draw(rng, (rows, cols), dtype, loc=0.3)
    dy = draw(rng, (rows, cols), dtype)
    w = draw_param(rng, cols, "x", dtype)
    b = draw_param(rng, cols, "x", dtype, loc=0.0)
    if op == "rms_norm_bwd":
        _, rstd = nf.rms_norm_fwd(x, w)
        mean = None
        d = dict(dy=dy, x=x, weight=w, rstd=rstd)
    else:
        _, mean, rstd = nf.layer_norm_fwd(x, w, b)
        d = dict(dy=dy, x=x, weight=w, bias=b, mean=mean, rstd=rstd)
    expected = _param_grads_in_kernel_order(op, dy, x, rstd, mean, dtype)
    for parallel in (False, True):
        with cpu.forced(parallel):
            got = call_op(op, d, out=poisoned(x.shape, dtype))
            inplace = dy.copy()
            got_inplace = call_op(op, dict(d, dy=inplace), out=inplace)
        for g, e, name in zip(got[1:], expected, ("dweight", "dbias")):
            assert_bits_equal(g, e, f"{name}, parallel={parallel}")
        for g, e in zip(got_inplace, got):
            assert_bits_equal(g, e, "in place")
        if op == "layer_norm_bwd":     # one parameter: its gradient alone, same bits
            with cpu.forced(parallel):
                assert_bits_equal(call_op(op, dict(d, weight=None))[2], expected[1],
                                  "dbias without weight")
                assert_bits_equal(call_op(op, dict(d, bias=None))[1], expected[0],
                                  "dweight without bias")
    check_op(op, d, got)


@pytest.mark.parametrize("eps", [0.0, 1e-2, 1.0, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_eps_values(rng, dtype, eps):
    x = draw(rng, (5, 65), dtype, scale=0.3)
    y, rstd = nf.rms_norm_fwd(x, None, eps, out=poisoned(x.shape, dtype))
    yr, rr = ref.rms_norm_fwd(x, None, eps)
    stats_close(rstd, rr, dtype, scale=np.abs(rr), what="rstd")
    assert_close(y, yr, what="rms y")
    y, mean, rstd = nf.layer_norm_fwd(x, None, None, eps, out=poisoned(x.shape, dtype))
    yr, mr, rr = ref.layer_norm_fwd(x, None, None, eps)
    stats_close(rstd, rr, dtype, scale=np.abs(rr), what="rstd")
    assert_close(y, yr, cond=ln_fwd_cond(x, None, rr), what="ln y")


# ======================================================= layouts in assembly
def test_non_contiguous_layouts_run_unit_stride_loops():
    """Rows of a transposed (numba layout 'A') 3-D view reach the row functions
    as C-contiguous arrays: the drivers' assembly has packed arithmetic and no
    gathers (strided rows compiled to vgather loads and ran 2-9x slower)."""
    import re
    from numba import njit, typeof
    from numba_fused import cpu
    rows = np.ones((4, 6, 64), np.float32).transpose(1, 0, 2)
    assert typeof(rows).layout == "A"
    out = np.empty((4, 6, 64), np.float32).transpose(1, 0, 2)
    w, st = np.ones(64, np.float32), np.ones(24, np.float32)
    part = np.empty((1, 64), np.float32)
    args = {"softmax_fwd": (rows, out, 1), "softmax_bwd": (rows, rows, out, 1),
            "rms_norm_fwd": (rows, w, 1e-6, out, st.copy(), 1),
            "rms_norm_bwd": (rows, rows, w, st, out, part, 1, w.copy(), 1),
            "layer_norm_fwd": (rows, w, w, 1e-5, out, st.copy(), st.copy(), 1),
            "layer_norm_bwd": (rows, rows, w, st, st, out, part, part.copy(), 1,
                               w.copy(), w.copy(), 1)}
    for name, a in args.items():
        fresh = njit(cpu.SERIAL[name].py_func)      # cached code cannot be inspected
        fresh(*a)
        asm = fresh.inspect_asm(fresh.signatures[0])
        assert "gather" not in asm, f"{name}: strided (gather) loads"
        assert len(re.findall(r"\bv(?:mul|add|sub|fmadd\w*)ps\s+%?[yz]mm", asm)) >= 4, name


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("op", ["rms_norm_bwd", "layer_norm_bwd"])
def test_pipelined_bwd_rows_are_batch_invariant(rng, op, dtype):
    """The pipelined norm backwards (4-5 rows per dweight chunk, so every chunk
    runs the stage; columns not a power of two, so 1/cols is inexact): each row's
    dx has the bits of the same row alone, serial and parallel, in place."""
    cols = 4111
    assert cols >= (cpu.HALF_BWD_PIPELINE_COLS if is_half(dtype)
                    else cpu.BWD_PIPELINE_BYTES // np.dtype(dtype).itemsize)
    ROWS = 130
    x, dy = draw(rng, (ROWS, cols), dtype), draw(rng, (ROWS, cols), dtype)
    w = draw_param(rng, cols, "x", dtype)
    if op == "rms_norm_bwd":
        d = dict(dy=dy, x=x, weight=w, rstd=nf.rms_norm_fwd(x, w)[1])
    else:
        _, mean, rstd = nf.layer_norm_fwd(x, w, w)
        d = dict(dy=dy, x=x, weight=w, bias=w, mean=mean, rstd=rstd)
    assert ROWS // cpu.param_chunks(ROWS, cols) >= 4
    for parallel in (False, True):
        with cpu.forced(parallel):
            dx = call_op(op, d)[0]
            inplace = d["dy"].copy()
            call_op(op, dict(d, dy=inplace), out=inplace)
        assert_bits_equal(inplace, dx, f"{op} in place")
        with cpu.forced(False):
            for r in range(ROWS):
                alone = {k: (v[r:r + 1] if k in ("dy", "x", "mean", "rstd") else v)
                         for k, v in d.items()}
                assert_bits_equal(call_op(op, alone)[0][0], dx[r], f"{op} row {r}")


@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
@pytest.mark.parametrize("op, params", [("rms_norm_bwd", True), ("layer_norm_bwd", True),
                                        ("layer_norm_bwd", False)])
def test_bwd_pipeline_across_chunks_bits_do_not_depend_on_threads(rng, op, params, dtype):
    """The pipelined norm backward runs one pipeline through all the dweight/dbias
    chunks of a thread (7 chunks of 8-9 rows here; without parameters a chunk per
    row): dx, dweight and dbias have the same bits whatever the grouping (1, 2, 3
    or 7 groups), and match the reference."""
    rows, cols = 60, 4111
    assert cpu.param_chunks(rows, cols) == 7
    x, dy = draw(rng, (rows, cols), dtype), draw(rng, (rows, cols), dtype)
    w = draw_param(rng, cols, "x", dtype) if params else None
    if op == "rms_norm_bwd":
        d = dict(dy=dy, x=x, weight=w, rstd=nf.rms_norm_fwd(x, w)[1])
    else:
        _, mean, rstd = nf.layer_norm_fwd(x, w, w)
        d = dict(dy=dy, x=x, weight=w, bias=w, mean=mean, rstd=rstd)
    first = _norm_bwd_by_driver(op, d, cpu.PARALLEL, threads=1)
    check_op(op, d, first)
    for threads in (2, 3, 7):
        for g, e, name in zip(_norm_bwd_by_driver(op, d, cpu.PARALLEL, threads=threads),
                              first, ("dx", "dweight", "dbias")):
            if e is None:
                assert g is None
            else:
                assert_bits_equal(g, e, f"{name}, {threads} groups")


def _row_results(x, dy, w):
    """Forward outputs and backward dx of every op for the rows of x (bytes per row)."""
    y_sm = nf.softmax_fwd(x)
    y_rms, rstd = nf.rms_norm_fwd(x, w)
    y_ln, mean, ln_rstd = nf.layer_norm_fwd(x, w, w)
    outs = (y_sm, nf.softmax_bwd(y_sm, dy), y_rms, nf.rms_norm_bwd(dy, x, w, rstd)[0],
            y_ln, nf.layer_norm_bwd(dy, x, w, w, mean, ln_rstd)[0])
    return [[o[r].tobytes() for o in outs] for r in range(x.shape[0])]


@pytest.mark.parametrize("dtype, wkind", [(d, "x") for d in DTYPES] + [(BF16, "f32")],
                         ids=lambda v: dtype_id(v) if not isinstance(v, str) else v)
@pytest.mark.parametrize("cols", [7, 333, 1000, 4096])
def test_rows_are_batch_invariant(rng, dtype, wkind, cols):
    """A row's forward outputs and dx have the same bits alone, in a batch of 40
    (row by row) and in one of 80 (pipelined forwards), with the serial and the
    parallel kernels: every sum runs in the same lanes in the same order on every
    path (``numba_fused/_lanes.py``; bfloat16 rows beside a float32 weight take
    other lanes than beside a bfloat16 one, ``cpu._lanes_beside``). dweight/dbias
    sum over the batch, so they are left out."""
    x = draw(rng, (80, cols), dtype, scale=2.0, loc=0.5)
    dy = draw(rng, (80, cols), dtype)
    w = draw_param(rng, cols, wkind, dtype)
    with cpu.forced(parallel=False):
        alone = [_row_results(x[r:r + 1], dy[r:r + 1], w)[0] for r in range(0, 80, 7)]
    for parallel in (False, True):
        with cpu.forced(parallel):
            batched = (_row_results(x, dy, w), _row_results(x[:40], dy[:40], w)
                       + _row_results(x[40:], dy[40:], w))
        for rows in batched:
            for k, r in enumerate(range(0, 80, 7)):
                assert rows[r] == alone[k], f"row {r} (parallel={parallel})"


# ============================================= long rows: column-blocked calls
def _norm_bwd_by_driver(op, d, kernels, inplace=False, threads=2):
    """The backward kernel of ``op`` in ``kernels`` (cpu.PARALLEL: the row path,
    cpu.BLOCKED: column-blocked) on 2-D inputs, its rows in ``threads`` groups."""
    from numba_fused import _dtypes as D
    st = lambda a: None if a is None else D.to_storage(a)
    x, w, b = d["x"], d["weight"], d.get("bias")
    rows, cols = x.shape
    dy = d["dy"].copy() if inplace else d["dy"]
    dx = dy if inplace else poisoned(x.shape, x.dtype)
    chunks = cpu.param_chunks(rows, cols) if w is not None or b is not None else rows
    at = acc_dtype(x.dtype)
    parts = [None if p is None else np.full((chunks, cols), np.nan, at) for p in (w, b)]
    grads = [None if p is None else poisoned(p.shape, p.dtype) for p in (w, b)]
    target = None if inplace else st(dx)[None]
    if op == "rms_norm_bwd":
        kernels[op](st(dy)[None], st(x)[None], st(w), d["rstd"], target, parts[0],
                    chunks, st(grads[0]), threads)
        return dx, grads[0]
    kernels[op](st(dy)[None], st(x)[None], st(w), d["mean"], d["rstd"], target,
                parts[0], parts[1], chunks, st(grads[0]), st(grads[1]), threads)
    return dx, grads[0], grads[1]


def _partials_in_row_order(d, op, chunks):
    """dweight (and dbias) as the row path adds them, in NumPy: each term
    dy * xhat (dy) rounded in the accumulator type, added into its chunk's partial
    row in row order, the partials summed in chunk order, rounded once."""
    acc_t = acc_dtype(d["x"].dtype)
    x, dy = d["x"].astype(acc_t), d["dy"].astype(acc_t)
    centered = x if op == "rms_norm_bwd" else x - d["mean"][:, None]
    terms = [dy * (centered * d["rstd"][:, None])] + ([dy] if op == "layer_norm_bwd" else [])
    rows = x.shape[0]
    out = []
    for t in terms:
        total = None
        for k in range(chunks):
            lo, hi = k * rows // chunks, (k + 1) * rows // chunks
            part = t[lo].copy()
            for r in range(lo + 1, hi):
                part = part + t[r]
            total = part if total is None else total + part
        out.append(total.astype(d["x"].dtype))
    return out


@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
@pytest.mark.parametrize("op", ["rms_norm_bwd", "layer_norm_bwd"])
def test_norm_bwd_pairs_bits_equal_row_path(rng, op, dtype):
    """float32 norm backwards two rows at a time within each dweight/dbias chunk
    (rows of cpu.PAIR_BYTES, chunks of cpu.PAIR_CHUNK_ROWS rows and more; 16-17
    rows here, so both leftovers; bfloat16 keeps one row at a time): every row's dx
    has the bits of the row alone, and dweight and dbias those of the row path's
    order (each chunk's rows in turn), in place too and in 2 or 3 thread groups;
    the values match the reference."""
    rows, cols = 530, cpu.PAIR_BYTES // 2 + 37
    chunks = cpu.param_chunks(rows, cols)
    x, dy = draw(rng, (rows, cols), dtype, loc=0.3), draw(rng, (rows, cols), dtype)
    assert cpu._bwd_paired(_rows_storage(x), rows, chunks) == (dtype == F32)
    w = draw_param(rng, cols, "x", dtype)
    b = draw_param(rng, cols, "x", dtype, loc=0.0)
    if op == "rms_norm_bwd":
        d = dict(dy=dy, x=x, weight=w, rstd=nf.rms_norm_fwd(x, w)[1])
    else:
        _, mean, rstd = nf.layer_norm_fwd(x, w, b)
        d = dict(dy=dy, x=x, weight=w, bias=b, mean=mean, rstd=rstd)
    with cpu.forced(False):
        alone = np.stack([call_op(op, {k: (v[r:r + 1] if k in ("dy", "x", "mean", "rstd")
                                            else v) for k, v in d.items()})[0][0]
                          for r in range(rows)])
    dw = _partials_in_row_order(d, op, chunks)
    first = None
    for inplace, threads in ((False, 2), (True, 3)):
        got = _norm_bwd_by_driver(op, d, cpu.PARALLEL, inplace, threads)
        assert_bits_equal(got[0], alone, f"dx, in place={inplace}, {threads} groups")
        for g, e, name in zip(got[1:], dw, ("dweight", "dbias")):
            assert_bits_equal(g, e, f"{name}, in place={inplace}, {threads} groups")
        first = first or got
    check_op(op, d, first)


#: (op, dtype, params) of the column-blocked backward tests: every dtype with all
#: parameters, the other parameter sets in float32 and bfloat16 (each case compiles
#: kernels of its own: the full product cost ~4 min of CI)
WIDE_BWD_CASES = ([(op, d, p) for d in DTYPES
                   for op, p in (("layer_norm_bwd", "both"), ("rms_norm_bwd", "weight"))]
                  + [(op, d, p) for d in (F32, BF16)
                     for op, p in (("layer_norm_bwd", "weight"), ("layer_norm_bwd", "bias"),
                                   ("layer_norm_bwd", "none"), ("rms_norm_bwd", "none"))])


@pytest.mark.parametrize("shape", [(1, cpu.WIDE_COLS + 37), (5, 2 * cpu.WIDE_COLS + 3),
                                   (2 * cpu.CHUNK_ROWS - 1,
                                    cpu.WIDE_COLS + 3 * cpu.WIDE_BLOCK + 1)])
@pytest.mark.parametrize("op, dtype, params", WIDE_BWD_CASES,
                         ids=[f"{o}-{dtype_id(d)}-{p}" for o, d, p in WIDE_BWD_CASES])
def test_wide_bwd_bits_equal_row_path(rng, op, dtype, shape, params):
    """A column-blocked backward (few rows of cpu.WIDE_COLS columns or more) gives
    the row path's bits: dx (out of place, and in place with all parameters) and
    dweight/dbias, whose per-block partials are summed in the row path's chunk
    order; odd rows per chunk, a partial last block. And both match the reference."""
    rows, cols = shape
    x = draw(rng, shape, dtype, loc=0.3)
    dy = draw(rng, shape, dtype)
    w = draw_param(rng, cols, "x", dtype) if params in ("both", "weight") else None
    b = draw_param(rng, cols, "x", dtype, loc=0.0) if params in ("both", "bias") else None
    if op == "rms_norm_bwd":
        d = dict(dy=dy, x=x, weight=w, rstd=nf.rms_norm_fwd(x, w)[1])
    else:
        _, mean, rstd = nf.layer_norm_fwd(x, w, b)
        d = dict(dy=dy, x=x, weight=w, bias=b, mean=mean, rstd=rstd)
    assert cpu.param_chunks(rows, cols) < 2 and cols >= cpu.WIDE_COLS
    row_path = _norm_bwd_by_driver(op, d, cpu.PARALLEL)
    all_params = (op, params) in (("layer_norm_bwd", "both"), ("rms_norm_bwd", "weight"))
    for inplace in (False, True) if all_params else (False,):
        wide = _norm_bwd_by_driver(op, d, cpu.BLOCKED, inplace)
        for g, e, name in zip(wide, row_path, ("dx", "dweight", "dbias")):
            if e is None:
                assert g is None
            else:
                assert_bits_equal(g, e, f"{name}, in place={inplace}")
    check_op(op, d, row_path)


@pytest.mark.parametrize("cols", [cpu.WIDE_COLS - 1, cpu.WIDE_COLS + cpu.WIDE_BLOCK // 2 + 3])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
def test_long_rows_are_batch_invariant(rng, restore_threads, dtype, cols):
    """Long rows (around cpu.WIDE_COLS, whose sums go by blocks from there on):
    each backward row's dx has the bits of the row alone, batched (row path,
    pipelined), column-blocked and serial; the forwards' rows too."""
    rows = 2 * cpu.CHUNK_ROWS + 3          # a dweight partial per thread at 2 threads
    x = draw(rng, (rows, cols), dtype, scale=2.0, loc=0.5)
    dy = draw(rng, (rows, cols), dtype)
    w = draw_param(rng, cols, "x", dtype)
    numba.set_num_threads(min(2, restore_threads))
    with cpu.forced(parallel=True):
        batched = _row_results(x, dy, w)
    with cpu.forced(parallel=False):
        serial = _row_results(x, dy, w)
    assert serial == batched
    for r in (0, 1, rows // 2, rows - 1):
        with cpu.forced(parallel=True):            # one row: column-blocked from WIDE_COLS
            assert _row_results(x[r:r + 1], dy[r:r + 1], w)[0] == batched[r], f"row {r}"


@pytest.mark.parametrize("shape", [(1, cpu.WIDE_FWD_COLS + 37), (3, cpu.WIDE_FWD_COLS + 3)])
@dtypes
@pytest.mark.parametrize("op", ["rms_norm_fwd", "layer_norm_fwd"])
def test_wide_fwd_bits_equal_row_path(rng, op, dtype, shape):
    """A column-blocked norm forward (fewer rows than threads, cpu.WIDE_FWD_COLS
    columns or more) gives the row path's bits, y and the statistics, with both
    parameters, and (float32, bfloat16) with bias only and none; a row with an
    outlier takes LayerNorm's second statistics pass. And they match the reference."""
    rows, cols = shape
    x = draw(rng, shape, dtype, scale=2.0, loc=0.5)
    x[0, 0] = 300.0                # a sampled shift element: LayerNorm's second pass
    row = x[0].astype(np.float64)
    m0 = row[cpu.shift_points(cols)].mean()
    assert np.mean((row - m0) ** 2) > cpu.LN_SHIFT_COND * row.var()
    w = draw_param(rng, cols, "x", dtype)
    b = draw_param(rng, cols, "x", dtype, loc=0.0)
    for weight, bias in ((w, b), (None, b), (None, None))[:3 if dtype in (F32, BF16) else 1]:
        d = dict(x=x, weight=weight, bias=bias)
        row_path = _fwd_by_driver(op, d, 1)
        wide = _fwd_by_driver(op, d, 1, cpu.BLOCKED)
        for g, e in zip(wide, row_path):
            assert_bits_equal(g, e, f"{op}, weight={weight is not None}")
        check_op(op, d, row_path)


def test_blocked_kernels_serve_few_long_rows(restore_threads):
    """The backend picks the column-blocked norms for a few long rows only: the
    backwards from cpu.WIDE_COLS columns on fewer dweight partials (rows //
    cpu.CHUNK_ROWS) than threads, the
    forwards fewer rows than threads from cpu.WIDE_FWD_COLS columns; never softmax,
    whose forward takes cpu.LONG's kernels past cpu.PIPELINE_COLS columns."""
    if restore_threads < 2:
        pytest.skip("numba has fewer than 2 threads")
    numba.set_num_threads(2)
    x = lambda rows, cols: np.empty((1, rows, cols), np.uint16)     # bfloat16 bits
    most = 2 * cpu.CHUNK_ROWS - 1
    picks = {(op, rows, cols): cpu._parallel_kernel(op, x(rows, cols))
             for op in ("rms_norm_fwd", "layer_norm_fwd", "rms_norm_bwd", "layer_norm_bwd",
                        "softmax_fwd", "softmax_bwd")
             for rows, cols in ((1, cpu.WIDE_COLS), (most, cpu.WIDE_COLS),
                                (most + 1, cpu.WIDE_COLS),
                                (1, cpu.WIDE_COLS - 1), (1, cpu.WIDE_FWD_COLS),
                                (2, cpu.WIDE_FWD_COLS), (64, 1024))}
    blocked = {k for k, kernel in picks.items() if kernel is cpu.BLOCKED.get(k[0])}
    long = {k: kernel for k, kernel in picks.items() if kernel in cpu.LONG.values()}
    assert long == {("softmax_fwd", 1, cpu.WIDE_FWD_COLS): cpu.LONG["blocked"],
                    ("softmax_fwd", 2, cpu.WIDE_FWD_COLS): cpu.LONG["parallel"]}
    assert cpu.PIPELINE_COLS == cpu.WIDE_COLS          # the shapes above straddle both
    assert all(picks[k] is cpu.PARALLEL[k[0]] for k in set(picks) - blocked - set(long))
    assert blocked == {(op, rows, cols) for op in ("rms_norm_bwd", "layer_norm_bwd")
                       for rows, cols in ((1, cpu.WIDE_COLS), (most, cpu.WIDE_COLS),
                                          (1, cpu.WIDE_FWD_COLS), (2, cpu.WIDE_FWD_COLS))} | {
        (op, 1, cpu.WIDE_FWD_COLS) for op in ("rms_norm_fwd", "layer_norm_fwd")}


@dtypes
def test_softmax_fwd_by_blocks_past_long_cols(rng, dtype, restore_threads):
    """Which softmax forward serves which rows: past cpu.long_cols columns (rows of
    4 KiB in float32/float64, PIPELINE_COLS columns in the half types) cpu.LONG's
    kernels (serial, parallel, by pieces, and in the small-call entry), up to it
    the drivers. So a row's path depends on its columns alone: a float32/float64
    row has the same bits alone (small-call entry), in 3 rows (serial) and in 130
    (parallel) on both sides of the threshold, and different bits across it."""
    st = _storage(dtype)
    n = cpu.long_cols(st)
    assert n == {F32: 1024, F64: 512}.get(dtype, cpu.PIPELINE_COLS)
    threads = min(2, restore_threads)
    numba.set_num_threads(threads)
    x = lambda rows, cols: np.empty((1, rows, cols), st)
    for cols, long in ((n, False), (n + 1, True)):
        assert (cpu._serial_kernel("softmax_fwd", x(3, cols)) is cpu.LONG["serial"]) == long
        assert (cpu._parallel_kernel("softmax_fwd", x(64, cols)) is cpu.LONG["parallel"]) == long
        if threads == 2:
            assert (cpu._parallel_kernel("softmax_fwd", x(1, cols))
                    is cpu.LONG["blocked"]) == long
    if dtype not in (F32, F64):
        return
    rows = draw(rng, (130, n + 1), dtype, scale=4.0)
    for cols in (n, n + 1):
        batch = np.ascontiguousarray(rows[:, :cols])
        y = nf.softmax_fwd(batch)
        assert_bits_equal(nf.softmax_fwd(batch[:3]), y[:3], f"{cols} columns, 3 rows")
        assert_bits_equal(nf.softmax_fwd(batch[2:3]), y[2:3], f"{cols} columns, 1 row")
        assert_close(y, ref.softmax_fwd(batch), what="y")
    pipelined = _fwd_by_driver("softmax_fwd", dict(x=rows), 2)[0]     # n + 1 columns
    assert not np.array_equal(pipelined, nf.softmax_fwd(rows)), "not the long-row path"


@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
def test_norm_forwards_run_row_by_row_where_y_aliases_the_next_row(dtype, restore_threads):
    """Where y's row r lies a multiple of cpu.ALIAS_SPAN bytes from x's row r + 1
    (NumPy's y allocated right after a 256 MiB x), the norm forwards run one chunk
    per row instead of pipelined (cpu._norm_fwd_threads), with the same bits as
    into a separate buffer. The arrays are carved from one buffer whose untouched
    pages cost nothing."""
    if restore_threads < 2:
        pytest.skip("numba has fewer than 2 threads")
    numba.set_num_threads(2)
    rng = np.random.default_rng(11)
    rows, cols = 64, 1024
    item = np.dtype(dtype).itemsize
    n = rows * cols
    span = cpu.ALIAS_SPAN // item
    base = np.empty(span + 2 * n, dtype)
    x = base[:n].reshape(rows, cols)
    x[...] = (1 + 2 * rng.standard_normal((rows, cols))).astype(dtype)
    w = (1 + 0.1 * rng.standard_normal(cols)).astype(dtype)
    row = cols                                           # elements of one row
    aliased = base[span + row:span + row + n].reshape(rows, cols)
    near = base[span + row + cpu.ALIAS_NEAR // item:
                span + row + cpu.ALIAS_NEAR // item + n].reshape(rows, cols)
    threads = lambda y: cpu._norm_fwd_threads(x[None], y[None], 2)   # noqa: E731
    assert threads(aliased) == rows and threads(near) == 2
    assert threads(base[span + row - 8:span + row - 8 + n].reshape(rows, cols)) == rows
    with cpu.forced(parallel=True):
        for y in (aliased, near):
            y[...] = np.nan                               # poisoned
            got = nf.rms_norm_fwd(x, w, out=y)
            assert_bits_equal(got[0], nf.rms_norm_fwd(x, w)[0], "rms_norm y")
            y[...] = np.nan
            got = nf.layer_norm_fwd(x, w, w, out=y)
            want = nf.layer_norm_fwd(x, w, w)
            for g, e, name in zip(got, want, ("y", "mean", "rstd")):
                assert_bits_equal(g, e, f"layer_norm {name}")


def test_bwd_stage_noalias_spares_the_in_place_pointers():
    """The norm backwards' pipelined stage marks the pointers nothing else writes
    through ``noalias`` (the weight is then widened once per block), and not dy/dx,
    which are one array in place (``_no_alias_args``): read in the LLVM IR."""
    import re
    from numba import njit
    from numba_fused import cpu
    from numba_fused._lanes import data
    fresh = njit(error_model="numpy")(cpu._norm_bwd_stage_at.py_func)
    f32 = np.float32

    @njit
    def call(dy, x, w, parts):
        n = x.shape[1]
        return fresh(n, data(dy[0]), data(x[0]), data(w), f32(0), f32(1), f32(0), f32(0),
                     data(dy[0]), data(parts[0]), data(parts[1]), True, data(dy[1]),
                     data(x[1]), f32(0), np.intp(0))
    dy = np.ones((2, 256), np.uint16)
    call(dy, dy.copy(), np.ones(256, np.uint16), np.zeros((2, 256), np.float32))
    ir = fresh.inspect_llvm(fresh.signatures[0])
    head = re.search(r"define [^\n]*", ir).group(0)

    def attrs(name):
        return re.search(r"ptr ([^%,]*)%arg\." + name + r"\b", head).group(1)
    for name in ("xc", "weight", "dweight", "dbias", "dya", "xa"):
        assert "noalias" in attrs(name), name
    for name in ("dyc", "dxc"):
        assert "noalias" not in attrs(name), name

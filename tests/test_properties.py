"""Hypothesis properties over dtype, shape and memory layout.

Inputs are drawn with NumPy from a hypothesis-chosen seed (never zeros, see
conftest.draw); hypothesis picks the dtype, the leading shape, the row length,
the layout (strided, negative-stride, transposed, Fortran) and the scale."""
import os

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

import numba_fused as nf
from numba_fused import reference as ref
from conftest import (DTYPES, EPS, HALVES, LAYOUTS, TOL, as_layout, assert_bits_equal,
                      assert_close, bound, call_op, check_op, draw, draw_param, ln_fwd_cond,
                      row_scale)

# NF_HYPOTHESIS_EXAMPLES raises the count for a longer soak run.
SETTINGS = settings(max_examples=int(os.environ.get("NF_HYPOTHESIS_EXAMPLES", 30)),
                    deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
COLS = st.one_of(st.integers(1, 40), st.sampled_from([64, 127, 128, 129, 255, 1000, 1031]))


@st.composite
def cases(draw_, min_rows=1, grid=False):
    dtype = draw_(st.sampled_from(DTYPES))
    ndim = draw_(st.integers(1, 3))
    cols = draw_(COLS)
    lead = tuple(draw_(st.lists(st.integers(min_rows, 5), min_size=ndim - 1,
                                max_size=ndim - 1)))
    layouts = LAYOUTS if ndim >= 2 else [l for l in LAYOUTS if l != "transpose"]
    layout = draw_(st.sampled_from(layouts))
    seed = draw_(st.integers(0, 2 ** 32 - 1))
    scale = draw_(st.sampled_from([0.1, 1.0, 4.0]))
    return dtype, lead + (cols,), layout, np.random.default_rng(seed), scale


def _tol_sum(dtype):
    """How far a row of softmax outputs may sum from 1: each element is within
    1 ulp(ref) <= eps * ref (halves), or relatively within TOL (f32/f64:
    test_cpu checks softmax entries elementwise-relatively)."""
    dt = np.dtype(dtype)
    return EPS[dt] + TOL[np.dtype(np.float32)] if dt in HALVES else 2 * TOL[dt]


@SETTINGS
@given(cases())
def test_softmax_rows_sum_to_one(case):
    dtype, shape, layout, rng, scale = case
    x = as_layout(draw(rng, shape, dtype, scale=scale), layout)
    y = nf.softmax_fwd(x)
    y64 = y.astype(np.float64)
    assert np.all((y64 >= 0) & (y64 <= 1))
    assert np.max(np.abs(y64.sum(-1) - 1)) <= _tol_sum(dtype)


@SETTINGS
@given(cases(), st.data())
def test_softmax_shift_invariance(case, data):
    """softmax(x + c) == softmax(x) for a per-row c. x lives on a grid of
    quarters so that x + c is exact in every dtype (checked)."""
    dtype, shape, layout, rng, _ = case
    k = rng.integers(-32, 33, size=shape)
    k = np.where(k == 0, 1, k)
    x = (k / 4.0).astype(dtype)
    big = data.draw(st.sampled_from([16, 1e4]) if dtype not in HALVES else st.just(16))
    c = rng.integers(-1, 2, size=shape[:-1] + (1,)) * float(big) + \
        rng.integers(-16, 17, size=shape[:-1] + (1,))
    xs64 = x.astype(np.float64) + c
    xs = xs64.astype(dtype)
    assert np.array_equal(xs.astype(np.float64), xs64), "shifted input not exact"
    y = nf.softmax_fwd(as_layout(xs, layout))
    assert_close(y, ref.softmax_fwd(x), what="softmax(x + c)")


@SETTINGS
@given(cases())
def test_layer_norm_normalizes(case):
    """weight None, bias None: each row of y has mean 0 and variance
    var / (var + eps), within what the elementwise tolerance implies."""
    dtype, shape, layout, rng, scale = case
    cols = shape[-1]
    if cols < 2:
        return
    x = draw(rng, shape, dtype, scale=scale, loc=float(rng.choice([0.0, 3.0])))
    y, _, _ = nf.layer_norm_fwd(as_layout(x, layout))
    yr, _, rr = ref.layer_norm_fwd(x)
    x64 = x.astype(np.float64)
    var = x64.var(-1)
    keep = np.sqrt(var) >= 0.05          # rows with enough spread
    y64 = y.astype(np.float64)
    b = np.broadcast_to(bound(yr, dtype, row_scale(yr), ln_fwd_cond(x, None, rr)), yr.shape)
    mean_tol = b.mean(-1) + 1e-13
    var_tol = (b * (2 * np.abs(yr) + b)).mean(-1) + mean_tol ** 2 + 1e-12
    assert np.all(np.abs(y64.mean(-1)) <= mean_tol + np.abs(yr.mean(-1)))
    want = var / (var + 1e-5)
    assert np.all((np.abs(y64.var(-1) - want) <= var_tol)[keep])


@SETTINGS
@given(cases())
def test_rms_norm_unit_rms(case):
    dtype, shape, layout, rng, scale = case
    x = draw(rng, shape, dtype, scale=scale)
    y, rstd = nf.rms_norm_fwd(as_layout(x, layout))
    yr, _ = ref.rms_norm_fwd(x)
    b = np.broadcast_to(bound(yr, dtype, row_scale(yr)), yr.shape)
    y64 = y.astype(np.float64)
    ms = (x.astype(np.float64) ** 2).mean(-1)
    want = ms / (ms + 1e-6)
    tol = (b * (2 * np.abs(yr) + b)).mean(-1) + 1e-12
    assert np.all(np.abs((y64 ** 2).mean(-1) - want) <= tol)


OPS = ["softmax", "rms_norm", "layer_norm"]


@SETTINGS
@given(cases(min_rows=0), st.sampled_from(OPS), st.sampled_from([None, "x", "f32"]),
       st.sampled_from([None, "x", "f32"]), st.booleans())
def test_forward_backward_match_reference(case, op, wkind, bkind, inplace):
    """fwd then bwd (from the library's own saved statistics), arbitrary layout,
    optional in-place backward: every output matches the reference."""
    dtype, shape, layout, rng, scale = case
    cols = shape[-1]
    x = draw(rng, shape, dtype, scale=scale, loc=0.2)
    w = draw_param(rng, cols, wkind, dtype)
    b = draw_param(rng, cols, bkind, dtype, loc=0.0)
    dy = draw(rng, shape, dtype)
    xl = as_layout(x, layout)
    if op == "softmax":
        d = dict(x=xl)
        got = call_op("softmax_fwd", d)
        check_op("softmax_fwd", dict(x=x), got)
        bwd = "softmax_bwd"
        db = dict(y=as_layout(got[0], layout), dy=as_layout(dy, layout))
    elif op == "rms_norm":
        got = call_op("rms_norm_fwd", dict(x=xl, weight=w))
        check_op("rms_norm_fwd", dict(x=x, weight=w), got)
        bwd = "rms_norm_bwd"
        db = dict(dy=as_layout(dy, layout), x=xl, weight=w, rstd=got[1])
    else:
        got = call_op("layer_norm_fwd", dict(x=xl, weight=w, bias=b))
        check_op("layer_norm_fwd", dict(x=x, weight=w, bias=b), got)
        bwd = "layer_norm_bwd"
        db = dict(dy=as_layout(dy, layout), x=xl, weight=w, bias=b, mean=got[1], rstd=got[2])
    plain = {k: (None if v is None else np.array(v, order="C")) for k, v in db.items()}
    separate = call_op(bwd, db)
    res = call_op(bwd, db, out=db["dy"] if inplace else None)
    check_op(bwd, plain, res)
    if inplace:        # out=dy: the same bits as a separate buffer
        assert res[0] is db["dy"]
        for g, s in zip(res, separate):
            if s is not None:
                assert_bits_equal(np.array(g, order="C"), s, "in-place backward")

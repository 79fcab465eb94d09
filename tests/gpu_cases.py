"""GPU-path cases: the public API on device arrays vs the float64 reference (and the
CPU path), to the CPU suite's tolerances (conftest.py).

Not collected by the default test run (no ``test_`` prefix). It runs

* in the CUDA simulator, in its own process, from tests/test_gpu_sim.py
  (``NUMBA_ENABLE_CUDASIM=1`` must be set before numba is imported; the simulator
  uses gpu.SIM_TABLE: tiny blocks, so cols 33/70 exercise block-per-row, streaming
  and warp-per-row paths), and
* on a real GPU from benchmarks/gpu_check.sh (simulator off, hardware table), where
  the ``big`` cases (2^31+ elements) also run.
"""
import os

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

import numba_fused as nf
from numba_fused import gpu
from numba_fused import reference as ref
from conftest import (BF16, DTYPES, F16, F32, F64, acc_dtype, assert_bits_equal,
                      assert_close, check_op, draw, draw_param, dtype_id)

SIM = gpu.SIM
dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
OPS = ["softmax_fwd", "softmax_bwd", "rms_norm_fwd", "rms_norm_bwd",
       "layer_norm_fwd", "layer_norm_bwd"]
COLS = [1, 5, 33, 64, 70]
ROWS = [1, 3]
if not SIM:      # hardware: the same checks at sizes that reach every table row
    COLS = COLS + [1000, 4096, 32768, 70001, 1 << 20]


# ------------------------------------------------------------------ helpers
def tag(dtype):
    return "bfloat16" if np.dtype(dtype) == BF16 else None


def dev(a):
    """A host array on the device: bfloat16 travels as uint16 bits."""
    if a is None:
        return None
    if a.dtype == BF16:
        return cuda.to_device(np.ascontiguousarray(a).view(np.uint16))
    return cuda.to_device(np.ascontiguousarray(a))


def host(r, dtype):
    """A device result back on the host, as ``dtype``; checks the documented
    result types (bfloat16 as uint16 bits, float16 as float16)."""
    if r is None:
        return None
    h = r.copy_to_host()
    dtype = np.dtype(dtype)
    if dtype == BF16:
        assert h.dtype == np.uint16, f"bf16 results are uint16 bit arrays, got {h.dtype}"
        return h.view(BF16)
    assert h.dtype == dtype, (h.dtype, dtype)
    return h


PKINDS = {"rms_norm_fwd": [None, "x", "f32"], "rms_norm_bwd": [None, "x", "f32"],
          "layer_norm_fwd": [(None, None), ("x", "x"), ("f32", None), (None, "f32")],
          "layer_norm_bwd": [(None, None), ("x", "x"), ("f32", "f32"), ("x", None),
                             (None, "x")]}


def make_case(op, rng, shape, dtype, pk):
    """Named host inputs of one op; the statistics come from the reference (as
    the accumulator dtype), so the backward is checked on its own."""
    cols = shape[-1]
    x = draw(rng, shape, dtype, loc=0.3)
    dy = draw(rng, shape, dtype)
    if op.startswith("softmax"):
        if op == "softmax_fwd":
            return dict(x=draw(rng, shape, dtype, scale=3.0))
        y = ref.softmax_fwd(x).astype(dtype)
        return dict(y=y, dy=dy)
    acc = acc_dtype(dtype)
    if op.startswith("rms"):
        w = draw_param(rng, cols, pk, dtype)
        d = dict(x=x, weight=w)
        if op == "rms_norm_bwd":
            d.update(dy=dy, rstd=ref.rms_norm_fwd(x, w)[1].astype(acc))
        return d
    w = draw_param(rng, cols, pk[0], dtype)
    b = draw_param(rng, cols, pk[1], dtype, loc=0.0)
    d = dict(x=x, weight=w, bias=b)
    if op == "layer_norm_bwd":
        _, m, r = ref.layer_norm_fwd(x, w, b)
        d.update(dy=dy, mean=m.astype(acc), rstd=r.astype(acc))
    return d


def call_dev(op, d, dtype, out=None, stream=None):
    """Run ``op`` on device copies of ``d``; host results (logical dtypes)."""
    D = {k: dev(v) for k, v in d.items()}
    t = tag(dtype)
    f = getattr(nf, op)
    kw = dict(out=out, dtype=t, stream=stream)
    if op == "softmax_fwd":
        r = f(D["x"], **kw)
    elif op == "softmax_bwd":
        r = f(D["y"], D["dy"], **kw)
    elif op == "rms_norm_fwd":
        r = f(D["x"], D["weight"], **kw)
    elif op == "rms_norm_bwd":
        r = f(D["dy"], D["x"], D["weight"], D["rstd"], **kw)
    elif op == "layer_norm_fwd":
        r = f(D["x"], D["weight"], D["bias"], **kw)
    else:
        r = f(D["dy"], D["x"], D["weight"], D["bias"], D["mean"], D["rstd"], **kw)
    r = r if isinstance(r, tuple) else (r,)
    acc = acc_dtype(dtype)
    kinds = {"rms_norm_fwd": [dtype, acc], "layer_norm_fwd": [dtype, acc, acc],
             "rms_norm_bwd": [dtype, "weight"], "layer_norm_bwd": [dtype, "weight", "bias"]}
    out_dt = kinds.get(op, [dtype])
    res = []
    for a, k in zip(r, out_dt):
        if k in ("weight", "bias"):
            res.append(None if a is None else host(a, d[k].dtype))
        else:
            res.append(host(a, k))
    return tuple(res), D, r


# ------------------------------------------------------------------- tables
def test_simulator_table_reaches_every_path():
    """The shapes below hit warp-per-row and block-per-row groups, register-cached
    and streaming loops, vector and scalar chunks, forward and backward."""
    seen = set()
    for dt in DTYPES:
        st = np.dtype(dt).itemsize
        for cols in COLS:
            for W in {gpu._ALIGN // st if cols % (gpu._ALIGN // st) == 0 else 1}:
                for bwd in (False, True):
                    c = gpu.TABLE.choose(cols, W, np.dtype(dt) == F64, backward=bwd)
                    seen.add(("warp" if c.RPB > 1 else "block", c.NV > 0, W > 1, bwd))
    for bwd in (False, True):
        for need in [("warp", True), ("block", True), ("block", False)]:
            assert any(s[0] == need[0] and s[1] == need[1] and s[3] == bwd for s in seen), \
                (need, bwd, sorted(seen))
        assert any(s[2] and s[3] == bwd for s in seen) and any(not s[2] and s[3] == bwd
                                                                for s in seen)


def test_table_compiles_per_configuration_not_per_shape():
    """Many shapes map onto few configurations (the kernel cache key)."""
    keys = {gpu.HW_TABLE.choose(c, 8, False).key() for c in range(1, 300000, 977)}
    assert len(keys) <= 12, sorted(keys)
    big = gpu.HW_TABLE.choose(1 << 20, 8, False)
    assert big.G == 1024 and big.NV == 0


# ------------------------------------------------------------------- values
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("cols", COLS)
@dtypes
@pytest.mark.parametrize("op", OPS)
def test_op_matches_reference(rng, op, dtype, cols, rows):
    pks = PKINDS.get(op, [None])
    pk = pks[(cols + rows) % len(pks)]          # cycle the parameter kinds
    d = make_case(op, rng, (rows, cols), dtype, pk)
    got, _, raw = call_dev(op, d, dtype)
    assert all(type(a).__name__ in ("DeviceNDArray", "FakeCUDAArray") for a in raw
               if a is not None)
    check_op(op, d, got)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
def test_op_matches_cpu_path(rng, op, dtype):
    """The GPU and CPU paths agree (both to the reference's tolerance, and closely
    with each other: within 2 output ulps / the float32 tolerance)."""
    pk = PKINDS.get(op, [None])[1 % len(PKINDS.get(op, [None]))]
    d = make_case(op, rng, (3, 70), dtype, pk)
    got, _, _ = call_dev(op, d, dtype)
    f = getattr(nf, op)
    args = {"softmax_fwd": ["x"], "softmax_bwd": ["y", "dy"], "rms_norm_fwd": ["x", "weight"],
            "rms_norm_bwd": ["dy", "x", "weight", "rstd"],
            "layer_norm_fwd": ["x", "weight", "bias"],
            "layer_norm_bwd": ["dy", "x", "weight", "bias", "mean", "rstd"]}[op]
    cpu = f(*[d[a] for a in args])
    cpu = cpu if isinstance(cpu, tuple) else (cpu,)
    check_op(op, d, cpu)
    for g, c in zip(got, cpu):
        if c is None:
            assert g is None
            continue
        g64, c64 = g.astype(np.float64), c.astype(np.float64)
        fi = ml_dtypes.finfo(c.dtype)
        tol = 2 * float(fi.eps) * np.max(np.abs(c64), initial=0) + 1e-6 * np.max(
            np.abs(c64), initial=1e-30)
        assert np.nanmax(np.abs(g64 - c64), initial=0) <= tol, (op, g64, c64)


def test_stats_are_accumulator_dtype_and_values():
    rng = np.random.default_rng(1)
    x = draw(rng, (3, 33), F16)
    y, mean, rstd = nf.layer_norm_fwd(dev(x))
    assert mean.dtype == np.float32 and rstd.dtype == np.float32
    _, mr, rr = ref.layer_norm_fwd(x)
    assert_close(mean.copy_to_host(), mr, scale=np.max(np.abs(x.astype(np.float64)), -1),
                 dtype=F32)
    assert_close(rstd.copy_to_host(), rr, scale=rr, dtype=F32)


# ------------------------------------------------------------ special values
@dtypes
def test_softmax_special_rows(dtype):
    cols = 33
    x = np.zeros((5, cols), dtype)
    x[0, 3] = np.nan                 # NaN row
    x[1, 4] = np.inf                 # +inf row
    x[2, :] = -np.inf                # only -inf
    x[3, ::2] = -np.inf              # finite row with -inf entries: exact zeros
    x[4, :] = np.arange(cols) / 7
    (y,), _, _ = call_dev("softmax_fwd", dict(x=x), dtype)
    assert np.all(np.isnan(y[:3].astype(np.float32)))
    assert np.all(y[3, ::2].astype(np.float32) == 0)
    assert_close(y[3:], ref.softmax_fwd(x[3:]), what="finite rows")


@pytest.mark.parametrize("op", ["rms_norm_fwd", "layer_norm_fwd"])
def test_norm_nan_row_isolated(op):
    x = np.ones((3, 70), np.float32)
    x[1, 7] = np.nan
    d = dict(x=x, weight=None) if op == "rms_norm_fwd" else dict(x=x, weight=None, bias=None)
    got, _, _ = call_dev(op, d, F32)
    assert np.all(np.isnan(got[0][1])) and not np.any(np.isnan(got[0][[0, 2]]))


# ------------------------------------------------------------- in place, out
@pytest.mark.parametrize("cols", [5, 70])
@pytest.mark.parametrize("dtype", [F32, BF16, F64], ids=dtype_id)
@pytest.mark.parametrize("op", ["softmax_bwd", "rms_norm_bwd", "layer_norm_bwd"])
def test_inplace_backward_bit_identical(rng, op, dtype, cols):
    pk = "x" if op == "rms_norm_bwd" else ("x", "f32")
    d = make_case(op, rng, (3, cols), dtype, pk)
    want, D, _ = call_dev(op, d, dtype)
    D = {k: dev(v) for k, v in d.items()}
    t = tag(dtype)
    dy = D["dy"]
    if op == "softmax_bwd":
        r = nf.softmax_bwd(D["y"], dy, out=dy, dtype=t)
    elif op == "rms_norm_bwd":
        r = nf.rms_norm_bwd(dy, D["x"], D["weight"], D["rstd"], out=dy, dtype=t)
    else:
        r = nf.layer_norm_bwd(dy, D["x"], D["weight"], D["bias"], D["mean"], D["rstd"],
                              out=dy, dtype=t)
    r = r if isinstance(r, tuple) else (r,)
    got = host(dy, dtype)
    assert_bits_equal(got, want[0], f"{op} in place")
    for g, w, name in zip(r[1:], want[1:], ("weight", "bias")):
        assert_bits_equal(host(g, d[name].dtype), w, f"{op} d{name} in place")


class _CAIView:
    """A bare ``__cuda_array_interface__`` over ``base``'s memory with other shape and
    strides (what CuPy or torch hand over for a permuted tensor)."""

    def __init__(self, base, shape, strides):
        cai = dict(base.__cuda_array_interface__)
        cai.update(shape=tuple(shape), strides=tuple(strides))
        self.__cuda_array_interface__ = cai
        self._base = base


def test_out_buffer_and_strided_layouts(rng):
    """out= is written in place; transposed leading axes run zero-copy; a
    non-unit last stride and a strided out go through the device copy kernel."""
    x = draw(rng, (4, 3, 33), F32)
    want = ref.softmax_fwd(x)
    out = cuda.device_array((4, 3, 33), np.float32)
    r = nf.softmax_fwd(dev(x), out=out)
    assert r is out
    assert_close(out.copy_to_host(), want)
    # transposed leading axes (a view of a C-contiguous device buffer); numba's device
    # arrays transpose only 2-D, so on hardware the view is a bare
    # __cuda_array_interface__ object (as CuPy or torch hand over) with swapped strides
    xt = np.ascontiguousarray(x.swapaxes(0, 1))
    dx_t = dev(xt)
    if SIM:
        view = dx_t.transpose((1, 0, 2))
    else:
        s0, s1, s2 = dx_t.strides
        view = _CAIView(dx_t, (4, 3, 33), (s1, s0, s2))
    assert_close(nf.softmax_fwd(view).copy_to_host(), want)
    # every other column: needs a copy to C order
    wide = np.full((4, 3, 66), np.nan, np.float32)
    wide[..., ::2] = x
    dw = dev(wide)
    strided = dw[:, :, ::2]            # numba's device arrays take no Ellipsis
    assert_close(nf.softmax_fwd(strided).copy_to_host(), want)
    # strided out: results land in the view, the gaps keep their NaN
    obuf = cuda.to_device(np.full((4, 3, 66), np.nan, np.float32))
    nf.softmax_fwd(dev(x), out=obuf[:, :, ::2])
    h = obuf.copy_to_host()
    assert_close(h[..., ::2], want)
    assert np.all(np.isnan(h[..., 1::2]))


# ------------------------------------------------------------- empty shapes
@dtypes
def test_zero_rows_and_zero_cols(dtype):
    acc = acc_dtype(dtype)
    t = tag(dtype)
    x = dev(np.ones((0, 5), dtype))
    w = dev(np.ones(5, dtype))
    y = nf.softmax_fwd(x, dtype=t)
    assert y.shape == (0, 5)
    y, rstd = nf.rms_norm_fwd(x, w, dtype=t)
    assert y.shape == (0, 5) and rstd.shape == (0,) and rstd.dtype == acc
    dx, dw = nf.rms_norm_bwd(x, x, w, rstd, dtype=t)
    assert dx.shape == (0, 5)
    assert np.all(host(dw, dtype).astype(np.float32) == 0)          # a filled zero
    y, mean, rstd = nf.layer_norm_fwd(x, w, None, dtype=t)
    dx, dw, db = nf.layer_norm_bwd(x, x, w, None, mean, rstd, dtype=t)
    assert db is None and np.all(host(dw, dtype).astype(np.float32) == 0)
    # zero columns: the statistics of an empty row are NaN (a device fill)
    x0 = dev(np.ones((3, 0), dtype))
    y, rstd = nf.rms_norm_fwd(x0, dtype=t)
    assert y.shape == (3, 0) and np.all(np.isnan(rstd.copy_to_host()))
    y, mean, rstd = nf.layer_norm_fwd(x0, dtype=t)
    assert np.all(np.isnan(mean.copy_to_host())) and np.all(np.isnan(rstd.copy_to_host()))


# ------------------------------------------------------------ dtype, errors
def test_bf16_ways_in():
    rng = np.random.default_rng(3)
    x = draw(rng, (3, 33), BF16)
    want = ref.softmax_fwd(x)
    bits = cuda.to_device(x.view(np.uint16))
    ibits = cuda.to_device(x.view(np.int16))
    for a in (bits, ibits):
        r = nf.softmax_fwd(a, dtype="bfloat16")
        assert r.dtype == np.uint16
        assert_close(r.copy_to_host().view(BF16), want)
    # float16 bits tagged explicitly, and float16 device arrays as such
    xh = draw(rng, (3, 33), F16)
    r = nf.softmax_fwd(cuda.to_device(xh.view(np.int16)), dtype="float16")
    assert r.dtype == np.float16
    assert_close(r.copy_to_host(), ref.softmax_fwd(xh))
    r = nf.softmax_fwd(cuda.to_device(xh))
    assert_close(r.copy_to_host(), ref.softmax_fwd(xh))


def test_errors():
    x = cuda.to_device(np.ones((2, 4), np.float32))
    with pytest.raises(TypeError, match="host array"):
        nf.softmax_bwd(x, np.ones((2, 4), np.float32))
    with pytest.raises(TypeError, match="host array"):
        nf.rms_norm_fwd(x, np.ones(4, np.float32))
    with pytest.raises(TypeError, match="dtype"):
        nf.softmax_fwd(cuda.to_device(np.ones((2, 4), np.uint16)))     # untagged bits
    with pytest.raises(TypeError, match="disagrees"):
        nf.softmax_fwd(x, dtype="bfloat16")
    with pytest.raises(ValueError, match="shape"):
        nf.rms_norm_fwd(x, cuda.to_device(np.ones(5, np.float32)))
    with pytest.raises(ValueError, match="overlaps|shares"):
        nf.softmax_fwd(x, out=x)
    with pytest.raises(TypeError, match="stream"):
        nf.softmax_fwd(x, stream="nope")
    # a bf16 weight as float16 bits beside bf16 x is still read as bf16 (tag rule)
    xb = cuda.to_device(np.ones((2, 4), np.uint16))
    with pytest.raises(TypeError, match="weight"):
        nf.rms_norm_fwd(xb, cuda.to_device(np.ones(4, np.float64)), dtype="bfloat16")


def test_streams(rng):
    x = draw(rng, (3, 70), F32)
    want = ref.softmax_fwd(x)
    s = cuda.stream()
    r = nf.softmax_fwd(dev(x), stream=s)
    s.synchronize()
    assert_close(r.copy_to_host(), want)
    if SIM:
        r = nf.softmax_fwd(dev(x), stream=0)
    else:
        r = nf.softmax_fwd(dev(x), stream=int(s.handle))
    cuda.synchronize()
    assert_close(r.copy_to_host(), want)
    _, dw = nf.rms_norm_bwd(dev(x), dev(x), dev(np.ones(70, np.float32)),
                            dev(np.ones(3, np.float32)), stream=s)
    s.synchronize()
    assert_close(dw.copy_to_host(), (x.astype(np.float64) ** 2).sum(0),
                 scale=(x.astype(np.float64) ** 2).sum(0))


def test_param_grads_deterministic(rng):
    d = make_case("layer_norm_bwd", rng, (3, 70), F32, ("f32", "f32"))
    a, _, _ = call_dev("layer_norm_bwd", d, F32)
    b, _, _ = call_dev("layer_norm_bwd", d, F32)
    for u, v in zip(a, b):
        assert_bits_equal(u, v, "run to run")


def _reduce_in_order(part, lanes):
    """NumPy emulation of gpu.reduce_partials' order: lane l adds rows l, l + lanes,
    ... in turn, then the lane sums are added in lane order (accumulator dtype)."""
    ng = part.shape[0]
    sums = []
    for lane in range(min(lanes, ng)):
        s = part[lane].copy()
        for g in range(lane + lanes, ng, lanes):
            s = s + part[g]
        sums.append(s)
    r = sums[0]
    for s in sums[1:]:
        r = r + s
    return r


@pytest.mark.parametrize("ng,cols", [(1, 5), (3, 70), (37, 70), (150, 9)])
@pytest.mark.parametrize("acc,out_dt", [(F32, F32), (F32, BF16), (F64, F64), (F64, F32)],
                         ids=["f32", "f32-bf16", "f64", "f64-f32"])
def test_reduce_partials_order_and_bits(rng, acc, out_dt, ng, cols):
    """dweight/dbias's second kernel: the documented fixed order, bit for bit (the
    unrolled lane loop included: ng > 4 lanes), rounded once to the output dtype."""
    part = rng.standard_normal((ng, cols)).astype(acc)
    red = gpu._aux("reduce", np.dtype(acc).type)
    st = np.uint16 if out_dt == BF16 else out_dt
    out = cuda.to_device(np.full(cols, 0x7FC1 if out_dt == BF16 else np.nan).astype(st))
    rtpb = gpu.RED_COLS * gpu.RED_LANES
    red[max(1, -(-cols // gpu.RED_COLS) // 2), rtpb](cuda.to_device(part), out)
    got = out.copy_to_host()
    got = got.view(BF16) if out_dt == BF16 else got
    want = _reduce_in_order(part, gpu.RED_LANES).astype(out_dt)
    assert_bits_equal(got, want, "reduce_partials")


# ------------------------------------------------------------------ replay
needs_replay = pytest.mark.skipif(SIM or gpu.REPLAY is None,
                                  reason="replay runs recorded numba-cuda launches (real GPU)")


def _general(fn, *a, **k):
    """fn through the general path only (replay off)."""
    gpu.REPLAY.enabled = False
    try:
        return fn(*a, **k)
    finally:
        gpu.REPLAY.enabled = True


@needs_replay
@pytest.mark.parametrize("cols", [70, 4096, 40000])
@dtypes
@pytest.mark.parametrize("op", OPS)
def test_replayed_calls_match_the_general_path(rng, op, dtype, cols):
    """Fresh arrays of one description: the first call records, later ones replay;
    every result matches the reference and, bit for bit, the general path."""
    pks = PKINDS.get(op, [None])
    pk = pks[cols % len(pks)]
    before = gpu.REPLAY.replayed
    for _ in range(4):
        d = make_case(op, rng, (5, cols), dtype, pk)
        got, _, raw = call_dev(op, d, dtype)
        check_op(op, d, got)
        want, _, _ = _general(call_dev, op, d, dtype)
        for g, w in zip(got, want):
            if w is None:
                assert g is None
            else:
                assert_bits_equal(g, w, f"{op} replayed vs general")
    assert gpu.REPLAY.replayed >= before + 2, "no call was replayed"


@needs_replay
@pytest.mark.parametrize("dtype", [F32, BF16], ids=dtype_id)
def test_replay_out_inplace_eps_and_errors(rng, dtype):
    t = tag(dtype)
    d = make_case("rms_norm_bwd", rng, (6, 4096), dtype, "x")
    D = {k: dev(v) for k, v in d.items()}
    # out= given: results land in (and are) the caller's buffer, every time
    for _ in range(3):
        o = cuda.device_array_like(D["x"])
        y, rstd = nf.rms_norm_fwd(D["x"], D["weight"], out=o, dtype=t)
        assert y is o
        check_op("rms_norm_fwd", dict(x=d["x"], weight=d["weight"]),
                 (host(o, dtype), host(rstd, F32)))
    # eps is a value, not part of the description
    for eps in (1e-6, 0.5, 3.0):
        y, rstd = nf.rms_norm_fwd(D["x"], D["weight"], eps, dtype=t)
        _, want = ref.rms_norm_fwd(d["x"], d["weight"], eps)
        assert_close(host(rstd, F32), want, scale=want, dtype=F32)
    # in place over dy, replayed: bit-identical to a separate buffer
    want, _, _ = _general(call_dev, "rms_norm_bwd", d, dtype)
    for _ in range(3):
        dy = dev(d["dy"])
        dx, dw = nf.rms_norm_bwd(dy, D["x"], D["weight"], D["rstd"], out=dy, dtype=t)
        assert dx is dy
        assert_bits_equal(host(dy, dtype), want[0], "in place, replayed")
        assert_bits_equal(host(dw, d["weight"].dtype), want[1], "dweight, replayed")
    # a description that was replayed still rejects bad calls
    x = D["x"]
    with pytest.raises(ValueError, match="out"):
        nf.rms_norm_fwd(x, D["weight"], out=x, dtype=t)
    with pytest.raises(ValueError, match="eps"):
        nf.rms_norm_fwd(x, D["weight"], -1.0, dtype=t)
    with pytest.raises(TypeError, match="eps"):
        nf.rms_norm_fwd(x, D["weight"], True, dtype=t)
    # dy and out: rows 0-5 and 1-6 of one buffer (each of the replayed description)
    big = cuda.device_array((7, 4096), D["x"].dtype)
    big[:6].copy_to_device(D["dy"])
    for _ in range(2):
        nf.rms_norm_bwd(big[:6], x, D["weight"], D["rstd"], out=big[:6], dtype=t)
    with pytest.raises(ValueError, match="overlaps"):
        nf.rms_norm_bwd(big[:6], x, D["weight"], D["rstd"], out=big[1:], dtype=t)


@needs_replay
def test_replay_streams_and_scratch_growth(rng):
    """Recordings are per stream; a scratch buffer that grew meanwhile is found anew."""
    s1, s2 = cuda.stream(), cuda.stream()
    for cols in (4096, 20000, 4096):          # 20000 grows the partial-rows scratch
        d = make_case("layer_norm_bwd", rng, (300, cols), F32, ("f32", "f32"))
        want, _, _ = _general(call_dev, "layer_norm_bwd", d, F32)
        for s in (s1, s2, s1, int(s2.handle)):
            got, _, _ = call_dev("layer_norm_bwd", d, F32, stream=s)
            cuda.synchronize()
            for g, w in zip(got, want):
                assert_bits_equal(g, w, f"stream {s}, cols {cols}")


@needs_replay
def test_replay_torch_tensors(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    x = torch.randn(64, 1024, device="cuda")
    w = torch.randn(1024, device="cuda")
    st = torch.cuda.current_stream()
    for _ in range(4):
        x.normal_()
        y, mean, rstd = nf.layer_norm_fwd(x, w, None, stream=st)
        want = torch.nn.functional.layer_norm(x, (1024,), w, eps=1e-5)
        got = torch.as_tensor(y, device="cuda")
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):              # tensors reporting another stream
        x2 = torch.randn(64, 1024, device="cuda")
        y2, _, _ = nf.layer_norm_fwd(x2, w, None, stream=side)
        side.synchronize()
        assert torch.allclose(torch.as_tensor(y2, device="cuda"),
                              torch.nn.functional.layer_norm(x2, (1024,), w, eps=1e-5),
                              atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------- hardware
@pytest.mark.skipif(SIM or not os.environ.get("NUMBA_FUSED_GPU_BIG"),
                    reason="real GPU with NUMBA_FUSED_GPU_BIG=1 (needs ~10 GB)")
@pytest.mark.parametrize("op", ["softmax_fwd", "rms_norm_bwd"])
def test_over_2_31_elements(op):
    """64-bit offsets: a bf16 tensor of 2^31 + 2^20 elements; the last rows are
    checked against the reference."""
    cols = 4096
    rows = (2 ** 31 + 2 ** 20) // cols
    rng = np.random.default_rng(0)
    tail = draw(rng, (8, cols), BF16)
    x = cuda.device_array((rows, cols), np.uint16)
    x[-8:].copy_to_device(tail.view(np.uint16))
    x[:-8].copy_to_device(np.full((rows - 8, cols), 0x3F00, np.uint16))   # 0.5
    if op == "softmax_fwd":
        y = nf.softmax_fwd(x, dtype="bfloat16")
        assert_close(y[-8:].copy_to_host().view(BF16), ref.softmax_fwd(tail))
    else:
        rstd = cuda.to_device(np.full(rows, 2.0, np.float32))
        dx, dw = nf.rms_norm_bwd(x, x, cuda.to_device(np.ones(cols, np.uint16) * 0x3F80),
                                 rstd, dtype="bfloat16")
        t64 = tail.astype(np.float64)
        want = ref.rms_norm_bwd(tail, tail, np.ones(cols), np.full(8, 2.0))[0]
        assert_close(dx[-8:].copy_to_host().view(BF16), want)
        dwf = dw.copy_to_host().view(BF16).astype(np.float64)
        expect = (rows - 8) * 0.5 * 1.0 + (t64 * t64 * 2.0).sum(0)
        assert np.allclose(dwf, expect, rtol=2 ** -7)


@pytest.mark.parametrize("loc", [1e2, 1e4])
@pytest.mark.parametrize("cols", [33, 70])            # register (two-pass) / streaming (Chan)
@pytest.mark.parametrize("dtype", [F32, F64], ids=dtype_id)
def test_layer_norm_large_mean_is_stable(rng, dtype, cols, loc):
    x = draw(rng, (3, cols), dtype, scale=1.0, loc=loc)
    d = dict(x=x, weight=None, bias=None)
    got, _, _ = call_dev("layer_norm_fwd", d, dtype)
    check_op("layer_norm_fwd", d, got)
    _, _, rr = ref.layer_norm_fwd(x)
    # the variance is that of the data (~1), not swamped by loc**2
    assert np.allclose(got[2], rr, rtol=1e-3)

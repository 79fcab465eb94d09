"""Bad arguments: TypeError (wrong kind of thing) or ValueError (wrong value),
raised before any kernel runs, with the argument's name in the message."""
import re

import numpy as np
import pytest

import numba_fused as nf
from conftest import BF16, F16, F32, F64, draw, poisoned

R, C = 4, 8
_rng = np.random.default_rng(1234)
X = draw(_rng, (R, C), F32)
DY = draw(_rng, (R, C), F32)
W = draw(_rng, (C,), F32)
B = draw(_rng, (C,), F32)
Y = nf.softmax_fwd(X)
_, RSTD_RMS = nf.rms_norm_fwd(X, W)
_, MEAN, RSTD = nf.layer_norm_fwd(X, W, B)
XH = X.astype(F16)
X64 = X.astype(F64)


def _readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def _calls(x=X, dy=DY, y=Y, w=W, b=B, mean=MEAN, rstd=RSTD, rstd_rms=RSTD_RMS, **kw):
    """All public functions with the given arguments (keywords go to each)."""
    return {
        "softmax_fwd": lambda: nf.softmax_fwd(x, **kw),
        "softmax": lambda: nf.softmax(x, **kw),
        "softmax_bwd": lambda: nf.softmax_bwd(y, dy, **kw),
        "rms_norm_fwd": lambda: nf.rms_norm_fwd(x, w, **kw),
        "rms_norm": lambda: nf.rms_norm(x, w, **kw),
        "rms_norm_bwd": lambda: nf.rms_norm_bwd(dy, x, w, rstd_rms, **kw),
        "layer_norm_fwd": lambda: nf.layer_norm_fwd(x, w, b, **kw),
        "layer_norm": lambda: nf.layer_norm(x, w, b, **kw),
        "layer_norm_bwd": lambda: nf.layer_norm_bwd(dy, x, w, b, mean, rstd, **kw),
    }


def _expect(fn, exc, name):
    with pytest.raises(Exception) as info:
        fn()
    assert type(info.value) is exc, \
        f"expected {exc.__name__}, got {info.type.__name__}: {info.value}"
    assert re.search(rf"\b{re.escape(name)}\b", str(info.value)), \
        f"message does not name {name!r}: {info.value}"


CASES = []


def case(fname, exc, name, fn, tag):
    CASES.append(pytest.param(fn, exc, name, id=f"{fname}-{tag}"))


# ------------------------------------------------------- the row inputs
BAD_DTYPES = [np.int32, np.int64, np.int16, np.uint16, np.bool_, np.complex64, np.complex128,
              object, np.float128 if hasattr(np, "float128") else np.float32, ">f4"]
BAD_DTYPES = [np.dtype(d) for d in BAD_DTYPES if np.dtype(d) != np.dtype(np.float32)]

for dt in BAD_DTYPES:
    bad = (np.arange(R * C).reshape(R, C) % 3 + 1).astype(dt)
    t = str(dt).replace(">", "be")
    case("softmax_fwd", TypeError, "x", lambda bad=bad: nf.softmax_fwd(bad), f"x-{t}")
    case("softmax_bwd", TypeError, "y", lambda bad=bad: nf.softmax_bwd(bad, bad), f"y-{t}")
    case("rms_norm_fwd", TypeError, "x", lambda bad=bad: nf.rms_norm_fwd(bad), f"x-{t}")
    case("rms_norm_bwd", TypeError, "x",
         lambda bad=bad: nf.rms_norm_bwd(bad, bad, None, RSTD_RMS), f"x-{t}")
    case("rms_norm_bwd", TypeError, "dy",
         lambda bad=bad: nf.rms_norm_bwd(bad, X, None, RSTD_RMS), f"dy-{t}")
    case("layer_norm_fwd", TypeError, "x", lambda bad=bad: nf.layer_norm_fwd(bad), f"x-{t}")
    case("layer_norm_bwd", TypeError, "dy",
         lambda bad=bad: nf.layer_norm_bwd(bad, X, None, None, MEAN, RSTD), f"dy-{t}")
    case("softmax_bwd", TypeError, "dy", lambda bad=bad: nf.softmax_bwd(Y, bad), f"dy-{t}")

for fname, fn in _calls(x=[[1.0, 2.0]]).items():
    if not fname.endswith("bwd"):
        case(fname, TypeError, "x", fn, "x-list")
case("softmax_bwd", TypeError, "y", lambda: nf.softmax_bwd(Y.tolist(), DY), "y-list")
case("softmax_bwd", TypeError, "dy", lambda: nf.softmax_bwd(Y, DY.tolist()), "dy-list")
case("rms_norm_bwd", TypeError, "dy", lambda: nf.rms_norm_bwd(DY.tolist(), X, W, RSTD_RMS),
     "dy-list")
case("rms_norm_bwd", TypeError, "x", lambda: nf.rms_norm_bwd(DY, 3.0, W, RSTD_RMS), "x-float")
case("layer_norm_bwd", TypeError, "x",
     lambda: nf.layer_norm_bwd(DY, X.tolist(), W, B, MEAN, RSTD), "x-list")
case("softmax_fwd", TypeError, "x", lambda: nf.softmax_fwd(None), "x-None")
case("softmax_fwd", TypeError, "x", lambda: nf.softmax_fwd(np.float32(1.0)), "x-npscalar")

zero_d = np.array(1.5, np.float32)
for fname, fn in _calls(x=zero_d, y=zero_d, dy=zero_d, w=None, b=None).items():
    if fname in ("softmax_bwd",):
        case(fname, ValueError, "y", fn, "0d")
    elif not fname.endswith("bwd"):
        case(fname, ValueError, "x", fn, "0d")
case("rms_norm_bwd", ValueError, "x",
     lambda: nf.rms_norm_bwd(zero_d, zero_d, None, np.array(1.0, np.float32)), "0d")

# shapes disagree
DY_T = draw(_rng, (C, R), F32)
case("softmax_bwd", ValueError, "dy", lambda: nf.softmax_bwd(Y, DY_T), "dy-shape")
case("softmax_bwd", ValueError, "dy", lambda: nf.softmax_bwd(Y, DY[:, :-1]), "dy-cols")
case("softmax_bwd", ValueError, "dy", lambda: nf.softmax_bwd(Y, DY[None]), "dy-ndim")
case("rms_norm_bwd", ValueError, "dy", lambda: nf.rms_norm_bwd(DY[:-1], X, W, RSTD_RMS),
     "dy-shape")
case("layer_norm_bwd", ValueError, "dy",
     lambda: nf.layer_norm_bwd(DY[:, :-1], X, W, B, MEAN, RSTD), "dy-shape")
# dtypes disagree (each supported on its own)
case("softmax_bwd", TypeError, "dy", lambda: nf.softmax_bwd(Y, DY.astype(F64)), "dy-dtype")
case("rms_norm_bwd", TypeError, "dy",
     lambda: nf.rms_norm_bwd(DY.astype(BF16), X, W, RSTD_RMS), "dy-dtype")
case("layer_norm_bwd", TypeError, "dy",
     lambda: nf.layer_norm_bwd(DY.astype(F16), X, W, B, MEAN, RSTD), "dy-dtype")

# ------------------------------------------------------- weight / bias
for pname in ("weight", "bias"):
    for tag, bad, exc in [("len", W[:-1], ValueError), ("len+", np.ones(C + 1, F32), ValueError),
                          ("2d", W[None], ValueError), ("0d", np.array(1.0, F32), ValueError),
                          ("f64", W.astype(F64), TypeError), ("f16", W.astype(F16), TypeError),
                          ("int", np.ones(C, np.int32), TypeError),
                          ("bool", np.ones(C, bool), TypeError),
                          ("list", W.tolist(), TypeError)]:
        kw = {"w": bad} if pname == "weight" else {"b": bad}
        for fname, fn in _calls(**kw).items():
            if pname == "bias" and not fname.startswith("layer"):
                continue
            if fname.startswith("softmax"):
                continue
            case(fname, exc, pname, fn, f"{pname}-{tag}")
# f16 x with a bf16 (neither x's dtype nor float32) or float64 weight
case("rms_norm_fwd", TypeError, "weight", lambda: nf.rms_norm_fwd(XH, W.astype(BF16)),
     "weight-bf16-for-f16")
case("layer_norm_fwd", TypeError, "bias", lambda: nf.layer_norm_fwd(XH, None, B.astype(F64)),
     "bias-f64-for-f16")
case("layer_norm_fwd", TypeError, "weight",
     lambda: nf.layer_norm_fwd(X64, W.astype(F16), None), "weight-f16-for-f64")

# ------------------------------------------------------- statistics
for sname in ("mean", "rstd"):
    for tag, bad, exc in [("f64", MEAN.astype(F64), TypeError),
                          ("f16", MEAN.astype(F16), TypeError),
                          ("short", MEAN[:-1], ValueError), ("2d", MEAN[:, None], ValueError),
                          ("full", X, ValueError), ("list", MEAN.tolist(), TypeError)]:
        case("layer_norm_bwd", exc, sname, lambda bad=bad, s=sname: nf.layer_norm_bwd(
            DY, X, W, B, bad if s == "mean" else MEAN, bad if s == "rstd" else RSTD),
            f"{sname}-{tag}")
    if sname == "rstd":
        for tag, bad, exc in [("f64", RSTD_RMS.astype(F64), TypeError),
                              ("int", RSTD_RMS.astype(np.int32), TypeError),
                              ("short", RSTD_RMS[:-1], ValueError),
                              ("list", RSTD_RMS.tolist(), TypeError)]:
            case("rms_norm_bwd", exc, "rstd",
                 lambda bad=bad: nf.rms_norm_bwd(DY, X, W, bad), f"rstd-{tag}")
# float64 x needs float64 statistics
case("rms_norm_bwd", TypeError, "rstd",
     lambda: nf.rms_norm_bwd(DY.astype(F64), X64, None, RSTD_RMS), "rstd-f32-for-f64")
case("layer_norm_bwd", TypeError, "mean",
     lambda: nf.layer_norm_bwd(DY.astype(F64), X64, None, None, MEAN, RSTD.astype(F64)),
     "mean-f32-for-f64")
# half x: float32 statistics
case("rms_norm_bwd", TypeError, "rstd",
     lambda: nf.rms_norm_bwd(XH, XH, None, RSTD_RMS.astype(F16)), "rstd-f16-for-f16")

# ------------------------------------------------------- eps
for fname in ("rms_norm_fwd", "rms_norm", "layer_norm_fwd", "layer_norm"):
    f = getattr(nf, fname)
    for tag, eps, exc in [("neg", -1e-6, ValueError), ("nan", float("nan"), ValueError),
                          ("inf", float("inf"), ValueError), ("-inf", -float("inf"), ValueError),
                          ("npnan", np.float32("nan"), ValueError),
                          ("str", "1e-5", TypeError), ("None", None, TypeError),
                          ("bool", True, TypeError), ("complex", 1e-5 + 0j, TypeError),
                          ("array", np.array([1e-5]), TypeError)]:
        case(fname, exc, "eps", lambda f=f, eps=eps: f(X, None, eps=eps), f"eps-{tag}")

# ------------------------------------------------------- out
FWD = ("softmax_fwd", "softmax", "rms_norm_fwd", "rms_norm", "layer_norm_fwd", "layer_norm")
for tag, out, exc in [("shape", np.empty((R, C + 1), F32), ValueError),
                      ("transposed-shape", np.empty((C, R), F32), ValueError),
                      ("1d", np.empty(R * C, F32), ValueError),
                      ("dtype", np.empty((R, C), F64), TypeError),
                      ("bf16", np.empty((R, C), BF16), TypeError),
                      ("int", np.empty((R, C), np.int32), TypeError),
                      ("readonly", _readonly(X), ValueError),
                      ("list", X.tolist(), TypeError)]:
    for fname, fn in _calls(out=out).items():
        case(fname, exc, "out", fn, f"out-{tag}")

# out aliasing an input other than dy
for fname in FWD:
    f = getattr(nf, fname)
    xc = X.copy()
    case(fname, ValueError, "out", lambda f=f, xc=xc: f(xc, out=xc), "out-is-x")
    xc2 = X.copy()
    case(fname, ValueError, "out",
         lambda f=f, xc2=xc2: f(xc2[:, ::-1], out=xc2), "out-overlaps-x")
buf2 = np.ones((R, C), F32)
case("rms_norm_fwd", ValueError, "out", lambda: nf.rms_norm_fwd(X, buf2[1], out=buf2),
     "out-overlaps-weight")
buf3 = np.ones((R, C), F32)
case("layer_norm_fwd", ValueError, "out",
     lambda: nf.layer_norm_fwd(X, None, buf3[0], out=buf3), "out-overlaps-bias")
for fname, mk in [
        ("softmax_bwd", lambda y, dy, o: nf.softmax_bwd(y, dy, out=o)),
        ("rms_norm_bwd", lambda y, dy, o: nf.rms_norm_bwd(dy, y, None, RSTD_RMS, out=o)),
        ("layer_norm_bwd", lambda y, dy, o: nf.layer_norm_bwd(dy, y, None, None, MEAN, RSTD,
                                                              out=o))]:
    yc, dyc = Y.copy(), DY.copy()
    # out is the first input (y / x), not dy
    case(fname, ValueError, "out", lambda mk=mk, yc=yc, dyc=dyc: mk(yc, dyc, yc), "out-is-y/x")
    dyc2 = DY.copy()
    # out overlaps dy without being dy (reversed / shifted views)
    case(fname, ValueError, "out",
         lambda mk=mk, dyc2=dyc2: mk(Y, dyc2, dyc2[::-1]), "out-reversed-dy")
    big = np.ones((R + 1, C), F32)
    case(fname, ValueError, "out",
         lambda mk=mk, big=big: mk(Y, big[1:], big[:-1]), "out-shifted-dy")
m2 = MEAN.copy()
case("layer_norm_bwd", ValueError, "out",
     lambda: nf.layer_norm_bwd(DY, X, W, B, m2, RSTD, out=np.broadcast_to(m2[:, None], (R, C))),
     "out-broadcast-readonly")
r2 = np.ones((R, C), F32)
case("rms_norm_bwd", ValueError, "out",
     lambda: nf.rms_norm_bwd(DY, X, r2[0], RSTD_RMS, out=r2), "out-overlaps-weight")

# ------------------------------------------------------- stream / dtype tags
for fname, fn in _calls(stream=0).items():
    case(fname, ValueError, "stream", fn, "stream-0")
for fname, fn in _calls(dtype=np.float64).items():
    case(fname, TypeError, "dtype", fn, "dtype-tag")


@pytest.mark.parametrize("fn,exc,name", CASES)
def test_bad_argument(fn, exc, name):
    _expect(fn, exc, name)


# ------------------------------------------------------- before any kernel
def test_checks_run_before_kernels():
    """A bad later argument leaves out untouched: no kernel ran."""
    out = poisoned((R, C), F32)
    with pytest.raises(TypeError):
        nf.rms_norm_bwd(DY, X, W, RSTD_RMS.astype(F64), out=out)
    assert np.all(np.isnan(out))
    with pytest.raises(ValueError):
        nf.layer_norm_fwd(X, W, B, eps=-1.0, out=out)
    assert np.all(np.isnan(out))
    with pytest.raises(ValueError):
        nf.layer_norm_bwd(DY, X, W, B, MEAN, RSTD[:-1], out=out)
    assert np.all(np.isnan(out))
    with pytest.raises(ValueError):
        nf.softmax_fwd(X, out=out, stream=1)
    assert np.all(np.isnan(out))
    with pytest.raises(TypeError):
        nf.layer_norm_fwd(X, W, B.astype(F64), out=out)
    assert np.all(np.isnan(out))


@pytest.mark.parametrize("eps", [0, 0.0, 1, np.float32(1e-3), np.float64(1e-7), 1e-30])
def test_good_eps_values(eps):
    """Non-negative finite reals, ints and NumPy scalars included, are accepted."""
    y, rstd = nf.rms_norm_fwd(X, None, eps)
    want = 1 / np.sqrt((X.astype(np.float64) ** 2).mean(-1) + float(eps))
    assert np.allclose(rstd, want, rtol=1e-5)
    nf.layer_norm_fwd(X, None, None, eps)


def test_good_edge_arguments():
    """Legal corner cases are not rejected: f32 weights for half and f64 x,
    out=dy, a disjoint out, and 1-D x."""
    nf.rms_norm_fwd(XH, W)
    nf.layer_norm_fwd(X64, W, B)
    nf.layer_norm_fwd(X.astype(BF16), W.astype(BF16), B)
    dy = DY.copy()
    nf.softmax_bwd(Y, dy, out=dy)
    buf = np.ones((R + 1, C), F32)
    nf.rms_norm_fwd(X, buf[0], out=buf[1:])      # weight and out in one buffer, disjoint
    nf.softmax_fwd(X[0], out=np.empty(C, F32))


@pytest.mark.parametrize("x, want", [(X, "expected x's dtype float32"),
                                     (XH, "expected x's dtype float16 or float32")])
def test_param_dtype_message_names_the_allowed_dtypes(x, want):
    """Each allowed dtype once: float32 x accepts float32 only (not 'float32 or
    float32'); half and float64 x also accept float32."""
    with pytest.raises(TypeError) as e:
        nf.rms_norm_fwd(x, W.astype(BF16))          # bfloat16: neither x's dtype nor float32
    msg = str(e.value)
    assert msg.startswith("weight has dtype") and msg.endswith(want)

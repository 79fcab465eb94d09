"""The vectorizable exp and max (numba_fused._vecmath) against float64 NumPy.

Bounds from the CPU-speed issue: <= 2 ulp in float32, <= 1e-15 relative in
float64 (tested as <= 2 ulp, which is stricter: 2 ulp <= 4.5e-16 relative), with
ulps measured at the float64 reference with the subnormal floor, so gradual
underflow is checked too. Exactly 0 at -inf, +inf on overflow, NaN in, NaN out.
"""
import numpy as np
import pytest
from numba import njit

from numba_fused import _vecmath as V
from numba_fused._lanes import (_AVX512, lanes_count, lanes_load, lanes_load_like, lanes_store,
                                wide_lanes_zeros)

from conftest import ulp


def _vectorized(fn):
    @njit
    def apply(x):
        out = np.empty_like(x)
        for i in range(x.shape[0]):
            out[i] = fn(x[i])
        return out
    return apply


EXP = {"exp": (_vectorized(V.exp_f32), _vectorized(V.exp_f64)),
       "exp_nonpos": (_vectorized(V.exp_nonpos_f32), _vectorized(V.exp_nonpos_f64)),
       # exp_nonpos without AVX-512 (the table exps' permutes are AVX-512's)
       "exp_nonpos_poly": (_vectorized(V.exp_nonpos_f32_poly),
                           _vectorized(V.exp_nonpos_f64_poly))}


def _args(dtype, kind, n=400_000):
    """Every range that matters: a dense sweep over the whole finite domain of
    the result (normal and subnormal), random values, and integer multiples of
    ln2 (where the reduction's rounding to n flips), with their neighbours."""
    fi = np.finfo(dtype)
    lo = float(np.log(fi.smallest_subnormal)) - 1.0
    hi = 0.0 if kind.startswith("exp_nonpos") else float(np.log(fi.max))
    rng = np.random.default_rng(7)
    # the table exps (x <= 0) reduce by ln2/16: their n flips there
    step = np.log(2) / (16 if kind == "exp_nonpos" else 1)
    ln2 = np.arange(np.ceil(lo / step), np.floor(hi / step) + 1) * step
    ln2_half = ln2 + 0.5 * step
    x = np.concatenate([np.linspace(lo, hi, n), rng.uniform(lo, hi, n // 4),
                        rng.uniform(-1, 1, n // 8) * (1.0 if kind == "exp" else -1.0),
                        ln2, ln2_half]).astype(dtype)
    x = np.concatenate([x, np.nextafter(x, dtype(-np.inf)), np.nextafter(x, dtype(np.inf))])
    return x[(x >= lo) & (x <= hi)]


@pytest.mark.parametrize("kind", sorted(EXP))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_accuracy_in_ulps(kind, dtype):
    fn = EXP[kind][dtype == np.float64]
    x = _args(dtype, kind)
    got = fn(x).astype(np.float64)
    if dtype == np.float64:
        # exact float64 reference: NumPy's exp is correctly rounded to within 1 ulp;
        # compare in long double where the platform has it
        ref = np.exp(x.astype(np.longdouble))
    else:
        ref = np.exp(x.astype(np.float64))
    keep = ref < np.finfo(dtype).max      # above it the result is inf: special values
    x, got, ref = x[keep], got[keep], ref[keep]
    err = np.abs(got - ref) / ulp(np.asarray(ref, np.float64), dtype)
    worst = int(np.argmax(err))
    assert err[worst] <= 2.0, f"{kind} {dtype.__name__}: {err[worst]:.2f} ulp at x={x[worst]!r}"
    # and not trivially: most results are correctly rounded
    assert np.mean(err <= 0.5 + 1e-9) > 0.8


@pytest.mark.parametrize("kind", sorted(EXP))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_exp_special_values(kind, dtype):
    fn = EXP[kind][dtype == np.float64]
    fi = np.finfo(dtype)
    x = np.array([-np.inf, np.nan, -np.nan, 0.0, -0.0, -1e30 if dtype == np.float32 else -1e300,
                  float(np.log(fi.smallest_subnormal)) - 1.0], dtype)
    got = fn(x)
    assert got[0] == 0.0 and not np.signbit(got[0])
    assert np.isnan(got[1]) and np.isnan(got[2])
    assert got[3] == 1.0 and got[4] == 1.0
    assert got[5] == 0.0 and got[6] == 0.0
    sub = np.array([np.log(fi.tiny) - 3.0], dtype)    # a subnormal result, not flushed
    assert 0.0 < fn(sub)[0] < fi.tiny
    if kind == "exp":
        big = np.array([np.inf, float(np.log(fi.max)) + 1.0, 1e30], dtype)
        assert np.all(fn(big) == np.inf)
        top = np.array([np.log(fi.max) - 1e-3], dtype)
        assert np.isfinite(fn(top)[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fmax_skipnan_running_max_ignores_nan(rng, dtype):
    """fmax_skipnan(a, m): a where a > m, else m (a NaN a keeps m). A running
    maximum over any order of the elements is the maximum of the non-NaN ones,
    -inf when there are none; the assembly is one vmaxps (no blends)."""
    f = njit(lambda a, m: V.fmax_skipnan(a, m))
    assert f(dtype(3.0), dtype(2.0)) == 3.0 and f(dtype(1.0), dtype(2.0)) == 2.0
    assert f(dtype(np.nan), dtype(2.0)) == 2.0
    assert f(dtype(np.inf), dtype(2.0)) == np.inf
    assert f(dtype(-np.inf), dtype(-np.inf)) == -np.inf

    @njit
    def running(v):
        m = v.dtype.type(-np.inf)
        for c in range(v.shape[0]):
            m = V.fmax_skipnan(v[c], m)
        return m
    v = rng.standard_normal(257).astype(dtype)
    v[[3, 100, 256]] = np.nan
    want = np.nanmax(v)
    for _ in range(5):
        assert running(rng.permutation(v)) == want
    assert running(np.full(9, np.nan, dtype)) == -np.inf
    asm = f.inspect_asm(f.signatures[0])
    assert "vmaxs" in asm and "blend" not in asm


def _lanes_exp_nonpos(wide):
    @njit
    def apply(x, out):
        z = wide_lanes_zeros(x) if wide else lanes_load(x, 0, 0)
        n = lanes_count(z)
        for c in range(0, x.shape[0], n):
            k = min(n, x.shape[0] - c)
            lanes_store(out, c, V.fexp_nonpos(lanes_load_like(x, c, k, z)), k)
    return apply


@pytest.mark.parametrize("wide", [False, True], ids=["lanes", "wide_lanes"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lanes_exp_nonpos_bits_equal_scalar(dtype, wide):
    """In lanes (the softmax's exp) the 2**n scaling is one vscalef where the CPU
    has AVX-512, the shifts and two multiplies elsewhere and for scalars: both
    round p * 2**n once, so every result has the scalar function's bits,
    subnormal results, 0 at -inf and NaN included."""
    x = np.concatenate([_args(dtype, "exp_nonpos"),
                        np.array([-np.inf, np.nan, 0.0, -0.0, -1e30], dtype)])
    want = EXP["exp_nonpos"][dtype == np.float64](x)
    out = np.full_like(x, 7.0)
    fn = _lanes_exp_nonpos(wide)
    fn(x, out)
    bits = np.uint32 if dtype == np.float32 else np.uint64
    same = (out.view(bits) == want.view(bits)) | (np.isnan(out) & np.isnan(want))
    assert same.all(), f"{(~same).sum()} differ, first at x={x[~same][0]!r}"
    assert np.count_nonzero((want > 0) & (want < np.finfo(dtype).tiny)) > 1000
    if _AVX512:
        asm = fn.inspect_asm(fn.signatures[0])
        assert "vscalef" in asm and "vpslld" not in asm and "vpsllq" not in asm
        # the table exp's lookup: one permute per vector (where the width has one)
        if dtype == np.float32:
            assert "vpermps" in asm or "vpermi2ps" in asm or "vpermt2ps" in asm
        elif wide:
            assert "vpermi2pd" in asm or "vpermt2pd" in asm

"""numba_fused._dtypes: the in-kernel conversions, bit-exact against NumPy and
ml_dtypes, and the dtype policy helpers."""
import numpy as np
import pytest
from numba import njit

from numba_fused import _dtypes as D
from conftest import BF16, F16, F32, F64


@njit(cache=False)
def _widen_all(a):
    out = np.empty(a.size, np.float32)
    for i in range(a.size):
        out[i] = D.widen(a[i])
    return out


@njit(cache=False)
def _widen_any(a, out):
    for i in range(a.size):
        out[i] = D.widen(a[i])


@njit(cache=False)
def _narrow_all(v, out):
    for i in range(v.size):
        out[i] = D.narrow(v[i], out)


@njit(cache=False)
def _acc_of(arr, value):
    return D.acc(arr, value)


@njit(cache=False)
def _bitcasts(f, d):
    return (D.f32_as_i32(f), D.i32_as_f32(D.f32_as_i32(f)),
            D.f64_as_i64(d), D.i64_as_f64(D.f64_as_i64(d)))


ALL16 = np.arange(1 << 16, dtype=np.uint16)


def _assert_widened(got, want, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    nan = np.isnan(want)
    # NaN patterns: NaN-ness only (the f16 up-conversion quiets signalling NaNs)
    assert np.array_equal(np.isnan(got), nan), f"{what}: NaN mismatch"
    gb, wb = got.view(np.uint32)[~nan], want.view(np.uint32)[~nan]
    bad = np.nonzero(gb != wb)[0]
    assert bad.size == 0, f"{what}: {bad.size} patterns differ, e.g. {gb[bad[:5]]} vs {wb[bad[:5]]}"


def test_widen_f16_all_patterns():
    bits = ALL16.view(np.int16)
    _assert_widened(_widen_all(bits), ALL16.view(np.float16).astype(np.float32), "f16->f32")


def test_widen_bf16_all_patterns():
    _assert_widened(_widen_all(ALL16), ALL16.view(BF16).astype(np.float32), "bf16->f32")


def test_widen_bf16_is_a_shift():
    """bf16 widening keeps NaN payloads too (it is a 16-bit shift)."""
    got = _widen_all(ALL16).view(np.uint32)
    assert np.array_equal(got, ALL16.astype(np.uint32) << 16)


def test_widen_f16_nan_patterns_are_nan():
    nan_bits = ALL16[np.isnan(ALL16.view(np.float16))]
    assert nan_bits.size == 2 * 1023
    assert np.all(np.isnan(_widen_all(nan_bits.view(np.int16))))


def _f32_cases():
    """Random float32 bit patterns (every class: subnormal, normal, inf, NaN),
    random values across the half ranges, and the rounding edge cases: every
    half value, the midpoints between neighbours (ties to even), just above and
    below each midpoint, the overflow threshold, signed zeros and subnormals."""
    rng = np.random.default_rng(2026)
    parts = [rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32),
             rng.standard_normal(1 << 16).astype(np.float32) * np.float32(1e3),
             (rng.standard_normal(1 << 16) * 1e-5).astype(np.float32),
             (rng.standard_normal(1 << 16) * 1e-38).astype(np.float32)]
    for half in (np.float16, BF16):
        with np.errstate(invalid="ignore"):
            vals = ALL16.view(half).astype(np.float64)
        vals = vals[np.isfinite(vals)]
        vals = np.unique(vals)
        mids = (vals[:-1] + vals[1:]) / 2            # exact in float64, and in f32
        mids32 = mids.astype(np.float32)
        parts += [vals.astype(np.float32), mids32,
                  np.nextafter(mids32, np.float32(np.inf)),
                  np.nextafter(mids32, np.float32(-np.inf))]
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65519.996, 65520.0, 65536.0,
               -65520.0, 3.3895314e38, 3.39e38, np.finfo(np.float32).max,
               np.finfo(np.float32).tiny, np.finfo(np.float32).smallest_subnormal,
               2.0 ** -24, 2.0 ** -25, 2.0 ** -25 * 1.0000001, 2.0 ** -26, 6.1035156e-05,
               2.0 ** -133, 2.0 ** -134, 2.0 ** -126]
    parts.append(np.array(special + [-s for s in special], np.float32))
    # signalling and payload NaNs
    parts.append(np.array([0x7F800001, 0x7FA00000, 0xFF800001, 0x7FC00001, 0xFFFFFFFF],
                          np.uint32).view(np.float32))
    return np.concatenate(parts)


F32_CASES = _f32_cases()


@pytest.mark.parametrize("half,storage", [(F16, np.int16), (BF16, np.uint16)], ids=["f16", "bf16"])
def test_narrow_f32_to_half(half, storage):
    v = F32_CASES
    out = np.empty(v.size, storage)
    _narrow_all(v, out)
    with np.errstate(over="ignore", invalid="ignore"):
        want = v.astype(half)
    got = out.view(half)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), "NaN mismatch"
    gb = got.view(np.uint16)[~nan]
    wb = want.view(np.uint16)[~nan]
    bad = np.nonzero(gb != wb)[0]
    assert bad.size == 0, (f"{bad.size} values round differently, e.g. "
                           f"{v[~nan][bad[:5]]}: {gb[bad[:5]]} vs {wb[bad[:5]]}")


def test_narrow_bf16_nan_stays_quiet_nan():
    nans = np.array([0x7F800001, 0x7FA00000, 0xFF800001, 0x7FC00000, 0x7FFFFFFF, 0xFFC12345],
                    np.uint32).view(np.float32)
    out = np.empty(nans.size, np.uint16)
    _narrow_all(nans, out)
    assert np.all(np.isnan(out.view(BF16)))
    assert np.all(out & 0x0040), "bf16 NaN must be quiet"
    assert np.array_equal(out >> 15, nans.view(np.uint32) >> 31), "NaN sign lost"


def test_round_trip_half_exact():
    """widen then narrow is the identity on every non-NaN half pattern."""
    for bits, storage in ((ALL16.view(np.int16), np.int16), (ALL16, np.uint16)):
        out = np.empty(bits.size, storage)
        _narrow_all(_widen_all(bits), out)
        half = F16 if storage is np.int16 else BF16
        keep = ~np.isnan(bits.view(half))
        assert np.array_equal(out[keep], bits[keep])


def test_float_storage_passthrough():
    rng = np.random.default_rng(7)
    v64 = rng.standard_normal(1000) * 1e5
    out64 = np.empty(1000, np.float64)
    _widen_any(v64, out64)
    assert np.array_equal(out64, v64)
    v32 = v64.astype(np.float32)
    out32 = np.empty(1000, np.float32)
    _widen_any(v32, out32)
    assert np.array_equal(out32.view(np.uint32), v32.view(np.uint32))
    # narrow into float32 storage is a float32 rounding; into float64 exact
    n32 = np.empty(1000, np.float32)
    _narrow_all(v64, n32)
    assert np.array_equal(n32, v64.astype(np.float32))
    n64 = np.empty(1000, np.float64)
    _narrow_all(v64, n64)
    assert np.array_equal(n64, v64)


def test_acc_types():
    assert isinstance(_acc_of(np.zeros(1, np.float64), 1), float)
    v = _acc_of(np.zeros(1, np.int16), 1.1)
    assert v == np.float32(1.1)
    assert _acc_of(np.zeros(1, np.uint16), 1.1) == np.float32(1.1)
    assert _acc_of(np.zeros(1, np.float32), 1.1) == np.float32(1.1)
    assert _acc_of(np.zeros(1, np.float64), 1.1) == 1.1


def test_bitcasts():
    i, f, j, d = _bitcasts(np.float32(-1.5), -2.25)
    assert i == np.float32(-1.5).view(np.int32)
    assert f == np.float32(-1.5)
    assert j == np.float64(-2.25).view(np.int64)
    assert d == -2.25


def test_policy_helpers():
    assert D.SUPPORTED == (F32, F64, F16, BF16)
    assert D.storage_dtype(np.float16) == np.int16
    assert D.storage_dtype(BF16) == np.uint16
    assert D.storage_dtype(np.float32) == np.float32
    assert D.storage_dtype(np.float64) == np.float64
    for dt in (F32, F16, BF16):
        assert D.acc_dtype(dt) == F32
    assert D.acc_dtype(F64) == F64
    for dt in D.SUPPORTED:
        a = np.arange(6, dtype=np.float32).astype(dt).reshape(2, 3)[:, ::2]
        s = D.to_storage(a)
        assert s.dtype == D.storage_dtype(dt)
        assert np.shares_memory(s, a) and s.shape == a.shape and s.strides == a.strides
        back = D.from_storage(s, dt)
        assert back.dtype == dt and np.array_equal(back.astype(np.float64), a.astype(np.float64))

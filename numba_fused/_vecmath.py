"""Vectorizable math for the accumulator types: ``fexp`` and ``fmax``.

numba has no SVML: ``np.exp`` is a scalar libm call that stops LLVM from
vectorizing the softmax loops, and a ``v if v > m else m`` max does not vectorize
without nnan. ``fmax`` is LLVM's ``llvm.maximum`` (IEEE maximum: NaN propagates),
which vectorizes as a reduction.

exp(x) = 2**n * exp(r) with n = rint(x / ln2), r = x - n*ln2 (Cody-Waite split
of ln2, |r| <= ln2/2), exp(r) by a polynomial, and 2**n applied as two exact
power-of-two factors so results down to the smallest subnormal come out right.
No branches: clamping and the integer part are selects and bit tricks, so the
body vectorizes. Accuracy: <= 1 ulp (float32, Cephes coefficients),
<= 2 ulp (float64, degree-13 Taylor on |r| <= 0.347; truncation < 5e-18).
exp(-inf) = +0 exactly, overflow gives +inf, NaN propagates.

Compiled without 'reassoc': the magic-number rounding ``(t + M) - M`` must not
be folded away.
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

_MAGIC32 = 12582912.0            # 1.5 * 2**23: adding it rounds to an integer
_MAGIC64 = 6755399441055744.0    # 1.5 * 2**52
_LOG2E = 1.4426950408889634


def _scale_intrinsic(fty, ity, bits, bias, magic):
    """p * 2**n where n is the integer held in the mantissa of t = n + magic."""
    magic_bits = int(np.array(magic, dtype=np.float32 if bits == 32 else np.float64)
                     .view(np.int32 if bits == 32 else np.int64))
    llf = ir.FloatType() if bits == 32 else ir.DoubleType()
    lli = ir.IntType(bits)
    mant = 23 if bits == 32 else 52

    @intrinsic
    def scale(typingctx, p, t):
        if p != fty or t != fty:
            return None

        def codegen(context, builder, sig, args):
            p, t = args
            n = builder.sub(builder.bitcast(t, lli), ir.Constant(lli, magic_bits))
            n1 = builder.ashr(n, ir.Constant(lli, 1))
            n2 = builder.sub(n, n1)

            def pow2(k):
                e = builder.shl(builder.add(k, ir.Constant(lli, bias)), ir.Constant(lli, mant))
                return builder.bitcast(e, llf)
            return builder.fmul(builder.fmul(p, pow2(n1)), pow2(n2))
        return fty(fty, fty), codegen
    return scale


@intrinsic
def _clamp(typingctx, x, lo, hi):
    """min(max(x, lo), hi) as two selects (no branches, so loops vectorize);
    NaN fails both comparisons and passes through."""
    if not (x == lo == hi and isinstance(x, types.Float)):
        return None

    def codegen(context, builder, sig, args):
        x, lo, hi = args
        x = builder.select(builder.fcmp_ordered('>', x, hi), hi, x)
        return builder.select(builder.fcmp_ordered('<', x, lo), lo, x)
    return x(x, x, x), codegen


_scale32 = _scale_intrinsic(types.float32, types.int32, 32, 127, _MAGIC32)
_scale64 = _scale_intrinsic(types.float64, types.int64, 64, 1023, _MAGIC64)

_FLAGS = {'nsz'}   # no 'contract': see cpu.FLAGS


@njit(fastmath=_FLAGS, cache=True)
def exp_f32(x):
    """exp for float32 (see module docstring)."""
    x = _clamp(x, np.float32(-104.0), np.float32(89.0))
    t = x * np.float32(_LOG2E) + np.float32(_MAGIC32)
    n = t - np.float32(_MAGIC32)
    r = x - n * np.float32(0.693359375)
    r = r - n * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * (r * r) + r + np.float32(1.0)
    return _scale32(p, t)


@njit(fastmath=_FLAGS, cache=True)
def exp_f64(x):
    """exp for float64 (see module docstring)."""
    x = _clamp(x, -746.0, 710.0)
    t = x * _LOG2E + _MAGIC64
    n = t - _MAGIC64
    r = x - n * 6.93147180369123816490e-01
    r = r - n * 1.90821492927058770002e-10
    p = 1.0 / 6227020800.0
    p = p * r + 1.0 / 479001600.0
    p = p * r + 1.0 / 39916800.0
    p = p * r + 1.0 / 3628800.0
    p = p * r + 1.0 / 362880.0
    p = p * r + 1.0 / 40320.0
    p = p * r + 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * (r * r) + r + 1.0
    return _scale64(p, t)


@intrinsic
def fmax(typingctx, a, b):
    """IEEE-754 maximum of two floats of one type; NaN if either is NaN."""
    if not (a == b and isinstance(a, types.Float)):
        return None

    def codegen(context, builder, sig, args):
        ty = args[0].type
        fn = builder.module.declare_intrinsic("llvm.maximum", [ty],
                                              ir.FunctionType(ty, [ty, ty]))
        return builder.call(fn, args)
    return a(a, a), codegen


def fexp(x):
    """exp in x's (accumulator) float type; jitted code only."""
    raise NotImplementedError


@overload(fexp)
def _fexp(x):
    if x == types.float32:
        return lambda x: exp_f32(x)
    if x == types.float64:
        return lambda x: exp_f64(x)
    return None

"""Vectorizable math for the accumulator types: ``fexp`` and ``fmax_skipnan``.

numba has no SVML: ``np.exp`` is a scalar libm call that stops LLVM from
vectorizing the softmax loops. ``fmax_skipnan`` is a select, one ``vmaxps``, for
running maxima in explicit lanes (``_lanes``).

exp(x) = 2**n * exp(r) with n = rint(x / ln2), r = x - n*ln2 (Cody-Waite split
of ln2 in two FMAs, |r| <= ln2/2), exp(r) by a Horner polynomial of FMAs, and
2**n applied as exact power-of-two factors so results down to the smallest
subnormal come out right. No branches: clamping and the integer part are selects
and bit tricks, so the body vectorizes. ``exp_nonpos`` (softmax's exp(x - max),
whose argument is <= 0) drops the upper clamp and scales in 5 instructions instead
of 8: 0.24 vs 0.39 ns per element for the softmax exp-sum pass (float32, one core);
in lanes on AVX-512 in one, ``vscalefps``/``vscalefpd``, which rounds p * 2**n
once as well, so the bits are the same (the bfloat16 softmax forward, compute-bound,
gained 1.06-1.14x, 2026-12-05).
Accuracy (tests/test_vecmath.py, measured): <= 1.0 ulp in float32 (Cephes
coefficients) and float64 (degree-13 Taylor on |r| <= 0.347; truncation < 5e-18),
over 91% correctly rounded. On AVX-512 float32's ``exp_nonpos`` reduces by ln2/16
instead and reads 2**(j/16) from a 16-entry table with one vector permute
(``exp_nonpos_f32_table``): a degree-3 polynomial, 11 vector operations per
vector instead of 14, <= 1.06 ulp, 82% correctly rounded; the bfloat16 softmax
forward, bound by its arithmetic, gained 1.08-1.15x (2026-12-06). float64's
likewise (``exp_nonpos_f64_table``, degree 7, the table's rounding error added
from a second table): 13 operations of the FMA pipes per vector instead of 17,
<= 1.0 ulp, 99% correctly rounded (the polynomial: 91%); the float64 softmax
forward 1.05-1.18x on one core in cache, 1.00-1.04x from memory (2026-12-08).
exp(-inf) = +0 exactly, overflow gives +inf, NaN propagates.

Compiled without 'reassoc': the magic-number rounding ``(t + M) - M`` must not
be folded away.
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from . import _cache  # noqa: F401  (cache stamps: before any cached kernel)
from ._dtypes import const_like, int_like
from ._lanes import _AVX512, Lanes, apply, float_intrinsic, result_lanes

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


def _binary(emit, doc):
    """An intrinsic f(a, b) = emit(builder, a, b) on two floats of one type, or on
    lanes and a float (splatted), part by part."""
    @intrinsic
    def op(typingctx, a, b):
        lt = result_lanes(a, b)
        if lt is None and not (a == b and isinstance(a, types.Float)):
            return None

        def codegen(context, builder, sig, args):
            return apply(context, builder, sig, args, emit)
        return (lt or a)(a, b), codegen
    op.__doc__ = doc
    return op


_clamp_below = _binary(lambda b, x, lo: b.select(b.fcmp_ordered('<', x, lo), lo, x),
                       """max(x, lo) as one select; NaN passes through. x may be lanes.""")


def _fused(subtract, doc):
    """An intrinsic f(a, b, c) = a * b + c (or - c) with one rounding, llvm.fma
    (vfmadd/vfmsub on x86-64), on floats of one type or lanes (scalars splatted)."""
    @intrinsic
    def op(typingctx, a, b, c):
        lt = result_lanes(a, b, c)
        if lt is None and not (a == b == c and isinstance(a, types.Float)):
            return None

        def codegen(context, builder, sig, args):
            return apply(context, builder, sig, args, lambda b, x, y, z: b.call(
                float_intrinsic(b, "llvm.fma", x.type, 3), [x, y, b.fneg(z) if subtract else z]))
        return (lt or a)(a, b, c), codegen
    op.__doc__ = doc
    return op


_fma = _fused(False, """a * b + c with one rounding. Explicit, so the same bits whether
numba JIT-compiles or loads cached code (unlike 'contract').""")
_fms = _fused(True, """a * b - c with one rounding (as ``_fma``).""")


#: AVX-512's vscalefps/pd: p * 2**floor(n) rounded once (gradual underflow
#: included, NaN propagates), by vector width
_SCALEF = {(32, 8): ("llvm.x86.avx512.mask.scalef.ps.256", False),
           (32, 16): ("llvm.x86.avx512.mask.scalef.ps.512", True),
           (64, 4): ("llvm.x86.avx512.mask.scalef.pd.256", False),
           (64, 8): ("llvm.x86.avx512.mask.scalef.pd.512", True)}


def _scalef(builder, ty):
    """The vscalef intrinsic for the float vector type ``ty``, or None (scalars,
    other widths, no AVX-512)."""
    if not (_AVX512 and isinstance(ty, ir.VectorType)):
        return None
    bits = 32 if ty.element == ir.FloatType() else 64
    found = _SCALEF.get((bits, ty.count))
    if found is None:
        return None
    name, rounding = found
    args = [ty, ty, ty, ir.IntType(max(8, ty.count))] + ([ir.IntType(32)] if rounding else [])
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, args), name)


def _scale_shifted_intrinsic(fty, bits, bias, magic, shift, steps=0):
    """p * 2**k for k = floor(n / 2**steps) <= 0 (n held in t as in ``scale``; steps > 0
    for the table exp, whose n counts 2**steps-ths of a binade): p * 2**(k + shift) is
    exact (a normal power of two for every n the clamp allows), then one multiply
    by 2**-shift rounds once, gradual underflow included. 5 instructions instead of
    scale's 8; NaN p stays NaN (multiplies only). p and t may be lanes; lanes on
    AVX-512 take one vscalef of n = t - magic instead (the same single rounding,
    all-ones mask, current rounding mode)."""
    magic_bits = int(np.array(magic, dtype=np.float32 if bits == 32 else np.float64)
                     .view(np.int32 if bits == 32 else np.int64))
    mant = 23 if bits == 32 else 52
    down = float(2.0 ** -shift)
    # t - magic counts units of magic's last place; vscalef wants binades
    per_binade = float(2.0 ** -steps / np.spacing(np.float32(magic) if bits == 32 else magic))

    @intrinsic
    def scale(typingctx, p, t):
        vector = isinstance(p, Lanes) and p == t and p.dtype == fty
        if not vector and (p != fty or t != fty):
            return None

        def codegen(context, builder, sig, args):
            def scaled(b, p, t):
                scalef = _scalef(b, p.type)
                if scalef is not None:
                    n = b.fsub(t, const_like(p.type, magic))
                    if per_binade != 1.0:       # exact; vscalef floors it
                        n = b.fmul(n, const_like(p.type, per_binade))
                    mask = const_like(scalef.args[3].type, -1)
                    current_rounding = [ir.Constant(ir.IntType(32), 4)][:len(scalef.args) - 4]
                    return b.call(scalef, [p, n, p, mask] + current_rounding)
                ity = int_like(p.type, bits)
                n = b.sub(b.bitcast(t, ity), const_like(ity, magic_bits))
                e = b.add(b.ashr(n, const_like(ity, steps)), const_like(ity, shift + bias))
                pow2 = b.bitcast(b.shl(e, const_like(ity, mant)), p.type)
                return b.fmul(b.fmul(p, pow2), const_like(p.type, down))
            return apply(context, builder, sig, args, scaled)
        return p(p, t), codegen
    return scale


_scale32 = _scale_intrinsic(types.float32, types.int32, 32, 127, _MAGIC32)
_scale64 = _scale_intrinsic(types.float64, types.int64, 64, 1023, _MAGIC64)
_scale32_nonpos = _scale_shifted_intrinsic(types.float32, 32, 127, _MAGIC32, 64)
_scale64_nonpos = _scale_shifted_intrinsic(types.float64, 64, 1023, _MAGIC64, 512)
_scale32_nonpos_16ths = _scale_shifted_intrinsic(types.float32, 32, 127, _MAGIC32 / 16, 64,
                                                 steps=4)
_scale64_nonpos_16ths = _scale_shifted_intrinsic(types.float64, 64, 1023, _MAGIC64 / 16, 512,
                                                 steps=4)


def _exp2_16ths_tables():
    """(float32, float64, float64 low part) tables of 2**(j/16), j = 0..15, from
    60-digit values: float64 correctly rounded, float32 rounded from it (the same
    16 values as rounding exactly), the low part what float64 left off, rounded."""
    import decimal
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        exact = [decimal.Decimal(2) ** (decimal.Decimal(j) / 16) for j in range(16)]
        f64 = [float(v) for v in exact]
        low = [float(v - decimal.Decimal(h)) for v, h in zip(exact, f64)]
    return [float(np.float32(h)) for h in f64], f64, low


#: 2**(j/16), j = 0..15, rounded to float32 / float64 (the table exps'), and what
#: float64's rounding left off (EXP2_16THS_F64_LO)
EXP2_16THS, EXP2_16THS_F64, EXP2_16THS_F64_LO = _exp2_16ths_tables()
#: the permute that reads a 16-entry table, by (bits, lanes a vector): one table
#: register (index bits 0-3) or two halves (bit 3 picks the half)
_PERMUTE_16 = {(32, 16): ("llvm.x86.avx512.permvar.sf.512", False),      # vpermps
               (32, 8): ("llvm.x86.avx512.vpermi2var.ps.256", True),     # vpermi2ps
               (64, 8): ("llvm.x86.avx512.vpermi2var.pd.512", True)}     # vpermi2pd


def _table16(tables, doc):
    """An intrinsic f(t) = tables[bits][n mod 16] for the integer n held in
    t = n/16 + magic/16 (n in units of t's last place; magic's low mantissa bits
    are 0, so t's low 4 bits are n mod 16, negative n included). In lanes on
    AVX-512 one permute per vector from a table held in registers; scalars and
    other widths load it from a constant (LLVM's lowering of a variable
    extractelement)."""
    @intrinsic
    def table16(typingctx, t):
        fty = t.dtype if isinstance(t, Lanes) else t
        if fty not in (types.float32, types.float64):
            return None
        bits = 32 if fty == types.float32 else 64
        values = tables.get(bits)
        if values is None:
            return None

        def lookup(b, t):
            fl = ir.FloatType() if bits == 32 else ir.DoubleType()
            ity = ir.IntType(bits)
            if isinstance(t.type, ir.VectorType):
                count = t.type.count
                idx = b.bitcast(t, ir.VectorType(ity, count))
                found = _PERMUTE_16.get((bits, count)) if _AVX512 else None
                if found is not None and not found[1]:
                    fn = cgutils.get_or_insert_function(
                        b.module, ir.FunctionType(t.type, [t.type, idx.type]), found[0])
                    return b.call(fn, [ir.Constant(t.type, [ir.Constant(fl, v) for v in values]),
                                       idx])
                if found is not None:
                    fn = cgutils.get_or_insert_function(
                        b.module, ir.FunctionType(t.type, [t.type, idx.type, t.type]), found[0])
                    half = [ir.Constant(t.type, [ir.Constant(fl, v)
                                                 for v in values[i:i + count]])
                            for i in (0, count)]
                    return b.call(fn, [half[0], idx, half[1]])
                out = ir.Constant(t.type, None)
                for i in range(count):
                    out = b.insert_element(out, lookup(b, b.extract_element(t, ir.Constant(
                        ir.IntType(32), i))), ir.Constant(ir.IntType(32), i))
                return out
            j = b.and_(b.bitcast(t, ity), ir.Constant(ity, 15))
            table = ir.Constant(ir.VectorType(fl, 16), [ir.Constant(fl, v) for v in values])
            return b.extract_element(table, j)

        def codegen(context, builder, sig, args):
            return apply(context, builder, sig, args, lookup)
        return t(t), codegen
    table16.__doc__ = doc
    return table16


_exp2_16ths = _table16({32: EXP2_16THS, 64: EXP2_16THS_F64},
                       "2**(j/16) rounded (EXP2_16THS, EXP2_16THS_F64); see ``_table16``.")
_exp2_16ths_lo = _table16({64: EXP2_16THS_F64_LO},
                          "2**(j/16) - EXP2_16THS_F64[j], rounded; see ``_table16``.")


_FLAGS = {'nsz'}   # no 'contract': see the note at the top of cpu.py


_f32 = np.float32


@njit(fastmath=_FLAGS, cache=True)
def _expm_f32(x):
    """(p, t) with exp(x) = p * 2**n, n held in t = n + magic; x already clamped.
    n = rint(x / ln2) by magic-number rounding, r = x - n*ln2 in two fused steps
    (Cody-Waite), p(r) by Horner with FMAs (Cephes expf coefficients)."""
    t = _fma(x, _f32(_LOG2E), _f32(_MAGIC32))
    n = t - _f32(_MAGIC32)
    r = _fma(n, _f32(2.12194440e-4), _fma(n, _f32(-0.693359375), x))
    p = _fma(_f32(1.9875691500e-4), r, _f32(1.3981999507e-3))
    p = _fma(p, r, _f32(8.3334519073e-3))
    p = _fma(p, r, _f32(4.1665795894e-2))
    p = _fma(p, r, _f32(1.6666665459e-1))
    p = _fma(p, r, _f32(5.0000001201e-1))
    return _fma(p, r * r, r) + _f32(1.0), t


@njit(fastmath=_FLAGS, cache=True)
def _expm_f64(x):
    """As _expm_f32; degree-13 Taylor (truncation < 5e-18 on |r| <= 0.347)."""
    t = _fma(x, _LOG2E, _MAGIC64)
    n = t - _MAGIC64
    r = _fma(n, -1.90821492927058770002e-10, _fma(n, -6.93147180369123816490e-01, x))
    p = _fma(1.0 / 6227020800.0, r, 1.0 / 479001600.0)
    p = _fma(p, r, 1.0 / 39916800.0)
    p = _fma(p, r, 1.0 / 3628800.0)
    p = _fma(p, r, 1.0 / 362880.0)
    p = _fma(p, r, 1.0 / 40320.0)
    p = _fma(p, r, 1.0 / 5040.0)
    p = _fma(p, r, 1.0 / 720.0)
    p = _fma(p, r, 1.0 / 120.0)
    p = _fma(p, r, 1.0 / 24.0)
    p = _fma(p, r, 1.0 / 6.0)
    p = _fma(p, r, 0.5)
    return _fma(p, r * r, r) + 1.0, t


@njit(fastmath=_FLAGS, cache=True)
def exp_f32(x):
    """exp for float32, every argument (see the module docstring)."""
    p, t = _expm_f32(_clamp(x, _f32(-104.0), _f32(89.0)))
    return _scale32(p, t)


@njit(fastmath=_FLAGS, cache=True)
def exp_f64(x):
    """exp for float64, every argument (see the module docstring)."""
    p, t = _expm_f64(_clamp(x, -746.0, 710.0))
    return _scale64(p, t)


@njit(fastmath=_FLAGS, cache=True)
def exp_nonpos_f32_poly(x):
    """exp for x <= 0 or NaN: softmax's exp(x - max). The same polynomial, one
    clamp and the 5-instruction scaling; wrong for x > 44 (outside its domain).
    ``exp_nonpos_f32`` where the CPU has no AVX-512."""
    p, t = _expm_f32(_clamp_below(x, _f32(-104.0)))
    return _scale32_nonpos(p, t)


_LN2_16 = float(np.log(2.0)) / 16.0
_LN2_16_HI = float(np.float32(_LN2_16))
_LN2_16_LO = float(np.float32(_LN2_16 - _LN2_16_HI))


@njit(fastmath=_FLAGS, cache=True)
def exp_nonpos_f32_table(x):
    """exp for x <= 0 or NaN, by a 16-entry table: exp(x) = 2**k * 2**(j/16) * exp(r)
    with n = rint(16 x / ln2) = 16 k + j, r = x - n ln2/16 (Cody-Waite, |r| <= ln2/32,
    exact first step: the FMA's product is exact and r needs 23 bits), exp(r) - 1 =
    q = r + r**2/2 + r**3/6 (truncation <= 0.08 ulp), T = 2**(j/16) rounded, the
    result T + T q rounded once by an FMA and scaled as ``exp_nonpos_f32_poly``:
    <= 1.1 ulp (tests/test_vecmath.py). 11 vector operations against the
    polynomial's 14 (degree 3 instead of 7, for a permute and a multiply).
    The rounding constant is magic/16, so t - magic/16 = n/16 in binades, what
    vscalef takes, and t's low 4 bits still hold j: the same bits as rounding n
    itself, without a multiply by 1/16 per vector (bfloat16 softmax forward
    1.03-1.07x, float32 1.00-1.07x, ab.py 2026-12-08)."""
    x = _clamp_below(x, _f32(-104.0))
    t = _fma(x, _f32(_LOG2E), _f32(_MAGIC32 / 16))
    n = t - _f32(_MAGIC32 / 16)
    r = _fma(n, _f32(-16.0 * _LN2_16_LO), _fma(n, _f32(-16.0 * _LN2_16_HI), x))
    q = _fma(_fma(r, _f32(1.0 / 6.0), _f32(0.5)), r, _f32(1.0)) * r
    table = _exp2_16ths(t)
    return _scale32_nonpos_16ths(_fma(table, q, table), t)


#: exp for x <= 0 or NaN in float32 (softmax's exp(x - max)): the table exp where a
#: vector permute reads the table (AVX-512), else the polynomial
exp_nonpos_f32 = exp_nonpos_f32_table if _AVX512 else exp_nonpos_f32_poly


@njit(fastmath=_FLAGS, cache=True)
def exp_nonpos_f64_poly(x):
    """exp for x <= 0 or NaN (as exp_nonpos_f32_poly; wrong for x > 354): the
    degree-13 polynomial. ``exp_nonpos_f64`` where the CPU has no AVX-512."""
    p, t = _expm_f64(_clamp_below(x, -746.0))
    return _scale64_nonpos(p, t)


def _ln2_split():
    """(hi, lo): ln2 rounded to float64, and the rest rounded."""
    import decimal
    with decimal.localcontext() as ctx:
        ctx.prec = 60
        ln2 = decimal.Decimal(2).ln()
        hi = float(ln2)
        return hi, float(ln2 - decimal.Decimal(hi))


_LN2_HI64, _LN2_LO64 = _ln2_split()


@njit(fastmath=_FLAGS, cache=True)
def exp_nonpos_f64_table(x):
    """``exp_nonpos_f32_table`` in float64: n = rint(16 x / ln2) (held as n/16 in
    binades, magic/16), r = x - (n/16) ln2 (Cody-Waite: the first step exact, r
    needs 51 bits), exp(r) - 1 = q by the degree-7 Taylor polynomial on |r| <=
    ln2/32 (truncation 1.2e-18), T = 2**(j/16) correctly rounded and T_lo what
    that rounding left off (a second table), the result T + fma(T, q, T_lo)
    scaled as ``exp_nonpos_f64_poly``: <= 1.0 ulp, 99% correctly rounded (without
    T_lo 76%). 13 vector operations of the FMA pipes per vector instead of the
    degree-13 polynomial's 17 (one ``vpermi2pd`` reads a table from two
    registers)."""
    x = _clamp_below(x, -746.0)
    t = _fma(x, _LOG2E, _MAGIC64 / 16)
    n = t - _MAGIC64 / 16
    r = _fma(n, -_LN2_LO64, _fma(n, -_LN2_HI64, x))
    p = _fma(r, 1.0 / 5040.0, 1.0 / 720.0)
    p = _fma(p, r, 1.0 / 120.0)
    p = _fma(p, r, 1.0 / 24.0)
    p = _fma(p, r, 1.0 / 6.0)
    p = _fma(p, r, 0.5)
    q = _fma(p, r, 1.0) * r
    table = _exp2_16ths(t)
    return _scale64_nonpos_16ths(table + _fma(table, q, _exp2_16ths_lo(t)), t)


#: exp for x <= 0 or NaN in float64: the table exp on AVX-512, else the polynomial
exp_nonpos_f64 = exp_nonpos_f64_table if _AVX512 else exp_nonpos_f64_poly


fmax_skipnan = _binary(
    lambda b, x, m: b.select(b.fcmp_ordered('>', x, m), x, m),
    """The larger of a and m, m where a is NaN: select(a > m, a, m), one vmaxps
    (LLVM's IEEE ``llvm.maximum`` lowers to six AVX-512 instructions). For running
    maxima m = fmax_skipnan(x, m) that may ignore NaN: m stays the maximum of the
    other elements, whatever their order. a, m may be lanes.""")


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


def fexp_nonpos(x):
    """exp(x) for x <= 0 or NaN (softmax's exp(x - max)); jitted code only."""
    raise NotImplementedError


@overload(fexp_nonpos)
def _fexp_nonpos(x):
    if x == types.float32 or (isinstance(x, Lanes) and x.dtype == types.float32):
        return lambda x: exp_nonpos_f32(x)
    if x == types.float64 or (isinstance(x, Lanes) and x.dtype == types.float64):
        return lambda x: exp_nonpos_f64(x)
    return None

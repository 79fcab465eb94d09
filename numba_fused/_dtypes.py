"""Dtype policy and scalar conversions shared by the CPU and GPU kernels.

The one numerics spec of numba_fused:

* x, dy, y may be float32, float64, float16 or bfloat16 (``ml_dtypes.bfloat16``);
  weight/bias are x's dtype or float32.
* Every value is widened to the *accumulator* type on load (float64 for float64,
  float32 for everything else), all arithmetic and reductions run in it, and the
  result is rounded to the output dtype once, at the store (``narrow``).
* Saved statistics (mean, rstd) are stored in the accumulator type.

numba cannot load float16 or bfloat16 arrays, so kernels see *storage* views:
float16 travels as int16 bits and bfloat16 as uint16 bits. The storage type alone
tells a kernel which conversion to apply, so one kernel body serves every dtype
(numba compiles one specialization per storage type).

The conversions are LLVM intrinsics, not table look-ups, so they vectorize
(``vcvtph2ps`` with F16C; bf16 is a 16-bit shift) and are bit-exact with NumPy and
ml_dtypes: subnormals, +-inf, NaN, round to nearest even.
"""
import sys

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)

# ``bfloat16`` and ``SUPPORTED`` (module attributes, below) are filled in on first
# need: importing ml_dtypes 0.7 costs ~0.85 s (0.007 s for 0.6; measured
# 2026-12-03), most of a 1 s import-plus-first-call budget, and a float32 user
# never needs it. A bfloat16 array implies ml_dtypes is already imported, so
# recognizing one costs nothing extra.
_STORAGE = {float32: float32, float64: float64, float16: np.dtype(np.int16)}
_ACC = {float32: float32, float64: float64, float16: float32,
        np.dtype(np.int16): float32, np.dtype(np.uint16): float32}   # and storage types


def load_bfloat16():
    """Register ``ml_dtypes.bfloat16`` (idempotent, thread-safe: the same values
    are stored by every caller) and return its dtype."""
    import ml_dtypes
    bf16 = np.dtype(ml_dtypes.bfloat16)
    _STORAGE[bf16] = np.dtype(np.uint16)
    _ACC[bf16] = float32
    module = sys.modules[__name__]
    #: dtypes accepted for x/dy/y, in the order the benchmark and docs list them.
    module.SUPPORTED = (float32, float64, float16, bf16)
    module.bfloat16 = bf16
    return bf16


def __getattr__(name):
    if name in ("bfloat16", "SUPPORTED"):
        load_bfloat16()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_supported(dtype):
    """A dtype x/dy/y may have; the first bfloat16 seen registers ml_dtypes'."""
    if dtype in _STORAGE:
        return True
    if getattr(dtype, "name", None) == "bfloat16" and "bfloat16" not in globals():
        return dtype == load_bfloat16()
    return False


def as_dtype(dtype):
    """``np.dtype(dtype)``, also for the name 'bfloat16' before ml_dtypes is imported."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        return load_bfloat16()
    return np.dtype(dtype)


def storage_dtype(dtype):
    """The dtype a kernel sees for a logical dtype (halves as integer bits)."""
    dtype = as_dtype(dtype)
    is_supported(dtype)
    return _STORAGE[dtype]


def acc_dtype(dtype):
    """Accumulator (and statistics) dtype: float64 for float64, else float32."""
    acc = _ACC.get(dtype) if isinstance(dtype, np.dtype) else None   # hot: ~60 ns
    return acc if acc is not None else (float64 if as_dtype(dtype) == float64 else float32)


def to_storage(a):
    """View a float16/bfloat16 array as its integer bits; other dtypes unchanged."""
    st = _STORAGE[a.dtype]
    return a if st is a.dtype else a.view(st)    # `is`: hot path; an equal dtype views as itself


def from_storage(a, dtype):
    """Inverse of ``to_storage``."""
    dtype = as_dtype(dtype)
    return a if a.dtype == dtype else a.view(dtype)


def acc_numba_type(storage):
    """The accumulator numba type for a numba storage type (float64 for float64,
    else float32): the policy above, in jitted code's typing."""
    return types.float64 if storage == types.float64 else types.float32


# ---------------------------------------------------------------- intrinsics
# The conversions are written once as IR helpers that take a scalar or a vector
# (``_lanes`` converts whole blocks with them; the scalar intrinsics below wrap them).
_i32, _i64 = ir.IntType(32), ir.IntType(64)
_f32, _f64 = ir.FloatType(), ir.DoubleType()


def const_like(ty, value):
    """A constant of ``ty``, splatted when ``ty`` is a vector type."""
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [ir.Constant(ty.element, value)] * ty.count)
    return ir.Constant(ty, value)


def int_like(ty, bits):
    """The integer type with ``bits`` bits, a vector of them if ``ty`` is a vector."""
    if isinstance(ty, ir.VectorType):
        return ir.VectorType(ir.IntType(bits), ty.count)
    return ir.IntType(bits)


def float_like(ty, fty):
    if isinstance(ty, ir.VectorType):
        return ir.VectorType(fty, ty.count)
    return fty


def widen_ir(builder, value, storage):
    """Storage values (scalar or vector of int16 float16 bits, uint16 bfloat16
    bits, float32, float64) -> float32 (float64 for float64). Exact."""
    ty = value.type
    if storage == types.int16:
        return builder.fpext(builder.bitcast(value, float_like(ty, ir.HalfType())),
                             float_like(ty, ir.FloatType()))
    if storage == types.uint16:
        wide = builder.shl(builder.zext(value, int_like(ty, 32)), const_like(int_like(ty, 32), 16))
        return builder.bitcast(wide, float_like(ty, ir.FloatType()))
    return value


def narrow_ir(builder, value, storage):
    """float32/float64 values -> ``storage`` values, round to nearest even once
    (bfloat16: NaN stays a quiet NaN). Scalar or vector."""
    ty = value.type
    if storage == types.float64:
        return value
    f32 = float_like(ty, ir.FloatType())
    if value.type != f32:
        value = builder.fptrunc(value, f32)
    if storage == types.float32:
        return value
    if storage == types.int16:
        return builder.bitcast(builder.fptrunc(value, float_like(ty, ir.HalfType())),
                               int_like(ty, 16))
    i32 = int_like(ty, 32)
    bits = builder.bitcast(value, i32)
    c16 = const_like(i32, 16)
    lsb = builder.and_(builder.lshr(bits, c16), const_like(i32, 1))
    rounded = builder.lshr(builder.add(builder.add(bits, const_like(i32, 0x7FFF)), lsb), c16)
    quiet_nan = builder.or_(builder.lshr(bits, c16), const_like(i32, 0x40))
    isnan = builder.fcmp_unordered('uno', value, value)
    return builder.trunc(builder.select(isnan, quiet_nan, rounded), int_like(ty, 16))


@intrinsic
def f16_bits_to_f32(typingctx, bits):
    """float16 bits (int16) -> float32, exact (LLVM fpext half)."""
    if bits != types.int16:
        return None
    return types.float32(types.int16), lambda context, builder, sig, args: widen_ir(
        builder, args[0], types.int16)


@intrinsic
def f32_to_f16_bits(typingctx, value):
    """float32 -> float16 bits (int16), round to nearest even (LLVM fptrunc)."""
    if value != types.float32:
        return None
    return types.int16(types.float32), lambda context, builder, sig, args: narrow_ir(
        builder, args[0], types.int16)


@intrinsic
def bf16_bits_to_f32(typingctx, bits):
    """bfloat16 bits (uint16) -> float32: the bits are the float32's top half."""
    if bits != types.uint16:
        return None
    return types.float32(types.uint16), lambda context, builder, sig, args: widen_ir(
        builder, args[0], types.uint16)


@intrinsic
def f32_to_bf16_bits(typingctx, value):
    """float32 -> bfloat16 bits (uint16), round to nearest even; NaN stays a quiet NaN."""
    if value != types.float32:
        return None
    return types.uint16(types.float32), lambda context, builder, sig, args: narrow_ir(
        builder, args[0], types.uint16)


def _bitcast(src_ty, dst_ty, llvm_dst):
    @intrinsic
    def cast(typingctx, value):
        if value != src_ty:
            return None

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], llvm_dst)
        return dst_ty(src_ty), codegen
    return cast


f32_as_i32 = _bitcast(types.float32, types.int32, _i32)
i32_as_f32 = _bitcast(types.int32, types.float32, _f32)
f64_as_i64 = _bitcast(types.float64, types.int64, _i64)
i64_as_f64 = _bitcast(types.int64, types.float64, _f64)


# --------------------------------------------------- generic load/store/const
def widen(value):
    """Storage element -> accumulator type (float32, or float64 for float64)."""
    raise NotImplementedError  # only callable from jitted code


def narrow(value, out):
    """Accumulator value -> an element of ``out``'s storage type (the one rounding)."""
    raise NotImplementedError


def acc(arr, value):
    """``value`` as the accumulator type of ``arr``'s storage type."""
    raise NotImplementedError


_WIDEN = {types.int16: f16_bits_to_f32, types.uint16: bf16_bits_to_f32}


@overload(widen, target='generic')
def _widen(value):
    if value in _WIDEN:
        conv = _WIDEN[value]
        return lambda value: conv(value)
    if value in (types.float32, types.float64):
        return lambda value: value
    return None


@overload(narrow, target='generic')
def _narrow(value, out):
    dt = out.dtype
    if dt == types.int16:
        return lambda value, out: f32_to_f16_bits(np.float32(value))
    if dt == types.uint16:
        return lambda value, out: f32_to_bf16_bits(np.float32(value))
    if dt == types.float32:
        return lambda value, out: np.float32(value)
    if dt == types.float64:
        return lambda value, out: np.float64(value)
    return None


@overload(acc, target='generic')
def _acc(arr, value):
    if acc_numba_type(arr.dtype) == types.float64:
        return lambda arr, value: np.float64(value)
    return lambda arr, value: np.float32(value)

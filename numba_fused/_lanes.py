"""Explicit SIMD lanes for the CPU reductions: a fixed summation order.

A reduction written as a scalar loop and compiled with 'reassoc' lets LLVM pick
the order of the sum (vector width, interleave count, epilogue), and it picks per
compilation context: numba links a private copy of every jitted callee into each
library and re-optimizes it there, so the serial build, the parallel build and
code loaded from the on-disk cache each carried their own copy of ``_exp_sum`` --
and the linker resolved the shared symbol to whichever copy was loaded first.
Measured 2026-12-04: with the parallel build cached, a process that loaded both
builds from the cache computed the *serial* softmax 1 ulp off on some rows.

Here the order is in the code: a row is read ``lanes(arr)`` elements at a time
into one LLVM vector (``Lanes``: 64 float32 or 32 float64, that is four zmm
registers -- four independent accumulator chains), every lane accumulates its
own column residue class, the last partial block is zero-padded, and
``lanes_sum`` adds the lanes in a fixed tree. No fast-math flags: LLVM may not
reorder any of it, so every copy of a reduction computes the same bits,
inlined or not, JIT-compiled or loaded from the cache.

Functions (jitted code only):

* ``lanes(arr)`` -- the lane count for arr's accumulator type (a constant).
* ``lanes_load(arr, c, k)`` -- arr[c:c+k] widened to the accumulator type, k <=
  lanes(arr); lanes k and up are 0. ``lanes_load_like(arr, c, k, v)``: in v's type.
* ``lanes_store(arr, c, v, k)`` -- arr[c:c+k] = the first k lanes of v, rounded
  to arr's storage type once.
* ``lanes_keep(v, k, fill)`` -- lanes k and up replaced by ``fill``.
* ``lanes_sum(v)``, ``lanes_max(v)`` -- tree sum, IEEE maximum (NaN propagates).
* ``+``, ``-``, ``*`` between lanes and lanes or a scalar (splatted), and the
  ``_vecmath`` primitives (fma, fmax, clamps, the exp scaling) accept lanes.

The constant ``k == lanes(arr)`` of a full block folds the masking away.
"""
import operator

import llvmlite.binding as llb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, overload, register_model

#: lanes per vector, float32 and float64: four 512-bit registers on AVX-512
#: (fewer on AVX2: four ymm registers)
_AVX512 = "+avx512f" in llb.get_host_cpu_features().flatten().split(",")
LANES32 = 64 if _AVX512 else 32
LANES64 = LANES32 // 2


class Lanes(types.Type):
    """``count`` values of the float type ``dtype`` in one LLVM vector."""

    def __init__(self, dtype, count):
        self.dtype = dtype
        self.count = count
        super().__init__(name=f"Lanes({dtype}, {count})")


@register_model(Lanes)
class _LanesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        elem = dmm.lookup(fe_type.dtype).get_value_type()
        super().__init__(dmm, fe_type, ir.VectorType(elem, fe_type.count))


def _acc_of(dtype):
    return types.float64 if dtype == types.float64 else types.float32


def lanes_type(dtype):
    """Lanes of the accumulator type of an array of storage type ``dtype``."""
    acc = _acc_of(dtype)
    return Lanes(acc, LANES64 if acc == types.float64 else LANES32)


# ------------------------------------------------------------ IR helpers
def splat(builder, value, vty):
    """A scalar as a vector of ``vty``: insertelement + shufflevector (broadcast)."""
    undef = ir.Constant(vty, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), vty.count), None)
    return builder.shuffle_vector(one, undef, zeros)


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


def float_intrinsic(builder, name, ty, nargs):
    """The LLVM intrinsic ``name`` (llvm.fma, llvm.maximum) for the float type or
    float vector type ``ty`` (llvmlite names only scalar overloads itself)."""
    elem = ty.element if isinstance(ty, ir.VectorType) else ty
    suffix = {ir.FloatType(): "f32", ir.DoubleType(): "f64"}[elem]
    if isinstance(ty, ir.VectorType):
        suffix = f"v{ty.count}{suffix}"
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty] * nargs),
                                          f"{name}.{suffix}")


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
    if storage == types.float32:
        f32 = float_like(ty, ir.FloatType())
        return value if value.type == f32 else builder.fptrunc(value, f32)
    if value.type != float_like(ty, ir.FloatType()):
        value = builder.fptrunc(value, float_like(ty, ir.FloatType()))
    ty = value.type
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


def _storage_ir(context, dtype):
    return context.get_data_type(dtype)


def _elem_pointer(context, builder, aty, arr, c):
    data = context.make_array(aty)(context, builder, arr).data
    return builder.gep(data, [c], inbounds=True)


# --------------------------------------------------------------- typing
def _is_lanes_array(arr):
    return (isinstance(arr, types.Array) and arr.ndim == 1 and arr.layout == 'C'
            and arr.dtype in (types.int16, types.uint16, types.float32, types.float64))


@intrinsic
def lanes(typingctx, arr):
    """The lane count of arr's accumulator type (a compile-time constant)."""
    if not _is_lanes_array(arr):
        return None
    count = lanes_type(arr.dtype).count

    def codegen(context, builder, sig, args):
        return context.get_constant(types.intp, count)
    return types.intp(arr), codegen


def _load_codegen(lt):
    """Codegen of a lanes load of arr[c:c+k] into Lanes ``lt``."""
    def codegen(context, builder, sig, args):
        aty = sig.args[0]
        arr, c, k = args[:3]
        sty = _storage_ir(context, aty.dtype)
        size = context.get_abi_sizeof(sty)
        vty = ir.VectorType(sty, lt.count)
        ptr = _elem_pointer(context, builder, aty, arr, c)
        full = builder.icmp_signed('==', k, ir.Constant(k.type, lt.count))
        with builder.if_else(full) as (then, otherwise):
            with then:
                whole = builder.load(builder.bitcast(ptr, vty.as_pointer()), align=size)
                then_block = builder.block
            with otherwise:
                # a partial block: k elements copied into a zeroed buffer (never
                # reads past the row)
                buf = cgutils.alloca_once(builder, vty)
                builder.store(ir.Constant(vty, None), buf)
                cgutils.raw_memcpy(builder, builder.bitcast(buf, sty.as_pointer()), ptr,
                                   k, size)
                part = builder.load(buf)
                else_block = builder.block
        raw = builder.phi(vty)
        raw.add_incoming(whole, then_block)
        raw.add_incoming(part, else_block)
        value = widen_ir(builder, raw, aty.dtype)
        elem = context.get_value_type(lt.dtype)
        if value.type.element != elem:
            value = builder.fpext(value, ir.VectorType(elem, lt.count))
        return value
    return codegen


@intrinsic
def lanes_zeros(typingctx, arr):
    """Zero lanes of arr's accumulator type."""
    if not _is_lanes_array(arr):
        return None
    lt = lanes_type(arr.dtype)

    def codegen(context, builder, sig, args):
        return ir.Constant(context.get_value_type(lt), None)
    return lt(arr), codegen


@intrinsic
def lanes_load(typingctx, arr, c, k):
    """arr[c:c+k] widened into lanes (k <= lanes(arr)); lanes k and up are 0."""
    if not (_is_lanes_array(arr) and isinstance(c, types.Integer)
            and isinstance(k, types.Integer)):
        return None
    lt = lanes_type(arr.dtype)
    return lt(arr, types.intp, types.intp), _load_codegen(lt)


@intrinsic
def lanes_load_like(typingctx, arr, c, k, like):
    """``lanes_load`` into the type of ``like`` (float32 weights of float64 rows)."""
    if not (_is_lanes_array(arr) and isinstance(like, Lanes)
            and lanes_type(arr.dtype).count >= like.count):
        return None
    src = lanes_type(arr.dtype)
    if like.count != src.count and not (src.dtype == types.float32
                                        and like.dtype == types.float64):
        return None
    return like(arr, types.intp, types.intp, like), _load_codegen(like)


@intrinsic
def lanes_store(typingctx, arr, c, v, k):
    """arr[c:c+k] = the first k lanes of v, rounded once to arr's storage type."""
    if not (_is_lanes_array(arr) and isinstance(v, Lanes)):
        return None

    def codegen(context, builder, sig, args):
        aty = sig.args[0]
        arr, c, v, k = args
        sty = _storage_ir(context, aty.dtype)
        vty = ir.VectorType(sty, sig.args[2].count)
        value = narrow_ir(builder, v, aty.dtype)
        ptr = _elem_pointer(context, builder, aty, arr, c)
        full = builder.icmp_signed('==', k, ir.Constant(k.type, vty.count))
        with builder.if_else(full) as (then, otherwise):
            with then:
                builder.store(value, builder.bitcast(ptr, vty.as_pointer()),
                              align=context.get_abi_sizeof(sty))
            with otherwise:
                buf = cgutils.alloca_once(builder, vty)
                builder.store(value, buf)
                cgutils.raw_memcpy(builder, ptr, builder.bitcast(buf, sty.as_pointer()),
                                   k, context.get_abi_sizeof(sty))
        return context.get_dummy_value()
    return types.void(arr, types.intp, v, types.intp), codegen


@intrinsic
def lanes_keep(typingctx, v, k, fill):
    """v with lanes k and up replaced by ``fill``."""
    if not (isinstance(v, Lanes) and isinstance(k, types.Integer)
            and isinstance(fill, types.Float)):
        return None

    def codegen(context, builder, sig, args):
        v, k, fill = args
        n = v.type.count
        idx = ir.Constant(ir.VectorType(k.type, n), [ir.Constant(k.type, i) for i in range(n)])
        keep = builder.icmp_signed('<', idx, splat(builder, k, idx.type))
        fill = context.cast(builder, fill, sig.args[2], sig.args[0].dtype)
        return builder.select(keep, v, splat(builder, fill, v.type))
    return v(v, types.intp, fill), codegen


def _tree(builder, v, combine):
    while v.type.count > 1:
        half = v.type.count // 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), half),
                                                      list(range(half))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(ir.IntType(32), half),
                                                      list(range(half, 2 * half))))
        v = combine(lo, hi)
    return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))


@intrinsic
def lanes_sum(typingctx, v):
    """Sum of the lanes: halves added pairwise, log2(count) steps (a fixed order)."""
    if not isinstance(v, Lanes):
        return None

    def codegen(context, builder, sig, args):
        return _tree(builder, args[0], builder.fadd)
    return v.dtype(v), codegen


@intrinsic
def lanes_max(typingctx, v):
    """IEEE maximum of the lanes (NaN if any lane is NaN)."""
    if not isinstance(v, Lanes):
        return None

    def codegen(context, builder, sig, args):
        def combine(a, b):
            return builder.call(float_intrinsic(builder, "llvm.maximum", a.type, 2), [a, b])
        return _tree(builder, args[0], combine)
    return v.dtype(v), codegen


# ------------------------------------------------------------ arithmetic
def operands(context, builder, sig, args):
    """The arguments as vectors of the result's lanes type (scalars splatted)."""
    rty = sig.return_type
    vty = context.get_value_type(rty)
    out = []
    for t, a in zip(sig.args, args):
        if not isinstance(t, Lanes):
            a = splat(builder, context.cast(builder, a, t, rty.dtype), vty)
        out.append(a)
    return out


def result_lanes(*tys):
    """The Lanes type of a mixed lanes/scalar operation, or None."""
    ls = [t for t in tys if isinstance(t, Lanes)]
    if not ls or any(t != ls[0] for t in ls):
        return None
    if not all(isinstance(t, (Lanes, types.Float)) for t in tys):
        return None
    return ls[0]


def _binary(op):
    @intrinsic
    def impl(typingctx, a, b):
        lt = result_lanes(a, b)
        if lt is None:
            return None

        def codegen(context, builder, sig, args):
            return getattr(builder, op)(*operands(context, builder, sig, args))
        return lt(a, b), codegen
    return impl


_add, _sub, _mul = _binary('fadd'), _binary('fsub'), _binary('fmul')


def _register(pyop, impl):
    @overload(pyop)
    def ov(a, b):
        if result_lanes(a, b) is not None:
            return lambda a, b: impl(a, b)
        return None


for _pyop, _impl in ((operator.add, _add), (operator.sub, _sub), (operator.mul, _mul)):
    _register(_pyop, _impl)

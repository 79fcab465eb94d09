"""Explicit SIMD lanes for the CPU reductions: a fixed summation order.

A reduction written as a scalar loop and compiled with 'reassoc' lets LLVM pick
the order of the sum (vector width, interleave count, epilogue), and it picks per
compilation context: numba links a private copy of every jitted callee into each
library and re-optimizes it there, so the serial build, the parallel build and
code loaded from the on-disk cache each carried their own copy of ``_exp_sum`` --
and the linker resolved the shared symbol to whichever copy was loaded first.
Measured 2026-12-04: with the parallel build cached, a process that loaded both
builds from the cache computed the *serial* softmax 1 ulp off on some rows.

Here the order is in the code: a row is read a block of lanes at a time
as four LLVM vectors of one register each (``Lanes``: four independent
accumulator chains; ``LANES``), every lane accumulates its
own column residue class, the last partial block is zero-padded, and
``lanes_sum`` adds the lanes in a fixed tree. No fast-math flags: LLVM may not
reorder any of it, so every copy of a reduction computes the same bits,
inlined or not, JIT-compiled or loaded from the cache.

Functions (jitted code only):

Arrays are C-contiguous 1-D arrays or their data pointers (``data(a)``).

* ``lanes_zeros(arr)``, ``wide_lanes_zeros(arr)`` (zmm parts) -- zero lanes of
  arr's accumulator type, paired for bfloat16 arrays (``Lanes``: which lane holds
  which column, ``columns``); ``ordered_lanes_zeros``, ``ordered_wide_lanes_zeros``
  -- the same in column order; ``lanes_count(v)`` -- their count (a constant).
* ``lanes_load(arr, c, k)`` -- arr[c:c+k] widened to the accumulator type, k <=
  the lane count; lanes k and up are 0. ``lanes_load_like(arr, c, k, v)``: in v's type.
* ``lanes_store(arr, c, v, k)`` -- arr[c:c+k] = the first k lanes of v, rounded
  to arr's storage type once. arr may be ``streaming(row, on)``: whole blocks on
  a 64-byte boundary then go out in non-temporal stores while ``on``.
* ``lanes_keep(v, k, fill)`` -- lanes k and up replaced by ``fill``.
* ``lanes_sum(v)``, ``lanes_max(v)`` -- tree sum, IEEE maximum (NaN propagates).
* ``+``, ``-``, ``*`` between lanes and lanes or a scalar (splatted), and the
  ``_vecmath`` primitives (fma, fmax_skipnan, clamps, the exp scaling) accept lanes.

Partial blocks use LLVM's masked loads and stores (nothing read or written past
k); a full block's constant k folds the masks away.
"""
import operator

import llvmlite.binding as llb
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, models, overload, register_model

from ._dtypes import acc_numba_type, narrow_ir, widen_ir

#: lanes by storage type, in four parts of one register each: zmm for float16/
#: bfloat16 rows (their conversions gain from the width), ymm for float32/float64
#: rows, which start wherever NumPy put them (16-byte aligned), so most 64-byte
#: loads would straddle two cache lines (measured 2026-12-04 in cache, one core,
#: the pipelined float32 rms_norm stage: zmm 0.23-0.30 vs ymm 0.17-0.20 ns per
#: element). Parts, not one wide vector: LLVM legalizes a wide vector into zmm
#: wherever AVX-512 exists, whatever the function prefers.
_AVX512 = "+avx512f" in llb.get_host_cpu_features().flatten().split(",")
LANES = {types.int16: 64 if _AVX512 else 32, types.uint16: 64 if _AVX512 else 32,
         types.float32: 32, types.float64: 16}
PARTS = 4
#: bfloat16 stores test this many parts for subnormals at once (``_narrow_parts``)
GUARD_PARTS = 2      # even: a paired store interleaves the parts two by two
#: AVX512-BF16: vcvtneps2bf16 rounds 16 floats to bfloat16 in one instruction
_BF16_HW = {"+avx512bf16", "+avx512dq"} <= set(llb.get_host_cpu_features().flatten().split(","))
if _BF16_HW:
    llb.initialize_native_asmparser()   # numba JIT-compiles inline asm only with it


class Lanes(types.Type):
    """``count`` values of the float type ``dtype``, held as PARTS vectors.

    ``paired``: which lane holds which column. Unpaired, part p holds the
    columns p * n + j (n lanes a part) in order. Paired (the lanes of bfloat16
    rows), parts 2q and 2q + 1 hold the even and the odd columns of the 2n
    columns from 2qn: a bfloat16 is the top half of a float32, so a vector of
    bfloat16 pairs read as 32-bit words is the odd columns once its low halves are
    masked off (``vpandd``) and the even ones once shifted up 16 bits
    (``vpslld``). In order, each part took a zero-extending shuffle
    (``vpmovzxwd``) and a shift. A store interleaves the pair again (one
    ``vpermt2w`` for two parts), so memory always holds the columns in order,
    whatever the layout; lanes of the two layouts never mix (a typing error).
    """

    def __init__(self, dtype, count, paired=False):
        self.dtype = dtype
        self.count = count
        self.paired = paired
        super().__init__(name=f"Lanes({dtype}, {count}{', paired' if paired else ''})")


@register_model(Lanes)
class _LanesModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        elem = dmm.lookup(fe_type.dtype).get_value_type()
        part = ir.VectorType(elem, fe_type.count // PARTS)
        super().__init__(dmm, fe_type, ir.ArrayType(part, PARTS))


def lanes_type(dtype):
    """Lanes of the accumulator type for an array of storage type ``dtype``
    (bfloat16: paired)."""
    return Lanes(acc_numba_type(dtype), LANES[dtype], paired=dtype == types.uint16)


def columns(lt):
    """Per part of Lanes ``lt``, the column (from the block's first) of each lane."""
    n = lt.count // PARTS
    if lt.paired:
        return [[2 * n * (p // 2) + 2 * j + p % 2 for j in range(n)] for p in range(PARTS)]
    return [[n * p + j for j in range(n)] for p in range(PARTS)]


# ------------------------------------------------------------ IR helpers
def splat(builder, value, vty):
    """A scalar as a vector of ``vty``: insertelement + shufflevector (broadcast)."""
    undef = ir.Constant(vty, ir.Undefined)
    one = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), vty.count), None)
    return builder.shuffle_vector(one, undef, zeros)


def _type_suffix(ty):
    """LLVM's overload suffix of a scalar or vector type: f32, v8f32, v16i16..."""
    if isinstance(ty, ir.VectorType):
        return f"v{ty.count}{_type_suffix(ty.element)}"
    return {ir.FloatType(): "f32", ir.DoubleType(): "f64"}.get(ty) or f"i{ty.width}"


def float_intrinsic(builder, name, ty, nargs):
    """The LLVM intrinsic ``name`` (llvm.fma, llvm.maximum) for the float type or
    float vector type ``ty`` (llvmlite names only scalar overloads itself)."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty] * nargs),
                                          f"{name}.{_type_suffix(ty)}")


def split(builder, value):
    """The PARTS vectors of a lanes value."""
    return [builder.extract_value(value, i) for i in range(value.type.count)]


def join(builder, parts):
    """A lanes value from its part vectors."""
    value = ir.Constant(ir.ArrayType(parts[0].type, len(parts)), ir.Undefined)
    for i, part in enumerate(parts):
        value = builder.insert_value(value, part, i)
    return value


def apply(context, builder, sig, args, fn):
    """fn(builder, *operands) on each part of the result's lanes (scalar
    arguments splatted), or once on plain scalars."""
    rty = sig.return_type
    if not isinstance(rty, Lanes):
        return fn(builder, *args)
    part_ty = context.get_value_type(rty).element
    operands = []
    for t, a in zip(sig.args, args):
        if isinstance(t, Lanes):
            operands.append(split(builder, a))
        else:
            operands.append([splat(builder, context.cast(builder, a, t, rty.dtype),
                                   part_ty)] * PARTS)
    return join(builder, [fn(builder, *(ops[i] for ops in operands)) for i in range(PARTS)])


def result_lanes(*tys):
    """The Lanes type of a mixed lanes/scalar operation, or None."""
    ls = [t for t in tys if isinstance(t, Lanes)]
    if not ls or any(t != ls[0] for t in ls):
        return None
    if not all(isinstance(t, (Lanes, types.Float)) for t in tys):
        return None
    return ls[0]


def _elem_pointer(context, builder, aty, arr, c, inbounds=True):
    """&arr[c] for an array or a data pointer (``inbounds=False`` where c may lie
    past the end: an inbounds pointer there would be poison)."""
    if not isinstance(aty, types.CPointer):
        arr = context.make_array(aty)(context, builder, arr).data
    return builder.gep(arr, [c], inbounds=inbounds)


def _part_pointers(builder, ptr, part_ty, count=PARTS):
    """Pointers to the ``count`` consecutive vectors of ``part_ty`` from ``ptr``."""
    return [builder.bitcast(builder.gep(ptr, [ir.Constant(ir.IntType(64), i * part_ty.count)],
                                        inbounds=True), part_ty.as_pointer())
            for i in range(count)]


class Stream(types.Type):
    """An output row's data pointer and whether ``lanes_store`` may write it with
    non-temporal stores (``streaming``)."""

    def __init__(self, dtype):
        self.dtype = dtype
        super().__init__(name=f"Stream({dtype})")


@register_model(Stream)
class _StreamModel(models.StructModel):
    def __init__(self, dmm, fe_type):
        # 'on' as a byte: a boolean member (i1 as a value, i8 in memory) broke
        # parfors, which store the value where the data layout is expected
        super().__init__(dmm, fe_type, [('data', types.CPointer(fe_type.dtype)),
                                        ('on', types.uint8)])


def _stream_fields(context, builder, sty, value):
    """(data pointer, 'on' as an i1) of a Stream value."""
    s = cgutils.create_struct_proxy(sty)(context, builder, value=value)
    return s.data, builder.icmp_unsigned('!=', s.on, ir.Constant(ir.IntType(8), 0))


# --------------------------------------------------------------- typing
def _is_lanes_array(arr):
    """A C-contiguous 1-D array or a data pointer of a storage type."""
    return ((isinstance(arr, types.Array) and arr.ndim == 1 and arr.layout == 'C'
             or isinstance(arr, types.CPointer))
            and arr.dtype in (types.int16, types.uint16, types.float32, types.float64))


def streaming(row, on):
    """``row`` (a C-contiguous 1-D array or data pointer; None passes through) as
    a ``Stream``: ``lanes_store`` writes its whole blocks that start on a 64-byte
    boundary with non-temporal stores while ``on`` (a run-time bool)."""
    raise NotImplementedError


@intrinsic
def _stream(typingctx, row, on):
    if not (_is_lanes_array(row) and isinstance(on, (types.Boolean, types.BooleanLiteral))):
        return None
    st = Stream(row.dtype)

    def codegen(context, builder, sig, args):
        s = cgutils.create_struct_proxy(st)(context, builder)
        s.data = _elem_pointer(context, builder, sig.args[0], args[0],
                               ir.Constant(ir.IntType(64), 0))
        on = context.cast(builder, args[1], sig.args[1], types.boolean)
        s.on = builder.zext(on, ir.IntType(8))
        return s._getvalue()
    return st(row, on), codegen


@overload(streaming)
def _streaming_impl(row, on):
    if isinstance(row, types.NoneType):
        return lambda row, on: None
    return lambda row, on: _stream(row, on)


@intrinsic
def stream_parts(typingctx, s):
    """(whether ``s`` streams, its data pointer) for a ``Stream``; (False, s) for
    a data pointer. A loop that branches on the first can run the second, a plain
    pointer, with no per-block test (``lanes_store``)."""
    if isinstance(s, Stream):
        sig = types.Tuple((types.boolean, types.CPointer(s.dtype)))(s)
    elif isinstance(s, types.CPointer):
        sig = types.Tuple((types.boolean, s))(s)
    else:
        return None

    def codegen(context, builder, sig, args):
        if isinstance(sig.args[0], Stream):
            data, on = _stream_fields(context, builder, sig.args[0], args[0])
        else:
            on, data = ir.Constant(ir.IntType(1), 0), args[0]
        return context.make_tuple(builder, sig.return_type, [on, data])
    return sig, codegen


def data(a):
    """The data pointer of a C-contiguous 1-D array (None for None): lanes code
    takes pointers, which carry no reference count to take and release per call."""
    raise NotImplementedError


@intrinsic
def _data_pointer(typingctx, arr):
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.layout == 'C'):
        return None

    def codegen(context, builder, sig, args):
        return context.make_array(sig.args[0])(context, builder, args[0]).data
    return types.CPointer(arr.dtype)(arr), codegen


@overload(data)
def _data_impl(a):
    if isinstance(a, (types.NoneType, Stream)):
        return lambda a: a
    return lambda a: _data_pointer(a)


def _zeros(wide, ordered=False):
    @intrinsic
    def zeros(typingctx, arr):
        if not _is_lanes_array(arr):
            return None
        lt = lanes_type(arr.dtype)
        if wide:
            lt = Lanes(lt.dtype, LANES[types.uint16] // (2 if lt.dtype == types.float64 else 1),
                       lt.paired)
        if ordered:
            lt = Lanes(lt.dtype, lt.count)

        def codegen(context, builder, sig, args):
            return ir.Constant(context.get_value_type(lt), None)
        return lt(arr), codegen
    return zeros


lanes_zeros = _zeros(False)
lanes_zeros.__doc__ = "Zero lanes of arr's accumulator type."
wide_lanes_zeros = _zeros(True)
wide_lanes_zeros.__doc__ = """Zero lanes of arr's accumulator type in zmm-sized parts (for
compute-bound loops such as the softmax exp, which gains from the width more than
it loses on split loads: 1.11-1.29x in float32, benchmarks/ab.py 2026-12-04)."""
ordered_lanes_zeros = _zeros(False, ordered=True)
ordered_lanes_zeros.__doc__ = """``lanes_zeros`` unpaired (columns in order) for bfloat16 rows
too: for loops that also load or store a float32 row of their columns (a scratch
row, dweight partials), which paired lanes would shuffle both ways."""
ordered_wide_lanes_zeros = _zeros(True, ordered=True)
ordered_wide_lanes_zeros.__doc__ = "``wide_lanes_zeros`` unpaired (see ``ordered_lanes_zeros``)."


@intrinsic
def lanes_count(typingctx, v):
    """The lane count of v (a compile-time constant)."""
    if not isinstance(v, Lanes):
        return None
    count = v.count

    def codegen(context, builder, sig, args):
        return context.get_constant(types.intp, count)
    return types.intp(v), codegen


def _masks(builder, k, part_count, count=PARTS):
    """Per vector of ``part_count`` consecutive elements (``count`` of them), the
    elements i * part_count + j < k (all true for k == lanes: folded)."""
    return _column_masks(builder, k, [[i * part_count + j for j in range(part_count)]
                                      for i in range(count)])


def _column_masks(builder, k, cols):
    """Per list of columns in ``cols``, the vector of (column < k)."""
    ity = ir.VectorType(k.type, len(cols[0]))
    kk = splat(builder, k, ity)
    return [builder.icmp_signed('<', ir.Constant(ity, [ir.Constant(k.type, j) for j in cs]), kk)
            for cs in cols]


def _deinterleave(builder, value):
    """(even elements, odd elements) of a vector."""
    i32 = ir.IntType(32)
    half = value.type.count // 2
    return [builder.shuffle_vector(value, value, ir.Constant(ir.VectorType(i32, half),
                                                             [2 * j + odd for j in range(half)]))
            for odd in (0, 1)]


def _interleave(builder, even, odd):
    """The vector even[0], odd[0], even[1], odd[1], ..."""
    n = even.type.count
    return builder.shuffle_vector(even, odd, ir.Constant(ir.VectorType(ir.IntType(32), 2 * n),
                                                         [i for j in range(n) for i in (j, n + j)]))


def _widen_pair(builder, raw, storage, elem):
    """A paired part pair (even, odd columns, as ``elem`` floats) from a vector of
    2n consecutive storage values. bfloat16: the values as n 32-bit words, the odd
    columns their top halves (low halves masked off), the even ones their low
    halves shifted up -- no shuffle."""
    if storage == types.uint16:
        n = raw.type.count // 2
        words = builder.bitcast(raw, ir.VectorType(ir.IntType(32), n))
        fty = ir.VectorType(ir.FloatType(), n)
        i32v = ir.VectorType(ir.IntType(32), n)
        even = builder.shl(words, ir.Constant(i32v, [ir.Constant(ir.IntType(32), 16)] * n))
        odd = builder.and_(words, ir.Constant(i32v, [ir.Constant(ir.IntType(32), -0x10000)] * n))
        pair = [builder.bitcast(even, fty), builder.bitcast(odd, fty)]
    else:
        pair = _deinterleave(builder, widen_ir(builder, raw, storage))
    if pair[0].type.element != elem:
        pair = [builder.fpext(v, ir.VectorType(elem, v.type.count)) for v in pair]
    return pair


def _masked_load(builder, ptr, mask, size):
    """llvm.masked.load of ``ptr``'s vector type: lanes off the mask read nothing and
    are 0 (AVX-512: one masked vmovups; never faults past the row)."""
    vty = ptr.type.pointee
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vty, [ptr.type, ir.IntType(32), mask.type, vty]),
        f"llvm.masked.load.{_type_suffix(vty)}.p0")
    return builder.call(fn, [ptr, ir.Constant(ir.IntType(32), size), mask,
                             ir.Constant(vty, None)])


def _masked_store(builder, value, ptr, mask, size):
    """llvm.masked.store: only the lanes on the mask are written."""
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [value.type, ptr.type, ir.IntType(32),
                                                        mask.type]),
        f"llvm.masked.store.{_type_suffix(value.type)}.p0")
    builder.call(fn, [value, ptr, ir.Constant(ir.IntType(32), size), mask])


def _narrow_parts(builder, values, storage, emit):
    """emit(``narrow_ir`` of a lanes value's parts, index of the first); bfloat16 by
    ``vcvtneps2bf16`` where the CPU has it.

    The instruction rounds to nearest even and quiets NaN exactly as
    ``narrow_ir`` does, but reads subnormal floats as zero: when one of
    GUARD_PARTS parts holds one, those parts take ``narrow_ir`` on a cold branch
    instead, so the bits never differ. Each branch emits its own stores (no phi
    holding results across the test). One test per 2 parts instead of one per
    part: bfloat16 rms_norm fwd 1.03-1.06x, softmax bwd 1.02-1.04x, layer_norm
    fwd 1.02-1.03x in cache (2026-12-06); one test per 4 parts cost the
    layer_norm forward's two-row stage 0.83-0.96x (more values live across the
    test). Why the instruction: ``narrow_ir``'s integer rounding is 9 vector
    instructions per part, most of a bfloat16 forward's arithmetic per element
    (the bfloat16 forwards are compute-bound on this project's machines)."""
    ty = values[0].type
    if not (_BF16_HW and storage == types.uint16 and isinstance(ty, ir.VectorType)
            and ty.count == 16 and ty.element == ir.FloatType()):
        emit([narrow_ir(builder, value, storage) for value in values], 0)
        return
    i16v = ir.VectorType(ir.IntType(16), 16)
    # vfpclassps $0x20 (denormal): one instruction; llvm.is.fpclass lowers to three
    is_class = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VectorType(ir.IntType(1), 16),
                                        [ty, ir.IntType(32)]), "llvm.x86.avx512.fpclass.ps.512")
    def group(values, first):
        subnormal = None
        for value in values:
            mask = builder.call(is_class, [value, ir.Constant(ir.IntType(32), 0x20)])
            subnormal = mask if subnormal is None else builder.or_(subnormal, mask)
        any_of = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(1), [subnormal.type]),
            "llvm.vector.reduce.or.v16i1")
        with builder.if_else(builder.call(any_of, [subnormal]), likely=False) as (slow, fast):
            with slow:
                emit([narrow_ir(builder, value, storage) for value in values], first)
            with fast:
                emit([builder.asm(ir.FunctionType(i16v, [ty]), "vcvtneps2bf16 $1, $0", "=v,v",
                                  [value], side_effect=False) for value in values], first)
    for i in range(0, len(values), GUARD_PARTS):
        group(values[i:i + GUARD_PARTS], i)


def _load_codegen(lt):
    """Codegen of a lanes load of arr[c:c+k] into Lanes ``lt``."""
    def codegen(context, builder, sig, args):
        aty = sig.args[0]
        arr, c, k = args[:3]
        sty = context.get_data_type(aty.dtype)
        size = context.get_abi_sizeof(sty)
        part_ty = ir.VectorType(sty, lt.count // PARTS)
        ptr = _elem_pointer(context, builder, aty, arr, c)
        elem = context.get_value_type(lt.dtype)
        parts = []
        if lt.paired:
            pair_ty = ir.VectorType(sty, 2 * part_ty.count)
            for p, mask in zip(_part_pointers(builder, ptr, pair_ty, PARTS // 2),
                               _masks(builder, k, pair_ty.count, PARTS // 2)):
                parts += _widen_pair(builder, _masked_load(builder, p, mask, size),
                                     aty.dtype, elem)
            return join(builder, parts)
        for p, mask in zip(_part_pointers(builder, ptr, part_ty),
                           _masks(builder, k, part_ty.count)):
            value = widen_ir(builder, _masked_load(builder, p, mask, size), aty.dtype)
            if value.type.element != elem:
                value = builder.fpext(value, ir.VectorType(elem, part_ty.count))
            parts.append(value)
        return join(builder, parts)
    return codegen


@intrinsic
def lanes_load(typingctx, arr, c, k):
    """arr[c:c+k] widened into lanes (k <= their count); lanes k and up are 0."""
    if not (_is_lanes_array(arr) and isinstance(c, types.Integer)
            and isinstance(k, types.Integer)):
        return None
    lt = lanes_type(arr.dtype)
    return lt(arr, types.intp, types.intp), _load_codegen(lt)


@intrinsic
def lanes_load_like(typingctx, arr, c, k, like):
    """``lanes_load`` into the lanes type of ``like`` (a float32 scratch row or
    weight beside bfloat16 or float64 rows)."""
    if not (_is_lanes_array(arr) and isinstance(like, Lanes)):
        return None
    src = lanes_type(arr.dtype)
    if like.dtype != src.dtype and not (src.dtype == types.float32
                                        and like.dtype == types.float64):
        return None
    return like(arr, types.intp, types.intp, like), _load_codegen(like)


#: ``stream_head`` realigns rows of this many bytes and more (callers may ask for
#: more)
HEAD_MIN_BYTES = 1 << 11


@intrinsic
def stream_head(typingctx, s, c, n, least):
    """The columns from c to the first 64-byte boundary of a streaming output row
    ``s`` (a ``Stream`` that is on) whose n columns from c hold ``least`` bytes or
    more (HEAD_MIN_BYTES at least, so the head, under 64 bytes, lies inside them);
    0 for a row that does not stream (off, a data pointer, None) or is shorter. A
    store loop that stores these columns first (a short block) has every later
    whole block on a cache line, where ``lanes_store`` streams it: a row whose byte
    length is not a multiple of 64 (an odd column count) starts off a line, and
    lost every non-temporal store."""
    if not all(isinstance(a, types.Integer) for a in (c, n, least)):
        return None
    if not isinstance(s, Stream):
        if not (isinstance(s, types.NoneType) or _is_lanes_array(s)):
            return None
        return types.intp(s, c, n, least), lambda context, builder, sig, args: ir.Constant(
            ir.IntType(64), 0)

    def codegen(context, builder, sig, args):
        data, on = _stream_fields(context, builder, sig.args[0], args[0])
        i64 = ir.IntType(64)
        size = context.get_abi_sizeof(context.get_data_type(sig.args[0].dtype))
        c = context.cast(builder, args[1], sig.args[1], types.intp)
        n = context.cast(builder, args[2], sig.args[2], types.intp)
        addr = builder.ptrtoint(builder.gep(data, [c], inbounds=False), i64)
        gap = builder.and_(builder.neg(addr), ir.Constant(i64, 63))
        head = builder.udiv(gap, ir.Constant(i64, size))
        least = context.cast(builder, args[3], sig.args[3], types.intp)
        least = builder.select(builder.icmp_signed('<', least, ir.Constant(i64, HEAD_MIN_BYTES)),
                               ir.Constant(i64, HEAD_MIN_BYTES), least)
        long = builder.icmp_signed('>=', builder.mul(n, ir.Constant(i64, size)), least)
        return builder.select(builder.and_(on, long), head, ir.Constant(i64, 0))
    return types.intp(s, c, n, least), codegen


@intrinsic
def lanes_store(typingctx, arr, c, v, k):
    """arr[c:c+k] = the first k lanes of v, rounded once to arr's storage type.

    arr a ``Stream`` that is on: a whole block (k = the lane count) starting on a
    64-byte boundary is written with non-temporal stores (``vmovntps``/
    ``vmovntdq``): whole cache lines go to memory without being read first, where
    an ordinary store reads each line it writes (a third of a forward's traffic).
    Other blocks, and every block while off, take the masked stores."""
    if not ((_is_lanes_array(arr) or isinstance(arr, Stream)) and isinstance(v, Lanes)):
        return None

    def codegen(context, builder, sig, args):
        aty, lt = sig.args[0], sig.args[2]
        arr, c, v, k = args
        sty = context.get_data_type(aty.dtype)
        size = context.get_abi_sizeof(sty)
        part_ty = ir.VectorType(sty, lt.count // PARTS)
        stream = None
        if isinstance(aty, Stream):
            arr, stream = _stream_fields(context, builder, aty, arr)
            aty = types.CPointer(aty.dtype)
        ptr = _elem_pointer(context, builder, aty, arr, c)
        if lt.paired:
            # a pair of parts, interleaved, is one vector of consecutive columns
            part_ty = ir.VectorType(sty, 2 * part_ty.count)
            pointers = _part_pointers(builder, ptr, part_ty, PARTS // 2)
            masks = _masks(builder, k, part_ty.count, PARTS // 2)
        else:
            pointers = _part_pointers(builder, ptr, part_ty)
            masks = _masks(builder, k, part_ty.count)

        def vectors(values, first):
            """(vector, its index) to store for the narrowed parts from ``first``."""
            if not lt.paired:
                return [(v, first + i) for i, v in enumerate(values)]
            return [(_interleave(builder, values[i], values[i + 1]), (first + i) // 2)
                    for i in range(0, len(values), 2)]

        def masked(values, first):
            for value, i in vectors(values, first):
                _masked_store(builder, value, pointers[i], masks[i], size)

        if stream is None:
            _narrow_parts(builder, split(builder, v), aty.dtype, masked)
            return context.get_dummy_value()
        i64 = ir.IntType(64)
        aligned = builder.icmp_unsigned('==', builder.and_(builder.ptrtoint(ptr, i64),
                                                           ir.Constant(i64, 63)),
                                        ir.Constant(i64, 0))
        whole = builder.icmp_signed('==', k, ir.Constant(k.type, lt.count))
        go = builder.and_(builder.and_(stream, whole), aligned)

        def stores(values, first):
            with builder.if_else(go) as (nontemporal, ordinary):
                with nontemporal:
                    one = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
                    for value, i in vectors(values, first):
                        store = builder.store(value, pointers[i])
                        store.align = part_ty.count * size
                        store.set_metadata('nontemporal', one)
                with ordinary:
                    masked(values, first)
        _narrow_parts(builder, split(builder, v), aty.dtype, stores)
        return context.get_dummy_value()
    return types.void(arr, types.intp, v, types.intp), codegen


def _prefetch_codegen(locality):
    """Codegen of ``prefetch``/``prefetch_l2``: llvm.prefetch (read) of the two cache
    lines from &arr[c] with LLVM's locality hint (3: prefetcht0, 2: prefetcht1)."""
    def codegen(context, builder, sig, args):
        ptr = builder.bitcast(_elem_pointer(context, builder, sig.args[0], *args, inbounds=False),
                              ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32]),
            "llvm.prefetch.p0")
        for offset in (0, 64):
            p = builder.gep(ptr, [ir.Constant(ir.IntType(64), offset)])
            builder.call(fn, [p, ir.Constant(i32, 0), ir.Constant(i32, locality),
                              ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return codegen


@intrinsic
def prefetch(typingctx, arr, c):
    """Prefetch the two cache lines from &arr[c] into the L1 (prefetcht0; a hint:
    never faults, even past the array's end, and never changes a result)."""
    if not (_is_lanes_array(arr) and isinstance(c, types.Integer)):
        return None
    return types.void(arr, types.intp), _prefetch_codegen(3)


@intrinsic
def prefetch_l2(typingctx, arr, c):
    """``prefetch`` into the L2, not the L1 (prefetcht1): for lines wanted a few
    rows from now, which in the L1 would evict the rows in use."""
    if not (_is_lanes_array(arr) and isinstance(c, types.Integer)):
        return None
    return types.void(arr, types.intp), _prefetch_codegen(2)


@intrinsic
def lanes_keep(typingctx, v, k, fill):
    """v with lanes k and up replaced by ``fill``."""
    if not (isinstance(v, Lanes) and isinstance(k, types.Integer)
            and isinstance(fill, types.Float)):
        return None

    def codegen(context, builder, sig, args):
        v, k, fill = args
        parts = split(builder, v)
        fill = splat(builder, context.cast(builder, fill, sig.args[2], sig.args[0].dtype),
                     parts[0].type)
        return join(builder, [builder.select(mask, part, fill) for part, mask
                              in zip(parts, _column_masks(builder, k, columns(sig.args[0])))])
    return v(v, types.intp, fill), codegen


def _tree(builder, v, combine):
    """Parts combined as (p0 . p1) . (p2 . p3), then the halves of the vector
    pairwise down to one lane: a fixed order."""
    parts = split(builder, v)
    while len(parts) > 1:
        parts = [combine(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
    v = parts[0]
    while v.type.count > 1:
        half = v.type.count // 2
        i32 = ir.IntType(32)
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, half),
                                                      list(range(half))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, half),
                                                      list(range(half, 2 * half))))
        v = combine(lo, hi)
    return builder.extract_element(v, ir.Constant(ir.IntType(32), 0))


@intrinsic
def lanes_sum(typingctx, v):
    """Sum of the lanes in a fixed tree (``_tree``)."""
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
def _binary(op):
    @intrinsic
    def impl(typingctx, a, b):
        lt = result_lanes(a, b)
        if lt is None:
            return None

        def codegen(context, builder, sig, args):
            return apply(context, builder, sig, args, lambda bld, x, y: getattr(bld, op)(x, y))
        return lt(a, b), codegen
    return impl


def _register(pyop, impl):
    @overload(pyop)
    def ov(a, b):
        if result_lanes(a, b) is not None:
            return lambda a, b: impl(a, b)
        return None


for _pyop, _op in ((operator.add, 'fadd'), (operator.sub, 'fsub'), (operator.mul, 'fmul')):
    _register(_pyop, _binary(_op))

"""CPU kernels: softmax, RMSNorm and LayerNorm, forward and backward (numba).

Backend contract (shared with ``gpu.py``; the dispatcher calls these):

    softmax_fwd(x, y)                        softmax_bwd(y, dy, dx)
    rms_norm_fwd(x, weight, eps, y, rstd)    rms_norm_bwd(dy, x, weight, rstd, dx, dweight)
    layer_norm_fwd(x, weight, bias, eps, y, mean, rstd)
    layer_norm_bwd(dy, x, weight, mean, rstd, dx, dweight, dbias)

x, y, dy, dx are 3-D (outer, inner, cols) storage views with unit last stride
(float16 as int16 bits, bfloat16 as uint16 bits; see ``_dtypes``); a flat row
index r means row (r // inner, r % inner) in each. weight/bias: 1-D or None.
mean/rstd: 1-D (rows,) in the accumulator type. dweight/dbias: (cols,) outputs in
the parameter's storage type, or None. dx may be dy, the same object: an in-place
backward, which the kernels then write through dy itself (see ``_target``).

Each op is one row function, written once for every dtype: ``widen`` loads into
the accumulator type, ``narrow`` rounds once at the store; it always sees rows as
C-contiguous 1-D arrays (``_row_at``), whatever the layout of the 3-D views,
so every layout runs the same vectorized code. Row drivers exist in a parallel
build (prange over rows) and a serial one for small calls, where a parallel
launch costs more than the work. Rows run software-pipelined (``_softmax_fwd_rows``,
``_softmax_bwd_rows``, the norms' ``*_fwd_rows`` and ``_norm_bwd_rows``), one chunk of
rows per thread: one pass over the columns takes the next row's sums while it
stores the current row, so memory and compute overlap. Where that measured slower
(on the AMD EPYC, float32/float64 backwards on rows under 8 KiB, 16 KiB for the
softmax, and float16/bfloat16 norm backwards under 128 columns), a row takes its
two passes in turn; the softmax forward goes by blocks on long rows
(``_softmax_fwd_long_row``; from 4 KiB rows in float32/float64).

dweight/dbias: rows are split into a fixed number of chunks that depends only on
(rows, cols), each chunk accumulates its own partial row in the accumulator type,
and the partials are summed in chunk order: the same bits on every run and for
every thread count, no atomics.
"""
import contextlib
import operator
import os
import sys
import threading
import time

import numba
import numpy as np
from numba import carray, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload
from numba.np.numpy_support import as_dtype
from llvmlite import ir

from . import _cache  # noqa: F401  (cache stamps: before any cached kernel)
from ._alloc import ALIAS_SPAN, ALIGN, STREAM_BYTES, on_line
from ._dtypes import acc, acc_numba_type, narrow, widen
from ._lanes import (lanes_keep, lanes_load, lanes_load_like, lanes_max, lanes_store, prefetch,
                     lanes_count, lanes_sum, lanes_zeros, ordered_lanes_zeros,
                     ordered_wide_lanes_zeros, wide_lanes_zeros)
from ._lanes import data as _data
from ._lanes import prefetch_l2
from ._lanes import stream_head, stream_parts, streaming
from ._vecmath import _fma, _fms, fexp_nonpos, fmax_skipnan

# No fast-math flags anywhere. Elementwise loops (the stores) are compiled
# strictly: LLVM emits a vector and a scalar version of each loop and picks one
# at run time by aliasing (out=dy takes the scalar one), and with reassociation
# the two rounded differently (measured: in-place dx was 1 ulp off). No 'contract':
# FMA formation differed between numba's JIT and its cached object code (a process
# loading kernels from the on-disk cache got other bits than the one that compiled
# them), and results must not depend on the cache. nnan/ninf would break -inf
# masking and NaN propagation.
#: the sums: explicit lanes (``_lanes``) and no fast-math flags, so the order of
#: every sum is fixed by the code, whichever copy of a function runs (a
#: reassociated loop let LLVM choose it per compilation, and the serial and
#: parallel builds and the on-disk cache each held a copy compiled differently).
#: Called, not inlined (inlined into every driver they doubled the compile time,
#: 2m15 -> 4m for float32 and float16; 2026-12-04), on data pointers, because
#: array arguments cost 120-200 ns per call (NRT reference counts).
_lanes_fn = njit(cache=True, nogil=True, error_model='numpy')


def _prefer_512(context, builder, sig, args):
    # llvmlite accepts only its known attribute names; a string attribute is
    # rendered verbatim in the function's definition
    set.add(builder.function.attributes, '"prefer-vector-width"="512"')
    return context.get_dummy_value()


@intrinsic
def _wide_vectors(typingctx):
    """Marks the function being compiled "prefer-vector-width"="512". LLVM's
    tuning for Intel's AVX-512 cores (Skylake-SP to Sapphire Rapids) vectorizes
    with 256-bit registers unless told otherwise, which halves the lanes of the
    exp polynomial and of the half-precision conversions. LLVM clamps the width
    to what the CPU has (AVX2: 256), and AMD's tuning already prefers 512.
    Each function with a hot loop asks for itself: numba optimizes (and
    vectorizes) every jitted function in its own module before linking it into
    its callers, so a caller's attribute does not reach a callee's loops; prange
    outlines its body, so the drivers ask inside the loop.

    Where it pays (benchmarks/ab.py, 2026-12-04, Xeon with AVX-512, 2 cores,
    256 -> 512 bits, median ratios): softmax fwd, whose exp is compute-bound,
    1.11-1.29x in float32, 1.17-1.30x in bfloat16; the other float16/bfloat16
    kernels 1.00-1.27x (``_wide_for_halves``). Not for the float32 norm
    backwards (rms_norm bwd 0.82-0.87x, layer_norm bwd 0.79-1.05x); softmax bwd and
    the float32/float64 forwards moved 0.95-1.07x: those keep LLVM's choice."""
    return types.void(), _prefer_512


@intrinsic
def _wide_for_halves(typingctx, a):
    """``_wide_vectors`` when ``a`` holds float16/bfloat16 bits, else nothing."""
    half = isinstance(a, types.Array) and a.dtype in (types.int16, types.uint16)

    def codegen(context, builder, sig, args):
        if half:
            _prefer_512(context, builder, sig, args)
        return context.get_dummy_value()
    return types.void(a), codegen

#: row functions are inlined into the drivers (whose cached code then holds the
#: whole loop nest): as separate jitted functions their calls cost 1.1-1.8x on
#: short rows (benchmarks/ab.py, 2026-12-03: 65536x32 softmax fwd float32
#: 2.33 -> 1.61 ms, layer_norm bwd bfloat16 2.37 -> 1.30 ms; 4096 columns
#: unchanged). numba inlines them before typing, so optional parameters go
#: through the typed helpers below (_times, _plus, _vadd_into), never through
#: ``is not None`` branches, which inlined code cannot prune.
_row = njit(nogil=True, error_model='numpy', inline='always')
#: the paths that run only on long rows: the norm backwards' pipeline
#: (``_norm_bwd_rows``, rows of BWD_PIPELINE_BYTES and more; float16/bfloat16 from
#: HALF_BWD_PIPELINE_COLS) and the norms two rows at a time (``_paired``). Compiled
#: once per signature, for the serial and the parallel builds alike, and called
#: (~0.2 us with array arguments, once per thread's rows or dweight chunk, against
#: >= 1 us a row). Inlined into every driver they were compiled for each build and
#: each driver signature: a cold float32 ``warmup`` took 276 s, 244 s with the
#: pairs out of line, 221 s with ``_norm_bwd_rows`` too (2026-12-06, AMD EPYC).
_long_rows_fn = njit(cache=True, nogil=True, error_model='numpy')

#: calls with fewer elements than this run the serial kernels: where a 2-thread
#: parallel launch (~2 us) stopped paying on the project's 2-core machine (measured
#: 2026-12-02: rms_norm fwd serial 3.7 us vs parallel 3.65 us at 32768 elements).
#: These are floors: ``_calibrate`` raises them where launches cost more.
SERIAL_BELOW = 1 << 15
#: per-kernel floors: softmax forward (an exp per element) pays for a parallel
#: launch much earlier (serial 4.65 us vs parallel 4.20 us at 8192 elements, 1024
#: columns); the norm backwards with dweight/dbias partials ("+params") much later
#: (2026-12-03, 1024 columns, serial vs parallel: rms_norm 13 vs 25 us at 32768
#: elements, 40 vs 41 us at 131072; layer_norm 16 vs 38, 51 vs 52 us).
_SERIAL_BELOW_BY_KERNEL = {"softmax_fwd": 1 << 13, "rms_norm_bwd+params": 1 << 17,
                           "layer_norm_bwd+params": 1 << 17}
#: serial kernel speed in elements per us (float32, 1024 columns, in cache; 2026-12-03)
#: for ``_calibrate``: a 2-thread launch pays once the serial time exceeds twice
#: the launch cost.
_SERIAL_RATE = {"softmax_fwd": 2200, "softmax_bwd": 5000, "rms_norm_fwd": 7000,
                "rms_norm_bwd": 4000, "rms_norm_bwd+params": 3200, "layer_norm_fwd": 4500,
                "layer_norm_bwd": 3000, "layer_norm_bwd+params": 2500}
#: calibrated thresholds never exceed this many elements
SERIAL_CAP = 1 << 20
#: at most this many dweight/dbias partial rows, and at most _PARTIAL_ELEMS floats
MAX_CHUNKS = 32
_PARTIAL_ELEMS = 1 << 19
#: and at least this many rows per partial row: two partials from 2 * CHUNK_ROWS
#: rows on, more only at MANY_CHUNK_ROWS rows each (see param_chunks)
CHUNK_ROWS = 4
MANY_CHUNK_ROWS = 8


@intrinsic
def _no_alias_args(typingctx, names):
    """Marks the pointer arguments ``names`` (a space-separated literal) of the
    function being compiled ``noalias``: for ``_lanes_fn`` functions on data
    pointers, whose stores LLVM must otherwise assume may change any other
    argument's memory (it reloaded and re-widened the weight after each dx
    store). Only for pointers that no other argument writes through: not dy/dx
    of a backward, which may be one array (in place)."""
    if not isinstance(names, types.StringLiteral):
        return None
    wanted = {"arg." + n for n in names.literal_value.split()}

    def codegen(context, builder, sig, args):
        for a in builder.function.args:
            if a.name in wanted and isinstance(a.type, ir.PointerType):
                a.add_attribute("noalias")
        return context.get_dummy_value()
    return types.void(names), codegen


#: where each thread's row work keeps its stack: this byte offset within a 4 KiB
#: page (``_frame_on_page``), chosen from ``benchmarks/frame_scan.py``
FRAME_OFFSET = 0x210


def _frame_target(builder):
    """The page offset ``_frame_on_page`` moves to, as an LLVM value (a constant;
    ``benchmarks/frame_scan.py`` swaps in a load to scan offsets in one process)."""
    return ir.Constant(ir.IntType(64), FRAME_OFFSET)


@intrinsic
def _frame_on_page(typingctx):
    """Moves the stack pointer down to FRAME_OFFSET within its 4 KiB page (a dynamic
    alloca of 64 bytes to a page) and returns the old one, for ``_frame_back`` at
    the end of the same loop body. Every prange body (and its serial twin) starts
    with it, so the functions it calls, the stages with the hot loops, keep their
    frames at one place in a page on every thread and for every caller.

    Why: before ``_aligned_frame``, LLVM kept some of a stage's vector accumulators in
    16-byte aligned stack slots, loaded and stored on every iteration
    (``_layer_norm_fwd_stage2_at``, float32: 15 ymm slots), and a slot that straddled a
    page boundary cost a split load and store each time. Where the frames fell depended
    on the caller: the main thread's stack position moves with the Python call depth
    (and ASLR), the workers' is fixed per process. AMD EPYC (Zen 4) VM, 2026-12-06,
    float32 4096x4096, the caller's stack moved in 16-byte steps over a page: layer_norm
    fwd 16 ms instead of 4 at 14 of 256 positions, layer_norm bwd 17 instead of 6.7 at
    17, rms_norm bwd 16.5 instead of 6.3 at 7; float64 alike; float16/bfloat16 1.3x at a
    few. That was the "per-process slow state" of earlier benchmark runs (RESULTS.md).
    With the frames moved here, each kernel is slow at a band of offsets instead:
    0x3c0-0x6b0 (layer_norm fwd), 0xbc0-0xd00 (rms_norm bwd), 0xce0-0xf80 (layer_norm
    bwd), a few others; 0x210 lies clear of all of them, and as an odd multiple of 16 it
    also gives the float32/float64 layer_norm forward 1.08x (fewer of its slots split
    across cache lines).

    Since the stages align their frames (``_aligned_frame``) no offset is slow any
    more (float32, same scan). The move stays: it makes a kernel's time independent
    of its caller's stack, on every thread, for any other stack effect a compiler,
    a CPU or a later change brings (``benchmarks/frame_scan.py`` finds them), for a
    few nanoseconds per chunk."""
    def codegen(context, builder, sig, args):
        i64, i8p = ir.IntType(64), ir.IntType(8).as_pointer()
        save = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i8p, []),
                                              "llvm.stacksave")
        saved = builder.call(save, [])
        pad = builder.and_(builder.sub(builder.ptrtoint(saved, i64), _frame_target(builder)),
                           ir.Constant(i64, 4095))
        buf = builder.alloca(ir.IntType(8), size=builder.add(pad, ir.Constant(i64, 64)))
        # an empty asm statement that takes the buffer, or LLVM drops the alloca
        builder.asm(ir.FunctionType(ir.VoidType(), [i8p]), "", "r,~{memory}", [buf],
                    side_effect=True)
        return saved
    return types.voidptr(), codegen


@intrinsic
def _frame_back(typingctx, saved):
    """Restores the stack pointer that ``_frame_on_page`` returned."""
    def codegen(context, builder, sig, args):
        restore = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer()]),
            "llvm.stackrestore")
        builder.call(restore, [args[0]])
        return context.get_dummy_value()
    return types.void(types.voidptr), codegen


@intrinsic
def _aligned_frame(typingctx):
    """Marks the function being compiled "stackrealign": its prologue aligns the
    stack pointer, so LLVM keeps vector spills in slots aligned to their size
    (vmovaps), which never straddle a cache line or a page. Without it the
    ``_lanes_fn`` stages spilled ymm accumulators to 16-byte aligned slots with
    vmovups, loaded and stored every iteration: half of them split across two
    lines, and where one straddled a page the kernel ran 2.5-4x slower (see
    ``_frame_on_page``). Every ``_lanes_fn`` function asks for itself, as for
    ``_wide_vectors``. AMD EPYC VM, 2026-12-06, float32 4096x4096, stack at 16-byte
    steps over a page: no slow offset left (layer_norm fwd had 14 of 256,
    layer_norm bwd 14, rms_norm bwd 7), and the medians 0.89-0.97x the time
    (layer_norm fwd 3.49 ms against 3.80-3.95, bwd 5.68 against 6.4-6.9, rms_norm
    bwd 5.29 against 5.9-6.2; bfloat16 0.95-1.0x)."""
    def codegen(context, builder, sig, args):
        set.add(builder.function.attributes, '"stackrealign"')
        return context.get_dummy_value()
    return types.void(), codegen


# ------------------------------------------- optional parameters (typed helpers)
def _with_param(combine, doc):
    """A jitted-code helper f(v, param, c) = combine(v, widen(param[c])), or v when
    param is None (chosen by type, so inlined row functions need no branch)."""
    def helper(v, param, c):
        raise NotImplementedError
    helper.__doc__ = doc

    @overload(helper)
    def impl(v, param, c):
        if isinstance(param, types.NoneType):
            return lambda v, param, c: v
        return lambda v, param, c: combine(v, widen(param[c]))
    return helper


_times = _with_param(operator.mul, "v * weight[c], or v when weight is None.")
_plus = _with_param(operator.add, "v + bias[c], or v when bias is None.")


def _lanes_beside(x, a, b):
    """Zero lanes for row x in loops that also load or store the rows a and b
    (None, or arrays with x's columns): x's own (``lanes_zeros``: paired for
    bfloat16), or in column order where a or b is of another storage type (a
    float32 weight beside bfloat16 rows, float32 partials), which paired lanes
    would shuffle at each load and store (bfloat16 norms with float32 weights ran
    0.85-0.97x paired; ab.py --weight-dtype float32, 2026-12-07)."""
    raise NotImplementedError


@overload(_lanes_beside)
def _lanes_beside_impl(x, a, b):
    dtype = x.dtype
    if all(isinstance(p, types.NoneType) or p.dtype == dtype for p in (a, b)):
        return lambda x, a, b: lanes_zeros(x)
    return lambda x, a, b: ordered_lanes_zeros(x)


def _with_lanes_param(combine, doc):
    """The lanes form of ``_with_param``: f(v, param, c, k) = combine(v,
    param[c:c+k] as v's lanes), or v when param is None."""
    def helper(v, param, c, k):
        raise NotImplementedError
    helper.__doc__ = doc

    @overload(helper)
    def impl(v, param, c, k):
        if isinstance(param, types.NoneType):
            return lambda v, param, c, k: v
        return lambda v, param, c, k: combine(v, lanes_load_like(param, c, k, v))
    return helper


_vtimes = _with_lanes_param(operator.mul, "v * weight[c:c+k], or v when weight is None.")
_vplus = _with_lanes_param(operator.add, "v + bias[c:c+k], or v when bias is None.")


def _affine(v, weight, bias, c):
    """v * weight[c] + bias[c] in one rounding (an FMA) when both are given, else
    ``_plus(_times(...))``: LayerNorm's store, one operation per element fewer."""
    raise NotImplementedError


@overload(_affine)
def _affine_impl(v, weight, bias, c):
    if isinstance(weight, types.NoneType) or isinstance(bias, types.NoneType):
        return lambda v, weight, bias, c: _plus(_times(v, weight, c), bias, c)
    cast = as_dtype(v).type        # a float32 parameter beside float64 rows
    return lambda v, weight, bias, c: _fma(v, cast(widen(weight[c])), cast(widen(bias[c])))


def _vaffine(v, weight, bias, c, k):
    """The lanes form of ``_affine`` (the same bits)."""
    raise NotImplementedError


@overload(_vaffine)
def _vaffine_impl(v, weight, bias, c, k):
    if isinstance(weight, types.NoneType) or isinstance(bias, types.NoneType):
        return lambda v, weight, bias, c, k: _vplus(_vtimes(v, weight, c, k), bias, c, k)
    return lambda v, weight, bias, c, k: _fma(v, lanes_load_like(weight, c, k, v),
                                              lanes_load_like(bias, c, k, v))


def _centered(v, mean):
    """v - mean, or v when mean is None (RMSNorm, softmax): no subtraction at all,
    where a runtime 0 would cost one per element."""
    raise NotImplementedError


@overload(_centered)
def _centered_impl(v, mean):
    if isinstance(mean, types.NoneType):
        return lambda v, mean: v
    return lambda v, mean: v - mean


def _vadd_into(total, c, v, k, first):
    raise NotImplementedError


@overload(_vadd_into)
def _vadd_into_impl(total, c, v, k, first):
    """total[c:c+k] = v (lanes) on a chunk's first row, else total[c:c+k] + v;
    nothing for None."""
    if isinstance(total, types.NoneType):
        return lambda total, c, v, k, first: None

    def impl(total, c, v, k, first):
        lanes_store(total, c, v if first else lanes_load_like(total, c, k, v) + v, k)
    return impl


# --------------------------------------------------------------- reductions
#: Long rows (WIDE_COLS columns and more) are summed by blocks of WIDE_BLOCK
#: columns: each block in lanes, the blocks' sums added in column order. A norm
#: call on few such rows (``_wide_bwd``, ``_wide_fwd``) runs column-blocked
#: (``norm_fwd_blocked``, ``norm_bwd_blocked``): every thread takes a range of
#: blocks of all rows, first their sums, then (the rows' sums added) their
#: stores, so one long row runs on every thread, and a block of weight and of the
#: dweight/dbias partials stays in cache across the rows. The rows' own passes
#: (``*_at``) take the same sums block by block, so a row gets the same bits on
#: either path, and the choice may depend on the rows and the threads: the norm
#: backwards, whose row path ran one thread per dweight partial (one for 4 rows
#: of 1M columns), and the norm forwards on fewer rows than threads (a row per
#: thread on the row path). The softmax is row by row (its exp sum is not blocked).
#: In the ``*_at`` functions a long row's sums start from -0.0, the identity of
#: addition, so the blocks' loop holds the span once (twice with the span spelled
#: out for shorter rows, where a blocks loop ran 0.84-0.92x): three copies of
#: each span were a third of the stages' compile time (2026-12-06).
WIDE_COLS = 1 << 16
WIDE_BLOCK = 1 << 13
#: a norm forward runs column-blocked from this many columns (and fewer rows than
#: threads)
WIDE_FWD_COLS = 1 << 18
#: elements ahead of a pipelined forward's read stream that its float16/bfloat16
#: passes prefetch (``_prefetch_halves``; 2048 and 4096 measured worse for the
#: softmax and rms_norm, 2026-12-05; the backwards' four streams gained nothing)
PREFETCH_AHEAD = 1024


@_row
def _max(x):
    """The maximum of the row's non-NaN elements (-inf if none). The softmax needs
    no more: a NaN element's exp is NaN, so its row's sum and every output are."""
    return _max_at(x.shape[0], _data(x))


@_lanes_fn
def _max_at(n, x):
    """``_max`` on data pointers (see ``_lanes_fn``); wide lanes: 1.07x over ymm
    in cache (float32 4x32768, one thread, 2026-12-04)."""
    _aligned_frame()
    m = wide_lanes_zeros(x) + acc(x, -np.inf)
    step = lanes_count(m)
    for c in range(0, n - step + 1, step):
        m = fmax_skipnan(lanes_load_like(x, c, step, m), m)
    if n % step:
        c, k = n - n % step, n % step
        m = fmax_skipnan(lanes_keep(lanes_load_like(x, c, k, m), k, acc(x, -np.inf)), m)
    return lanes_max(m)


# Every reduction below is a wrapper (inlined) passing data pointers to a
# ``_lanes_fn``, which reads the row a block of lanes at a time (see ``_lanes``):
# a loop over whole blocks and one call for the zero-padded last block, both
# through the same inlined block function, whose masking folds away in the loop.
@_row
def _exp_sum(x, m, scratch):
    """scratch = exp(x - m); returns sum(scratch)."""
    return _exp_sum_at(x.shape[0], _data(x), m, _data(scratch))


@_lanes_fn
def _exp_sum_at(n, x, m, scratch):
    """``_exp_sum`` on data pointers (see ``_lanes_fn``). Lanes in column order:
    the exps go to a float32 scratch row (paired bfloat16 lanes would shuffle
    them there and back)."""
    _aligned_frame()
    s = ordered_wide_lanes_zeros(x)
    step = lanes_count(s)
    for c in range(0, n - step + 1, step):
        s = _exp_sum_block(x, m, scratch, s, c, step)
    if n % step:
        s = _exp_sum_block(x, m, scratch, s, n - n % step, n % step)
    return lanes_sum(s)


@_row
def _exp_sum_block(x, m, scratch, s, c, k):
    e = lanes_keep(fexp_nonpos(lanes_load_like(x, c, k, s) - m), k, acc(x, 0.0))
    lanes_store(scratch, c, e, k)
    return s + e


@_row
def _softmax_fwd_stage(xa, xb, mb, sb, sc, inv, yc):
    """One pass over three rows of the pipelined forward (``_softmax_fwd_rows``):
    returns (max(xa), sum(sb)) with sb = exp(xb - mb), and stores yc = sc * inv.
    The same (wide) lanes as ``_exp_sum``, so a row gets the same bits pipelined or
    not: batch-invariant. (ymm lanes here ran float32 4096x4096 1.04-1.08x faster,
    but ymm in ``_exp_sum`` cost 0.85-0.95x on the row-by-row shapes; ab.py --evict
    256, 15 rounds, 2026-12-04.)"""
    return _softmax_fwd_stage_at(xa.shape[0], _data(xa), _data(xb), mb, _data(sb), _data(sc),
                                 inv, _data(yc))


@_lanes_fn
def _softmax_fwd_stage_at(n, xa, xb, mb, sb, sc, inv, yc):
    """``_softmax_fwd_stage`` on data pointers (see ``_lanes_fn``). A loop of its
    own for a row that does not stream: the per-block test of a streamed store cost
    this compute-bound loop 3-6% in cache (float32 256x1024 and 1024x1024, ab.py
    15 rounds, 2026-12-06)."""
    _aligned_frame()
    on, plain = stream_parts(yc)
    if on:
        return _softmax_fwd_stage_loop(n, xa, xb, mb, sb, sc, inv, yc)
    return _softmax_fwd_stage_loop(n, xa, xb, mb, sb, sc, inv, plain)


@_row
def _softmax_fwd_stage_loop(n, xa, xb, mb, sb, sc, inv, yc):
    s = ordered_wide_lanes_zeros(xa)         # as _exp_sum's
    m = wide_lanes_zeros(xa) + acc(xa, -np.inf)
    step = lanes_count(s)
    for c in range(0, n - step + 1, step):
        _prefetch_halves(xa, c + PREFETCH_AHEAD)
        m, s = _softmax_fwd_block(xa, xb, mb, sb, sc, inv, yc, m, s, c, step)
    if n % step:
        m, s = _softmax_fwd_block(xa, xb, mb, sb, sc, inv, yc, m, s, n - n % step, n % step)
    return lanes_max(m), lanes_sum(s)


@_row
def _softmax_fwd_block(xa, xb, mb, sb, sc, inv, yc, m, s, c, k):
    m = fmax_skipnan(lanes_keep(lanes_load_like(xa, c, k, m), k, acc(xa, -np.inf)), m)
    e = lanes_keep(fexp_nonpos(lanes_load_like(xb, c, k, s) - mb), k, acc(xa, 0.0))
    lanes_store(sb, c, e, k)
    lanes_store(yc, c, lanes_load_like(sc, c, k, s) * inv, k)
    return m, s + e


@_row
def _softmax_long_stage(x, m, scratch, c0, c1, d1):
    """One step of ``_softmax_fwd_long_row``: scratch[c0:c1] = exp(x - m) and their
    sum, while it takes the max of x[c1:d1] (the next block, from memory; at most
    c1 - c0 elements). Returns (sum, max)."""
    return _softmax_long_stage_at(_data(x), m, _data(scratch), c0, c1, d1)


@_lanes_fn
def _softmax_long_stage_at(x, m, scratch, c0, c1, d1):
    """``_softmax_long_stage`` on data pointers (see ``_lanes_fn``). float16/bfloat16
    rows prefetch the next block's stream (ab.py --evict 512, 2026-12-05: bfloat16
    16x262144 1.17x, 4x1048576 1.08x, 1x1048576 1.06x)."""
    _aligned_frame()
    s = ordered_wide_lanes_zeros(x)          # as _exp_sum's
    mx = wide_lanes_zeros(x) + acc(x, -np.inf)
    step = lanes_count(s)
    both = (d1 - c1) - (d1 - c1) % step          # columns of whole blocks in both
    for i in range(0, both, step):
        _prefetch_halves(x, c1 + i + PREFETCH_AHEAD)
        s = _exp_sum_block(x, m, scratch, s, c0 + i, step)
        mx = fmax_skipnan(lanes_load_like(x, c1 + i, step, mx), mx)
    if (d1 - c1) % step:
        mx = fmax_skipnan(lanes_keep(lanes_load_like(x, c1 + both, (d1 - c1) % step, mx),
                                     (d1 - c1) % step, acc(x, -np.inf)), mx)
    n = c1 - c0
    for i in range(both, n - step + 1, step):
        s = _exp_sum_block(x, m, scratch, s, c0 + i, step)
    if n % step and n - n % step >= both:
        s = _exp_sum_block(x, m, scratch, s, c1 - n % step, n % step)
    return lanes_sum(s), lanes_max(mx)


@_row
def _scaled_store(scratch, f, y, c0, c1, stream):
    """y[c0:c1] = scratch[c0:c1] * f, rounded once (scratch may be y itself; then
    stream is False)."""
    _scaled_store_at(_data(scratch), f, _fwd_stream(_data(y), stream), c0, c1)


@_lanes_fn
def _scaled_store_at(scratch, f, y, c0, c1):
    """``_scaled_store`` on data pointers (see ``_lanes_fn``)."""
    _aligned_frame()
    on, plain = stream_parts(y)
    if on:
        _scaled_store_loop(scratch, f, y, c0, c1)
    else:
        _scaled_store_loop(scratch, f, plain, c0, c1)


@_row
def _scaled_store_loop(scratch, f, y, c0, c1):
    like = wide_lanes_zeros(scratch)
    step = lanes_count(like)
    n = c1 - c0
    for c in range(c0, c1 - step + 1, step):
        lanes_store(y, c, lanes_load_like(scratch, c, step, like) * f, step)
    if n % step:
        c, k = c1 - n % step, n % step
        lanes_store(y, c, lanes_load_like(scratch, c, k, like) * f, k)


@_row
def _sum_sq(x, center):
    """(sum((x - center)**2), sum(x - center)), each square added by an FMA (one
    operation per element fewer: the bfloat16 norm forwards are bound by their
    arithmetic; rms_norm fwd 1.04-1.08x in cache, 2026-12-06)."""
    return _sum_sq_at(x.shape[0], _data(x), center)


@_lanes_fn
def _sum_sq_at(n, x, center):
    """``_sum_sq`` on data pointers (see ``_lanes_fn``); long rows by blocks (see
    WIDE_COLS)."""
    _aligned_frame()
    if n < WIDE_COLS:
        return _sum_sq_span(x, center, 0, n)
    ss = sd = acc(x, -0.0)
    for c0 in range(0, n, WIDE_BLOCK):
        a, b = _sum_sq_span(x, center, c0, min(n, c0 + WIDE_BLOCK))
        ss, sd = ss + a, sd + b
    return ss, sd


@_row
def _sum_sq_span(x, center, c0, c1):
    ss = sd = lanes_zeros(x)
    step = lanes_count(ss)
    for c in range(c0, c1 - step + 1, step):
        ss, sd = _sum_sq_block(x, center, ss, sd, c, step)
    if (c1 - c0) % step:
        ss, sd = _sum_sq_block(x, center, ss, sd, c1 - (c1 - c0) % step, (c1 - c0) % step)
    return lanes_sum(ss), lanes_sum(sd)


@_row
def _sum_sq_block(x, center, ss, sd, c, k):
    d = lanes_keep(lanes_load(x, c, k) - center, k, acc(x, 0.0))
    return _fma(d, d, ss), sd + d


@_row
def _moments(x, center, scale):
    """(sum(x * scale), sum((x - center)**2), sum(x - center)), the products added
    by FMAs (as ``_sum_sq``; with the FMA store, ``_affine``, the bfloat16
    layer_norm forward ran 1.10-1.19x, 2026-12-06)."""
    return _moments_at(x.shape[0], _data(x), center, scale)


@_lanes_fn
def _moments_at(n, x, center, scale):
    """``_moments`` on data pointers (see ``_lanes_fn``); long rows by blocks (see
    WIDE_COLS)."""
    _aligned_frame()
    if n < WIDE_COLS:
        return _moments_span(x, center, scale, 0, n)
    sm = ss = sd = acc(x, -0.0)
    for c0 in range(0, n, WIDE_BLOCK):
        a, b, d = _moments_span(x, center, scale, c0, min(n, c0 + WIDE_BLOCK))
        sm, ss, sd = sm + a, ss + b, sd + d
    return sm, ss, sd


@_row
def _moments_span(x, center, scale, c0, c1):
    sm = ss = sd = lanes_zeros(x)
    step = lanes_count(ss)
    for c in range(c0, c1 - step + 1, step):
        sm, ss, sd = _moments_block(x, center, scale, sm, ss, sd, c, step)
    if (c1 - c0) % step:
        sm, ss, sd = _moments_block(x, center, scale, sm, ss, sd, c1 - (c1 - c0) % step,
                                    (c1 - c0) % step)
    return lanes_sum(sm), lanes_sum(ss), lanes_sum(sd)


@_row
def _moments_block(x, center, scale, sm, ss, sd, c, k):
    v = lanes_load(x, c, k)
    d = lanes_keep(v - center, k, acc(x, 0.0))
    return _fma(lanes_keep(v, k, acc(x, 0.0)), scale, sm), _fma(d, d, ss), sd + d


@_row
def _grad_sums(dy, weight, x, center):
    """With g = dy * weight: (sum(g * (x - center)), sum(g)), each product added by
    an FMA. Callers scale the first by rstd (sum(g * xhat) = rstd * it): one multiply
    per row instead of one per element (the half backwards are bound by their
    arithmetic: with the FMA, 4 operations per element instead of 6, 2026-12-05)."""
    return _grad_sums_at(x.shape[0], _data(dy), _data(weight), _data(x), center)


@_lanes_fn
def _grad_sums_at(n, dy, weight, x, center):
    """``_grad_sums`` on data pointers (see ``_lanes_fn``); long rows by blocks
    (see WIDE_COLS)."""
    _aligned_frame()
    return _grad_sums_blocks(n, dy, weight, x, center)


@_row
def _grad_sums_blocks(n, dy, weight, x, center):
    """The body of ``_grad_sums_at`` (and the sums of ``_norm_bwd_row_at``)."""
    if n < WIDE_COLS:       # one block: spelled out, the loop as it was (a blocks
        return _grad_sums_span(dy, weight, x, center, 0, n)   # loop: 0.84-0.92x)
    dot = gsum = acc(x, -0.0)
    for c0 in range(0, n, WIDE_BLOCK):
        d, g = _grad_sums_span(dy, weight, x, center, c0, min(n, c0 + WIDE_BLOCK))
        dot, gsum = dot + d, gsum + g
    return dot, gsum


@_row
def _grad_sums_span(dy, weight, x, center, c0, c1):
    """``_grad_sums`` of columns c0..c1-1, in lanes (``_lanes_beside`` the weight)."""
    dot = gsum = _lanes_beside(x, weight, None)
    step = lanes_count(dot)
    for c in range(c0, c1 - step + 1, step):
        dot, gsum = _grad_sums_block(dy, weight, x, center, dot, gsum, c, step)
    if (c1 - c0) % step:
        dot, gsum = _grad_sums_block(dy, weight, x, center, dot, gsum,
                                     c1 - (c1 - c0) % step, (c1 - c0) % step)
    return lanes_sum(dot), lanes_sum(gsum)


@_row
def _grad_sums_block(dy, weight, x, center, dot, gsum, c, k):
    g = _vtimes(lanes_load_like(dy, c, k, dot), weight, c, k)     # 0 in the padded lanes
    v = lanes_keep(_centered(lanes_load_like(x, c, k, dot), center), k, acc(x, 0.0))
    return _fma(g, v, dot), gsum + g


# ------------------------------------------------------------------ softmax
@_row
def _softmax_fwd_row(x, y, scratch):
    """y = exp(x - m) / sum(exp(x - m)), m = max(x).

    A NaN element's exp is NaN, and so are the row's sum and every output (m
    skips NaN: ``_max``); +inf makes m = inf and its own x - m NaN (inf - inf). A
    row of all -inf has m = -inf and x - m = NaN, as in torch. exp(x - m) is kept in
    ``scratch`` (accumulator type, one row, in cache): one exp per element, and
    y is rounded once from it.
    """
    inv = acc(x, 1.0) / _exp_sum(x, _max(x), scratch)
    for c in range(x.shape[0]):
        y[c] = narrow(scratch[c] * inv, y)


#: softmax forwards with at least this many rows and rows short enough not to go
#: by blocks (``long_cols``) run pipelined (``_softmax_fwd_rows``); the norm
#: forwards always are
PIPELINE_ROWS = 64
PIPELINE_COLS = 1 << 16


@_row
def _softmax_fwd_rows(x, y, lo, hi, sa, sb, spare):
    """Rows lo..hi-1 of a softmax forward, software-pipelined: one pass over the
    columns finds the max of row r + 2 (read from memory), takes exp(x - max) and
    its sum on row r + 1 (in cache, into scratch) and stores row r (to memory).

    Why: the three passes of ``_softmax_fwd_row`` each wait on memory or on the
    exp in turn, and their times add (measured 2026-12-04 on the project's Xeon:
    max pass 0.44 + exp pass 0.30 + store pass 0.3 ns per element per core); one
    pass that streams x in and y out while the exp runs hides much of the exp
    (ab.py median ratios 1.19-1.49x in float32, 1.52-1.65x in float64; 0.95-1.17x
    in bfloat16, whose conversions keep it compute-bound). Every row goes through the same three
    stages of the same loop whatever lo and hi are: the first two iterations store
    into ``spare`` and the last two repeat row hi - 1's max and exps (the same
    values), so results do not depend on the chunking. y never overlaps x (the
    dispatcher allows no in-place forward). sa, sb: scratch rows in the
    accumulator type; spare: a row of y's storage type.
    """
    mb = acc(x, -np.inf)       # max of the row in stage B (garbage until v = lo - 1)
    inv = acc(x, 1.0)          # 1 / sum for the row in stage C
    stream = _streams(y)
    for v in range(lo - 2, hi):
        a = min(v + 2, hi - 1)
        b = min(max(v + 1, lo), hi - 1)
        yc = _fwd_stream(_row_at(y, v), stream) if v >= lo else _fwd_stream(spare, False)
        ma, sum_b = _softmax_fwd_stage(_row_at(x, a), _row_at(x, b), mb, sb, sa, inv, yc)
        inv = acc(x, 1.0) / sum_b
        sa, sb = sb, sa        # row b's exps move to stage C
        mb = ma


#: softmax rows longer than ``long_cols`` run by blocks (``_softmax_fwd_long_row``)
#: of ``long_block`` columns: float16/bfloat16 rows of more than PIPELINE_COLS
#: columns by blocks of LONG_BLOCK, their exps in a float32 scratch row;
#: float32/float64 rows of more than Y_EXPS_ROW_BYTES by blocks of Y_EXPS_BLOCK,
#: their exps in y (``_exps_into``). Why float32/float64 from 4 KiB: the pipelined
#: stage has five rows in flight (x from memory, x and the exps to read again, the
#: exps and y to write), 20 KiB at 4 KiB rows; past the 32 KiB L1 they came from
#: the L2 and the forward cost 1.5x per element from 2,048 float32 columns (one
#: thread, from memory). By blocks, a block of x is read into the L1 for its max
#: and read there again for its exps. ab.py --evict 64, 2026-12-05, AMD EPYC:
#: float32 4096x4096 1.29-1.37x, 8192x2048 1.36x, 256x65536 1.20x; float64
#: 16384x1024 1.27-1.32x, 4096x4096 1.15-1.21x. Blocks of 512: float32 1.35x at
#: 4096x4096 against 1.21x by blocks of 8192; the half types lost 0.79-0.98x by
#: blocks at 1,024-16,384 columns (their exps go to scratch and their time to
#: the exp) and 0.96-1.0x by smaller blocks on long rows. In cache (the same 2 MiB
#: again and again) float32 by blocks ran 0.79-0.89x at 2,048-4,096 columns and
#: 1.09-1.14x at 16,384; from 2 KiB rows it lost 0.70-0.82x in cache and gained
#: nothing from memory. Exps in a scratch row instead of y: 0.57-0.92x.
LONG_BLOCK = 1 << 13
Y_EXPS_ROW_BYTES = 1 << 12
Y_EXPS_BLOCK = 1 << 9
#: float32 rows of at most this many bytes keep their exps in a scratch row when y
#: streams (``_streams``), and the store pass writes y with non-temporal stores:
#: exps in y cost a read of each line of y before it is written (a third of the
#: traffic). ab.py --evict 64 against exps in y, AMD EPYC, 2026-12-07, float32,
#: 1,280-2,048 columns 1.10-1.26x, 3,072 1.05x, but 4,096 0.84x and 6,144-16,384
#: 0.71-0.76x (the store pass then streams 16 KiB or more in a burst, with nothing
#: to compute meanwhile); float64, its exp heavier, 0.87-1.08x at 640-1,280 columns
#: and 0.65-0.89x from 1,792
STREAM_EXPS_ROW_BYTES = 1 << 13


def long_cols(dtype):
    """Softmax rows of more columns than this go by blocks (see LONG_BLOCK); dtype:
    the storage dtype (uint16 for float16/bfloat16)."""
    dtype = np.dtype(dtype)
    if dtype in (np.float32, np.float64):
        return Y_EXPS_ROW_BYTES // dtype.itemsize
    return PIPELINE_COLS


def long_block(dtype):
    """Columns per block of a long softmax row (see LONG_BLOCK)."""
    return Y_EXPS_BLOCK if np.dtype(dtype) in (np.float32, np.float64) else LONG_BLOCK


def _of_storage(of_dtype):
    """f(x) = of_dtype(x's storage dtype), a compile-time constant in jitted code."""
    def f(x):
        raise NotImplementedError
    f.__doc__ = f"``{of_dtype.__name__}`` of x's storage type, in jitted code."

    @overload(f)
    def impl(x):
        n = of_dtype(as_dtype(x.dtype))
        return lambda x: n
    return f


_long_cols = _of_storage(long_cols)
_long_block = _of_storage(long_block)


@_row
def _softmax_fwd_long_row(x, y, scratch, bmax, bsum, stream):
    """y = softmax(x) for a row of more than ``long_cols`` columns, by blocks of
    B = ``long_block`` columns: block j's exps e = exp(x - m_j) about its own max
    m_j, and their sum s_j, go into ``scratch`` while the next block's max is taken
    (x is read from memory once, the exps while the block is in L1); then
    y = e * exp(m_j - M) / S with M = max(m_j), S = sum(s_j * exp(m_j - M)).

    Why: a row past the L2 holds x and the exps' scratch in two MiB for the plain
    three passes (max, exps, store), which then wait on the L3 and memory in turn;
    here memory is read in the pass that computes the exps, and the store pass
    reads only scratch. The path depends on the column count alone, so a row's
    bits do not depend on the rows beside it. The exps take one more rounding
    (the factor) than ``_softmax_fwd_row``'s. A block of -inf only (masking) has
    e = 0 and factor 0; NaN and +inf give NaN rows, and a row of -inf only NaN,
    as ``_softmax_fwd_row``. stream: the store pass writes y with non-temporal
    stores (``_fwd_stream``; scratch is then not y)."""
    n, B = x.shape[0], _long_block(x)
    blocks = (n + B - 1) // B
    mx = _max(x[:B])
    for j in range(blocks):
        mx = _long_block_exps(x, scratch, bmax, bsum, j, mx, min(n, (j + 2) * B))
    _long_factors(x, bmax, bsum)
    for j in range(blocks):
        _scaled_store(scratch, bsum[j], y, j * B, min(n, (j + 1) * B), stream)


@_row
def _long_block_exps(x, scratch, bmax, bsum, j, mx, d1):
    """Block j of a long row (``_softmax_fwd_long_row``), whose max is mx: records
    it in bmax[j], stores the block's exps about it into scratch and their sum in
    bsum[j]; returns the max of x[end of block j:d1] (the next block, or nothing)."""
    B = _long_block(x)
    bmax[j] = mx
    m = acc(x, 0.0) if mx == -np.inf else mx   # exp(-inf - 0) = 0: e = 0, not NaN
    bsum[j], mx = _softmax_long_stage(x, m, scratch, j * B, min(x.shape[0], (j + 1) * B), d1)
    return mx


@_row
def _long_factors(x, bmax, bsum):
    """bsum[j] = exp(bmax[j] - M) / S, the store's factor per block, from the blocks'
    maxima and sums: M = max(bmax), S = sum(bsum[j] * exp(bmax[j] - M)) in block order."""
    top = acc(x, -np.inf)
    for j in range(bmax.shape[0]):
        top = max(top, bmax[j])
    total = acc(x, 0.0)
    for j in range(bmax.shape[0]):
        total += bsum[j] * _long_factor(x, bmax[j], top)
    inv = acc(x, 1.0) / total
    for j in range(bmax.shape[0]):
        bsum[j] = _long_factor(x, bmax[j], top) * inv


@_row
def _long_factor(x, m, top):
    """exp(m - top): 0 for a block of -inf only in a row that has a larger value;
    NaN when the row is -inf only (top = -inf: -inf - -inf)."""
    if m == -np.inf and top != -np.inf:
        return acc(x, 0.0)
    return fexp_nonpos(m - top)


@_row
def _softmax_bwd_dot(y, dy):
    """sum(dy * y) of a row."""
    return _grad_sums(dy, None, y, acc(y, 0.0))[0]


@_row
def _softmax_bwd_store(y, dy, dot, dx, stream):
    """dx = y * (dy - dot), in the stage's lanes; dx None: written into dy.
    ``stream``: non-temporal stores (``_target``)."""
    _softmax_bwd_store_at(y.shape[0], _data(y), _data(dy), dot,
                          _target(dx, dy, stream))


@_lanes_fn
def _softmax_bwd_store_at(n, y, dy, dot, dx):
    """``_softmax_bwd_store`` on data pointers (see ``_lanes_fn``); dx may be dy."""
    _aligned_frame()
    step = lanes_count(lanes_zeros(y))
    h = stream_head(dx, 0, n, 0)
    if h:
        _softmax_bwd_block(y, dy, dot, dx, 0, h)
    for c in range(h, n - step + 1, step):
        _softmax_bwd_block(y, dy, dot, dx, c, step)
    if (n - h) % step:
        _softmax_bwd_block(y, dy, dot, dx, n - (n - h) % step, (n - h) % step)


def _softmax_bwd_pipelined(y, shared):
    raise NotImplementedError


@overload(_softmax_bwd_pipelined)
def _softmax_bwd_pipelined_impl(y, shared):
    """Whether a softmax backward runs its rows pipelined: float32/float64 rows of
    SOFTMAX_BWD_PIPELINE_BYTES or more in a call that runs on more than one thread
    (``shared``) or rows of WIDE_COLS and more, and every float16/bfloat16 row;
    other rows take their two passes in turn. Row path against pipelined, ab.py,
    AMD EPYC, 2026-12-05, float32 from memory: 256-2048 columns 1.04-1.31x
    (65536x1024 1.08-1.12x), 4096 columns 0.95-1.01x, 16384 0.98x; in cache
    1.04-1.23x. bfloat16: 1.02-1.15x from memory but 0.90-0.98x in cache, so not
    there.

    One thread since 2026-12-07: a core on its own kept fewer lines in flight
    through the stage (two streams from memory, two from L2 and a streamed store
    in one loop) than through a row's two passes, so on one thread the row path
    ran float32 4096x4096 1.15x, 2048x8192 1.18x, 1024x16384 1.23x, 512x32000
    1.26x, 330x50257 1.15x from memory (ab.py --evict 64, NUMBA_NUM_THREADS=1),
    where on two it ran 0.94-1.01x; so not the rows of WIDE_COLS and more either,
    which the row path ran 0.90-0.94x in cache (float64 16x65536, two threads).
    Calls of STREAM_BYTES and more, whose stage prefetches (PREFETCH_L2_BYTES),
    run pipelined on one thread too: NUMBA_NUM_THREADS=1, 4096x4096 1.09x,
    2048x8192 1.14x against the row path. Rows under 16 KiB stay on the row path
    there as well (float32 8192x2048 and 65536x1024 pipelined: 0.97-0.98x)."""
    if y.dtype in (types.float32, types.float64):
        floor = SOFTMAX_BWD_PIPELINE_BYTES // (y.dtype.bitwidth // 8)
        return lambda y, shared: y.shape[2] >= floor and _pipeline_threads(y, shared)
    return lambda y, shared: True


@_row
def _softmax_bwd_rows(y, dy, dx, lo, hi, shared):
    """dx = y * (dy - sum(dy * y)) for rows lo..hi-1 (``shared``: of a call on
    more than one thread): each row's sum, then its store
    (``_softmax_bwd_pipelined`` false), or software-pipelined as the norm forwards:
    one pass stores row r (in cache) and takes the sum of row r + 1 (from memory);
    row lo's sum and row hi-1's store are passes of their own, with the stage's lanes
    and operations (a row's bits do not depend on lo and hi, nor on the path)."""
    stream = _streams(dx)
    if not _softmax_bwd_pipelined(y, shared):
        for r in range(lo, hi):
            yr, dyr = _row_at(y, r), _row_at(dy, r)
            _softmax_bwd_store(yr, dyr, _softmax_bwd_dot(yr, dyr), _row_at(dx, r), stream)
        return
    dot = _softmax_bwd_dot(_row_at(y, lo), _row_at(dy, lo))
    ahead = _ahead(y, 1)
    for r in range(lo, hi - 1):
        dyc = _row_at(dy, r)
        dot = _softmax_bwd_stage_at(
            y.shape[2], _data(_row_at(y, r + 1)), _data(_row_at(dy, r + 1)),
            _data(_row_at(y, r)), _data(dyc), dot,
            _target(_row_at(dx, r), dyc, stream), acc(y, 0.0), ahead)
    _softmax_bwd_store(_row_at(y, hi - 1), _row_at(dy, hi - 1), dot, _row_at(dx, hi - 1),
                       stream)


@_lanes_fn
def _softmax_bwd_stage_at(n, ya, dya, yc, dyc, dot, dxc, zero, ahead):
    """Stores dxc = yc * (dyc - dot) and returns sum(dya * ya) (as ``_grad_sums``;
    long rows by blocks), on data pointers (see ``_lanes_fn``); prefetches ya and
    dya ``ahead`` elements on (``_ahead``)."""
    _aligned_frame()
    if n < WIDE_COLS:
        return _softmax_bwd_stage_span(ya, dya, yc, dyc, dot, dxc, zero, 0, n, ahead)
    total = acc(ya, -0.0)
    for c0 in range(0, n, WIDE_BLOCK):
        total += _softmax_bwd_stage_span(ya, dya, yc, dyc, dot, dxc, zero, c0,
                                         min(n, c0 + WIDE_BLOCK), ahead)
    return total


#: the pipelined softmax backward and RMSNorm forward realign their streamed rows
#: from this many bytes (``_softmax_bwd_stage_span``, ``_rms_norm_fwd_stage_span``;
#: the elementwise store loops from _lanes.HEAD_MIN_BYTES)
STAGE_HEAD_BYTES = 3 << 10


@_row
def _softmax_bwd_stage_span(ya, dya, yc, dyc, dot, dxc, zero, c0, c1, ahead):
    """Columns c0..c1-1 of the stage. A streamed dxc that starts off a cache line
    stores its first ``stream_head`` columns on their own and its whole blocks from
    there, on lines (streamed), h columns ahead of the sums' blocks, which keep the
    row's own (the same bits). ab.py --evict 64, AMD EPYC, 2026-12-07, float32:
    4100x4097 1.15x, 330x50257 1.11x. Not the softmax forward's stage: its store
    reads the row's exps from an aligned scratch row, which the shift splits
    across lines (29000x577 0.80x, 16384x1000 0.96x); nor the norm backwards', whose
    dweight/dbias partial rows it would split likewise (the row path's store, h
    ahead: 0.52-0.78x at 197-769 columns). Rows of STAGE_HEAD_BYTES and more:
    bfloat16 1025 columns (2050 bytes) ran 0.97x, 2049 1.05-1.07x, 4097 1.19x,
    50257 1.27x; float64 4097 and 50257 1.14-1.15x."""
    s = g = lanes_zeros(ya)
    step = lanes_count(s)
    h = stream_head(dxc, c0, c1 - c0, STAGE_HEAD_BYTES)
    if h:
        _softmax_bwd_block(yc, dyc, dot, dxc, c0, h)
    n = c1 - c0
    whole = (n - h) // step
    for c in range(c0, c0 + whole * step, step):
        _prefetch_halves(ya, c + PREFETCH_AHEAD)
        _prefetch_halves(dya, c + PREFETCH_AHEAD)
        _prefetch_ahead(ya, c, ahead)
        _prefetch_ahead(dya, c, ahead)
        _softmax_bwd_block(yc, dyc, dot, dxc, h + c, step)
        s, g = _grad_sums_block(dya, None, ya, zero, s, g, c, step)
    if n // step > whole:
        s, g = _grad_sums_block(dya, None, ya, zero, s, g, c0 + whole * step, step)
    if n % step:
        s, g = _grad_sums_block(dya, None, ya, zero, s, g, c1 - n % step, n % step)
    if (n - h) % step:
        _softmax_bwd_block(yc, dyc, dot, dxc, c1 - (n - h) % step, (n - h) % step)
    return lanes_sum(s)


@_row
def _softmax_bwd_block(y, dy, dot, dx, c, k):
    lanes_store(dx, c, lanes_load(y, c, k) * (lanes_load(dy, c, k) - dot), k)


# ------------------------------------------------------------------ RMSNorm
@_row
def _rms_norm_rstd(x, ss, eps):
    """rstd = 1 / sqrt(mean(x**2) + eps) from ss = sum(x**2)."""
    return acc(x, 1.0) / np.sqrt(ss / acc(x, x.shape[0]) + acc(x, eps))


@_row
def _rms_norm_store(x, weight, rstd, y):
    """y = x * rstd * weight (the stage's store, the same operations)."""
    for c in range(x.shape[0]):
        y[c] = narrow(_times(widen(x[c]) * rstd, weight, c), y)


@_row
def _rms_norm_fwd_stage(xa, xc, weight, rstd, yc, ahead):
    """One pass of the pipelined forward (``_rms_norm_fwd_rows``): returns
    sum(xa**2) and stores yc = xc * rstd * weight."""
    return _rms_norm_fwd_stage_at(xa.shape[0], _data(xa), _data(xc), _data(weight), rstd,
                                  _data(yc), ahead)


@_lanes_fn
def _rms_norm_fwd_stage_at(n, xa, xc, weight, rstd, yc, ahead):
    """``_rms_norm_fwd_stage`` on data pointers (see ``_lanes_fn``); the sum of a
    long row by blocks (see WIDE_COLS); float32/float64 prefetch xa ``ahead``
    elements on (``_ahead``)."""
    _aligned_frame()
    if n < WIDE_COLS:
        return _rms_norm_fwd_stage_span(xa, xc, weight, rstd, yc, 0, n, ahead)
    ss = acc(xa, -0.0)
    for c0 in range(0, n, WIDE_BLOCK):
        ss += _rms_norm_fwd_stage_span(xa, xc, weight, rstd, yc, c0, min(n, c0 + WIDE_BLOCK),
                                       ahead)
    return ss


@_row
def _rms_norm_fwd_stage_span(xa, xc, weight, rstd, yc, c0, c1, ahead):
    """Columns c0..c1-1 of the stage. A float32/float64 yc that streams and starts
    off a cache line stores its first ``stream_head`` columns on their own and its
    whole blocks from there, on lines (streamed), h columns ahead of the sums'
    blocks, which keep the row's own (the same bits), for rows of STAGE_HEAD_BYTES
    and more. ab.py --evict 64, AMD EPYC, 2026-12-07, float32: 1000 columns
    1.28-1.43x (three runs), 1001 1.13x, 1500 1.21x, 2049 1.16x, 3001 1.10-1.13x,
    769 0.99-1.14x, but 577 0.92-1.08x (so not under 3 KiB); float64 769 1.09x;
    aligned rows 0.99-1.02x. Not float16/bfloat16 rows, bound by their arithmetic:
    the misaligned ones gained nothing, and the aligned ones ran this loop
    0.90-0.96x. Nor the LayerNorm forward's stage: 0.81-0.94x at 577-1001
    columns, 1.21x at 1000, 0.92x aligned."""
    ss = lanes_zeros(xa)
    step = lanes_count(ss)
    n = c1 - c0
    if not _wide_store_dtype(yc):
        for c in range(c0, c1 - step + 1, step):
            _prefetch_halves(xa, c + PREFETCH_AHEAD)
            ss = _rms_norm_fwd_block(xa, xc, weight, rstd, yc, ss, c, step)
        if n % step:
            ss = _rms_norm_fwd_block(xa, xc, weight, rstd, yc, ss, c1 - n % step, n % step)
        return lanes_sum(ss)
    h = stream_head(yc, c0, n, STAGE_HEAD_BYTES)
    if h:
        _rms_norm_fwd_store(xc, weight, rstd, yc, c0, h)
    whole = (n - h) // step
    for c in range(c0, c0 + whole * step, step):
        _prefetch_wide(xa, c, ahead)
        ss = _rms_norm_fwd_sum(xa, ss, c, step)
        _rms_norm_fwd_store(xc, weight, rstd, yc, h + c, step)
    if n // step > whole:
        ss = _rms_norm_fwd_sum(xa, ss, c0 + whole * step, step)
    if n % step:
        ss = _rms_norm_fwd_sum(xa, ss, c1 - n % step, n % step)
    if (n - h) % step:
        _rms_norm_fwd_store(xc, weight, rstd, yc, c1 - (n - h) % step, (n - h) % step)
    return lanes_sum(ss)


def _wide_store_dtype(row):
    """Whether an output row (array, pointer or Stream) holds float32/float64."""
    raise NotImplementedError


@overload(_wide_store_dtype)
def _wide_store_dtype_impl(row):
    wide = getattr(row, "dtype", None) in (types.float32, types.float64)
    return lambda row: wide


@_row
def _rms_norm_fwd_block(xa, xc, weight, rstd, yc, ss, c, k):
    ss = _rms_norm_fwd_sum(xa, ss, c, k)     # xa's load first: nothing says yc is not xa
    _rms_norm_fwd_store(xc, weight, rstd, yc, c, k)
    return ss


@_row
def _rms_norm_fwd_sum(xa, ss, c, k):
    v = lanes_load(xa, c, k)          # zero-padded: the squares need no mask
    return _fma(v, v, ss)


@_row
def _rms_norm_fwd_store(xc, weight, rstd, yc, c, k):
    v = lanes_load_like(xc, c, k, _lanes_beside(xc, weight, None))
    lanes_store(yc, c, _vtimes(v * rstd, weight, c, k), k)


@_row
def _rms_norm_fwd_rows(x, weight, eps, y, rstd, lo, hi):
    """rstd = 1 / sqrt(mean(x**2) + eps); y = x * rstd * weight, for rows lo..hi-1,
    software-pipelined as ``_softmax_fwd_rows`` in two stages: one pass sums the
    squares of row r + 1 (from memory) and stores row r (in cache). Row lo's sum
    and row hi-1's store are passes of their own, with the stage's lanes and
    operations: a row's bits do not depend on lo and hi (so neither on the thread
    count), and a chunk of one row is the plain two-pass row. Pipelined: ab.py
    median ratios 0.97-1.28x over float32, bfloat16 and float64 (2026-12-04).
    Rows of PAIR_BYTES and more go two at a time (``_rms_norm_fwd_pairs``). y is
    written with non-temporal stores from STREAM_BYTES on in every dtype (see
    ``_fwd_stream``)."""
    if _paired(x, lo, hi):
        _rms_norm_fwd_pairs(x, weight, eps, y, rstd, lo, hi)
        return
    rc = _rms_norm_rstd(_row_at(x, lo), _sum_sq(_row_at(x, lo), acc(x, 0.0))[0], eps)
    rstd[lo] = rc
    stream = _streams(y)
    ahead = _ahead(x, 1)
    for r in range(lo, hi - 1):
        xa = _row_at(x, r + 1)
        ss = _rms_norm_fwd_stage(xa, _row_at(x, r), weight, rc,
                                 streaming(_row_at(y, r), stream), ahead)
        rc = _rms_norm_rstd(xa, ss, eps)
        rstd[r + 1] = rc
    _rms_norm_store(_row_at(x, hi - 1), weight, rc, _row_at(y, hi - 1))


#: norm forwards on rows of at least this many bytes run their pipeline two
#: rows at a time (long rows by the same blocks: WIDE_COLS): one pass stores rows r and
#: r + 1 and takes the sums of rows r + 2 and r + 3, loading each weight (and
#: bias) element once for both. Why: at 4,096 float32 columns the stage's rows
#: and parameters exceed the 32 KiB L1, and every parameter row read from the L2
#: cost ~0.035 ns per element from memory (layer_norm fwd 0.345 with weight and
#: bias, 0.274 with neither; 2026-12-06). ab.py --evict 64 against one row at a
#: time (the same bits), AMD EPYC, 2 threads, 2026-12-06: float32 layer_norm
#: 1.12-1.13x at 4096x4096, 1024x16384 and 1024x4096, rms_norm 1.00-1.06x;
#: bfloat16 at 16,384 columns 1.07-1.13x, but at 4,096 (8 KiB rows) 0.90-0.98x,
#: and float32 1,024 columns 0.72-0.88x in a first trial: rows that fit the L1
#: one at a time lose. Past WIDE_COLS (against pairs below it only): 64x65536
#: 1.05-1.13x but layer_norm bfloat16 0.99-1.08x, 16x262144 float32 0.97-1.08x,
#: bfloat16 0.95-1.03x.
PAIR_BYTES = 1 << 14


@njit(inline='always')
def _paired(x, lo, hi):
    """Whether rows lo..hi-1 of a norm forward go two at a time (PAIR_BYTES); the
    backwards' rule: ``_bwd_paired``."""
    return x.shape[2] * x.itemsize >= PAIR_BYTES and hi - lo >= 4


@_long_rows_fn
def _rms_norm_fwd_pairs(x, weight, eps, y, rstd, lo, hi):
    """``_rms_norm_fwd_rows`` two rows at a time (see PAIR_BYTES): rows lo and lo + 1
    take their sums on their own, each pass stores two rows and sums the next two,
    and the last two or three rows are stored on their own (the third takes its
    sum first). Each row's sums and store have the lanes and operations of the
    one-row pipeline: the same bits."""
    _wide_for_halves(x)      # as the drivers: the stores' loops are compiled here
    for r in range(lo, lo + 2):
        rstd[r] = _rms_norm_rstd(_row_at(x, r), _sum_sq(_row_at(x, r), acc(x, 0.0))[0], eps)
    r = lo
    stream = _streams(y)
    ahead = _ahead(x, 2)
    while r + 3 < hi:
        s0, s1 = _rms_norm_fwd_stage2_at(
            x.shape[2], _data(_row_at(x, r + 2)), _data(_row_at(x, r + 3)),
            _data(_row_at(x, r)), _data(_row_at(x, r + 1)), _data(weight),
            acc(x, rstd[r]), acc(x, rstd[r + 1]), streaming(_row_at(y, r), stream),
            streaming(_row_at(y, r + 1), stream), ahead)
        rstd[r + 2] = _rms_norm_rstd(_row_at(x, r + 2), s0, eps)
        rstd[r + 3] = _rms_norm_rstd(_row_at(x, r + 3), s1, eps)
        r += 2
    if hi - r == 3:
        rstd[r + 2] = _rms_norm_rstd(_row_at(x, r + 2),
                                     _sum_sq(_row_at(x, r + 2), acc(x, 0.0))[0], eps)
    for k in range(r, hi):
        _rms_norm_store(_row_at(x, k), weight, acc(x, rstd[k]), _row_at(y, k))


@_lanes_fn
def _rms_norm_fwd_stage2_at(n, xa0, xa1, xc0, xc1, weight, rstd0, rstd1, yc0, yc1, ahead):
    """Two rows' ``_rms_norm_fwd_stage_at`` in one pass (``_rms_norm_fwd_pairs``):
    stores yc0, yc1 and returns the sums of squares of xa0, xa1, long rows by the
    same blocks (see WIDE_COLS)."""
    _aligned_frame()
    _no_alias_args("xa0 xa1 xc0 xc1 weight")
    if n < WIDE_COLS:
        return _rms_norm_fwd_span2(xa0, xa1, xc0, xc1, weight, rstd0, rstd1, yc0, yc1, 0, n,
                                   ahead)
    s0 = s1 = acc(xa0, -0.0)
    for c0 in range(0, n, WIDE_BLOCK):
        a, b = _rms_norm_fwd_span2(xa0, xa1, xc0, xc1, weight, rstd0, rstd1, yc0, yc1, c0,
                                   min(n, c0 + WIDE_BLOCK), ahead)
        s0, s1 = s0 + a, s1 + b
    return s0, s1


@_row
def _rms_norm_fwd_span2(xa0, xa1, xc0, xc1, weight, rstd0, rstd1, yc0, yc1, c0, c1, ahead):
    s0 = s1 = lanes_zeros(xa0)
    step = lanes_count(s0)
    for c in range(c0, c1 - step + 1, step):
        _prefetch_halves(xa0, c + PREFETCH_AHEAD)
        _prefetch_halves(xa1, c + PREFETCH_AHEAD)
        _prefetch_wide(xa0, c, ahead)
        _prefetch_wide(xa1, c, ahead)
        s0 = _rms_norm_fwd_block(xa0, xc0, weight, rstd0, yc0, s0, c, step)
        s1 = _rms_norm_fwd_block(xa1, xc1, weight, rstd1, yc1, s1, c, step)
    if (c1 - c0) % step:
        c, k = c1 - (c1 - c0) % step, (c1 - c0) % step
        s0 = _rms_norm_fwd_block(xa0, xc0, weight, rstd0, yc0, s0, c, k)
        s1 = _rms_norm_fwd_block(xa1, xc1, weight, rstd1, yc1, s1, c, k)
    return lanes_sum(s0), lanes_sum(s1)


@_row
def _norm_dx(g, xhat, rstd, dot, gmean):
    """A norm backward's dx = rstd * (g - xhat * dot - gmean), as
    rstd * g - ((rstd * dot) * xhat + rstd * gmean): two FMAs per element instead of
    four operations (the half backwards are bound by their arithmetic, 2026-12-05;
    the two row constants are loop-invariant). RMSNorm's is LayerNorm's with gmean 0.
    g, xhat may be lanes."""
    return _fms(rstd, g, _fma(rstd * dot, xhat, rstd * gmean))


# ---------------------------------------------------------------- LayerNorm
#: a LayerNorm row takes its second statistics pass when sum((x - m0)**2) / n
#: exceeds this many times the variance (see _layer_norm_fwd_row)
LN_SHIFT_COND = 8.0


@_row
def _layer_norm_store(x, weight, bias, mean, rstd, y):
    """y = (x - mean) * rstd * weight + bias, the last two by an FMA (the stage's
    store, the same operations).

    The statistics (``_layer_norm_fwd_rows``) are shifted sums: with d = x - m0,
    var = sum(d**2)/n - (sum(d)/n)**2, and mean = sum(x/n) directly
    (m0 + sum(d)/n would carry m0's rounding, eps*|m0|,
    which for a row whose mean is small against its spread measured up to 37x
    (median 14x) the error of the plain sum, and made the benchmark's error gate
    flaky on (1, 300) float32 rows). The cancellation in var is that of
    (mean - m0)**2 against var, so its relative error is ~eps * S/var with
    S = sum(d**2)/n = var + (mean - m0)**2. m0 is the mean of the row's first 4
    elements (``shift_points``), S/var ~ 1.25 for a typical row, and one pass over
    the row gives both statistics. A row with S > LN_SHIFT_COND * var (the sampled
    elements are outliers, or NaN/inf) takes a second pass
    about the first mean: the two-pass algorithm, whose deviations also correct
    the rounding of the first mean. Never E[x^2] - E[x]^2 about 0, which loses
    every digit for rows whose mean is large against their spread.
    rstd = 1 / sqrt(var + eps)."""
    for c in range(x.shape[0]):
        y[c] = narrow(_affine((widen(x[c]) - mean) * rstd, weight, bias, c), y)


def shift_points(cols):
    """The columns whose mean is a LayerNorm row's shift m0 (``_layer_norm_shift``):
    the first 4, or all of a shorter row with its last one repeated."""
    return [min(c, cols - 1) for c in range(4)]


@_row
def _layer_norm_shift(x):
    """m0: the mean of the row's first 4 elements (``shift_points``; see
    _layer_norm_store). The first, not 4 spread over the row (at 0, n/4, n/2,
    3n/4, until 2026-12-07): the pipelined stages take a row's m0 before its pass,
    and three loads from the middle of a row not yet read each waited for memory,
    where the row's first line is the one its pass reads first (the prefetchers'
    stream runs on into it from the row before). ab.py --evict 64, AMD EPYC, 2
    threads, three runs: float32 4096x4096 1.07-1.11x, 65536x1024 1.06-1.07x,
    2048x8192 1.06x; bfloat16 0.99-1.05x; in cache 1.00-1.03x; m0 = 0 (no loads at
    all, wrong bits on purpose) gained as much. For i.i.d. rows the two samples are
    alike; a row whose first 4 elements are outliers (sorted rows too) takes the
    second pass, as a row whose spread samples were outliers did."""
    last = x.shape[0] - 1
    quarter = acc(x, 0.25)       # scaled first: the sum cannot overflow
    return (widen(x[0]) * quarter + widen(x[min(1, last)]) * quarter
            + widen(x[min(2, last)]) * quarter + widen(x[min(3, last)]) * quarter)


@_row
def _layer_norm_stats(x, sums, inv_cols, eps):
    """(mean, rstd) from _moments(x, m0, inv_cols), with the second pass over x
    where the shifted sums are not accurate enough (see _layer_norm_store)."""
    mean, ss, sd = sums
    shift = sd * inv_cols
    var = ss * inv_cols - shift * shift
    if not ss * inv_cols <= acc(x, LN_SHIFT_COND) * var:
        ss, sd = _sum_sq(x, mean)
        shift = sd * inv_cols
        mean = mean + shift
        var = ss * inv_cols - shift * shift
    var = acc(x, 0.0) if var < acc(x, 0.0) else var   # rounding; NaN stays NaN
    return mean, acc(x, 1.0) / np.sqrt(var + acc(x, eps))


@_row
def _layer_norm_fwd_stage(xa, m0, inv_cols, xc, weight, bias, mean, rstd, yc, ahead):
    """One pass of the pipelined forward (``_layer_norm_fwd_rows``): returns
    _moments(xa, m0, inv_cols) and stores yc = (xc - mean) * rstd * weight + bias."""
    return _layer_norm_fwd_stage_at(xa.shape[0], _data(xa), m0, inv_cols, _data(xc),
                                    _data(weight), _data(bias), mean, rstd, _data(yc), ahead)


@_lanes_fn
def _layer_norm_fwd_stage_at(n, xa, m0, inv_cols, xc, weight, bias, mean, rstd, yc, ahead):
    """``_layer_norm_fwd_stage`` on data pointers (see ``_lanes_fn``); the sums of a
    long row by blocks (see WIDE_COLS); float32/float64 prefetch xa ``ahead``
    elements on (``_ahead``)."""
    _aligned_frame()
    if n < WIDE_COLS:
        return _layer_norm_fwd_stage_span(xa, m0, inv_cols, xc, weight, bias, mean, rstd, yc,
                                          0, n, ahead)
    sm = ss = sd = acc(xa, -0.0)
    for c0 in range(0, n, WIDE_BLOCK):
        a, b, d = _layer_norm_fwd_stage_span(xa, m0, inv_cols, xc, weight, bias, mean, rstd,
                                             yc, c0, min(n, c0 + WIDE_BLOCK), ahead)
        sm, ss, sd = sm + a, ss + b, sd + d
    return sm, ss, sd


@_row
def _layer_norm_fwd_stage_span(xa, m0, inv_cols, xc, weight, bias, mean, rstd, yc, c0, c1,
                               ahead):
    sm = ss = sd = lanes_zeros(xa)
    step = lanes_count(ss)
    for c in range(c0, c1 - step + 1, step):
        _prefetch_halves(xa, c + PREFETCH_AHEAD)
        _prefetch_wide(xa, c, ahead)
        sm, ss, sd = _layer_norm_fwd_block(xa, m0, inv_cols, xc, weight, bias, mean, rstd,
                                           yc, sm, ss, sd, c, step)
    if (c1 - c0) % step:
        sm, ss, sd = _layer_norm_fwd_block(xa, m0, inv_cols, xc, weight, bias, mean, rstd,
                                           yc, sm, ss, sd, c1 - (c1 - c0) % step,
                                           (c1 - c0) % step)
    return lanes_sum(sm), lanes_sum(ss), lanes_sum(sd)


@_row
def _layer_norm_fwd_block(xa, m0, inv_cols, xc, weight, bias, mean, rstd, yc, sm, ss, sd,
                          c, k):
    _layer_norm_fwd_store(xc, weight, bias, mean, rstd, yc, c, k)
    return _moments_block(xa, m0, inv_cols, sm, ss, sd, c, k)


@_row
def _layer_norm_fwd_store(xc, weight, bias, mean, rstd, yc, c, k):
    """yc[c:c+k] = (xc - mean) * rstd * weight + bias (the last two by an FMA)."""
    v = lanes_load_like(xc, c, k, _lanes_beside(xc, weight, bias))
    lanes_store(yc, c, _vaffine((v - mean) * rstd, weight, bias, c, k), k)


@_row
def _layer_norm_fwd_rows(x, weight, bias, eps, y, mean, rstd, lo, hi):
    """Rows lo..hi-1, pipelined as ``_rms_norm_fwd_rows`` (row lo's sums and row
    hi-1's store on their own): one pass takes the shifted sums of row r + 1 and
    stores row r; a row that needs the second statistics pass takes it while in
    cache, before its store. Statistics and store: see ``_layer_norm_store``.
    Rows of PAIR_BYTES and more go two at a time (``_layer_norm_fwd_pairs``), and
    float32/float64 rows a little shorter unpipelined (``_ln_fwd_two_passes``). y
    is written with non-temporal stores from STREAM_BYTES on in every dtype (see
    ``_fwd_stream``)."""
    if _paired(x, lo, hi):
        _layer_norm_fwd_pairs(x, weight, bias, eps, y, mean, rstd, lo, hi)
        return
    inv_cols = acc(x, 1.0) / acc(x, x.shape[2])
    stream = _streams(y)
    if _ln_fwd_two_passes(x):
        for r in range(lo, hi):
            xr = _row_at(x, r)
            mc, rc = _layer_norm_stats(xr, _moments(xr, _layer_norm_shift(xr), inv_cols),
                                       inv_cols, eps)
            mean[r], rstd[r] = mc, rc
            _layer_norm_store_at(x.shape[2], _data(xr), _data(weight), _data(bias), mc, rc,
                                 _data(streaming(_row_at(y, r), stream)))
        return
    xa = _row_at(x, lo)
    mc, rc = _layer_norm_stats(xa, _moments(xa, _layer_norm_shift(xa), inv_cols), inv_cols,
                               eps)
    mean[lo], rstd[lo] = mc, rc
    ahead = _ahead(x, 1)
    for r in range(lo, hi - 1):
        xa = _row_at(x, r + 1)
        sums = _layer_norm_fwd_stage(xa, _layer_norm_shift(xa), inv_cols, _row_at(x, r),
                                     weight, bias, mc, rc, streaming(_row_at(y, r), stream),
                                     ahead)
        mc, rc = _layer_norm_stats(xa, sums, inv_cols, eps)
        mean[r + 1], rstd[r + 1] = mc, rc
    _layer_norm_store(_row_at(x, hi - 1), weight, bias, mc, rc, _row_at(y, hi - 1))


#: float32/float64 LayerNorm forwards on rows of more than LN_TWO_PASS_BYTES
#: (and under PAIR_BYTES) take each row's two passes in turn, unpipelined
#: (``_ln_fwd_two_passes``)
LN_TWO_PASS_BYTES = 1 << 12


@njit(inline='always')
def _ln_fwd_two_passes(x):
    """Whether a LayerNorm forward's rows take their two passes one row after the
    other (the statistics, then the store) instead of the pipeline: float32/float64
    rows of more than LN_TWO_PASS_BYTES and under PAIR_BYTES. Why: the pipelined
    stage holds x's row r + 1 (read for its sums) until the next pass stores it,
    and reads the weight and the bias once a row: per L1 set that is 4L lines
    between two uses of a line (L = row bytes / 4 KiB), at or past the 8 ways
    from 8 KiB. Measured from memory (AMD EPYC, 2026-12-07, 2 threads): float32
    8192x2048 0.248 ns per element against 0.189 without the bias and 0.175 at
    1024 columns. Two passes a row against the pipeline, ab.py --evict 64, 11
    rounds: float32 1536 columns 1.48x, 2048 1.09-1.25x (five runs), 3072 1.35x,
    1280 1.08x; float64 1536 columns 1.15x; 1024 float32 columns (4 KiB) 1.00-1.08x
    but 0.96-0.97x in cache, so not there; in cache (--calls 10) from 1536
    columns 0.97-1.06x. Rows of PAIR_BYTES and more stay paired (two passes a row
    ran 0.93-0.96x there); float16/bfloat16 forwards, bound by their arithmetic,
    did not move (0.99-1.00x). The same operations as the stage: the same bits.
    Not in calls of STREAM_BYTES and more since 2026-12-07, where the stage
    prefetches x (PREFETCH_L2_BYTES): the pipeline against two passes a row, ab.py
    --evict 64, float32 8192x2048 1.16-1.27x, 16384x1536 1.45x; under
    STREAM_BYTES, without the prefetch, 1024x2048 0.89-0.91x."""
    return (x.itemsize >= 4 and LN_TWO_PASS_BYTES < x.shape[2] * x.itemsize < PAIR_BYTES
            and not _prefetches(x))


@_lanes_fn
def _layer_norm_store_at(n, x, weight, bias, mean, rstd, y):
    """``_layer_norm_store`` in the pipelined stage's lanes and operations (the same
    bits), on data pointers (see ``_lanes_fn``); y may be streaming."""
    _aligned_frame()
    _no_alias_args("x weight bias")
    step = lanes_count(lanes_zeros(x))
    h = stream_head(y, 0, n, 0)
    if h:
        _layer_norm_fwd_store(x, weight, bias, mean, rstd, y, 0, h)
    for c in range(h, n - step + 1, step):
        _layer_norm_fwd_store(x, weight, bias, mean, rstd, y, c, step)
    if (n - h) % step:
        _layer_norm_fwd_store(x, weight, bias, mean, rstd, y, n - (n - h) % step,
                              (n - h) % step)


@_long_rows_fn
def _layer_norm_fwd_pairs(x, weight, bias, eps, y, mean, rstd, lo, hi):
    """``_layer_norm_fwd_rows`` two rows at a time, as ``_rms_norm_fwd_pairs``: the
    same bits."""
    _wide_for_halves(x)
    inv_cols = acc(x, 1.0) / acc(x, x.shape[2])
    for r in range(lo, lo + 2):
        xa = _row_at(x, r)
        mean[r], rstd[r] = _layer_norm_stats(
            xa, _moments(xa, _layer_norm_shift(xa), inv_cols), inv_cols, eps)
    r = lo
    stream = _streams(y)
    ahead = _ahead(x, 2)
    while r + 3 < hi:
        xa0, xa1 = _row_at(x, r + 2), _row_at(x, r + 3)
        s = _layer_norm_fwd_stage2_at(
            x.shape[2], _data(xa0), _data(xa1), _layer_norm_shift(xa0),
            _layer_norm_shift(xa1), inv_cols, _data(_row_at(x, r)), _data(_row_at(x, r + 1)),
            _data(weight), _data(bias), acc(x, mean[r]), acc(x, rstd[r]),
            acc(x, mean[r + 1]), acc(x, rstd[r + 1]), streaming(_row_at(y, r), stream),
            streaming(_row_at(y, r + 1), stream), ahead)
        mean[r + 2], rstd[r + 2] = _layer_norm_stats(xa0, (s[0], s[1], s[2]), inv_cols, eps)
        mean[r + 3], rstd[r + 3] = _layer_norm_stats(xa1, (s[3], s[4], s[5]), inv_cols, eps)
        r += 2
    if hi - r == 3:
        xa = _row_at(x, r + 2)
        mean[r + 2], rstd[r + 2] = _layer_norm_stats(
            xa, _moments(xa, _layer_norm_shift(xa), inv_cols), inv_cols, eps)
    for k in range(r, hi):
        _layer_norm_store(_row_at(x, k), weight, bias, acc(x, mean[k]), acc(x, rstd[k]),
                          _row_at(y, k))


@_lanes_fn
def _layer_norm_fwd_stage2_at(n, xa0, xa1, m00, m01, inv_cols, xc0, xc1, weight, bias,
                              mean0, rstd0, mean1, rstd1, yc0, yc1, ahead):
    """Two rows' ``_layer_norm_fwd_stage_at`` in one pass (``_layer_norm_fwd_pairs``):
    stores yc0, yc1 and returns the shifted sums of xa0 (about m00), then of xa1
    (about m01), long rows by the same blocks (see WIDE_COLS)."""
    _aligned_frame()
    _no_alias_args("xa0 xa1 xc0 xc1 weight bias")
    if n < WIDE_COLS:
        return _layer_norm_fwd_span2(xa0, xa1, m00, m01, inv_cols, xc0, xc1, weight, bias,
                                     mean0, rstd0, mean1, rstd1, yc0, yc1, 0, n, ahead)
    z = acc(xa0, -0.0)
    s = (z, z, z, z, z, z)
    for c0 in range(0, n, WIDE_BLOCK):
        t = _layer_norm_fwd_span2(xa0, xa1, m00, m01, inv_cols, xc0, xc1, weight, bias,
                                  mean0, rstd0, mean1, rstd1, yc0, yc1, c0,
                                  min(n, c0 + WIDE_BLOCK), ahead)
        s = (s[0] + t[0], s[1] + t[1], s[2] + t[2], s[3] + t[3], s[4] + t[4], s[5] + t[5])
    return s


@_row
def _layer_norm_fwd_span2(xa0, xa1, m00, m01, inv_cols, xc0, xc1, weight, bias, mean0, rstd0,
                          mean1, rstd1, yc0, yc1, c0, c1, ahead):
    sm0 = ss0 = sd0 = sm1 = ss1 = sd1 = lanes_zeros(xa0)
    step = lanes_count(sm0)
    for c in range(c0, c1 - step + 1, step):
        _prefetch_halves(xa0, c + PREFETCH_AHEAD)
        _prefetch_halves(xa1, c + PREFETCH_AHEAD)
        _prefetch_wide(xa0, c, ahead)
        _prefetch_wide(xa1, c, ahead)
        sm0, ss0, sd0 = _layer_norm_fwd_block(xa0, m00, inv_cols, xc0, weight, bias, mean0,
                                              rstd0, yc0, sm0, ss0, sd0, c, step)
        sm1, ss1, sd1 = _layer_norm_fwd_block(xa1, m01, inv_cols, xc1, weight, bias, mean1,
                                              rstd1, yc1, sm1, ss1, sd1, c, step)
    if (c1 - c0) % step:
        c, k = c1 - (c1 - c0) % step, (c1 - c0) % step
        sm0, ss0, sd0 = _layer_norm_fwd_block(xa0, m00, inv_cols, xc0, weight, bias, mean0,
                                              rstd0, yc0, sm0, ss0, sd0, c, k)
        sm1, ss1, sd1 = _layer_norm_fwd_block(xa1, m01, inv_cols, xc1, weight, bias, mean1,
                                              rstd1, yc1, sm1, ss1, sd1, c, k)
    return (lanes_sum(sm0), lanes_sum(ss0), lanes_sum(sd0), lanes_sum(sm1), lanes_sum(ss1),
            lanes_sum(sd1))


@_row
def _layer_norm_bwd_store(dy, x, weight, mean, rstd, dot, gmean, dx, dweight, dbias, first,
                          stream):
    """The store pass of a row given its sums (the pipelines' first and last rows;
    ``_norm_bwd_row_at`` has it after the sums): the pipelined stage's store
    (``_norm_bwd_store_at``, dx, dweight and dbias in one loop of lanes). With mean
    None, gmean 0 and dbias None it is RMSNorm's (its x - 0 would be exact). It replaced
    an element loop that LLVM vectorized, with dbias in a loop of its own (as a third
    output there the bfloat16 backward ran ~1.6x slower): the same bits, and on the AMD
    EPYC, 2026-12-05, from memory bfloat16 1024-2048 columns 1.12-1.34x, float16
    1.00-1.15x, float32 0.97-1.13x; in cache 1.03-1.12x (small float32 calls
    0.96-1.12x).

    ``stream``: dx in non-temporal stores (``_streams``). Until 2026-12-07 this
    store never streamed, so the float32/float64 row path (rows under
    BWD_PIPELINE_BYTES) read every line of dx before writing it. ab.py --evict 64,
    9 rounds, AMD EPYC, float32: rms_norm bwd 1.12-1.23x, layer_norm bwd
    1.04-1.29x (65536x1024 1.14x / 1.04x; 8192x2000 1.23x / 1.29x), bfloat16
    (pipelined from fewer columns) 0.99-1.03x."""
    # np.intp(0) and first != False: plain int64 and bool, where a literal 0 or
    # False compiled the callee again (62 of its 78 signatures in a CI run, 2026-12-06)
    _norm_bwd_store_at(np.intp(0), x.shape[0], _data(dy), _data(x), _data(weight), mean,
                       rstd, dot, gmean, _target(dx, dy, stream),
                       _data(dweight), _data(dbias), first != False)  # noqa: E712


@_row
def _layer_norm_bwd_sums(dy, x, weight, mean, rstd):
    """(mean(g * xhat), mean(g)) of a row."""
    inv_cols = acc(x, 1.0) / acc(x, x.shape[0])
    dot, gsum = _grad_sums(dy, weight, x, mean)
    return rstd * dot * inv_cols, gsum * inv_cols


@_long_rows_fn
def _norm_bwd_rows(dy, x, weight, mean, rstd, dx, wparts, bparts, chunks, k0, k1):
    """The rows of chunks k0..k1-1 (of ``chunks``; see ``_chunk_rows``) of a norm
    backward (LayerNorm; RMSNorm with mean None), software-pipelined as
    ``_softmax_bwd_rows``: one pass over the columns stores row r (dx, and its
    terms into its chunk's dweight/dbias partial rows wparts/bparts[k], in cache)
    while it takes the sums of row r + 1 (from memory). The first row's sums and
    the last row's store are passes of their own, with the stage's lanes and
    operations: dx has the row-by-row bits, and each partial adds its chunk's rows'
    terms one row at a time, in row order, as the row path does.

    One pipeline runs through all the chunks of a thread, so a thread whose chunks
    hold one row each (16x65536: 16 partial rows) still overlaps every row's sums
    with the previous row's store; pipelined per chunk it could not (float32
    16x65536 from memory 1.5 ms against 0.68 column-blocked, 2026-12-05).

    Which rows take it: ``_rows_pipelined``. It replaced row pairs (one store pass
    for two rows, each partial element read and written once per two rows;
    float32/float64 from 1024 columns, halves from 4096), whose stage kept twice
    the live lanes and spilled, and it leaves one dweight/dbias order on every
    path. Against the pipelined pairs (AMD EPYC, 2026-12-05, ab.py and five buffer
    placements, 2 threads, from memory): float32 65536x1024 rms_norm bwd
    1.01-1.42x, layer_norm bwd 0.87-1.12x; one thread in cache 0.93-1.05x in L2,
    1.19-1.40x from L3; 4096 columns 0.91-1.03x; float64 0.95-1.07x; bfloat16
    65536x1024 rms_norm 1.09-1.26x, layer_norm 1.20-1.35x; against the row path
    (below the old pair floors) bfloat16 1.24-1.44x at 64-2048 columns in cache,
    while that row path stored element by element (in lanes it has won below
    4096 columns from memory since: see _rows_pipelined).
    """
    rows = x.shape[0] * x.shape[1]
    lo, hi = _chunk_rows(k0, rows, chunks)[0], _chunk_rows(k1 - 1, rows, chunks)[1]
    if _bwd_paired(x, hi - lo, k1 - k0):
        _norm_bwd_chunks_paired(dy, x, weight, mean, rstd, dx, wparts, bparts, rows, chunks,
                                k0, k1)
        return
    inv_cols = acc(x, 1.0) / acc(x, x.shape[2])
    dot, gmean = _layer_norm_bwd_sums(_row_at(dy, lo), _row_at(x, lo), weight,
                                      _stat(x, mean, lo), acc(x, rstd[lo]))
    k, start, end = k0, lo, _chunk_rows(k0, rows, chunks)[1]
    stream = _streams(dx)
    ahead = _ahead(x, 1)
    for r in range(lo, hi - 1):
        if r == end:             # row r opens chunk k + 1
            k, start, end = k + 1, r, _chunk_rows(k + 1, rows, chunks)[1]
        dyc = _row_at(dy, r)
        s, g = _norm_bwd_stage_at(
            x.shape[2], _data(dyc), _data(_row_at(x, r)), _data(weight),
            _stat(x, mean, r), acc(x, rstd[r]), dot, _gmean_of(x, mean, gmean),
            _target(_row_at(dx, r), dyc, stream),
            _data(_row_of(wparts, k)), _data(_row_of(bparts, k)), r == start,
            _data(_row_at(dy, r + 1)), _data(_row_at(x, r + 1)),
            _stat(x, mean, r + 1), ahead)
        dot, gmean = acc(x, rstd[r + 1]) * s * inv_cols, g * inv_cols
    if hi - 1 == end:
        k, start = k + 1, hi - 1
    _layer_norm_bwd_store(_row_at(dy, hi - 1), _row_at(x, hi - 1), weight,
                          _stat(x, mean, hi - 1), acc(x, rstd[hi - 1]), dot,
                          _gmean_of(x, mean, gmean), _row_at(dx, hi - 1),
                          _row_of(wparts, k), _row_of(bparts, k), hi - 1 == start, stream)


#: float32/float64 norm backwards on rows of PAIR_BYTES and more whose
#: dweight/dbias chunks hold this many rows or more (on average) run two rows at a
#: time within each chunk (``_norm_bwd_pairs``): the weight is loaded, and the
#: partial rows read and written, once per two rows. Shorter chunks keep the one
#: pipeline through them all. ab.py --evict 64 against one row at a time, AMD EPYC,
#: 2026-12-06: float32 4096x4096 1.03-1.04x, 1024x16384 1.05x, 1024x4096
#: 1.08-1.12x; float64 2048x4096 and 4096x2048 1.03-1.05x; bfloat16 1024x16384
#: 0.95-1.02x, so not the half types (a micro with one partial row per thread
#: had float32 1.07-1.17x).
PAIR_CHUNK_ROWS = 16


@njit(inline='always')
def _bwd_paired(x, rows, chunks):
    """Whether ``rows`` rows in ``chunks`` dweight/dbias chunks of a norm backward
    go two at a time: float32/float64 rows of PAIR_BYTES and more, PAIR_CHUNK_ROWS
    rows a chunk or more on average."""
    return (x.itemsize >= 4 and x.shape[2] * x.itemsize >= PAIR_BYTES
            and rows >= PAIR_CHUNK_ROWS * chunks)


def _norm_bwd_chunks_paired(dy, x, weight, mean, rstd, dx, wparts, bparts, rows, chunks, k0,
                            k1):
    raise NotImplementedError


@overload(_norm_bwd_chunks_paired)
def _norm_bwd_chunks_paired_impl(dy, x, weight, mean, rstd, dx, wparts, bparts, rows, chunks,
                                 k0, k1):
    """Chunks k0..k1-1 of a norm backward two rows at a time (``_norm_bwd_pairs``).
    Nothing for float16/bfloat16, which ``_bwd_paired`` never pairs: decided in
    typing, so their backwards do not compile the pairs."""
    if x.dtype.bitwidth < 32:
        return lambda dy, x, weight, mean, rstd, dx, wparts, bparts, rows, chunks, k0, k1: None

    def impl(dy, x, weight, mean, rstd, dx, wparts, bparts, rows, chunks, k0, k1):
        for k in range(k0, k1):
            start, end = _chunk_rows(k, rows, chunks)
            _norm_bwd_pairs(dy, x, weight, mean, rstd, dx, _row_of(wparts, k),
                            _row_of(bparts, k), start, end)
    return impl


@_long_rows_fn
def _norm_bwd_pairs(dy, x, weight, mean, rstd, dx, wpart, bpart, start, end):
    """Rows start..end-1, one dweight/dbias chunk (partial rows wpart, bpart), of a
    norm backward two rows at a time (see PAIR_BYTES): rows start and start + 1
    take their sums on their own, each pass stores two rows (dx, and both rows'
    terms into the partials, in row order) and sums the next two, and the last two
    or three rows are stored on their own. The lanes and operations of
    ``_norm_bwd_rows``' stage, row by row: the same bits. A chunk of fewer than 4
    rows takes each row's two passes."""
    inv_cols = acc(x, 1.0) / acc(x, x.shape[2])
    stream = _streams(dx)
    if end - start < 4:
        for r in range(start, end):
            _norm_bwd_two_passes(dy, x, weight, mean, rstd, dx, wpart, bpart, r, r == start,
                                 stream)
        return
    d0, m0 = _layer_norm_bwd_sums(_row_at(dy, start), _row_at(x, start), weight,
                                  _stat(x, mean, start), acc(x, rstd[start]))
    d1, m1 = _layer_norm_bwd_sums(_row_at(dy, start + 1), _row_at(x, start + 1), weight,
                                  _stat(x, mean, start + 1), acc(x, rstd[start + 1]))
    r = start
    ahead = _ahead(x, 2)
    while r + 3 < end:
        dy0, dy1 = _row_at(dy, r), _row_at(dy, r + 1)
        s0, g0, s1, g1 = _norm_bwd_stage2_at(
            x.shape[2], _data(dy0), _data(_row_at(x, r)), _data(dy1), _data(_row_at(x, r + 1)),
            _data(weight), _stat(x, mean, r), acc(x, rstd[r]), d0, _gmean_of(x, mean, m0),
            _stat(x, mean, r + 1), acc(x, rstd[r + 1]), d1, _gmean_of(x, mean, m1),
            _target(_row_at(dx, r), dy0, stream),
            _target(_row_at(dx, r + 1), dy1, stream),
            _data(wpart), _data(bpart), r == start,
            _data(_row_at(dy, r + 2)), _data(_row_at(x, r + 2)), _stat(x, mean, r + 2),
            _data(_row_at(dy, r + 3)), _data(_row_at(x, r + 3)), _stat(x, mean, r + 3), ahead)
        d0, m0 = acc(x, rstd[r + 2]) * s0 * inv_cols, g0 * inv_cols
        d1, m1 = acc(x, rstd[r + 3]) * s1 * inv_cols, g1 * inv_cols
        r += 2
    _layer_norm_bwd_store(_row_at(dy, r), _row_at(x, r), weight, _stat(x, mean, r),
                          acc(x, rstd[r]), d0, _gmean_of(x, mean, m0), _row_at(dx, r), wpart,
                          bpart, False, stream)
    _layer_norm_bwd_store(_row_at(dy, r + 1), _row_at(x, r + 1), weight, _stat(x, mean, r + 1),
                          acc(x, rstd[r + 1]), d1, _gmean_of(x, mean, m1), _row_at(dx, r + 1),
                          wpart, bpart, False, stream)
    if end - r == 3:
        _norm_bwd_two_passes(dy, x, weight, mean, rstd, dx, wpart, bpart, r + 2, False, stream)


@_row
def _norm_bwd_two_passes(dy, x, weight, mean, rstd, dx, wpart, bpart, r, first, stream):
    """Row r of a norm backward on its own: its sums, then its store, with the
    operations of the pipelined rows' stage (the same bits). With
    xhat = (x - mean) * rstd, g = dy * weight:
    dx = rstd * (g - xhat * mean(g * xhat) - mean(g)); wpart += dy * xhat and
    bpart += dy (= on the chunk's ``first`` row: partial rows need no zeroing).
    RMSNorm: mean None (no subtraction, no mean(g) term) and bpart None. dx None:
    written into dy (in place). ``stream``: dx in non-temporal stores
    (``_streams(dx)`` of the whole output, as the pipelined rows')."""
    dyr, xr = _row_at(dy, r), _row_at(x, r)
    _norm_bwd_row_at(xr.shape[0], _data(dyr), _data(xr), _data(weight), _stat(x, mean, r),
                     acc(x, rstd[r]), acc(x, 1.0) / acc(x, xr.shape[0]),
                     _target(_row_at(dx, r), dyr, stream), _data(wpart), _data(bpart),
                     first != False)  # noqa: E712


@_lanes_fn
def _norm_bwd_row_at(n, dy, x, weight, mean, rstd, inv_cols, dx, dweight, dbias, first):
    """``_norm_bwd_two_passes`` on data pointers: the row's sums (those of
    ``_layer_norm_bwd_sums``), then its store (that of ``_norm_bwd_store_at``), in
    one call, where there were two: the same bits, and ab.py --evict 64, 11
    rounds, AMD EPYC, 2026-12-07: float32 layer_norm bwd 65536x1024 1.10x,
    16384x1024 1.15x, 4096x4096 1.03x, 512-2000 columns 1.01-1.03x (rms_norm bwd
    0.97-1.03x); small calls (--calls 500) float32 64x1024 1.15-1.16x, bfloat16
    1x1024 1.07-1.09x, 64x1024 1.03x, (1, 1024) float32 1.01-1.02x."""
    _aligned_frame()
    _no_alias_args("x weight dweight dbias")
    dot, gsum = _grad_sums_blocks(n, dy, weight, x, mean)
    _norm_bwd_store_span(0, n, dy, x, weight, mean, rstd, rstd * dot * inv_cols,
                         _gmean_of(x, mean, gsum * inv_cols), dx, dweight, dbias, first)


@_lanes_fn
def _norm_bwd_stage2_at(n, dyc0, xc0, dyc1, xc1, weight, meanc0, rstdc0, dotc0, gmeanc0,
                        meanc1, rstdc1, dotc1, gmeanc1, dxc0, dxc1, dweight, dbias, first,
                        dya0, xa0, meana0, dya1, xa1, meana1, ahead):
    """Two rows' ``_norm_bwd_stage_at`` in one pass (``_norm_bwd_pairs``): stores
    rows c0 and c1 (c0's terms into the partials first, ``first`` for c0 only) and
    returns the sums of rows a0 and a1, long rows by the same blocks (WIDE_COLS)."""
    _aligned_frame()
    _no_alias_args("xc0 xc1 weight dweight dbias dya0 xa0 dya1 xa1")
    if n < WIDE_COLS:
        return _norm_bwd_span2(dyc0, xc0, dyc1, xc1, weight, meanc0, rstdc0, dotc0, gmeanc0,
                               meanc1, rstdc1, dotc1, gmeanc1, dxc0, dxc1, dweight, dbias,
                               first, dya0, xa0, meana0, dya1, xa1, meana1, 0, n, ahead)
    z = acc(xc0, -0.0)
    t = (z, z, z, z)
    for c0 in range(0, n, WIDE_BLOCK):
        u = _norm_bwd_span2(dyc0, xc0, dyc1, xc1, weight, meanc0, rstdc0, dotc0, gmeanc0,
                            meanc1, rstdc1, dotc1, gmeanc1, dxc0, dxc1, dweight, dbias, first,
                            dya0, xa0, meana0, dya1, xa1, meana1, c0, min(n, c0 + WIDE_BLOCK),
                            ahead)
        t = (t[0] + u[0], t[1] + u[1], t[2] + u[2], t[3] + u[3])
    return t


@_row
def _norm_bwd_span2(dyc0, xc0, dyc1, xc1, weight, meanc0, rstdc0, dotc0, gmeanc0, meanc1,
                    rstdc1, dotc1, gmeanc1, dxc0, dxc1, dweight, dbias, first, dya0, xa0,
                    meana0, dya1, xa1, meana1, c0, c1, ahead):
    s0 = g0 = s1 = g1 = _lanes_beside(xc0, weight, None)   # as _grad_sums_span
    step = lanes_count(s0)
    for c in range(c0, c1 - step + 1, step):
        _prefetch_ahead(dya0, c, ahead)
        _prefetch_ahead(xa0, c, ahead)
        _prefetch_ahead(dya1, c, ahead)
        _prefetch_ahead(xa1, c, ahead)
        _norm_bwd_block(dyc0, xc0, weight, meanc0, rstdc0, dotc0, gmeanc0, dxc0, dweight, dbias,
                        first, c, step)
        _norm_bwd_block(dyc1, xc1, weight, meanc1, rstdc1, dotc1, gmeanc1, dxc1, dweight, dbias,
                        False, c, step)
        s0, g0 = _grad_sums_block(dya0, weight, xa0, meana0, s0, g0, c, step)
        s1, g1 = _grad_sums_block(dya1, weight, xa1, meana1, s1, g1, c, step)
    if (c1 - c0) % step:
        c, k = c1 - (c1 - c0) % step, (c1 - c0) % step
        s0, g0 = _grad_sums_block(dya0, weight, xa0, meana0, s0, g0, c, k)
        s1, g1 = _grad_sums_block(dya1, weight, xa1, meana1, s1, g1, c, k)
        _norm_bwd_block(dyc0, xc0, weight, meanc0, rstdc0, dotc0, gmeanc0, dxc0, dweight, dbias,
                        first, c, k)
        _norm_bwd_block(dyc1, xc1, weight, meanc1, rstdc1, dotc1, gmeanc1, dxc1, dweight, dbias,
                        False, c, k)
    return lanes_sum(s0), lanes_sum(g0), lanes_sum(s1), lanes_sum(g1)


@njit(inline='always')
def _chunk_rows(k, rows, chunks):
    """Rows start..end-1 of chunk k of ``chunks`` (each a dweight/dbias partial row;
    ``param_chunks``)."""
    return k * rows // chunks, (k + 1) * rows // chunks


@_lanes_fn
def _norm_bwd_stage_at(n, dyc, xc, weight, meanc, rstdc, dotc, gmeanc, dxc, dweight, dbias,
                       first, dya, xa, meana, ahead):
    """The stage of ``_norm_bwd_rows`` on data pointers (see ``_lanes_fn``): stores
    row c (dx, the partials) and returns (sum(g * (xa - meana)), sum(g)) of row a,
    long rows by blocks (see WIDE_COLS). meanc/meana None: RMSNorm's (no
    subtraction; its x - 0 would be exact, so the same bits). dyc and dxc may be
    one row (in place), so only the others are noalias. dya and xa are prefetched
    ``ahead`` elements on (``_ahead``)."""
    _aligned_frame()
    _no_alias_args("xc weight dweight dbias dya xa")
    if n < WIDE_COLS:
        return _norm_bwd_stage_span(dyc, xc, weight, meanc, rstdc, dotc, gmeanc, dxc, dweight,
                                    dbias, first, dya, xa, meana, 0, n, ahead)
    s = g = acc(xc, -0.0)
    for c0 in range(0, n, WIDE_BLOCK):
        t, u = _norm_bwd_stage_span(dyc, xc, weight, meanc, rstdc, dotc, gmeanc, dxc, dweight,
                                    dbias, first, dya, xa, meana, c0, min(n, c0 + WIDE_BLOCK),
                                    ahead)
        s, g = s + t, g + u
    return s, g


@_row
def _norm_bwd_stage_span(dyc, xc, weight, meanc, rstdc, dotc, gmeanc, dxc, dweight, dbias,
                         first, dya, xa, meana, c0, c1, ahead):
    s = g = _lanes_beside(xc, weight, None)     # as _grad_sums_span
    step = lanes_count(s)
    for c in range(c0, c1 - step + 1, step):
        _prefetch_halves(dya, c + PREFETCH_AHEAD)
        _prefetch_halves(xa, c + PREFETCH_AHEAD)
        _prefetch_ahead(dya, c, ahead)
        _prefetch_ahead(xa, c, ahead)
        _norm_bwd_block(dyc, xc, weight, meanc, rstdc, dotc, gmeanc, dxc, dweight, dbias,
                        first, c, step)
        s, g = _grad_sums_block(dya, weight, xa, meana, s, g, c, step)
    if (c1 - c0) % step:
        c, k = c1 - (c1 - c0) % step, (c1 - c0) % step
        s, g = _grad_sums_block(dya, weight, xa, meana, s, g, c, k)
        _norm_bwd_block(dyc, xc, weight, meanc, rstdc, dotc, gmeanc, dxc, dweight, dbias,
                        first, c, k)
    return lanes_sum(s), lanes_sum(g)


@_lanes_fn
def _norm_bwd_store_at(c0, c1, dy, x, weight, mean, rstd, dot, gmean, dx, dweight, dbias,
                       first):
    """The stage's store alone, columns c0..c1-1 (the column-blocked backward's),
    on data pointers (see ``_lanes_fn``)."""
    _aligned_frame()
    _no_alias_args("x weight dweight dbias")
    _norm_bwd_store_span(c0, c1, dy, x, weight, mean, rstd, dot, gmean, dx, dweight, dbias,
                         first)


@_row
def _norm_bwd_store_span(c0, c1, dy, x, weight, mean, rstd, dot, gmean, dx, dweight, dbias,
                         first):
    """The body of ``_norm_bwd_store_at`` (and the store of ``_norm_bwd_row_at``)."""
    step = lanes_count(lanes_zeros(x))
    for c in range(c0, c1 - step + 1, step):
        _norm_bwd_block(dy, x, weight, mean, rstd, dot, gmean, dx, dweight, dbias, first, c,
                        step)
    if (c1 - c0) % step:
        _norm_bwd_block(dy, x, weight, mean, rstd, dot, gmean, dx, dweight, dbias, first,
                        c1 - (c1 - c0) % step, (c1 - c0) % step)


@_row
def _norm_bwd_block(dy, x, weight, mean, rstd, dot, gmean, dx, dweight, dbias, first, c, k):
    """``_layer_norm_bwd_store``'s operations on columns c..c+k-1 (dy loaded before
    dx is stored: in place they are one row). Lanes ``_lanes_beside`` the float32
    dweight/dbias partials, so in column order wherever there are any: paired
    lanes shuffle each partial block both ways (bfloat16, ab.py 2026-12-07, paired
    against column order: rms_norm bwd 0.87-0.92x from memory, 0.89-0.97x in
    cache; layer_norm bwd 0.95-0.98x in cache). The weight is either the rows'
    type, or float32 and then has float32 partials."""
    like = _lanes_beside(x, dweight, dbias)
    d = lanes_load_like(dy, c, k, like)
    xhat = _centered(lanes_load_like(x, c, k, like), mean) * rstd
    _vadd_into(dweight, c, d * xhat, k, first)
    _vadd_into(dbias, c, d, k, first)
    lanes_store(dx, c, _norm_dx(_vtimes(d, weight, c, k), xhat, rstd, dot, gmean), k)


def _stat(x, stats, r):
    raise NotImplementedError


@overload(_stat)
def _stat_impl(x, stats, r):
    """stats[r] in x's accumulator type; None for None (RMSNorm's mean, which the
    consumers skip: ``_centered``)."""
    if isinstance(stats, types.NoneType):
        return lambda x, stats, r: None
    return lambda x, stats, r: acc(x, stats[r])


# ------------------------------------------------------------------ drivers
def _row_of(a, k):
    raise NotImplementedError


@overload(_row_of)
def _row_of_impl(a, k):
    """a[k], None for None."""
    if isinstance(a, types.NoneType):
        return lambda a, k: None
    return lambda a, k: a[k]


@intrinsic
def _row_pointer(typingctx, a, r):
    """Address of a[r // a.shape[1], r % a.shape[1], 0] for a 3-D array."""
    if not (isinstance(a, types.Array) and a.ndim == 3):
        return None

    def codegen(context, builder, sig, args):
        aty = sig.args[0]
        arr = context.make_array(aty)(context, builder, args[0])
        shape = cgutils.unpack_tuple(builder, arr.shape)
        o = builder.sdiv(args[1], shape[1])
        i = builder.srem(args[1], shape[1])
        return cgutils.get_item_pointer2(
            context, builder, data=arr.data, shape=shape,
            strides=cgutils.unpack_tuple(builder, arr.strides), layout=aty.layout,
            inds=[o, i, context.get_constant(types.intp, 0)], wraparound=False)
    return types.CPointer(a.dtype)(a, types.intp), codegen


def _row_at(a, r):
    raise NotImplementedError


@overload(_row_at)
def _row_at_impl(a, r):
    """Flat row r of a 3-D (outer, inner, cols) storage array as a C-contiguous
    1-D array (None for None). The dispatcher guarantees a unit last stride, but
    numba types a row of a non-C array (a transposed or padded input) as strided:
    its loops then did not vectorize (measured: softmax fwd 6.7-8.9x, rms_norm
    3.4-4x and its backward ~2x slower than on a C array of the same shape)."""
    if isinstance(a, types.NoneType):
        return lambda a, r: None
    return lambda a, r: carray(_row_pointer(a, r), a.shape[2])


def _target(dx, dy, stream):
    raise NotImplementedError


@overload(_target)
def _target_impl(dx, dy, stream):
    """The row a backward stores into, as a ``streaming`` row: dx, streamed while
    ``stream``, or dy for an in-place backward (dx None), never streamed (its
    lines were just read). The store loop then loads and stores through one
    pointer, which LLVM vectorizes without a run-time overlap test; dy passed again
    as dx overlaps itself, fails that test and took the scalar loop (measured:
    1.5-4.6x slower in-place backwards, bf16 worst). Both are Streams, so in-place
    and out-of-place calls share one compiled store."""
    if isinstance(dx, types.NoneType):
        return lambda dx, dy, stream: streaming(dy, False)
    return lambda dx, dy, stream: streaming(dx, stream)


def _streams(out):
    """Whether the pipelined stages write ``out`` (None: in place, no) with
    non-temporal stores (``streaming``): STREAM_BYTES or more (``_alloc``, which
    starts outputs this large on a cache line). Why: an ordinary store first
    reads the line it writes, a third of a forward's memory traffic and a quarter
    of a backward's, and an output this large leaves the caches before it is read
    anyway. ab.py --evict 64 against ordinary stores, AMD EPYC, 2026-12-06, float32
    (outputs 64-byte aligned): 4096x4096 rms_norm fwd 1.45x, layer_norm fwd 1.31x,
    softmax bwd 1.09x, the norm backwards 1.12-1.24x; 65536x1024 softmax fwd
    1.56x, bwd 1.35x, rms_norm bwd 1.36x; 2048x2048 (16 MiB, in cache between
    calls) 1.20-1.35x; 1024x1024 (4 MiB) 0.92-1.32x, mixed. Jitted code only."""
    raise NotImplementedError


@overload(_streams)
def _streams_impl(out):
    if isinstance(out, types.NoneType):
        return lambda out: False
    return lambda out: out.size * out.itemsize >= STREAM_BYTES


def _fwd_stream(row, on):
    """A softmax forward's output row: ``streaming(row, on)``, but the plain row
    for float16/bfloat16 storage. Their softmax is compute-bound here (its exp),
    and non-temporal stores cost it time (ab.py --evict 64, AMD EPYC, 2026-12-06,
    bfloat16: 0.87-0.92x at 4096x4096 and 8192x2048; 0.84-0.93x again that
    evening; 0.95-1.08x on 2026-12-07 with paired lanes); a plain row also
    compiles no second store path. The norm forwards stream in every dtype
    (``streaming`` itself): rms_norm fwd bfloat16 1.26-1.39x (2026-12-06
    evening; float16 0.99x), layer_norm fwd bfloat16 once paired lanes had
    lightened its arithmetic (0.96-0.97x before): 2026-12-07, five runs at
    512-16384 columns, 1.05-1.35x in most cells, 0.86-0.98x once each at
    32768x2048, 65536x1024 and 8192x2048 (1.12-1.21x in their other runs);
    float16 0.96-1.03x."""
    raise NotImplementedError


@overload(_fwd_stream)
def _fwd_stream_impl(row, on):
    if row.dtype in (types.int16, types.uint16):
        return lambda row, on: row
    return lambda row, on: streaming(row, on)


def _long_streams(y, cols):
    """Whether a long softmax row of ``cols`` columns keeps its exps in scratch and
    streams y (see STREAM_EXPS_ROW_BYTES): float32 y only."""
    raise NotImplementedError


@overload(_long_streams)
def _long_streams_impl(y, cols):
    if y.dtype == types.float32:
        return lambda y, cols: _streams(y) and cols * 4 <= STREAM_EXPS_ROW_BYTES
    return lambda y, cols: False


def _exps_into(y, scratch):
    """Where a long row's exps go (``_softmax_fwd_long_row``): y itself when y's
    type is the accumulator type (the store then rescales y in place: the same
    bits, one row less in the caches; but see STREAM_EXPS_ROW_BYTES), else the
    accumulator-typed scratch."""
    raise NotImplementedError


@overload(_exps_into)
def _exps_into_impl(y, scratch):
    if y.dtype == scratch.dtype:
        return lambda y, scratch: y
    return lambda y, scratch: scratch


def _prefetch_halves(a, c):
    """``prefetch(a, c)`` for float16/bfloat16 rows, nothing for float32/float64:
    the pipelined stages' read streams, PREFETCH_AHEAD elements ahead. Why: the
    half forwards spend ~2x the compute per byte, and the hardware prefetchers
    alone left memory idle during it (ab.py --evict 512, 2026-12-05, bfloat16
    4096x4096 and 65536x1024: layer_norm fwd 1.15-1.32x, rms_norm fwd 1.05-1.07x,
    softmax fwd 1.04-1.09x; float32 0.85-1.07x, noise, so not there). The
    backwards' stages likewise (ab.py --evict 64, 2026-12-06, bfloat16 4096x4096,
    three runs of four: softmax bwd 1.08-1.21x, rms_norm bwd 1.16-1.31x, layer_norm
    bwd 1.37-1.55x, fwd+bwd 1.09-1.22x, 1024x8192 and 2048x4096 1.04-1.35x; the
    fourth run 0.91-1.08x; float16 1.05-1.07x; float32 0.87-1.03x, so not there;
    the halves' row path (rows under HALF_BWD_PIPELINE_COLS), prefetching its
    sums pass: 0.95-1.02x, so not there)."""
    raise NotImplementedError


@overload(_prefetch_halves)
def _prefetch_halves_impl(a, c):
    if a.dtype in (types.int16, types.uint16):
        return lambda a, c: prefetch(a, c)
    return lambda a, c: None


#: in calls of STREAM_BYTES and more, the pipelined stages' read streams (the
#: rows they sum, from memory) are prefetched into the L2 (``prefetch_l2``) at
#: least this many bytes ahead (``_ahead``). Why: a stage mixes those streams
#: with rows it re-reads from the caches and a streamed store, and on its own a
#: core kept too few lines in flight: one thread ran the layer_norm backward at
#: 0.79 ns per float32 element from memory against 0.34 in its L2, about the sum
#: of its arithmetic and of a copy's time, not the larger of the two. ab.py
#: --evict 64 against none, AMD EPYC, 2 threads, 2026-12-07, float32:
#: layer_norm bwd 4096x4096 1.14-1.17x, 8192x2048 1.39-1.49x, 2048x8192
#: 1.08-1.10x, rms_norm bwd 1.10-1.16x / 1.30-1.34x / 1.10-1.14x, softmax bwd
#: 1.10-1.25x (1024x16384 1.14x), layer_norm fwd 1.19-1.23x at 4096x4096,
#: rms_norm fwd 1.09-1.17x; float64 bwds 1.04-1.11x; bfloat16 bwds 1.06-1.33x at
#: 4096x4096, 65536x1024 norm bwds 1.13-1.15x. Into the L1 (prefetcht0) instead:
#: 0.94-0.97x; non-temporal (prefetchnta): 0.96-1.03x. 16 KiB ahead: 1.10-1.14x
#: at 4096x4096, 64 KiB: 1.11-1.18x. Not the float16/bfloat16 forwards, bound by
#: their arithmetic (layer_norm fwd 0.92-0.97x at 1024-2048 columns), nor the
#: softmax forward (float32 0.87-1.00x: its exp, not memory, sets its pace), nor
#: the row paths' store passes (the next rows prefetched there: 0.86-1.05x).
#: Smaller calls do not: from the caches the instructions cost float32 rms_norm
#: fwd 0.93-0.96x (64x4096, 1024x1024, 512x2048, --calls 20), 0.96-1.02x with
#: the test that skips them. With it, the pipelines pay from shorter rows in
#: such calls (``_rows_pipelined``, ``_ln_fwd_two_passes``).
PREFETCH_L2_BYTES = 1 << 15


@njit(inline='always')
def _pipeline_threads(a, shared):
    """The float32/float64 backwards' thread rule for their pipelines
    (``_softmax_bwd_pipelined``, ``_rows_pipelined``): a call on more than one
    thread (``shared``), rows of WIDE_COLS and more, or a call whose stages
    prefetch (``_prefetches``); on one thread otherwise, a row's two passes in
    turn keep more lines in flight than the stage."""
    return shared or a.shape[2] >= WIDE_COLS or _prefetches(a)


@njit(inline='always')
def _prefetches(a):
    """Whether the pipelined stages of a call on ``a`` prefetch (``_ahead``): at
    the size from which outputs stream (``_streams``), which leave the caches
    before they are read; the pipelines' size rules (``_rows_pipelined``,
    ``_softmax_bwd_pipelined``, ``_ln_fwd_two_passes``) follow it."""
    return _streams(a)


@njit(inline='always')
def _ahead(a, per):
    """Elements from a stage's column c to the one it prefetches, in a stage that
    sums ``per`` rows of ``a`` a pass; 0 (no prefetch: ``_prefetch_ahead``) for
    arrays under STREAM_BYTES. PREFETCH_L2_BYTES ahead in the same row on
    rows of twice that and more; else the rows as many passes ahead as cover it
    (so a two-row stage never prefetches its other row, which it is reading),
    by a's row stride (a hint: on a layout whose rows are not evenly spaced it
    may fetch lines no stage reads, which changes no result)."""
    if not _prefetches(a):
        return 0
    row = a.shape[2] * a.itemsize
    if row >= 2 * PREFETCH_L2_BYTES:
        return PREFETCH_L2_BYTES // a.itemsize
    passes = (PREFETCH_L2_BYTES + per * row - 1) // (per * row)
    return passes * per * (a.strides[1] // a.itemsize)


@njit(inline='always')
def _prefetch_ahead(a, c, ahead):
    """``prefetch_l2(a, c + ahead)`` unless ahead is 0 (``_ahead``)."""
    if ahead:
        prefetch_l2(a, c + ahead)


def _prefetch_wide(a, c, ahead):
    """``_prefetch_ahead`` for float32/float64 rows, nothing for float16/bfloat16
    (the forwards' stages: see PREFETCH_L2_BYTES)."""
    raise NotImplementedError


@overload(_prefetch_wide)
def _prefetch_wide_impl(a, c, ahead):
    if a.dtype in (types.int16, types.uint16):
        return lambda a, c, ahead: None
    return lambda a, c, ahead: _prefetch_ahead(a, c, ahead)


def _scratch_elems(y, x, n):
    """n, or 0 when y's type is x's accumulator type (``_exps_into`` takes y)."""
    raise NotImplementedError


@overload(_scratch_elems)
def _scratch_elems_impl(y, x, n):
    if y.dtype == acc_numba_type(x.dtype):
        return lambda y, x, n: 0
    return lambda y, x, n: n


def _acc_empty(x, n):
    raise NotImplementedError


@overload(_acc_empty)
def _acc_empty_impl(x, n):
    dt = np.float64 if x.dtype == types.float64 else np.float32
    return lambda x, n: np.empty(n, dt)


def _sum_into(partials, out):
    raise NotImplementedError


@overload(_sum_into)
def _sum_into_impl(partials, out):
    if isinstance(partials, types.NoneType):
        return lambda partials, out: None
    return lambda partials, out: _sum_partials(partials, out, 0, partials.shape[1])


@njit(cache=True, nogil=True)
def _sum_partials(partials, out, lo, hi):
    """out[c] = sum over chunks, in chunk order (deterministic), rounded once, for
    the columns lo..hi-1.

    Accumulated a partial row at a time: the same additions in the same order as
    a per-column loop, but each pass is a contiguous loop LLVM vectorizes (the
    column-strided form cost 1.7 ns per partial element, measured)."""
    total = partials[0, lo:hi].copy()
    for k in range(1, partials.shape[0]):
        row = partials[k, lo:hi]
        for c in range(hi - lo):
            total[c] += row[c]
    for c in range(hi - lo):
        out[lo + c] = narrow(total[c], out)


#: the parallel backwards sum their dweight/dbias partials in parallel, by blocks
#: of SUM_BLOCK columns, from PARALLEL_SUM_ELEMS partial elements on (below, a
#: second parallel launch costs more than it saves: ~60 us with OpenMP's
#: passive wait policy). Each column is summed in the same order either way.
SUM_BLOCK = 1 << 13
PARALLEL_SUM_ELEMS = 1 << 18


def _sum_blocks(partials):
    raise NotImplementedError


@overload(_sum_blocks)
def _sum_blocks_impl(partials):
    """Column blocks for a parallel sum of the partials: 0 for None or small ones."""
    if isinstance(partials, types.NoneType):
        return lambda partials: 0

    def impl(partials):
        if partials.shape[0] * partials.shape[1] < PARALLEL_SUM_ELEMS:
            return 0
        return (partials.shape[1] + SUM_BLOCK - 1) // SUM_BLOCK
    return impl


def _sum_block(partials, out, b):
    raise NotImplementedError


@overload(_sum_block)
def _sum_block_impl(partials, out, b):
    """Block b of SUM_BLOCK columns of ``_sum_partials`` (nothing for None)."""
    if isinstance(partials, types.NoneType):
        return lambda partials, out, b: None
    return lambda partials, out, b: _sum_cols(
        partials, out, b * SUM_BLOCK, min(partials.shape[1], (b + 1) * SUM_BLOCK))


@njit(inline='always')
def _pipelined(rows, cols):
    """Whether a forward runs pipelined: a function of the shape only, so a row's
    bits never depend on the thread count."""
    return rows >= PIPELINE_ROWS and cols <= PIPELINE_COLS


@njit(inline='always')
def _thread_chunks(rows, threads, parallel):
    """Chunks of a pipelined driver: one per thread in the parallel build (the
    backend passes ``numba.get_num_threads()``: in jitted code it stops numba from
    caching the function), one in the serial build. The results do not depend on
    them."""
    return max(1, min(rows, threads)) if parallel else 1


@njit(inline='always')
def _pipeline_chunks(rows, threads):
    """``_thread_chunks`` for the softmax forward, whose chunks repeat ~1.5 rows of
    work each: at least 32 rows per chunk."""
    return _thread_chunks(rows // 32, threads, True)


#: norm backwards run pipelined (``_norm_bwd_rows``) from rows of this many bytes
#: in float32/float64 (from STREAMED_BWD_PIPELINE_BYTES in calls of STREAM_BYTES
#: and more, whose stages prefetch), from HALF_BWD_PIPELINE_COLS columns in
#: float16/bfloat16 (see _rows_pipelined); float32/float64 softmax backwards from
#: SOFTMAX_BWD_PIPELINE_BYTES (see _softmax_bwd_pipelined)
BWD_PIPELINE_BYTES = 1 << 13
STREAMED_BWD_PIPELINE_BYTES = 1 << 12
HALF_BWD_PIPELINE_COLS = 1 << 7
SOFTMAX_BWD_PIPELINE_BYTES = 1 << 14


def _rows_pipelined(x, shared):
    raise NotImplementedError


@overload(_rows_pipelined)
def _rows_pipelined_impl(x, shared):
    """Whether a norm backward runs its rows pipelined (``_norm_bwd_rows``) rather
    than one row's two passes after the other (``_norm_bwd_two_passes``): float32/float64
    rows of BWD_PIPELINE_BYTES or more, float16/bfloat16 rows of
    HALF_BWD_PIPELINE_COLS columns or more (a function of the signature and the
    shape; the bits are the same either way). Measured on the AMD EPYC,
    2026-12-05 (in-process A/B, 2 threads, from memory unless said; row path
    against pipelined): float32 1024 columns 1.06-1.10x, 1.23-1.37x where dx's
    rows lie 2**28 bytes from x's next ones (see ALIAS_SPAN), 1.07-1.11x from L3,
    even in L2; 8 KiB rows (float32 2048, float64 1024 columns) 0.91-1.01x, aliased
    1.18-1.25x; 16 KiB rows 0.93-0.99x. bfloat16, once the row path stored in
    lanes (``_layer_norm_bwd_store``): 1024-2048 columns from memory 1.06-1.59x
    in the first runs, then over four runs at 65536x1024 0.92-1.36x (median
    1.10), 8192x2048 rms_norm 1.14-1.22x but layer_norm 0.83-0.98x; 0.93-0.97x in
    cache; 4096 columns 0.87-0.94x, 16384 0.94-0.99x, hence the floor at 4096 (it
    was 64: with the element-loop store the row path ran 0.77-0.92x in cache from
    64 columns up). 2048 since 2026-12-06, once the pipelined stage prefetched its
    half read streams (``_prefetch_halves``): pipelined against the row path, ab.py
    --evict 64, 11 rounds, 8192x2048 and 32768x2048: bfloat16 backwards 1.16-1.23x,
    fwd+bwd 1.09-1.24x, float16 1.08-1.26x; in cache (128x2048, 512x2048, bfloat16)
    1.01-1.19x. 1024 columns (65536x1024): 0.96-1.10x, so not there.

    Lowered on 2026-12-06 (evening), once the dweight/dbias partial rows started
    on cache lines (``_on_lines``): the pipelined stage adds a row's terms into its
    partial row while it loads the next row, and the split partial stores had
    cost it most. Pipelined against the row path, ab.py --evict 64, 11 rounds:
    float32 2048 columns (8192x2048, 16384x2048, 32768x2048) 1.10-1.33x, fwd+bwd
    1.06-1.17x, in cache 2048x2048 1.25-1.29x, 512x2048 0.98-1.05x, 128x2048
    1.01x; float32 1024 columns 0.87x (layer_norm) and 1.15x (rms_norm): not
    there. bfloat16 1024 columns 1.07-1.46x (65536x1024, 32768x1024), in cache
    1.06-1.32x; 512 columns 1.01-1.42x, in cache 1.06-1.11x; 256 and 128
    columns from memory layer_norm 0.98-1.02x, rms_norm 1.11-1.16x, in cache
    1.07-1.13x.

    float32/float64 on one thread of the parallel build (``shared`` false: the
    call's partials make one group) take the row path under WIDE_COLS columns
    since 2026-12-07, as the softmax backward (``_softmax_bwd_pipelined``): ab.py
    --evict 64, NUMBA_NUM_THREADS=1, row path against the pipeline and its pairs:
    8192x2048 layer_norm 1.18-1.23x, rms_norm 1.21-1.22x; 4096x4096 1.09-1.10x;
    2048x8192 1.01-1.04x. Not the serial build, which runs the small calls from
    the caches: there the row path ran 16x4096 0.92-0.95x (32x2048 and 48x2048
    0.98-1.04x).

    In calls of STREAM_BYTES and more, whose stages prefetch (PREFETCH_L2_BYTES),
    float32/float64 rows from STREAMED_BWD_PIPELINE_BYTES, on one thread as well
    (2026-12-07, ab.py --evict 64, pipelined against the row path: 65536x1024
    1.01-1.09x, 16384x1024 1.07-1.22x, 16384x1536 1.25-1.29x; 2 KiB rows,
    131072x512, 0.99-1.06x, so not there; under STREAM_BYTES 1024 columns
    0.90-0.95x; one thread 4096x4096 1.16-1.20x, 8192x2048 1.15-1.25x, 2048x8192
    1.09-1.14x)."""
    if x.dtype in (types.float32, types.float64):
        floor = BWD_PIPELINE_BYTES // (x.dtype.bitwidth // 8)
        streamed = STREAMED_BWD_PIPELINE_BYTES // (x.dtype.bitwidth // 8)
        return lambda x, shared: (
            x.shape[2] >= (streamed if _prefetches(x) else floor)
            and _pipeline_threads(x, shared))
    return lambda x, shared: x.shape[2] >= HALF_BWD_PIPELINE_COLS


def _wide_bwd(rows, cols, threads):
    """Whether a norm backward runs column-blocked: rows of WIDE_COLS columns and
    more, too few for a dweight partial (``param_chunks``) per thread. The row
    path runs a thread per partial at most, and where it has one for every thread
    it reads the rows from memory once where the column-blocked pass reads them
    twice (AMD EPYC, 2026-12-05, in-process A/B from memory, 2 threads, row path
    against column-blocked: 8x65536-8x131072 1.06-1.26x, 16x65536-32x65536
    1.15-1.30x, 16x262144 1.03-1.28x; 4x262144, one partial, 0.71-0.81x)."""
    return cols >= WIDE_COLS and param_chunks(rows, cols) < threads


@njit(inline='always')
def _wide_blocks(cols):
    return (cols + WIDE_BLOCK - 1) // WIDE_BLOCK


@njit(inline='always')
def _wide_cols(b, cols):
    """Columns c0..c1-1 of block b."""
    return b * WIDE_BLOCK, min(cols, (b + 1) * WIDE_BLOCK)


def _cols(a, c0, c1):
    raise NotImplementedError


@overload(_cols)
def _cols_impl(a, c0, c1):
    """a[c0:c1] of a 1-D array (C-contiguous stays so), None for None."""
    if isinstance(a, types.NoneType):
        return lambda a, c0, c1: None
    return lambda a, c0, c1: a[c0:c1]


@_row
def _block_cols(a, r, c0, c1):
    """Columns c0..c1-1 of flat row r of a 3-D storage array (None for None)."""
    return _cols(_row_at(a, r), c0, c1)


def _wide_sums_table(x, rows, cols, n):
    raise NotImplementedError


@overload(_wide_sums_table)
def _wide_sums_table_impl(x, rows, cols, n):
    """(rows, blocks, n) partial sums in x's accumulator type."""
    dt = np.float64 if x.dtype == types.float64 else np.float32
    return lambda x, rows, cols, n: np.empty((rows, _wide_blocks(cols), n), dt)


@_row
def _block_total(sums, r, i):
    """sums[r, :, i] added in block order."""
    total = sums[r, 0, i]
    for b in range(1, sums.shape[1]):
        total += sums[r, b, i]
    return total


def _gmean_of(x, mean, g):
    raise NotImplementedError


@overload(_gmean_of)
def _gmean_of_impl(x, mean, g):
    """mean(g) for LayerNorm; 0 for RMSNorm (mean None), whose dx has no such term."""
    if isinstance(mean, types.NoneType):
        return lambda x, mean, g: acc(x, 0.0)
    return lambda x, mean, g: g


def _wide_fwd(rows, cols, threads):
    """Whether a norm forward runs column-blocked: rows of WIDE_FWD_COLS columns or
    more, fewer than the threads (the row path runs a row per thread: single rows
    of 262144-1M columns measured 1.24-1.82x column-blocked; with 2-16 rows per
    thread the row path won, 1.03-1.6x from memory, where the blocked first pass
    only reads; 1x65536 was even, three launches for 20 us; ab.py 2026-12-05)."""
    return cols >= WIDE_FWD_COLS and rows < threads


@_row
def _wide_fwd_sums(x, mean, sums, b):
    """sums[r, b] = the forward's sums of block b of every row (``_fwd_block_sums``)."""
    c0, c1 = _wide_cols(b, x.shape[2])
    inv_cols = acc(x, 1.0) / acc(x, x.shape[2])
    for r in range(x.shape[0] * x.shape[1]):
        _fwd_block_sums(_block_cols(x, r, c0, c1), _row_at(x, r), mean, inv_cols,
                        sums[r, b])


def _fwd_slots(mean):
    raise NotImplementedError


@overload(_fwd_slots)
def _fwd_slots_impl(mean):
    """Sums per (row, block) of a column-blocked forward (``_fwd_block_sums``)."""
    slots = 1 if isinstance(mean, types.NoneType) else 3
    return lambda mean: slots


def _fwd_block_sums(xs, row, mean, inv_cols, out):
    raise NotImplementedError


@overload(_fwd_block_sums)
def _fwd_block_sums_impl(xs, row, mean, inv_cols, out):
    """out = (sum(x/n), sum((x-m0)**2), sum(x-m0)) about the row's shift for
    LayerNorm; (sum(x**2),) for RMSNorm (mean None)."""
    if isinstance(mean, types.NoneType):
        def rms(xs, row, mean, inv_cols, out):
            out[0] = _sum_sq(xs, acc(xs, 0.0))[0]
        return rms

    def ln(xs, row, mean, inv_cols, out):
        out[0], out[1], out[2] = _moments(xs, _layer_norm_shift(row), inv_cols)
    return ln


def _wide_fwd_stats(x, eps, sums, mean, rstd):
    raise NotImplementedError


@overload(_wide_fwd_stats)
def _wide_fwd_stats_impl(x, eps, sums, mean, rstd):
    """Each row's statistics from its blocks' sums (``_wide_fwd_sums``): LayerNorm's
    mean and rstd (``_layer_norm_stats``), or RMSNorm's rstd (mean None)."""
    if isinstance(mean, types.NoneType):
        def rms(x, eps, sums, mean, rstd):
            for r in range(sums.shape[0]):
                rstd[r] = _rms_norm_rstd(_row_at(x, r), _block_total(sums, r, 0), eps)
        return rms

    def ln(x, eps, sums, mean, rstd):
        inv_cols = acc(x, 1.0) / acc(x, x.shape[2])
        for r in range(sums.shape[0]):
            mean[r], rstd[r] = _layer_norm_stats(
                _row_at(x, r), (_block_total(sums, r, 0), _block_total(sums, r, 1),
                                _block_total(sums, r, 2)), inv_cols, eps)
    return ln


@_row
def _wide_fwd_store(x, weight, bias, mean, rstd, y, b):
    """Block b of every row's forward store: LayerNorm's, or RMSNorm's (mean None)."""
    c0, c1 = _wide_cols(b, x.shape[2])
    w, bb = _cols(weight, c0, c1), _cols(bias, c0, c1)
    for r in range(x.shape[0] * x.shape[1]):
        _norm_store(_block_cols(x, r, c0, c1), w, bb, mean, r, rstd[r],
                    _block_cols(y, r, c0, c1))


def _norm_store(x, weight, bias, mean, r, rstd, y):
    raise NotImplementedError


@overload(_norm_store)
def _norm_store_impl(x, weight, bias, mean, r, rstd, y):
    if isinstance(mean, types.NoneType):
        return lambda x, weight, bias, mean, r, rstd, y: _rms_norm_store(x, weight, rstd, y)
    return lambda x, weight, bias, mean, r, rstd, y: _layer_norm_store(x, weight, bias,
                                                                       mean[r], rstd, y)


@_row
def _wide_bwd_sums(dy, x, weight, mean, rstd, sums, b):
    """sums[r, b] = (sum(g * (x - mean)), sum(g)) over block b, every row."""
    c0, c1 = _wide_cols(b, x.shape[2])
    w = _cols(weight, c0, c1)
    for r in range(x.shape[0] * x.shape[1]):
        sums[r, b, 0], sums[r, b, 1] = _grad_sums(
            _block_cols(dy, r, c0, c1), w, _block_cols(x, r, c0, c1), _stat(x, mean, r))


@_row
def _wide_bwd_stats(x, mean, rstd, sums):
    """Each row's (mean(g * xhat), mean(g)) into sums[r, 0] (mean(g) 0 for RMSNorm)."""
    inv_cols = acc(x, 1.0) / acc(x, x.shape[2])
    for r in range(sums.shape[0]):
        dot, g = _block_total(sums, r, 0), _block_total(sums, r, 1)
        sums[r, 0, 0] = acc(x, rstd[r]) * dot * inv_cols
        sums[r, 0, 1] = _gmean_of(x, mean, g * inv_cols)


@_row
def _wide_bwd_store(dy, x, weight, mean, rstd, dx, wparts, bparts, sums, b, chunks,
                    dweight, dbias):
    """The store pass of block b: each chunk's rows (``param_chunks``) into its
    partial, row by row as the row path, then the block's partials summed in chunk
    order (``_sum_partials``): dweight/dbias get the row path's bits, and the
    partials never leave the cache. RMSNorm runs it with mean None and mean(g) 0."""
    rows, cols = x.shape[0] * x.shape[1], x.shape[2]
    c0, c1 = _wide_cols(b, cols)
    stream = _streams(dx)
    for k in range(chunks):
        r0, r1 = _chunk_rows(k, rows, chunks)
        wp, bp = _row_of(wparts, k), _row_of(bparts, k)
        for r in range(r0, r1):
            dyr = _row_at(dy, r)
            _norm_bwd_store_at(c0, c1, _data(dyr), _data(_row_at(x, r)), _data(weight),
                               _stat(x, mean, r), acc(x, rstd[r]), sums[r, 0, 0],
                               sums[r, 0, 1],
                               _target(_row_at(dx, r), dyr, stream), _data(wp),
                               _data(bp), r == r0)
    _sum_cols(wparts, dweight, c0, c1)
    _sum_cols(bparts, dbias, c0, c1)


def _sum_cols(partials, out, c0, c1):
    raise NotImplementedError


@overload(_sum_cols)
def _sum_cols_impl(partials, out, c0, c1):
    """``_sum_partials`` on columns c0..c1-1 (nothing for None)."""
    if isinstance(partials, types.NoneType):
        return lambda partials, out, c0, c1: None
    return lambda partials, out, c0, c1: _sum_partials(partials, out, c0, c1)


@njit(parallel=True, cache=True, nogil=True)
def sum_partials_by_blocks(dweight_parts, dweight, dbias_parts, dbias, blocks):
    """dweight/dbias = their partials summed (``_sum_partials``), by ``blocks``
    blocks of SUM_BLOCK columns on all threads; None skips one. A kernel of its
    own, which the parallel backwards call: as a second parallel loop in every
    driver it cost 0.3-0.9 s of compile per signature (2026-12-05), where this one
    compiles once per partial and output type."""
    for b in prange(blocks):
        _sum_block(dweight_parts, dweight, b)
        _sum_block(dbias_parts, dbias, b)


def _build(loop):
    """Row drivers iterating with ``loop``: prange (parallel build) or range.

    ``loop`` is referenced in every body on purpose: numba's cache key hashes
    the closure cells, so the two builds get distinct cache entries. For the same
    reason no body calls another jitted function of the build: a dispatcher in a
    closure cell hashes differently in every process, and no process loaded the
    cache (2026-12-05: CI 28 min instead of 15, and the cache test failed).
    Module-level jitted functions are globals, not cells: the bodies call those.

    Both builds are cached on disk, and compute the same bits compiled or loaded
    (tests/test_runtime.py::test_parallel_bits_equal_serial_compiled_or_cached):
    every sum runs in explicit lanes with a fixed order (``_lanes``). With
    reassociated loops instead, a process that loaded the parallel build from the
    cache computed the softmax and the pipelined norm forwards 1 ulp off on some
    rows (2026-12-04): each library held its own differently vectorized copy of a
    reduction, and the linker picked one by symbol name.
    """
    parallel = loop is prange
    opts = dict(parallel=parallel, cache=True, nogil=True, error_model='numpy')

    @njit(**opts)
    def softmax_fwd(x, y, threads):
        rows, cols = x.shape[0] * x.shape[1], x.shape[2]
        if _pipelined(rows, cols):
            chunks = _pipeline_chunks(rows, threads) if parallel else 1
            for k in loop(chunks):
                frame = _frame_on_page()
                _wide_vectors()      # in the loop: prange outlines its body
                _softmax_fwd_rows(x, y, k * rows // chunks, (k + 1) * rows // chunks,
                                  _acc_empty(x, cols), _acc_empty(x, cols),
                                  np.empty(cols, y.dtype))
                _frame_back(frame)
        else:
            chunks = min(rows, 16 * MAX_CHUNKS)
            for k in loop(chunks):
                frame = _frame_on_page()
                _wide_vectors()
                scratch = _acc_empty(x, cols)
                for r in range(k * rows // chunks, (k + 1) * rows // chunks):
                    _softmax_fwd_row(_row_at(x, r), _row_at(y, r), scratch)
                _frame_back(frame)

    @njit(**opts)
    def softmax_bwd(y, dy, dx, threads):
        rows = y.shape[0] * y.shape[1]
        chunks = _thread_chunks(rows, threads, parallel)
        for k in loop(chunks):
            frame = _frame_on_page()
            _wide_for_halves(y)
            _softmax_bwd_rows(y, dy, dx, k * rows // chunks, (k + 1) * rows // chunks,
                              chunks > 1)
            _frame_back(frame)

    @njit(**opts)
    def rms_norm_fwd(x, weight, eps, y, rstd, threads):
        rows = x.shape[0] * x.shape[1]
        chunks = _thread_chunks(rows, threads, parallel)
        for k in loop(chunks):
            frame = _frame_on_page()
            _wide_for_halves(x)
            _rms_norm_fwd_rows(x, weight, eps, y, rstd, k * rows // chunks,
                               (k + 1) * rows // chunks)
            _frame_back(frame)

    @njit(**opts)
    def layer_norm_fwd(x, weight, bias, eps, y, mean, rstd, threads):
        rows = x.shape[0] * x.shape[1]
        chunks = _thread_chunks(rows, threads, parallel)
        for k in loop(chunks):
            frame = _frame_on_page()
            _wide_for_halves(x)
            _layer_norm_fwd_rows(x, weight, bias, eps, y, mean, rstd, k * rows // chunks,
                                 (k + 1) * rows // chunks)
            _frame_back(frame)

    # dweight/dbias partials are summed in the driver, after the row loop: one
    # dispatch per call (a second numba call cost ~0.4 us, measured).
    @njit(**opts)
    def rms_norm_bwd(dy, x, weight, rstd, dx, dweight_parts, chunks, dweight, threads):
        rows = x.shape[0] * x.shape[1]
        groups = _thread_chunks(chunks, threads, parallel)
        for t in loop(groups):
            frame = _frame_on_page()
            _wide_for_halves(x)
            k0, k1 = t * chunks // groups, (t + 1) * chunks // groups
            if _rows_pipelined(x, groups > 1 or not parallel):
                _norm_bwd_rows(dy, x, weight, None, rstd, dx, dweight_parts, None, chunks,
                               k0, k1)
            else:
                stream = _streams(dx)
                for k in range(k0, k1):
                    start, end = _chunk_rows(k, rows, chunks)
                    for r in range(start, end):
                        _norm_bwd_two_passes(dy, x, weight, None, rstd, dx,
                                             _row_of(dweight_parts, k), None, r, r == start,
                                             stream)
            _frame_back(frame)
        # the partials' sum: by column blocks in parallel when there are many
        blocks = _sum_blocks(dweight_parts) if parallel else 0
        if blocks:
            sum_partials_by_blocks(dweight_parts, dweight, None, None, blocks)
        else:
            _sum_into(dweight_parts, dweight)

    @njit(**opts)
    def layer_norm_bwd(dy, x, weight, mean, rstd, dx, dweight_parts, dbias_parts,
                       chunks, dweight, dbias, threads):
        rows = x.shape[0] * x.shape[1]
        groups = _thread_chunks(chunks, threads, parallel)
        for t in loop(groups):
            frame = _frame_on_page()
            _wide_for_halves(x)
            k0, k1 = t * chunks // groups, (t + 1) * chunks // groups
            if _rows_pipelined(x, groups > 1 or not parallel):
                _norm_bwd_rows(dy, x, weight, mean, rstd, dx, dweight_parts, dbias_parts,
                               chunks, k0, k1)
            else:
                stream = _streams(dx)
                for k in range(k0, k1):
                    start, end = _chunk_rows(k, rows, chunks)
                    for r in range(start, end):
                        _norm_bwd_two_passes(dy, x, weight, mean, rstd, dx,
                                             _row_of(dweight_parts, k),
                                             _row_of(dbias_parts, k), r, r == start, stream)
            _frame_back(frame)
        blocks = max(_sum_blocks(dweight_parts), _sum_blocks(dbias_parts)) if parallel else 0
        if blocks:
            sum_partials_by_blocks(dweight_parts, dweight, dbias_parts, dbias, blocks)
        else:
            _sum_into(dweight_parts, dweight)
            _sum_into(dbias_parts, dbias)

    return dict(softmax_fwd=softmax_fwd, softmax_bwd=softmax_bwd,
                rms_norm_fwd=rms_norm_fwd, rms_norm_bwd=rms_norm_bwd,
                layer_norm_fwd=layer_norm_fwd, layer_norm_bwd=layer_norm_bwd)


PARALLEL = _build(prange)
SERIAL = _build(range)


# Column-blocked norms (see WIDE_COLS): parallel kernels of their own, which the
# backend picks for a few long rows (``_wide_fwd``, ``_wide_bwd``). Inside the
# row drivers they doubled the parallel builds' compile time (four float32 norm
# drivers 16.9 -> 26.6 s cold, 2026-12-05), for every signature compiled,
# whether or not a call ever took them. Module-level dispatchers: the backend
# calls them, no driver does (see ``_build``).
_blocked = njit(parallel=True, cache=True, nogil=True, error_model='numpy')


@_blocked
def norm_fwd_blocked(x, weight, bias, eps, y, mean, rstd):
    """A norm forward by column blocks: the blocks' sums, each row's statistics
    from them (serial), the blocks' stores. LayerNorm; RMSNorm with mean None."""
    rows, cols = x.shape[0] * x.shape[1], x.shape[2]
    sums = _wide_sums_table(x, rows, cols, _fwd_slots(mean))
    for b in prange(_wide_blocks(cols)):
        frame = _frame_on_page()
        _wide_for_halves(x)
        _wide_fwd_sums(x, mean, sums, b)
        _frame_back(frame)
    _wide_fwd_stats(x, eps, sums, mean, rstd)
    for b in prange(_wide_blocks(cols)):
        frame = _frame_on_page()
        _wide_for_halves(x)
        _wide_fwd_store(x, weight, bias, mean, rstd, y, b)
        _frame_back(frame)


@_blocked
def norm_bwd_blocked(dy, x, weight, mean, rstd, dx, dweight_parts, dbias_parts, chunks,
                     dweight, dbias):
    """A norm backward by column blocks: the blocks' (dot, sum(g)), each row's means
    of them (serial), the blocks' stores with their dweight/dbias partials summed.
    LayerNorm; RMSNorm with mean None (and no dbias)."""
    rows, cols = x.shape[0] * x.shape[1], x.shape[2]
    sums = _wide_sums_table(x, rows, cols, 2)
    for b in prange(_wide_blocks(cols)):
        frame = _frame_on_page()
        _wide_for_halves(x)
        _wide_bwd_sums(dy, x, weight, mean, rstd, sums, b)
        _frame_back(frame)
    _wide_bwd_stats(x, mean, rstd, sums)
    for b in prange(_wide_blocks(cols)):
        frame = _frame_on_page()
        _wide_for_halves(x)
        _wide_bwd_store(dy, x, weight, mean, rstd, dx, dweight_parts, dbias_parts, sums, b,
                        chunks, dweight, dbias)
        _frame_back(frame)


#: the column-blocked kernels, called with the arguments of PARALLEL's drivers
BLOCKED = dict(
    rms_norm_fwd=lambda x, weight, eps, y, rstd, threads: norm_fwd_blocked(
        x, weight, None, eps, y, None, rstd),
    layer_norm_fwd=lambda x, weight, bias, eps, y, mean, rstd, threads: norm_fwd_blocked(
        x, weight, bias, eps, y, mean, rstd),
    rms_norm_bwd=lambda dy, x, weight, rstd, dx, parts, chunks, dweight, threads:
        norm_bwd_blocked(dy, x, weight, None, rstd, dx, parts, None, chunks, dweight, None),
    layer_norm_bwd=lambda dy, x, weight, mean, rstd, dx, wparts, bparts, chunks, dweight,
        dbias, threads: norm_bwd_blocked(dy, x, weight, mean, rstd, dx, wparts, bparts, chunks,
                                         dweight, dbias))
_BLOCKED_WHEN = dict(rms_norm_fwd=_wide_fwd, layer_norm_fwd=_wide_fwd,
                     rms_norm_bwd=_wide_bwd, layer_norm_bwd=_wide_bwd)


def _build_long(loop):
    """The softmax forward on rows of more than ``long_cols`` columns
    (``_softmax_fwd_long_row``), parallel (prange) or serial: kernels of their
    own, with the drivers' arguments, for the reason of the column-blocked norms
    (inside the softmax drivers this path cost every signature 1.3 s of parallel
    and 0.5 s of serial compile, 2026-12-05). ``loop`` is referenced in the body
    (see ``_build``)."""
    parallel = loop is prange

    @njit(parallel=parallel, cache=True, nogil=True, error_model='numpy')
    def softmax_fwd_long(x, y, threads):
        rows, cols = x.shape[0] * x.shape[1], x.shape[2]
        blocks = (cols + _long_block(x) - 1) // _long_block(x)
        chunks = _thread_chunks(rows, threads, parallel)   # one scratch row per thread
        stream = _long_streams(y, cols)
        for k in loop(chunks):
            frame = _frame_on_page()
            _wide_vectors()
            scratch = _acc_empty(x, cols if stream else _scratch_elems(y, x, cols))
            bmax, bsum = _acc_empty(x, blocks), _acc_empty(x, blocks)
            for r in range(k * rows // chunks, (k + 1) * rows // chunks):
                yr = _row_at(y, r)
                # two calls, not one on exps chosen at run time (scratch if stream
                # else y): that ran 0.84-0.85x at 1,792-2,048 columns (ab.py --evict
                # 64, 2026-12-08), likely as the store loop can no longer tell that
                # scratch is not y
                if stream:
                    _softmax_fwd_long_row(_row_at(x, r), yr, scratch, bmax, bsum, True)
                else:
                    _softmax_fwd_long_row(_row_at(x, r), yr, _exps_into(yr, scratch), bmax,
                                          bsum, False)
            _frame_back(frame)
    return softmax_fwd_long


@_blocked
def softmax_fwd_long_blocked(x, y, threads):
    """The long-row softmax forward for fewer rows than threads: each thread takes
    a range of the (row, block) pieces, first their exps and sums, then (each row's
    factors from them) their stores; the bits of ``_softmax_fwd_long_row``, whose
    steps it runs. Exps go to y as there, or to a scratch of every row."""
    rows, cols, B = x.shape[0] * x.shape[1], x.shape[2], _long_block(x)
    blocks = (cols + B - 1) // B
    pieces = rows * blocks
    chunks = max(1, min(threads, pieces))
    bmax, bsum = _acc_empty(x, pieces), _acc_empty(x, pieces)
    scratch = _acc_empty(x, _scratch_elems(y, x, rows * cols))
    for k in prange(chunks):
        frame = _frame_on_page()
        _wide_vectors()
        mx = acc(x, -np.inf)
        lo, hi = k * pieces // chunks, (k + 1) * pieces // chunks
        for p in range(lo, hi):
            r, j = p // blocks, p % blocks
            xr = _row_at(x, r)
            if p == lo or j == 0:
                mx = _max(xr[j * B:min(cols, (j + 1) * B)])
            more = p + 1 < hi and j + 1 < blocks        # the next block is this chunk's
            mx = _long_block_exps(xr, _exps_into(_row_at(y, r), scratch[r * cols:(r + 1) * cols]),
                                  bmax[r * blocks:(r + 1) * blocks],
                                  bsum[r * blocks:(r + 1) * blocks], j, mx,
                                  min(cols, (j + 2 if more else j + 1) * B))
        _frame_back(frame)
    for r in range(rows):
        _long_factors(x, bmax[r * blocks:(r + 1) * blocks], bsum[r * blocks:(r + 1) * blocks])
    for k in prange(chunks):
        frame = _frame_on_page()
        _wide_vectors()
        for p in range(k * pieces // chunks, (k + 1) * pieces // chunks):
            r, j = p // blocks, p % blocks
            yr = _row_at(y, r)
            _scaled_store(_exps_into(yr, scratch[r * cols:(r + 1) * cols]), bsum[p], yr,
                          j * B, min(cols, (j + 1) * B), False)
        _frame_back(frame)


#: the long-row softmax forwards, by build; "blocked" for fewer rows than threads
LONG = dict(parallel=_build_long(prange), serial=_build_long(range),
            blocked=softmax_fwd_long_blocked)


def _long(name, x):
    return name == "softmax_fwd" and x.shape[2] > long_cols(x.dtype)


def _parallel_kernel(name, x):
    """PARALLEL[name], or BLOCKED[name] for a norm call on a few long rows, or
    LONG's for a softmax forward on long rows (by pieces for fewer rows than
    threads: the same bits)."""
    if _long(name, x):
        return LONG["blocked" if x.shape[0] * x.shape[1] < _thread_count() else "parallel"]
    if x.shape[2] >= WIDE_COLS and name in BLOCKED and _BLOCKED_WHEN[name](
            x.shape[0] * x.shape[1], x.shape[2], _thread_count()):
        return BLOCKED[name]
    return PARALLEL[name]


def _serial_kernel(name, x):
    """SERIAL[name], or LONG's for a softmax forward on long rows."""
    return LONG["serial"] if _long(name, x) else SERIAL[name]


#: the serial/parallel floors in elements, by kernel key (name, or name+"+params")
_FLOORS = {key: _SERIAL_BELOW_BY_KERNEL.get(key, SERIAL_BELOW) for key in _SERIAL_RATE}
#: the thresholds in use: the floors until ``_calibrate`` runs
_serial_below = dict(_FLOORS)
#: the floors the small-call entries use (they are serial; never calibrated)
SMALL_BELOW = {name: _FLOORS[name] for name in SERIAL}
_launch_lock = threading.Lock()
_needs_lock = True   # until the first parallel launch shows which layer loaded
_calibrated = False
#: set in a child forked after this process ran parallel kernels on GNU OpenMP
_forked_serial = False


def _gnu_omp_running():
    """Whether numba's threads are up on the omp layer with GNU OpenMP, which
    cannot be used again in a forked child."""
    from numba.np.ufunc import parallel
    if not parallel._is_initialized:
        return False
    try:
        if numba.threading_layer() != "omp":
            return False        # tbb and workqueue survive a fork
        from numba.np.ufunc import omppool
    except (ValueError, ImportError):
        return False
    return getattr(omppool, "openmp_vendor", "GNU") == "GNU"


def _after_fork_in_child():
    """In a child forked from this process: every call runs the serial kernels
    (the same bits) once the parent had numba's GNU OpenMP threads up. Why: numba
    then ends such a child at its first parallel launch ("Terminating: fork()
    called from a process already using GNU OpenMP, this is unsafe.", SIGTERM),
    and a forked worker (multiprocessing, a torch DataLoader's workers) is the
    common way to meet it; measured 2026-12-07, the omp layer with GNU OpenMP
    (numba's choice where no tbb is installed). And the launch lock comes new: a
    thread of the parent may have held it when it forked."""
    global _launch_lock, _calibrated, _forked_serial
    _launch_lock = threading.Lock()
    if _gnu_omp_running():
        _forked_serial = _calibrated = True
        _serial_below.update(dict.fromkeys(_serial_below, sys.maxsize))


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@njit(parallel=True, cache=True, nogil=True)
def _launch_probe(a):
    for i in prange(a.shape[0]):
        a[i] += 1.0


def launch_cost(probes=9):
    """Seconds per parallel launch of an empty kernel, median of ``probes``
    back-to-back launches, here and now (this machine, threading layer, thread
    count and OpenMP settings)."""
    a = np.zeros(max(2, numba.get_num_threads()))
    _launch_probe(a)                 # compile or load, start the pool
    times = []
    for _ in range(probes):
        t0 = time.perf_counter()
        _launch_probe(a)
        times.append(time.perf_counter() - t0)
    return sorted(times)[probes // 2]


def _calibrate():
    """Raise the serial thresholds to where a parallel launch pays on this setup:
    2 * launch cost * the kernel's serial rate, between its floor and SERIAL_CAP.
    Why: with OMP_WAIT_POLICY=PASSIVE (for busy shared cores; README) a launch measured
    ~60 us back to back on the project's VM, 2.2 us without, and serial kernels
    won up to 256K-512K elements (softmax bwd 93 vs 112 us at 524288). Runs once,
    at the first call above a floor; results do not depend on it (serial and
    parallel kernels give the same bits)."""
    global _calibrated
    launch_us = launch_cost() * 1e6
    for key, rate in _SERIAL_RATE.items():
        _serial_below[key] = int(min(SERIAL_CAP, max(_FLOORS[key], 2 * launch_us * rate)))
    _calibrated = True


@contextlib.contextmanager
def forced(parallel):
    """Within the block, calls run the parallel (True) or the serial (False)
    kernels whatever their size (the same bits either way; the small-call entries
    stay serial): for ``warmup`` and tests. Not for use while other threads call."""
    with _launch_lock:
        if not _calibrated:
            _calibrate()
        saved = dict(_serial_below)
        serial = not parallel or _forked_serial      # see _after_fork_in_child
        _serial_below.update(dict.fromkeys(saved, sys.maxsize if serial else 0))
    try:
        yield
    finally:
        _serial_below.update(saved)


def _run(name, key, x, *args):
    """Run kernel ``name``: serial below the threshold of ``key`` (the name, or
    name+"+params" for a backward with dweight/dbias) in elements, else parallel.

    numba's workqueue threading layer aborts the process when two Python threads
    launch parallel kernels at once; with it (and until the first launch tells
    which layer numba picked) parallel launches are serialized. tbb and omp are
    thread-safe and take no lock.
    """
    global _needs_lock
    if x.size < _serial_below[key]:
        return _serial_kernel(name, x)(*args)
    if not _needs_lock:
        return _parallel_kernel(name, x)(*args)
    with _launch_lock:
        if not _calibrated:
            _calibrate()
            if x.size < _serial_below[key]:
                return _serial_kernel(name, x)(*args)
        _parallel_kernel(name, x)(*args)
        _needs_lock = numba.threading_layer() == "workqueue"
        _bind_thread_count()


def param_chunks(rows, cols):
    """Number of dweight/dbias partial rows: a function of the shape only (so are
    the bits of dweight/dbias), at most MAX_CHUNKS and _PARTIAL_ELEMS elements,
    at least CHUNK_ROWS rows each. Why the rows: every row adds into its chunk's
    partial row, which a row of its own per chunk reads and writes as often as
    the row's data (16x65536 had 16 partial rows of 256 KiB); in the benchmark
    the partials start out of cache. At least 4 rows per partial against one
    (AMD EPYC, 2026-12-05, in-process A/B, from memory, 2 threads): 16x65536
    1.32-1.82x, 32x65536 1.04-1.31x, 64x16384 1.07-1.25x, 16x262144 (4 chunks
    either way) 1.01-1.05x; 8 rows gained ~10% more, but leaves fewer chunks,
    hence threads, to few rows (16 rows: 2). Likewise at most 2**19 partial
    elements rather than 2**20 (rows of more than 16,384 columns get fewer
    partials): 16x262144 1.14-1.21x, 32x131072 1.05-1.20x, 64x65536 1.06-1.23x;
    2**18 gained more at 32-64 rows (1.10-1.38x) but left 16x262144 one partial
    (column-blocked then: 0.83-1.07x).

    More than two partials only at MANY_CHUNK_ROWS (8) rows each: every partial
    row is read and written once per row of its chunk, as often as the row's own
    data, so in cache a chunk of 4 rows spent more on its partials than on its
    rows. ab.py, AMD EPYC, 2 threads, 2026-12-06, 8 rows a partial against 4,
    dweight/dbias bwd: in cache (32-128x4096, 64x1024, 128x2048, 16x8192)
    float32 1.04-1.15x (layer_norm 64x1024 0.99x), bfloat16 1.05-1.19x; from
    memory (16-64x65536, 128x16384, 200x4096) float32 1.00-1.09x, bfloat16
    1.02-1.18x. But two partials (a thread each here) from 8 rows as before:
    8-15 rows at 8 a partial would have one, and ran 0.76-0.95x. The price is on
    machines of more threads than two: fewer partials, hence busy threads, for
    16-255 rows."""
    by_rows = max(min(2, rows // CHUNK_ROWS), rows // MANY_CHUNK_ROWS)
    return max(1, min(by_rows, MAX_CHUNKS, _PARTIAL_ELEMS // max(cols, 1)))


_param_chunks = njit(cache=True)(param_chunks)


# ------------------------------------------------------- small-call entries
# A (1, 1024) call spends more time in Python than in its kernel: checks, views,
# allocations and the backend's bookkeeping cost ~5 us of a 7 us layer_norm bwd
# (measured 2026-12-03), at ~50 ns per attribute read on the project's VMs. The
# entries below take the public arguments of a small 2-D float32/float64 call as
# they are, beside output buffers ``_dispatch`` allocates (NumPy's own arrays:
# arrays allocated in numba code come back with owndata False and, from cached
# code, dtype objects equal to but not NumPy's canonical ones), and do the rest
# in compiled code: numba's dispatcher types each argument in C (dtype, ndim and
# C layout are part of the signature), the entry checks the shapes (ValueError:
# the caller falls back to the general path, which names the argument) and runs
# the serial driver. ``_dispatch`` compiles a signature only for calls its own
# fast-path checks accept, and calls the entries with compilation disabled
# otherwise (``_dispatch._SmallCall``).
_small = njit(cache=True, nogil=True, error_model='numpy')
_serial_softmax_fwd = SERIAL["softmax_fwd"]
_serial_softmax_fwd_long = LONG["serial"]
_serial_softmax_bwd = SERIAL["softmax_bwd"]
_serial_rms_norm_fwd = SERIAL["rms_norm_fwd"]
_serial_rms_norm_bwd = SERIAL["rms_norm_bwd"]
_serial_layer_norm_fwd = SERIAL["layer_norm_fwd"]
_serial_layer_norm_bwd = SERIAL["layer_norm_bwd"]


@njit(inline='always')
def _require(ok):
    if not ok:
        raise ValueError("not a small call")    # caught by _dispatch: general path


def _fits(p, cols):
    raise NotImplementedError


@overload(_fits)
def _fits_impl(p, cols):
    """weight/bias of length cols, or None."""
    if isinstance(p, types.NoneType):
        return lambda p, cols: True
    return lambda p, cols: p.shape[0] == cols


def _chunks_for(rows, cols, weight, bias):
    raise NotImplementedError


@overload(_chunks_for)
def _chunks_for_impl(rows, cols, weight, bias):
    """As the backend entries: one chunk per row without params, else param_chunks."""
    if isinstance(weight, types.NoneType) and isinstance(bias, types.NoneType):
        return lambda rows, cols, weight, bias: rows
    return lambda rows, cols, weight, bias: _param_chunks(rows, cols)


def _parts_for(p, x, chunks, cols):
    raise NotImplementedError


@overload(_parts_for)
def _parts_for_impl(p, x, chunks, cols):
    """Partial rows in the accumulator type (None for None); summing one is a copy."""
    if isinstance(p, types.NoneType):
        return lambda p, x, chunks, cols: None
    dt = np.float64 if x.dtype == types.float64 else np.float32
    return lambda p, x, chunks, cols: np.empty((chunks, cols), dt)


def _rows3(a):
    raise NotImplementedError


@overload(_rows3)
def _rows3_impl(a):
    """The (1, rows, cols) view of a 2-D array; None (an in-place dx) stays None."""
    if isinstance(a, types.NoneType):
        return lambda a: None
    return lambda a: a.reshape((1, a.shape[0], a.shape[1]))


@njit(inline='always')
def _serial_threads():
    """The serial drivers' thread count, typed int64: a literal 1 (Literal[int](1))
    compiled a second copy of every serial driver signature that the small-call
    entries reach (54 of the 289 driver signatures a CI run compiled, 2026-12-06)."""
    return np.int64(1)


@njit(inline='always')
def _eps_ok(eps):
    return eps >= 0.0 and eps < np.inf


@_small
def small_softmax_fwd(x, y):
    rows, cols = x.shape
    _require(rows * cols > 0)
    if cols > _long_cols(x):       # the path depends on the columns alone (long_cols)
        _serial_softmax_fwd_long(_rows3(x), _rows3(y), _serial_threads())
    else:
        _serial_softmax_fwd(_rows3(x), _rows3(y), _serial_threads())


@_small
def small_softmax_bwd(y, dy, dx):
    rows, cols = y.shape
    _require(rows * cols > 0 and dy.shape == y.shape)
    _serial_softmax_bwd(_rows3(y), _rows3(dy), _rows3(dx), _serial_threads())


@_small
def small_rms_norm_fwd(x, weight, eps, y, rstd):
    rows, cols = x.shape
    _require(rows * cols > 0 and _fits(weight, cols) and _eps_ok(eps))
    _serial_rms_norm_fwd(_rows3(x), weight, eps, _rows3(y), rstd, _serial_threads())


@_small
def small_layer_norm_fwd(x, weight, bias, eps, y, mean, rstd):
    rows, cols = x.shape
    _require(rows * cols > 0 and _fits(weight, cols) and _fits(bias, cols) and _eps_ok(eps))
    _serial_layer_norm_fwd(_rows3(x), weight, bias, eps, _rows3(y), mean, rstd,
                           _serial_threads())


@_small
def small_rms_norm_bwd(dy, x, weight, rstd, dx, dweight):
    rows, cols = x.shape
    _require(rows * cols > 0 and dy.shape == x.shape and rstd.shape[0] == rows
             and _fits(weight, cols))
    chunks = _chunks_for(rows, cols, weight, None)
    _serial_rms_norm_bwd(_rows3(dy), _rows3(x), weight, rstd, _rows3(dx),
                         _parts_for(weight, x, chunks, cols), chunks, dweight,
                         _serial_threads())


@_small
def small_layer_norm_bwd(dy, x, weight, bias, mean, rstd, dx, dweight, dbias):
    rows, cols = x.shape
    _require(rows * cols > 0 and dy.shape == x.shape and mean.shape[0] == rows
             and rstd.shape[0] == rows and _fits(weight, cols) and _fits(bias, cols))
    chunks = _chunks_for(rows, cols, weight, bias)
    _serial_layer_norm_bwd(_rows3(dy), _rows3(x), weight, mean, rstd, _rows3(dx),
                           _parts_for(weight, x, chunks, cols),
                           _parts_for(bias, x, chunks, cols), chunks, dweight, dbias,
                           _serial_threads())


#: the small-call entries by kernel name (each applies below SMALL_BELOW[name])
SMALL = dict(softmax_fwd=small_softmax_fwd, softmax_bwd=small_softmax_bwd,
             rms_norm_fwd=small_rms_norm_fwd, rms_norm_bwd=small_rms_norm_bwd,
             layer_norm_fwd=small_layer_norm_fwd, layer_norm_bwd=small_layer_norm_bwd)


class _Scratch:
    """Reused dweight/dbias partial-row buffers, at most ``limit`` bytes kept.

    A fresh multi-MiB array is a fresh mmap whose every page faults on its first
    write, inside the kernel: measured 7 ms of a 10 ms 16x262144 LayerNorm
    backward on this project's VM. Buffers are taken and given back under a lock,
    so concurrent calls never share one; their contents are garbage (the first
    row of each chunk assigns). Buffers under ``small`` bytes come from malloc's
    heap, whose pages are already mapped: they are plain ``np.empty`` and skip the
    lock (it cost ~1 us of a 5 us small call). glibc serves 128 KiB and more from
    fresh mmaps (its default M_MMAP_THRESHOLD), so ``small`` stays below that: at
    256 KiB, the (32, 1024) float32 partials of a 128x1024 layer_norm bwd faulted
    in on every call (backend 144 vs 64 us, measured 2026-12-03). The pooled
    buffers start on a cache line (``_on_lines``).
    """

    def __init__(self, limit=32 << 20, small=64 << 10):
        self._free, self._bytes, self._limit, self._small = {}, 0, limit, small
        self._lock = threading.Lock()

    def take(self, shape, dtype):
        dtype = np.dtype(dtype)
        if shape[0] * shape[1] * dtype.itemsize < self._small:
            return np.empty(shape, dtype)
        key = (shape, dtype)
        with self._lock:
            free = self._free.get(key)
            if free:
                a = free.pop()
                self._bytes -= a.nbytes
                return a
        return _on_lines(shape, dtype)

    def give(self, a, out):
        """Back to the pool: partials ``_partials`` gave for ``out``, unless they are
        out's own view (one chunk in out's dtype) or small (plain ``np.empty``)."""
        if a is None or a.nbytes < self._small or _partials_are_out(out, a.shape[0], a.dtype):
            return
        with self._lock:
            if self._bytes + a.nbytes <= self._limit:
                self._free.setdefault((a.shape, a.dtype), []).append(a)
                self._bytes += a.nbytes


def _on_lines(shape, dtype):
    """An empty (rows, cols) array that starts on a cache line (a view of a byte
    buffer), so the partial rows' vectors do not straddle lines. NumPy starts
    large arrays 16 bytes into a page: every 64-byte part of the half backwards'
    partials (float32 zmm) and every other 32-byte part of float32's (ymm) then
    spanned two lines, and the partials are read and written once a row.
    ab.py --evict 64 against np.empty, AMD EPYC, 2026-12-06: bfloat16 4096x4096
    rms_norm bwd 1.25x, layer_norm bwd 1.22x (8192x2048 1.23x), fwd+bwd
    1.12-1.13x; float32 4096x4096 bwd 1.07-1.08x, 65536x1024 layer_norm bwd
    1.08x; 1024x16384 and 256x1024 even (0.97-1.03x)."""
    return on_line(np.empty(shape[0] * shape[1] * dtype.itemsize + ALIGN, np.uint8), shape,
                   dtype)


_SCRATCH = _Scratch()


def _partials_are_out(out, chunks, dtype):
    """Whether ``out``'s partial rows are out itself: one chunk in out's dtype."""
    return chunks == 1 and out.dtype == dtype


def _partials(out, chunks, dtype):
    """Partial rows for ``out`` (dweight/dbias): one chunk in the accumulator
    type is ``out`` itself (summing one partial is a copy); the others come from
    ``_SCRATCH`` and go back with ``_SCRATCH.give(parts, out)``."""
    if out is None:
        return None
    if _partials_are_out(out, chunks, dtype):
        return out[None]
    return _SCRATCH.take((chunks, out.shape[0]), dtype)


# ----------------------------------------------------------- backend entry
#: the calling thread's numba thread count (``numba.get_num_threads``, which
#: costs 0.57 us a call on the project's VM; its raw getter, bound once the threads
#: are launched, 0.08 us)
_thread_count = numba.get_num_threads


def _bind_thread_count():
    global _thread_count
    from numba.np.ufunc import parallel
    _thread_count = getattr(parallel, "_get_num_threads", numba.get_num_threads)


#: window, around multiples of ALIAS_SPAN (``_alloc``), of the store/load aliasing below
ALIAS_NEAR = 4096


def _norm_fwd_threads(x, y, threads):
    """The thread count for a pipelined norm forward: ``threads``, or one chunk per
    row (each row its own two passes, ``_rms_norm_fwd_rows``: the same bits) when
    y's row r lies a multiple of ALIAS_SPAN bytes from x's row r + 1, to within
    ALIAS_NEAR bytes. The pipelined stage stores the one while it loads the other,
    column by column, and on AMD Zen, whose L1 ways are predicted from a hash of
    linear-address bits 12-27, lines 2**28 bytes apart evict each other. Two
    arrays of 256 MiB allocated one after the other are exactly that far apart
    (NumPy's x, then its y, at 65536x1024 float32: y = x + 2**28 + 4096): measured
    2026-12-05 on the project's AMD EPYC VM, layer_norm fwd 28-30 ms pipelined
    against 13-16 ms row by row, rms_norm fwd 17 against 15 ms; a buffer 8 KiB
    further on ran pipelined in 16-17 ms. The outputs the library allocates are
    placed clear of this (``_alloc.place``); a caller's ``out=`` may not be."""
    d = (y.ctypes.data - x.ctypes.data - x.shape[2] * x.itemsize) % ALIAS_SPAN
    if d < ALIAS_NEAR or d > ALIAS_SPAN - ALIAS_NEAR:
        return max(threads, x.shape[0] * x.shape[1])
    return threads


def _run_threaded(name, x, *args, y=None):
    """``_run`` for the pipelined drivers (the forwards and softmax_bwd), which take
    the thread count last: one chunk per thread (the bits do not depend on it), or
    for a norm forward given its output ``y``, one per row where ``_norm_fwd_threads``
    finds y's address aliasing x's."""
    plain = x.shape[2] < WIDE_COLS and not _long(name, x)
    if x.size < _serial_below[name]:
        return (SERIAL[name] if plain else _serial_kernel(name, x))(*args, 1)
    threads = _thread_count() if y is None else _norm_fwd_threads(x, y, _thread_count())
    if not _needs_lock and plain:   # _run's common case, one call less
        return PARALLEL[name](*args, threads)
    return _run(name, name, x, *args, threads)


def softmax_fwd(x, y):
    _run_threaded("softmax_fwd", x, x, y)


def softmax_bwd(y, dy, dx):
    _run_threaded("softmax_bwd", y, y, dy, None if dx is dy else dx)


def rms_norm_fwd(x, weight, eps, y, rstd):
    _run_threaded("rms_norm_fwd", x, x, weight, eps, y, rstd, y=y)


def layer_norm_fwd(x, weight, bias, eps, y, mean, rstd):
    _run_threaded("layer_norm_fwd", x, x, weight, bias, eps, y, mean, rstd, y=y)


# The backwards below run ~10 Python statements per call: at ~50 ns each on the
# project's VMs they are measurable against a 5 us (1, 1024) call, hence the
# shortcuts (no params: no partials; a partial taken from the pool is the only
# thing given back). Without dweight/dbias a row is a chunk, and a group of its
# own (``rows`` for the thread count): each row's two passes in turn, not
# pipelined, which one pipeline per thread did not beat (AMD EPYC, 2026-12-05,
# from memory: bfloat16 4096x4096 0.86-0.90x, 256x16384 1.16x, float32 0.95-1.06x).
def rms_norm_bwd(dy, x, weight, rstd, dx, dweight):
    rows = x.shape[0] * x.shape[1]
    if dweight is None:
        _run("rms_norm_bwd", "rms_norm_bwd", x, dy, x, weight, rstd,
             None if dx is dy else dx, None, rows, None, rows)
        return
    chunks = param_chunks(rows, x.shape[2])
    parts = _partials(dweight, chunks, rstd.dtype)     # rstd is in the accumulator type
    _run("rms_norm_bwd", "rms_norm_bwd+params", x, dy, x, weight, rstd,
         None if dx is dy else dx, parts, chunks, dweight, _thread_count())
    _SCRATCH.give(parts, dweight)


def layer_norm_bwd(dy, x, weight, mean, rstd, dx, dweight, dbias):
    rows = x.shape[0] * x.shape[1]
    if dweight is None and dbias is None:
        _run("layer_norm_bwd", "layer_norm_bwd", x, dy, x, weight, mean, rstd,
             None if dx is dy else dx, None, None, rows, None, None, rows)
        return
    chunks = param_chunks(rows, x.shape[2])
    acc_dtype = rstd.dtype                            # rstd is in the accumulator type
    wparts = _partials(dweight, chunks, acc_dtype)
    bparts = _partials(dbias, chunks, acc_dtype)
    _run("layer_norm_bwd", "layer_norm_bwd+params", x, dy, x, weight, mean, rstd,
         None if dx is dy else dx, wparts, bparts, chunks, dweight, dbias, _thread_count())
    _SCRATCH.give(wparts, dweight)
    _SCRATCH.give(bparts, dbias)


#: the warmup groups, costliest first (the order ``jobs`` hands them out in): the
#: build, and the shape whose calls reach it; then the op
WARMUP_BUILDS = (("parallel", (128, SERIAL_BELOW // 128 + 1)), ("serial", (1, 8)),
                 ("blocked", (1, WIDE_FWD_COLS)))   # one long row: column-blocked norms,
#                                                      long-row softmax forwards
WARMUP_OPS = ("layer_norm", "rms_norm", "softmax")


def warmup(dtypes=None, verbose=False, jobs=1):
    """Compile (or load from the on-disk cache) every CPU kernel for every dtype,
    parameter dtype and layout the dispatcher produces for contiguous inputs:
    serial and parallel builds, and the column-blocked norms.
    Returns {"dtype/param-dtype/build": seconds}.

    ``jobs`` > 1 compiles the groups (each op of each key) in that many spawned
    processes into the on-disk cache, then loads them here; a key's seconds are
    then its workers'. numba compiles one function at a time per process, and a
    signature another process is compiling is waited for, not compiled twice
    (``_cache``). The workers are spawned: from a script, call it under
    ``if __name__ == "__main__":`` (``numba-fused warmup -j N`` needs nothing)."""
    from . import _dtypes as D
    names = [np.dtype(D.as_dtype(dt)).name for dt in (dtypes or D.SUPPORTED)]
    groups = [(dt, build, pdt, op) for build, _ in WARMUP_BUILDS for op in WARMUP_OPS
              for dt in names for pdt in sorted({dt, "float32"})
              if op != "softmax" or pdt == dt]      # softmax has no weight
    timings = {}
    if jobs > 1 and len(groups) > 1:
        import concurrent.futures
        import multiprocessing
        # spawn: a forked child of a process that ran parallel kernels runs them
        # serially (the threading layer's pool does not survive a fork)
        with concurrent.futures.ProcessPoolExecutor(
                min(jobs, len(groups)), multiprocessing.get_context("spawn")) as ex:
            futures = [(g, ex.submit(_warm_group, *g)) for g in groups]
            for (dt, build, pdt, _), f in futures:
                key = _warm_key(dt, build, pdt)
                timings[key] = timings.get(key, 0.0) + f.result()
    here = {}
    for dt, build, pdt, op in groups:       # with jobs: loads what the workers compiled
        key = _warm_key(dt, build, pdt)
        here[key] = here.get(key, 0.0) + _warm_group(dt, build, pdt, op)
    for key, seconds in here.items():
        timings.setdefault(key, seconds)
        if verbose:
            print(f"  {key}: {timings[key]:.2f} s" + (" (workers)" if jobs > 1 else ""))
    return timings


def _warm_key(dtype, build, pdt):
    """A warmup timing's key: "dtype/weight dtype/build"."""
    return f"{dtype}/{pdt}/{build}"


def _warm_group(dtype, build, pdt, op):
    """One op of one warmup key in this process (a ``jobs`` worker's task): every
    direction, with and without weight/bias, out= and in place. Returns seconds."""
    import numba_fused as nf
    from . import _dtypes as D
    dtype, pdt = D.as_dtype(dtype), D.as_dtype(pdt)
    shape = dict(WARMUP_BUILDS)[build]
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    w = np.ones(shape[-1], pdt)
    t0 = time.perf_counter()
    if op == "softmax" and build == "blocked":      # LONG: blocked, parallel, serial
        batch = np.repeat(x, max(2, _thread_count()), axis=0)
        for parallel, a in ((True, x), (True, batch), (False, x)):
            with forced(parallel):
                nf.softmax_fwd(a)
        return time.perf_counter() - t0
    with forced(parallel=build != "serial"):
        if op == "softmax":
            y = nf.softmax_fwd(x)
            for out in (None, dy.copy()):      # and the in-place (out=dy) kernels
                nf.softmax_bwd(y, dy if out is None else out, out=out)
        for weight in (None, w) if op != "softmax" else ():
            if op == "rms_norm":
                y, rstd = nf.rms_norm_fwd(x, weight)
                for out in (None, dy.copy()):
                    nf.rms_norm_bwd(dy if out is None else out, x, weight, rstd, out=out)
                continue
            for bias in (None, w):
                y, mean, rstd = nf.layer_norm_fwd(x, weight, bias)
                for out in (None, dy.copy()):
                    nf.layer_norm_bwd(dy if out is None else out, x, weight, bias,
                                      mean, rstd, out=out)
    return time.perf_counter() - t0

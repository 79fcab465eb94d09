"""CUDA kernels (numba-cuda) for the six op x direction pairs, and the device context.

Numerics: the spec of ``_dtypes`` -- every element is widened to the accumulator
(float32, float64 for float64) on load, all arithmetic and reductions run in it, and
the value is rounded once, at the store. LayerNorm's variance is two-pass (sum of
squared deviations from the mean). Softmax: a row holding NaN or +inf, or only -inf,
is NaN; -inf entries of a finite row are exactly 0.

Kernel design (memory roofline):

* A *group* of G threads owns a row: a warp per row (G = 32, 4 rows per 128-thread
  block) for short rows, a block per row (G = TPB) otherwise. Groups walk the rows
  grid-stride, so any row count works with a bounded grid.
* Columns go in *chunks* of W elements: W = 16 bytes / itemsize (16-byte vector
  loads and stores: 8 halves, 4 float32, 2 float64) when every base pointer is
  16-byte aligned, every row stride is a multiple of 16 bytes and cols % W == 0;
  else W = 1. Lane l handles chunks l, l + G, l + 2G, ... -- coalesced.
* Forward: if the lane's chunks fit NV <= CAP / W register slots the row is read
  from global memory once (kept in registers as accumulator values); longer rows use
  a strided streaming loop (softmax: an online max/sum, then one re-read -- in
  registers it is max, then exp kept in place, one exp an element; RMSNorm:
  one re-read; LayerNorm: per-thread chunk-merged mean/M2 (Chan) of values
  shifted by the row's first element, then one re-read). Any cols
  works (the loops are runtime-bounded; offsets are 64-bit).
* Reductions: warp shuffles (``shfl_xor_sync`` butterfly, every lane gets the same
  bits) then shared memory across the warps of a block. The CUDA simulator has no
  warp shuffles: there the same helper reduces through a shared-memory tree.
* Backward: pass 1 computes the row's dot products (and the dweight/dbias
  contributions), pass 2 re-reads the row (L1/L2) to write dx. dx may be dy itself:
  each thread reads a chunk before it writes the same chunk. dweight/dbias go
  through per-group float32 (float64 for float64) *partial rows* -- in registers
  when the lane's columns fit PCAP slots, else in the partial row in global memory,
  owned by one group -- and a second kernel sums the partial rows over the groups in
  a fixed order and rounds once. No atomics; bitwise run-to-run deterministic.
* Block size / chunk count come from ``Table.choose`` (the table is in ``Table``'s
  docstring); kernels are compiled once per (op, storage dtype, configuration),
  never per shape: the configuration set is small and fixed.

Known limits (measured on an H200, 2026-12-04, benchmarks/RESULTS.md "GPU"): float32
rows in registers run at the DRAM roofline; bfloat16 rows take as long as float32 ones
(latency-bound: 56-63 registers a thread cap occupancy at 50%, and a thread holds 16
elements, i.e. half the bytes); rows longer than the register cache (forward > 16,384
columns, backward always) are re-read in a second pass, from L2 while a wave's rows fit
in it and from DRAM beyond; backward partial rows that do not fit registers (> 8,192
columns with weights) are read-modify-written per row in L2 (8192 x 32768 bf16
LayerNorm backward: 7% of the copy roofline). Without thread-block clusters (quack's
approach for 262K columns) the 262,144-column backward cannot reach the 70% target.
Per-call host work: see ``Replay`` (the general path costs hundreds of microseconds).
Negative strides on device arrays are untested.

Device context (``DEVICE``): wraps ``__cuda_array_interface__`` objects (numba
device arrays, CuPy arrays, torch CUDA tensors) and simulator arrays. Results are
numba device arrays: float16 as float16, bfloat16 as *uint16 bit* arrays
(``ml_dtypes`` has no device counterpart; view them as bfloat16 with
``torch.as_tensor(r, device='cuda').view(torch.bfloat16)`` or ``cupy.asarray(r)``).
bf16 data comes in as a uint16/int16 (or torch ``<V2``) device array plus
``dtype="bfloat16"``; weight/bias given as 16-bit integer arrays are read as the
call's half dtype. ``reshape_view`` returns zero-copy views wherever NumPy's reshape
would; arrays that need a copy to C order (non-unit last stride) are copied on the
device by a strided copy kernel (up to 4 axes after merging). ``stream=`` takes a
numba stream, an object with a ``cuda_stream`` handle (torch.cuda.Stream) or an int
handle; every launch, fill and copy of the call is issued on it.
"""
import ctypes
import math
import os
import threading

import numpy as np

# numba-cuda 0.30.4 (the last release: maintenance mode, NVIDIA/numba-cuda#907 closed
# as won't-fix) registers an overload of np.row_stack when its typing registries load
# at the first kernel compile; NumPy 2.5 removed that alias of vstack, so every
# compile raised AttributeError there (seen on the project's H200 image: numba 0.68.0,
# NumPy 2.5.2). The alias is restored for numba-cuda to find; it is exactly vstack.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from numba import cuda, types  # noqa: E402

from . import _dtypes as D

D.load_bfloat16()   # device code takes dtype='bfloat16' names and raw uint16 bits

try:
    from numba.core import config as _config
    SIM = bool(_config.ENABLE_CUDASIM)
except Exception:  # pragma: no cover
    SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"

_ALIGN = 16   # bytes of one vector load/store


# ============================================================ device primitives
if SIM:
    import ml_dtypes as _mld

    def _widen_py(v):
        if isinstance(v, np.int16):
            return np.float32(v.view(np.float16))
        if isinstance(v, np.uint16):
            return (np.uint32(v) << np.uint32(16)).view(np.float32)
        return v

    def _narrow_py(v, st):
        if st == np.int16:
            return np.array(v, np.float32).astype(np.float16).view(np.int16)[()]
        if st == np.uint16:
            return np.array(v, np.float32).astype(_mld.bfloat16).view(np.uint16)[()]
        return st.type(v)

    def _make_ld3(n):
        def ld(a, o, i, c):
            return tuple(_widen_py(a[o, i, c + j]) for j in range(n))
        return ld

    def _make_ld1(n):
        def ld(a, c):
            return tuple(_widen_py(a[c + j]) for j in range(n))
        return ld

    def _st3(a, o, i, c, t):
        st = a.dtype
        for j in range(len(t)):
            a[o, i, c + j] = _narrow_py(t[j], st)

    def _st1(a, c, v):
        a[c] = _narrow_py(v, a.dtype)

    def _ld0(a, c):
        return _widen_py(a[c])


else:
    from llvmlite import ir
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _i8p = ir.IntType(8).as_pointer()
    _i16, _i32, _i64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)
    _f32 = ir.FloatType()
    _STORAGE_TYPES = (types.int16, types.uint16, types.float32, types.float64)

    def _acc_ty(st):
        return types.float64 if st == types.float64 else types.float32

    def _widen_ir(builder, v, st):
        if st == types.int16:
            return builder.fpext(builder.bitcast(v, ir.HalfType()), _f32)
        if st == types.uint16:
            return builder.bitcast(builder.shl(builder.zext(v, _i32), ir.Constant(_i32, 16)),
                                   _f32)
        return v

    def _narrow_ir(builder, v, st):
        if st == types.int16:
            return builder.bitcast(builder.fptrunc(v, ir.HalfType()), _i16)
        if st == types.uint16:   # round to nearest even; NaN stays a quiet NaN
            bits = builder.bitcast(v, _i32)
            c16 = ir.Constant(_i32, 16)
            lsb = builder.and_(builder.lshr(bits, c16), ir.Constant(_i32, 1))
            rnd = builder.lshr(builder.add(builder.add(bits, ir.Constant(_i32, 0x7FFF)), lsb),
                               c16)
            qnan = builder.or_(builder.lshr(bits, c16), ir.Constant(_i32, 0x40))
            isnan = builder.fcmp_unordered('uno', v, v)
            return builder.trunc(builder.select(isnan, qnan, rnd), _i16)
        return v

    def _elem_ptr(context, builder, aryty, aryval, idx):
        """Pointer to a[idx...] with 64-bit byte offsets; the last axis is taken as
        unit-stride (the dispatcher's contract; with one column only index 0 occurs)."""
        ary = context.make_array(aryty)(context, builder, aryval)
        strides = cgutils.unpack_tuple(builder, ary.strides, aryty.ndim)
        size = context.get_abi_sizeof(context.get_data_type(aryty.dtype))
        off = ir.Constant(_i64, 0)
        for d, (v, ty) in enumerate(idx):
            v = context.cast(builder, v, ty, types.int64)
            step = ir.Constant(_i64, size) if d == aryty.ndim - 1 else strides[d]
            off = builder.add(off, builder.mul(v, step))
        return builder.gep(builder.bitcast(ary.data, _i8p), [off]), size

    def _load_codegen(n, nidx):
        def codegen(context, builder, sig, args):
            aryty = sig.args[0]
            st = aryty.dtype
            ptr, size = _elem_ptr(context, builder, aryty, args[0],
                                  list(zip(args[1:1 + nidx], sig.args[1:1 + nidx])))
            elt = context.get_data_type(st)
            if n == 1:
                vals = [builder.load(builder.bitcast(ptr, elt.as_pointer()), align=size)]
            else:
                vty = ir.VectorType(elt, n)
                vec = builder.load(builder.bitcast(ptr, vty.as_pointer()),
                                   align=min(_ALIGN, n * size))
                vals = [builder.extract_element(vec, ir.Constant(_i32, j)) for j in range(n)]
            vals = [_widen_ir(builder, v, st) for v in vals]
            if sig.return_type == _acc_ty(st):
                return vals[0]
            return context.make_tuple(builder, sig.return_type, vals)
        return codegen

    def _make_ld3(n):
        @intrinsic
        def ld3(typingctx, a, o, i, c):
            """n widened elements a[o, i, c:c+n] (one n*itemsize-byte vector load)."""
            if not (isinstance(a, types.Array) and a.ndim == 3 and a.dtype in _STORAGE_TYPES):
                return None
            return types.UniTuple(_acc_ty(a.dtype), n)(a, o, i, c), _load_codegen(n, 3)
        return ld3

    def _make_ld1(n):
        @intrinsic
        def ld1(typingctx, a, c):
            """n widened elements a[c:c+n] of a 1-D array (vector load)."""
            if not (isinstance(a, types.Array) and a.ndim == 1 and a.dtype in _STORAGE_TYPES):
                return None
            return types.UniTuple(_acc_ty(a.dtype), n)(a, c), _load_codegen(n, 1)
        return ld1

    @intrinsic
    def _ld0(typingctx, a, c):
        """a[c] widened to the accumulator type (1-D)."""
        if not (isinstance(a, types.Array) and a.ndim == 1 and a.dtype in _STORAGE_TYPES):
            return None
        return _acc_ty(a.dtype)(a, c), _load_codegen(1, 1)

    def _store(context, builder, aryty, aryval, idx, vals):
        st = aryty.dtype
        ptr, size = _elem_ptr(context, builder, aryty, aryval, idx)
        elt = context.get_data_type(st)
        vals = [_narrow_ir(builder, v, st) for v in vals]
        n = len(vals)
        if n == 1:
            builder.store(vals[0], builder.bitcast(ptr, elt.as_pointer()), align=size)
            return
        vty = ir.VectorType(elt, n)
        vec = ir.Constant(vty, ir.Undefined)
        for j, v in enumerate(vals):
            vec = builder.insert_element(vec, v, ir.Constant(_i32, j))
        builder.store(vec, builder.bitcast(ptr, vty.as_pointer()), align=min(_ALIGN, n * size))

    @intrinsic
    def _st3(typingctx, a, o, i, c, t):
        """a[o, i, c:c+len(t)] = t rounded to a's storage (one vector store)."""
        if not (isinstance(a, types.Array) and a.ndim == 3 and a.dtype in _STORAGE_TYPES
                and isinstance(t, types.UniTuple) and t.dtype == _acc_ty(a.dtype)):
            return None

        def codegen(context, builder, sig, args):
            vals = cgutils.unpack_tuple(builder, args[4], sig.args[4].count)
            _store(context, builder, sig.args[0], args[0],
                   list(zip(args[1:4], sig.args[1:4])), vals)
            return context.get_dummy_value()
        return types.void(a, o, i, c, t), codegen

    @intrinsic
    def _st1(typingctx, a, c, v):
        """a[c] = v rounded to a's storage type (1-D)."""
        if not (isinstance(a, types.Array) and a.ndim == 1 and a.dtype in _STORAGE_TYPES
                and isinstance(v, types.Float)):
            return None

        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[2], sig.args[2], _acc_ty(sig.args[0].dtype))
            _store(context, builder, sig.args[0], args[0], [(args[1], sig.args[1])], [v])
            return context.get_dummy_value()
        return types.void(a, c, v), codegen

    def _inline(py, nargs, restype):
        """``py`` compiled into its caller by the target context. (numba-cuda's
        ``cuda.jit(device=True)`` functions ask the driver for the device's compute
        capability when compiled, so kernels calling them cannot be compiled to PTX
        without a GPU -- nor can ``_dtypes``' generic overloads; intrinsics can.)"""
        def typer(typingctx, *args):
            sig = restype(*args)(*args)

            def codegen(context, builder, sig, args):
                return context.compile_internal(builder, py, sig, args)
            return sig, codegen
        params = ", ".join(f"a{j}" for j in range(nargs))
        ns = {"typer": typer}
        exec(f"def {py.__name__}(typingctx, {params}):\n"
             f"    return typer(typingctx, {params})", ns)
        return intrinsic(ns[py.__name__])

    def _make_pack(n):
        @intrinsic
        def pack(typingctx, b, k):
            """(b[k], ..., b[k+n-1]) of a 1-D local array, as a tuple."""
            if not (isinstance(b, types.Array) and b.ndim == 1):
                return None

            def codegen(context, builder, sig, args):
                aryty = sig.args[0]
                ary = context.make_array(aryty)(context, builder, args[0])
                k = context.cast(builder, args[1], sig.args[1], types.int64)
                vals = [builder.load(builder.gep(ary.data,
                                                 [builder.add(k, ir.Constant(_i64, j))]))
                        for j in range(n)]
                return context.make_tuple(builder, sig.return_type, vals)
            return types.UniTuple(b.dtype, n)(b, k), codegen
        return pack


_LD3 = {n: _make_ld3(n) for n in (1, 2, 4, 8)}
_LD1 = {n: _make_ld1(n) for n in (1, 2, 4, 8)}


def _pack1(b, k):
    return (b[k],)


def _pack2(b, k):
    return (b[k], b[k + 1])


def _pack4(b, k):
    return (b[k], b[k + 1], b[k + 2], b[k + 3])


def _pack8(b, k):
    return (b[k], b[k + 1], b[k + 2], b[k + 3], b[k + 4], b[k + 5], b[k + 6], b[k + 7])


if SIM:
    _PACK = {1: _pack1, 2: _pack2, 4: _pack4, 8: _pack8}
else:
    _PACK = {n: _make_pack(n) for n in (1, 2, 4, 8)}


# ============================================================ configuration table
class Config:
    """One compiled kernel configuration. G: threads per row (group); RPB: rows
    (groups) per block; W: elements per chunk (vector width or 1); NV: chunk slots per
    lane kept in registers (0: streaming loop over global memory)."""
    __slots__ = ("G", "RPB", "W", "NV")

    def __init__(self, G, RPB, W, NV):
        self.G, self.RPB, self.W, self.NV = G, RPB, W, NV

    @property
    def tpb(self):
        return self.G * self.RPB

    def key(self):
        return (self.G, self.RPB, self.W, self.NV)

    def __repr__(self):
        return f"Config(G={self.G}, RPB={self.RPB}, W={self.W}, NV={self.NV})"


class Table:
    """Block shape by row length. chunks = ceil(cols / W); per = chunks a thread may
    hold: cap / W forward, pcap / W backward (at least 1).

    =========================  =====================================================
    chunks                     threads per row
    =========================  =====================================================
    <= warp * per              a warp per row, ``rpb`` rows per block
    <= t * per, t in sizes     one block of t threads (the smallest such t)
    larger                     one block of max(sizes) threads
    =========================  =====================================================

    NV = next_pow2(ceil(chunks / threads)). Forward: the row stays in registers
    (NV chunk slots) if NV * W <= cap, else the streaming loop (NV = 0). Backward: the
    dweight/dbias partials stay in registers if NV * W <= pcap (split between the
    parameters present, never below W), else the partial rows live in global memory.
    cap/pcap count accumulator values per thread; float64 uses cap/8 and pcap/4,
    scalar chunks (W = 1: one 64-bit address each) cap/4.

    Hardware: warp 32, rpb 4, sizes 128..1024, cap 16, pcap 8, with at most 64
    registers a thread (see ``launch_bounds``); every configuration is spill-free per
    ptxas (tests/test_gpu_ptx.py). Forward rows stay in registers up to 16,384
    columns (float64: 2,048); backward partials up to 8,192 (float64 2,048; LayerNorm
    with both parameters, float32: 4,096). bf16 forward: 1024 cols -> 128 threads,
    4096 -> 256, 8192 -> 512, 16384 -> 1024 (all cached), 32768 and up -> 1024
    streaming. bf16 backward: 1024 -> 128, 4096 -> 512, 8192+ -> 1024.
    The simulator uses a tiny table (block size is a parameter): warp 4, rpb 2,
    sizes 8/16, cap 4, pcap 4.
    """

    def __init__(self, warp, rpb, sizes, cap, pcap):
        self.warp, self.rpb, self.sizes, self.cap, self.pcap = warp, rpb, tuple(sizes), cap, pcap

    def _threads(self, chunks, per_thread):
        if chunks <= self.warp * per_thread:
            return self.warp, self.rpb
        for t in self.sizes:
            if chunks <= t * per_thread:
                return t, 1
        return self.sizes[-1], 1

    def choose(self, cols, W, f64, backward=False, nparams=1):
        cap = self.cap // 8 if f64 else self.cap // (4 if W == 1 else 1)
        pcap = max((self.pcap // 4 if f64 else self.pcap) // max(nparams, 1), W)
        chunks = -(-cols // W)
        per = max((pcap if backward else cap) // W, 1)
        G, rpb = self._threads(chunks, per)
        nv = 1 << max(0, (-(-chunks // G) - 1).bit_length())
        limit = pcap if backward else cap
        return Config(G, rpb, W, nv if nv * W <= limit else 0)


HW_TABLE = Table(warp=32, rpb=4, sizes=(128, 256, 512, 1024), cap=16, pcap=8)
SIM_TABLE = Table(warp=4, rpb=2, sizes=(8, 16), cap=4, pcap=4)
TABLE = SIM_TABLE if SIM else HW_TABLE


# ============================================================ reductions
def _make_reducers(G, RPB, ACC, warp):
    """group_sum / group_max over the G lanes of a row group. ``buf``: a shared
    (RPB, NS) array of ACC. Every thread of the block must call (uniform control)."""
    NW = max(G // warp, 1)
    if SIM:
        NS = G

        def _reduce(v, buf, lane, grp, is_max):
            buf[grp, lane] = v
            cuda.syncthreads()
            s = G // 2
            while s > 0:
                if lane < s:
                    a = buf[grp, lane]
                    b = buf[grp, lane + s]
                    if is_max:
                        buf[grp, lane] = a if a > b else b
                    else:
                        buf[grp, lane] = a + b
                cuda.syncthreads()
                s //= 2
            r = buf[grp, 0]
            cuda.syncthreads()
            return r

        def group_sum(v, buf, lane, grp):
            return _reduce(v, buf, lane, grp, False)

        def group_max(v, buf, lane, grp):
            return _reduce(v, buf, lane, grp, True)
        return group_sum, group_max, NS

    NS = NW

    def group_sum(v, buf, lane, grp):
        off = 16
        while off > 0:                  # butterfly: every lane ends with the same bits
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, off)
            off //= 2
        if NW > 1:
            if lane % 32 == 0:
                buf[grp, lane // 32] = v
            cuda.syncthreads()
            v = buf[grp, 0]
            for k in range(1, NW):
                v += buf[grp, k]
            cuda.syncthreads()
        return v

    def group_max(v, buf, lane, grp):
        off = 16
        while off > 0:
            o = cuda.shfl_xor_sync(0xFFFFFFFF, v, off)
            v = o if o > v else v
            off //= 2
        if NW > 1:
            if lane % 32 == 0:
                buf[grp, lane // 32] = v
            cuda.syncthreads()
            v = buf[grp, 0]
            for k in range(1, NW):
                b = buf[grp, k]
                v = b if b > v else v
            cuda.syncthreads()
        return v

    first = lambda *args: args[0]   # noqa: E731  (the reduced value's type)
    group_sum = _inline(group_sum, 4, first)
    group_max = _inline(group_max, 4, first)
    return group_sum, group_max, NS


# ============================================================ kernel factories
def launch_bounds(tpb):
    """(max threads per block, min blocks per SM): at least 1024 resident threads per
    SM, i.e. at most 64 registers a thread (the table keeps every kernel spill-free
    there; tests/test_gpu_ptx.py checks it with ptxas via nvJitLink)."""
    return (tpb, max(1, 1024 // tpb))


def _jit(tpb):
    if SIM:
        return cuda.jit
    return cuda.jit(launch_bounds=launch_bounds(tpb))


def _softmax_fwd_src(cfg, ACC, group_sum, group_max, NS, nbuf):
    G, RPB, W, NV = cfg.key()
    CACHED = NV > 0
    LD, PACK = _LD3[W], _PACK[W]
    NSLOT = max(NV * W, 1)

    def softmax_fwd(x, y):
        buf = cuda.local.array(NSLOT, ACC)
        tmp = cuda.local.array(W, ACC)
        red = cuda.shared.array((RPB, NS), ACC)
        tid = np.int64(cuda.threadIdx.x)
        lane = tid % G
        grp = tid // G
        inner = x.shape[1]
        cols = x.shape[2]
        rows = x.shape[0] * inner
        nk = NV if CACHED else (cols + G * W - 1) // (G * W)
        ninf = ACC(-math.inf)
        zero = ACC(0.0)
        one = ACC(1.0)
        rb = np.int64(cuda.blockIdx.x)
        while rb * RPB < rows:
            r = rb * RPB + grp
            rr = r if r < rows else rows - 1
            o = rr // inner
            i = rr - o * inner
            m = ninf
            s = zero
            if CACHED:
                # registers: max, then exp(x - max) kept in place: one exp an element
                for k in range(nk):
                    c = (k * G + lane) * W
                    if c < cols:
                        t = LD(x, o, i, c)
                        for j in range(W):
                            v = t[j]
                            buf[k * W + j] = v
                            m = v if v > m else m
                mx = group_max(m, red, lane, grp)
                for k in range(nk):
                    c = (k * G + lane) * W
                    if c < cols:
                        for j in range(W):
                            e = math.exp(buf[k * W + j] - mx)   # NaN/inf rows: NaN
                            buf[k * W + j] = e
                            s += e
            else:
                for k in range(nk):
                    c = (k * G + lane) * W
                    if c < cols:
                        t = LD(x, o, i, c)
                        for j in range(W):
                            v = t[j]
                            if v > m:           # online max/sum; NaN/inf propagate
                                s = s * math.exp(m - v) + (v - v + one)   # NaN if v = inf
                                m = v
                            else:
                                d = v - m
                                if d == d or v != v:   # skip only -inf - -inf
                                    s += math.exp(d)
                mx = group_max(m, red, lane, grp)
                if m != mx:
                    s = s * math.exp(m - mx)
            tot = group_sum(s, red, lane, grp)
            inv = one / tot
            if r < rows:
                for k in range(nk):
                    c = (k * G + lane) * W
                    if c < cols:
                        if CACHED:
                            t = PACK(buf, k * W)
                            for j in range(W):
                                tmp[j] = t[j] * inv
                        else:
                            t = LD(x, o, i, c)
                            for j in range(W):
                                tmp[j] = math.exp(t[j] - mx) * inv
                        _st3(y, o, i, c, PACK(tmp, 0))
            rb += np.int64(cuda.gridDim.x)
    return softmax_fwd


def _rms_norm_fwd_src(cfg, ACC, group_sum, group_max, NS, has_w):
    G, RPB, W, NV = cfg.key()
    CACHED = NV > 0
    LD, LDW, PACK = _LD3[W], _LD1[W], _PACK[W]
    NSLOT = max(NV * W, 1)
    HAS_W = has_w

    def rms_norm_fwd(x, w, eps, y, rstd):
        buf = cuda.local.array(NSLOT, ACC)
        tmp = cuda.local.array(W, ACC)
        red = cuda.shared.array((RPB, NS), ACC)
        tid = np.int64(cuda.threadIdx.x)
        lane = tid % G
        grp = tid // G
        inner = x.shape[1]
        cols = x.shape[2]
        rows = x.shape[0] * inner
        nk = NV if CACHED else (cols + G * W - 1) // (G * W)
        zero = ACC(0.0)
        one = ACC(1.0)
        e = ACC(eps)
        fcols = ACC(cols)
        rb = np.int64(cuda.blockIdx.x)
        while rb * RPB < rows:
            r = rb * RPB + grp
            rr = r if r < rows else rows - 1
            o = rr // inner
            i = rr - o * inner
            ss = zero
            for k in range(nk):
                c = (k * G + lane) * W
                if c < cols:
                    t = LD(x, o, i, c)
                    for j in range(W):
                        v = t[j]
                        if CACHED:
                            buf[k * W + j] = v
                        ss += v * v
            tot = group_sum(ss, red, lane, grp)
            rs = one / math.sqrt(tot / fcols + e)
            if r < rows:
                if lane == 0:
                    rstd[r] = rs
                for k in range(nk):
                    c = (k * G + lane) * W
                    if c < cols:
                        t = PACK(buf, k * W) if CACHED else LD(x, o, i, c)
                        if HAS_W:
                            tw = LDW(w, c)
                            for j in range(W):
                                tmp[j] = t[j] * rs * tw[j]
                        else:
                            for j in range(W):
                                tmp[j] = t[j] * rs
                        _st3(y, o, i, c, PACK(tmp, 0))
            rb += np.int64(cuda.gridDim.x)
    return rms_norm_fwd


def _layer_norm_fwd_src(cfg, ACC, group_sum, group_max, NS, has_w, has_b):
    G, RPB, W, NV = cfg.key()
    CACHED = NV > 0
    LD, LDW, PACK = _LD3[W], _LD1[W], _PACK[W]
    LD1 = _LD3[1]
    NSLOT = max(NV * W, 1)
    HAS_W, HAS_B = has_w, has_b

    def layer_norm_fwd(x, w, b, eps, y, mean, rstd):
        buf = cuda.local.array(NSLOT, ACC)
        tmp = cuda.local.array(W, ACC)
        red = cuda.shared.array((RPB, NS), ACC)
        tid = np.int64(cuda.threadIdx.x)
        lane = tid % G
        grp = tid // G
        inner = x.shape[1]
        cols = x.shape[2]
        rows = x.shape[0] * inner
        nk = NV if CACHED else (cols + G * W - 1) // (G * W)
        zero = ACC(0.0)
        one = ACC(1.0)
        e = ACC(eps)
        fcols = ACC(cols)
        rb = np.int64(cuda.blockIdx.x)
        while rb * RPB < rows:
            r = rb * RPB + grp
            rr = r if r < rows else rows - 1
            o = rr // inner
            i = rr - o * inner
            s = zero
            if CACHED:              # two-pass from registers
                for k in range(nk):
                    c = (k * G + lane) * W
                    if c < cols:
                        t = LD(x, o, i, c)
                        for j in range(W):
                            v = t[j]
                            buf[k * W + j] = v
                            s += v
                mu = group_sum(s, red, lane, grp) / fcols
                q = zero
                for k in range(nk):
                    c = (k * G + lane) * W
                    if c < cols:
                        t = PACK(buf, k * W)
                        for j in range(W):
                            d = t[j] - mu
                            q += d * d
            else:
                # one streaming pass: exact two-pass mean/M2 of each chunk, merged
                # into the thread's (n, mean, M2) (Chan et al.); the threads' parts
                # are then combined as sum(n mean) and sum(M2 + n (mean - mu)^2),
                # terms >= 0: as stable as two passes, one read fewer.
                # Values are shifted by the row's first element (one broadcast load):
                # at a large mean the running means then stay O(std), where their
                # rounding does not leak into M2.
                shift = LD1(x, o, i, 0)[0]
                tn = zero
                tmu = zero
                tq = zero
                fw = ACC(W)
                for k in range(nk):
                    c = (k * G + lane) * W
                    if c < cols:
                        t = LD(x, o, i, c)
                        cs = zero
                        for j in range(W):
                            cs += t[j] - shift
                        cm = cs / fw
                        cq = zero
                        for j in range(W):
                            d = (t[j] - shift) - cm
                            cq += d * d
                        nn = tn + fw
                        d = cm - tmu
                        f = fw / nn
                        tmu += d * f
                        tq += cq + d * d * tn * f
                        tn = nn
                mus = group_sum(tn * tmu, red, lane, grp) / fcols
                d = tmu - mus
                q = tq + tn * d * d
                mu = mus + shift
            rs = one / math.sqrt(group_sum(q, red, lane, grp) / fcols + e)
            if r < rows:
                if lane == 0:
                    mean[r] = mu
                    rstd[r] = rs
                for k in range(nk):
                    c = (k * G + lane) * W
                    if c < cols:
                        t = PACK(buf, k * W) if CACHED else LD(x, o, i, c)
                        for j in range(W):
                            tmp[j] = (t[j] - mu) * rs
                        if HAS_W:
                            tw = LDW(w, c)
                            for j in range(W):
                                tmp[j] = tmp[j] * tw[j]
                        if HAS_B:
                            tb = LDW(b, c)
                            for j in range(W):
                                tmp[j] = tmp[j] + tb[j]
                        _st3(y, o, i, c, PACK(tmp, 0))
            rb += np.int64(cuda.gridDim.x)
    return layer_norm_fwd


def _softmax_bwd_src(cfg, ACC, group_sum, group_max, NS):
    G, RPB, W, NV = cfg.key()
    FIT = NV > 0
    LD, PACK = _LD3[W], _PACK[W]

    def softmax_bwd(y, dy, dx):
        tmp = cuda.local.array(W, ACC)
        red = cuda.shared.array((RPB, NS), ACC)
        tid = np.int64(cuda.threadIdx.x)
        lane = tid % G
        grp = tid // G
        inner = y.shape[1]
        cols = y.shape[2]
        rows = y.shape[0] * inner
        nk = NV if FIT else (cols + G * W - 1) // (G * W)
        zero = ACC(0.0)
        rb = np.int64(cuda.blockIdx.x)
        while rb * RPB < rows:
            r = rb * RPB + grp
            rr = r if r < rows else rows - 1
            o = rr // inner
            i = rr - o * inner
            s = zero
            for k in range(nk):
                c = (k * G + lane) * W
                if c < cols:
                    ty = LD(y, o, i, c)
                    tg = LD(dy, o, i, c)
                    for j in range(W):
                        s += ty[j] * tg[j]
            dot = group_sum(s, red, lane, grp)
            if r < rows:
                for k in range(nk):
                    c = (k * G + lane) * W
                    if c < cols:
                        ty = LD(y, o, i, c)
                        tg = LD(dy, o, i, c)
                        for j in range(W):
                            tmp[j] = ty[j] * (tg[j] - dot)
                        _st3(dx, o, i, c, PACK(tmp, 0))
            rb += np.int64(cuda.gridDim.x)
    return softmax_bwd


def _norm_bwd_src(cfg, ACC, group_sum, group_max, NS, layer, has_w, need_dw, need_db):
    """RMSNorm (layer=False) or LayerNorm backward. part_w/part_b: (groups, cols)
    partial rows in ACC; the group with flat index blockIdx*RPB+grp owns its row."""
    G, RPB, W, NV = cfg.key()
    FIT = NV > 0
    LD, LDW, PACK = _LD3[W], _LD1[W], _PACK[W]
    NSLOT = max(NV * W, 1)
    LAYER, HAS_W, DW, DB = layer, has_w, need_dw, need_db

    def norm_bwd(dy, x, w, mean, rstd, dx, part_w, part_b):
        pw = cuda.local.array(NSLOT, ACC)
        pb = cuda.local.array(NSLOT, ACC)
        tmp = cuda.local.array(W, ACC)
        red = cuda.shared.array((RPB, NS), ACC)
        tid = np.int64(cuda.threadIdx.x)
        lane = tid % G
        grp = tid // G
        inner = x.shape[1]
        cols = x.shape[2]
        rows = x.shape[0] * inner
        nk = NV if FIT else (cols + G * W - 1) // (G * W)
        zero = ACC(0.0)
        fcols = ACC(cols)
        prow = np.int64(cuda.blockIdx.x) * RPB + grp
        # zero this group's partials (registers, or its own row in global memory)
        for k in range(nk):
            c = (k * G + lane) * W
            for j in range(W):
                if FIT:
                    pw[k * W + j] = zero
                    pb[k * W + j] = zero
                elif c < cols:
                    if DW:
                        part_w[prow, c + j] = zero
                    if DB:
                        part_b[prow, c + j] = zero
        rb = np.int64(cuda.blockIdx.x)
        while rb * RPB < rows:
            r = rb * RPB + grp
            valid = r < rows
            rr = r if valid else rows - 1
            o = rr // inner
            i = rr - o * inner
            rs = rstd[rr]
            mu = mean[rr] if LAYER else zero
            sg = zero
            sgx = zero
            for k in range(nk):
                c = (k * G + lane) * W
                if c < cols:
                    tx = LD(x, o, i, c)
                    tg = LD(dy, o, i, c)
                    for j in range(W):
                        tmp[j] = tg[j]
                    if HAS_W:
                        tw = LDW(w, c)
                        for j in range(W):
                            tmp[j] = tmp[j] * tw[j]
                    for j in range(W):
                        xh = (tx[j] - mu) * rs
                        g = tmp[j]
                        sgx += g * xh
                        if LAYER:
                            sg += g
                        if valid:
                            if FIT:
                                if DW:
                                    pw[k * W + j] += tg[j] * xh
                                if DB:
                                    pb[k * W + j] += tg[j]
                            else:
                                if DW:
                                    part_w[prow, c + j] += tg[j] * xh
                                if DB:
                                    part_b[prow, c + j] += tg[j]
            mgx = group_sum(sgx, red, lane, grp) / fcols
            mg = (group_sum(sg, red, lane, grp) / fcols) if LAYER else zero
            if valid:
                for k in range(nk):
                    c = (k * G + lane) * W
                    if c < cols:
                        tx = LD(x, o, i, c)
                        tg = LD(dy, o, i, c)
                        for j in range(W):
                            tmp[j] = tg[j]
                        if HAS_W:
                            tw = LDW(w, c)
                            for j in range(W):
                                tmp[j] = tmp[j] * tw[j]
                        for j in range(W):
                            xh = (tx[j] - mu) * rs
                            tmp[j] = rs * (tmp[j] - xh * mgx - mg)
                        _st3(dx, o, i, c, PACK(tmp, 0))
            rb += np.int64(cuda.gridDim.x)
        if FIT:
            for k in range(nk):
                c = (k * G + lane) * W
                if c < cols:
                    for j in range(W):
                        if DW:
                            part_w[prow, c + j] = pw[k * W + j]
                        if DB:
                            part_b[prow, c + j] = pb[k * W + j]
    return norm_bwd


#: the partial-row reduction's block: RED_COLS adjacent columns (one coalesced warp
#: row) x RED_LANES row lanes
RED_COLS, RED_LANES = (4, 4) if SIM else (32, 32)


def _reduce_partials_src(acc=np.float32):
    """out[c] = sum over the groups g of part[g, c], rounded once. Lane l of a column
    adds rows l, l + L, l + 2L, ... in order (four loads in flight), then lane 0 adds
    the L lane sums in order: a fixed partition and order, so the same bits on every
    run. (One thread per column, summing every group in turn, ran at 1% of the DRAM
    roofline on an H200: 201 us for 528 x 4096 partials, ncu 2026-12-04.)"""
    CT, L = RED_COLS, RED_LANES
    ACC = acc

    def reduce_partials(part, out):
        buf = cuda.shared.array((L, CT), ACC)
        t = cuda.threadIdx.x
        tx = t % CT
        ty = t // CT
        ng = part.shape[0]
        cols = part.shape[1]
        tile = np.int64(cuda.blockIdx.x)
        while tile * CT < cols:
            c = tile * CT + tx
            s = ACC(0)
            if c < cols and ty < ng:
                s = part[ty, c]
                g = ty + L
                while g + 3 * L < ng:
                    a0 = part[g, c]
                    a1 = part[g + L, c]
                    a2 = part[g + 2 * L, c]
                    a3 = part[g + 3 * L, c]
                    s += a0
                    s += a1
                    s += a2
                    s += a3
                    g += 4 * L
                while g < ng:
                    s += part[g, c]
                    g += L
            buf[ty, tx] = s
            cuda.syncthreads()
            if ty == 0 and c < cols:
                r = buf[0, tx]
                for k in range(1, min(L, ng)):
                    r += buf[k, tx]
                _st1(out, c, r)
            cuda.syncthreads()
            tile += cuda.gridDim.x
    return reduce_partials


def _copy4_src():
    def copy4(src, dst):
        """dst[...] = src[...] for 4-D arrays of any strides (64-bit flat index)."""
        i = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
        step = np.int64(cuda.gridDim.x) * cuda.blockDim.x
        n1, n2, n3 = dst.shape[1], dst.shape[2], dst.shape[3]
        n = dst.shape[0] * n1 * n2 * n3
        while i < n:
            i3 = i % n3
            q = i // n3
            i2 = q % n2
            q = q // n2
            i1 = q % n1
            i0 = q // n1
            dst[i0, i1, i2, i3] = src[i0, i1, i2, i3]
            i += step
    return copy4


def _fill_src():
    def fill(a, v):
        i = np.int64(cuda.blockIdx.x) * cuda.blockDim.x + cuda.threadIdx.x
        step = np.int64(cuda.gridDim.x) * cuda.blockDim.x
        while i < a.shape[0]:
            a[i] = v
            i += step
    return fill


_ACC_OF = {np.dtype(np.float64): np.float64}


def _acc_np(storage):
    return np.float64 if np.dtype(storage) == np.float64 else np.float32


_CACHE = {}
_CACHE_LOCK = threading.Lock()


def kernel_source(op, cfg, acc, **flags):
    """(python function, launch_bounds) of one kernel configuration -- what gets
    jitted; exposed for the PTX tests (``cuda.compile_ptx``)."""
    ACC = acc
    warp = TABLE.warp if SIM else 32
    gs, gm, ns = _make_reducers(cfg.G, cfg.RPB, ACC, warp)
    if op == "softmax_fwd":
        f = _softmax_fwd_src(cfg, ACC, gs, gm, ns, 0)
    elif op == "softmax_bwd":
        f = _softmax_bwd_src(cfg, ACC, gs, gm, ns)
    elif op == "rms_norm_fwd":
        f = _rms_norm_fwd_src(cfg, ACC, gs, gm, ns, flags["has_w"])
    elif op == "layer_norm_fwd":
        f = _layer_norm_fwd_src(cfg, ACC, gs, gm, ns, flags["has_w"], flags["has_b"])
    elif op == "rms_norm_bwd":
        f = _norm_bwd_src(cfg, ACC, gs, gm, ns, False, flags["has_w"], flags["has_w"], False)
    elif op == "layer_norm_bwd":
        f = _norm_bwd_src(cfg, ACC, gs, gm, ns, True, flags["has_w"], flags["need_dw"],
                          flags["need_db"])
    else:
        raise KeyError(op)
    return f, launch_bounds(cfg.tpb)


def _kernel(op, cfg, acc, **flags):
    key = (op, cfg.key(), acc, tuple(sorted(flags.items())))
    k = _CACHE.get(key)
    if k is None:
        with _CACHE_LOCK:
            k = _CACHE.get(key)
            if k is None:
                f, _ = kernel_source(op, cfg, acc, **flags)
                k = _CACHE[key] = _jit(cfg.tpb)(f)
    return k


_AUX = {}


def _aux(name, *args):
    key = (name,) + args
    k = _AUX.get(key)
    if k is None:
        src = {"reduce": _reduce_partials_src, "fill": _fill_src,
               "copy4": _copy4_src}[name](*args)
        k = _AUX[key] = cuda.jit(src)
    return k


# ============================================================ launch helpers
_MAX_GRID = 1 << 20


def _raw(a):
    return a.raw if isinstance(a, DeviceTensor) else a


def _ptr(a):
    if SIM:
        return a._ary.__array_interface__["data"][0] if hasattr(a, "_ary") else \
            a.__array_interface__["data"][0]
    return a.__cuda_array_interface__["data"][0]


def _vec_width(rowarrs, vecarrs, cols):
    """W for this call: 16-byte chunks if cols, every base pointer and every row
    stride allow it, else 1."""
    itemsize = rowarrs[0].dtype.itemsize
    W = _ALIGN // itemsize
    if cols % W:
        return 1
    for a in rowarrs:
        if _ptr(a) % _ALIGN or any(s % _ALIGN for s, n in zip(a.strides[:2], a.shape[:2])
                                   if n > 1):
            return 1
    for a in vecarrs:
        if a is not None and _ptr(a) % _ALIGN:
            return 1
    return W


def _sm_count():
    if SIM:
        return 2
    try:
        return cuda.get_current_device().MULTIPROCESSOR_COUNT
    except Exception:  # pragma: no cover
        return 132


def _grid(rows, cfg, cap=_MAX_GRID):
    return max(1, min(-(-rows // cfg.RPB), cap))


def _stream(stream):
    """The launch stream: the caller's (resolved like DeviceContext.check_stream:
    numba stream, torch-style ``cuda_stream`` object or int handle) or the default."""
    if stream is None:
        return DEVICE.stream
    return DEVICE._resolve_stream(stream)


_SCRATCH = {}
_SCRATCH_LOCK = threading.Lock()
_TLS = threading.local()      # .rec: the _Recorder of a call being recorded
_PERMANENT = set()            # addresses of buffers that live as long as the process


def _scratch(stream, slot, shape, dtype):
    """A reusable partial-rows buffer per (stream, thread, slot): launches on one
    stream run in order, so the next call may reuse it; other streams and threads
    get their own. Grows to the largest request (no cudaMalloc per call)."""
    n = int(np.prod(shape))
    try:
        handle = 0 if SIM else int(stream.handle or 0)   # numba Stream.handle: CUstream
    except (AttributeError, TypeError, ValueError):
        handle = id(stream)
    key = (handle, threading.get_ident(), slot, np.dtype(dtype).str)
    buf = _scratch_base(key, n, dtype, stream)
    rec = getattr(_TLS, "rec", None)
    if rec is not None:
        rec.scratch.append((key, n, dtype, stream, _dptr(buf)))
    return buf[:n].reshape(shape)


def _scratch_base(key, n, dtype, stream):
    buf = _SCRATCH.get(key)
    if buf is None or buf.size < n:
        with _SCRATCH_LOCK:
            buf = _SCRATCH.get(key)
            if buf is None or buf.size < n:
                buf = _SCRATCH[key] = cuda.device_array(max(n, 1), dtype=dtype,
                                                        stream=stream)
    return buf


def _dummy(dtype, ndim=1):
    """A one-element stand-in for an absent array argument (kept for the process)."""
    key = ("dummy", np.dtype(dtype).str, ndim)
    a = _AUX.get(key)
    if a is None:
        a = _AUX[key] = cuda.device_array((1,) * ndim, dtype=dtype)
        _PERMANENT.add(_dptr(a))
    return a


def _dptr(raw):
    """The device address of a numba device array's first element."""
    return _ptr(raw) if SIM else (raw.device_ctypes_pointer.value or 0)


def _launch(k, grid, tpb, s, *args):
    """k[grid, tpb, s](*args); while a call is recorded for replay (REPLAY), the
    compiled kernel and its launch configuration are recorded too."""
    lc = k[grid, tpb, s]
    rec = getattr(_TLS, "rec", None)
    if rec is not None:
        hooks = getattr(lc, "pre_launch_callbacks", None)
        if hooks is None:
            rec.broken = True             # this numba-cuda cannot tell: no replay
        else:
            hooks.append(lambda kernel, cfg: rec.launches.append((kernel, cfg, args)))
    lc(*args)


class _Kernels:
    """The backend namespace: the same six functions as ``cpu``, plus ``stream=``."""

    @staticmethod
    def _prep(x):
        x = _raw(x)
        return x, x.shape[0] * x.shape[1], x.shape[2]

    def softmax_fwd(self, x, y, stream=None):
        x, rows, cols = self._prep(x)
        y = _raw(y)
        if rows == 0:
            return
        s = _stream(stream)
        W = _vec_width([x, y], [], cols)
        acc = _acc_np(x.dtype)
        cfg = TABLE.choose(cols, W, acc is np.float64)
        k = _kernel("softmax_fwd", cfg, acc)
        _launch(k, _grid(rows, cfg), cfg.tpb, s, x, y)

    def softmax_bwd(self, y, dy, dx, stream=None):
        y, rows, cols = self._prep(y)
        dy, dx = _raw(dy), _raw(dx)
        if rows == 0:
            return
        s = _stream(stream)
        W = _vec_width([y, dy, dx], [], cols)
        acc = _acc_np(y.dtype)
        cfg = TABLE.choose(cols, W, acc is np.float64, backward=True)
        k = _kernel("softmax_bwd", cfg, acc)
        _launch(k, _grid(rows, cfg), cfg.tpb, s, y, dy, dx)

    def rms_norm_fwd(self, x, weight, eps, y, rstd, stream=None):
        x, rows, cols = self._prep(x)
        y, rstd, weight = _raw(y), _raw(rstd), _raw(weight)
        if rows == 0:
            return
        s = _stream(stream)
        W = _vec_width([x, y], [weight], cols)
        acc = _acc_np(x.dtype)
        cfg = TABLE.choose(cols, W, acc is np.float64)
        k = _kernel("rms_norm_fwd", cfg, acc, has_w=weight is not None)
        w = weight if weight is not None else _dummy(acc)
        _launch(k, _grid(rows, cfg), cfg.tpb, s, x, w, float(eps), y, rstd)

    def layer_norm_fwd(self, x, weight, bias, eps, y, mean, rstd, stream=None):
        x, rows, cols = self._prep(x)
        y, mean, rstd = _raw(y), _raw(mean), _raw(rstd)
        weight, bias = _raw(weight), _raw(bias)
        if rows == 0:
            return
        s = _stream(stream)
        W = _vec_width([x, y], [weight, bias], cols)
        acc = _acc_np(x.dtype)
        cfg = TABLE.choose(cols, W, acc is np.float64)
        k = _kernel("layer_norm_fwd", cfg, acc, has_w=weight is not None,
                    has_b=bias is not None)
        w = weight if weight is not None else _dummy(acc)
        b = bias if bias is not None else _dummy(acc)
        _launch(k, _grid(rows, cfg), cfg.tpb, s, x, w, b, float(eps), y, mean, rstd)

    def _norm_bwd(self, op, dy, x, weight, mean, rstd, dx, dweight, dbias, stream):
        x, rows, cols = self._prep(x)
        dy, dx, weight = _raw(dy), _raw(dx), _raw(weight)
        mean, rstd = _raw(mean), _raw(rstd)
        dweight, dbias = _raw(dweight), _raw(dbias)
        if rows == 0:
            return
        s = _stream(stream)
        W = _vec_width([x, dy, dx], [weight], cols)
        acc = _acc_np(x.dtype)
        need_dw, need_db = dweight is not None, dbias is not None
        cfg = TABLE.choose(cols, W, acc is np.float64, backward=True,
                           nparams=int(need_dw) + int(need_db))
        flags = dict(has_w=weight is not None)
        if op == "layer_norm_bwd":
            flags.update(need_dw=need_dw, need_db=need_db)
        k = _kernel(op, cfg, acc, **flags)
        if need_dw or need_db:
            # bounded partial rows: NV > 0 keeps them in registers; streaming
            # partials live in global memory, one group per SM keeps them L2-sized
            per_sm = max(1, 2048 // cfg.tpb) if cfg.NV else 1
            grid = _grid(rows, cfg, _sm_count() * per_sm)
        else:
            grid = _grid(rows, cfg)
        ng = grid * cfg.RPB
        pw = _scratch(s, 0, (ng, cols), acc) if need_dw else _dummy(acc, 2)
        pb = _scratch(s, 1, (ng, cols), acc) if need_db else _dummy(acc, 2)
        w = weight if weight is not None else _dummy(acc)
        mu = mean if mean is not None else rstd
        _launch(k, grid, cfg.tpb, s, dy, x, w, mu, rstd, dx, pw, pb)
        red = _aux("reduce", acc)
        rtpb = RED_COLS * RED_LANES
        rgrid = max(1, min(-(-cols // RED_COLS), 65535))
        if need_dw:
            _launch(red, rgrid, rtpb, s, pw, dweight)
        if need_db:
            _launch(red, rgrid, rtpb, s, pb, dbias)

    def rms_norm_bwd(self, dy, x, weight, rstd, dx, dweight, stream=None):
        self._norm_bwd("rms_norm_bwd", dy, x, weight, None, rstd, dx, dweight, None, stream)

    def layer_norm_bwd(self, dy, x, weight, mean, rstd, dx, dweight, dbias, stream=None):
        self._norm_bwd("layer_norm_bwd", dy, x, weight, mean, rstd, dx, dweight, dbias,
                       stream)


KERNELS = _Kernels()


# ============================================================ device context
class DeviceTensor:
    """A numba device array (``raw``, any dtype numba knows) with its *logical*
    dtype (float16/bfloat16 may travel as 16-bit integer bits). Shape, strides and
    the data pointer are read once (the dispatcher asks for them many times)."""
    __slots__ = ("raw", "dtype", "readonly", "shape", "strides", "ndim", "size", "_ptr")

    def __init__(self, raw, dtype, readonly=False):
        self.raw, self.dtype, self.readonly = raw, np.dtype(dtype), readonly
        self.shape = tuple(raw.shape)
        self.strides = tuple(raw.strides)
        self.ndim = len(self.shape)
        self.size = math.prod(self.shape)
        self._ptr = None

    @property
    def itemsize(self):
        return self.dtype.itemsize

    @property
    def ptr(self):
        if self._ptr is None:
            self._ptr = _ptr(self.raw)
        return self._ptr

    def __repr__(self):
        return f"DeviceTensor(shape={self.shape}, dtype={self.dtype})"


class _CAIShim:
    """Re-typed ``__cuda_array_interface__`` (torch's '<V2' bfloat16 -> '<u2')."""

    def __init__(self, obj, typestr):
        cai = dict(obj.__cuda_array_interface__)
        cai["typestr"] = typestr
        cai["descr"] = [("", typestr)]
        self.__cuda_array_interface__ = cai
        self._keep = obj


_HALF_BITS = (np.dtype(np.int16), np.dtype(np.uint16), np.dtype(np.float16))


class DeviceContext:
    """Device arrays on the current CUDA device (see the module docstring)."""

    name = "gpu"

    def __init__(self):
        self._tls = threading.local()

    @property
    def kernels(self):
        return KERNELS

    # -------------------------------------------------------------- streams
    def check_stream(self, stream):
        self._tls.stream = self._resolve_stream(stream)

    @staticmethod
    def _resolve_stream(stream):
        """None, a numba stream, an object with a ``cuda_stream`` handle (torch) or an
        int handle (wrapped with ``cuda.external_stream``). The simulator runs every
        launch synchronously and has no external streams: there an int handle means
        its one stream."""
        if stream is None:
            return None
        if isinstance(stream, (int, np.integer)) and not isinstance(stream, bool):
            return cuda.stream() if SIM else cuda.external_stream(int(stream))
        if SIM:
            if isinstance(stream, cuda.stream):
                return stream
        else:
            from numba.cuda.cudadrv.driver import Stream
            if isinstance(stream, Stream):
                return stream
            handle = getattr(stream, "cuda_stream", None)
            if isinstance(handle, (int, np.integer)):
                return cuda.external_stream(int(handle))
        raise TypeError(f"stream must be a numba CUDA stream, an object with a cuda_stream "
                        f"handle, or an int handle, got {type(stream).__name__}")

    @property
    def stream(self):
        s = getattr(self._tls, "stream", None)
        return s if s is not None else cuda.default_stream()

    # ---------------------------------------------------------------- wrap
    def _as_numba(self, obj, name):
        if SIM:
            if type(obj).__name__ in ("FakeCUDAArray", "FakeCUDAArrayBase"):
                return obj, False
            raise TypeError(f"{name} must be a CUDA array, got {type(obj).__name__}")
        if not hasattr(obj, "__cuda_array_interface__"):
            raise TypeError(f"{name} must be a CUDA array (__cuda_array_interface__), got "
                            f"{type(obj).__name__}")
        cai = obj.__cuda_array_interface__
        readonly = bool(cai.get("data", (0, False))[1])
        typestr = cai["typestr"]
        if typestr[1:] == "V2":
            obj = _CAIShim(obj, "<u2")
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        if isinstance(obj, DeviceNDArray):
            return obj, readonly
        return cuda.as_cuda_array(obj), readonly     # zero-copy view (CuPy, torch, ...)

    def wrap(self, obj, name, dtype=None):
        if isinstance(obj, DeviceTensor):
            if dtype is not None and np.dtype(dtype) != obj.dtype:
                raise TypeError(f"dtype={np.dtype(dtype)} disagrees with {name}'s dtype "
                                f"{obj.dtype}")
            return obj
        void2 = (not SIM and hasattr(obj, "__cuda_array_interface__")
                 and obj.__cuda_array_interface__["typestr"][1:] == "V2")
        if void2 and dtype is None:
            raise TypeError(f"{name} reports typestr '<V2' (torch's bfloat16); pass "
                            "dtype='bfloat16' to say so")
        raw, readonly = self._as_numba(obj, name)
        rd = np.dtype(raw.dtype)
        if dtype is None:
            return DeviceTensor(raw, rd, readonly)
        want = np.dtype(dtype)
        if want == rd:
            return DeviceTensor(raw, want, readonly)
        if want in (D.float16, D.bfloat16) and rd in _HALF_BITS:
            return DeviceTensor(raw, want, readonly)
        raise TypeError(f"dtype={want} disagrees with {name}'s device dtype {rd}; dtype= "
                        "tags 16-bit device arrays as float16 or bfloat16")

    def param_tag(self, obj, x_dtype):
        """The dtype tag for a weight/bias/out given with no tag: a 16-bit integer
        (or '<V2') device array beside half activations is read as their dtype."""
        x_dtype = np.dtype(x_dtype)
        if x_dtype not in (D.float16, D.bfloat16) or isinstance(obj, DeviceTensor):
            return None
        try:
            ts = (obj.dtype.str if SIM else obj.__cuda_array_interface__["typestr"])
        except AttributeError:
            return None
        return x_dtype if ts[1:] in ("i2", "u2", "V2") else None

    # ------------------------------------------------------------ allocate
    def _alloc(self, shape, dtype):
        dtype = np.dtype(dtype)
        raw = cuda.device_array(tuple(shape), dtype=D.storage_dtype(dtype)
                                if dtype in D.SUPPORTED else dtype, stream=self.stream)
        rec = getattr(_TLS, "rec", None)
        if rec is not None:
            rec.allocs.append(raw)
        return DeviceTensor(raw, dtype)

    def empty(self, shape, dtype):
        return self._alloc(shape, dtype)

    def full(self, shape, dtype, value):
        t = self._alloc(shape, dtype)
        n = t.size
        if n:
            st = t.raw.dtype
            if np.dtype(dtype) in (D.float16, D.bfloat16):
                bits = np.array(value, np.float32).astype(dtype).view(st)[()]
            else:
                bits = st.type(value)
            flat = t.raw.reshape(n)
            f = _aux("fill")
            f[max(1, min(-(-n // 256), 4096)), 256 if not SIM else 8, self.stream](flat, bits)
        return t

    def zeros(self, shape, dtype):
        return self.full(shape, dtype, 0)

    # ------------------------------------------------------------- layouts
    def storage(self, a):
        if not isinstance(a, DeviceTensor):
            return a
        st = D.storage_dtype(a.dtype) if a.dtype in D.SUPPORTED else a.dtype
        return a.raw if a.raw.dtype == st else a.raw.view(st)

    @staticmethod
    def _c_contiguous(a):
        return a.raw.is_c_contiguous() or a.size == 0

    def contiguous(self, a):
        if self._c_contiguous(a):
            return a
        out = self._alloc(a.shape, a.dtype)
        self._copy(out, a)
        return out

    def _copy(self, dst, src):
        """Device-side strided copy (same shape, same storage itemsize)."""
        n = dst.size
        if n == 0:
            return
        f = _aux("copy4")
        tpb = 8 if SIM else 256
        f[max(1, min(-(-n // tpb), 65535)), tpb, self.stream](
            _as4d(self.storage(src)), _as4d(self.storage(dst)))

    def reshape_view(self, a, shape):
        """A zero-copy view of ``a`` with ``shape`` wherever NumPy's reshape gives one
        (computed on a stand-in with the same strides), else None."""
        raw = a.raw
        shape = tuple(int(s) for s in shape)
        if a.size and _c_strides(a.shape, a.strides, raw.dtype.itemsize):
            if -1 in shape:
                known = math.prod(v for v in shape if v != -1)
                shape = tuple(a.size // known if v == -1 else v for v in shape)
            if math.prod(shape) != a.size:
                return None
            return DeviceTensor(raw.reshape(shape), a.dtype, a.readonly)   # fast path
        ghost = np.lib.stride_tricks.as_strided(np.zeros(1, raw.dtype), raw.shape,
                                                raw.strides)
        try:
            g = np.reshape(ghost, shape, copy=False)
        except ValueError:
            return None
        return DeviceTensor(_strided_view(raw, g.shape, g.strides), a.dtype, a.readonly)

    @staticmethod
    def _extent(a):
        return _span(a.ptr, a.shape, a.strides, a.raw.dtype.itemsize)

    def overlaps(self, a, b):
        """Conservative: the address ranges intersect."""
        (al, ah), (bl, bh) = self._extent(a), self._extent(b)
        return al < bh and bl < ah and ah > al and bh > bl

    def same_buffer(self, a, b):
        return a.ptr == b.ptr and a.shape == b.shape and a.strides == b.strides

    def writeable(self, a):
        return not a.readonly

    def copy_into(self, dst, src):
        self._copy(dst, src)

    def result(self, a):
        """A numba device array: float16 as float16, bfloat16 as uint16 bits."""
        if not isinstance(a, DeviceTensor):
            return a
        if a.dtype == D.float16:
            return a.raw if a.raw.dtype == np.float16 else a.raw.view(np.float16)
        if a.dtype == D.bfloat16:
            return a.raw if a.raw.dtype == np.uint16 else a.raw.view(np.uint16)
        return a.raw


def _span(ptr, shape, strides, itemsize):
    """[low, high) of the addresses an array of this layout at ``ptr`` touches
    ((ptr, ptr) when it is empty)."""
    lo = hi = ptr
    for n, s in zip(shape, strides):
        if n == 0:
            return lo, lo
        if s > 0:
            hi += (n - 1) * s
        else:
            lo += (n - 1) * s
    return lo, hi + itemsize


def _c_strides(shape, strides, itemsize):
    """True when (shape, strides) is C-contiguous (unit axes ignored)."""
    step = itemsize
    for n, st in zip(reversed(shape), reversed(strides)):
        if n != 1 and st != step:
            return False
        step *= n
    return True


def _strided_view(raw, shape, strides):
    """A device array viewing ``raw``'s first element with other shape/strides."""
    if SIM:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
        return FakeCUDAArray(np.lib.stride_tricks.as_strided(raw._ary, shape, strides))
    from numba.cuda.cudadrv.devicearray import DeviceNDArray
    return DeviceNDArray(tuple(shape), tuple(strides), raw.dtype, stream=raw.stream,
                         gpu_data=raw.gpu_data)


def _as4d(raw):
    """``raw`` as a 4-D view: leading unit axes, or -- past 4 axes -- adjacent axes
    merged wherever NumPy's reshape can do that without a copy."""
    shape, strides = tuple(raw.shape), tuple(raw.strides)
    ghost = np.lib.stride_tricks.as_strided(np.zeros(1, raw.dtype), shape, strides)
    while ghost.ndim > 4:
        for k in range(ghost.ndim - 1):
            new = ghost.shape[:k] + (ghost.shape[k] * ghost.shape[k + 1],) + ghost.shape[k + 2:]
            try:
                ghost = np.reshape(ghost, new, copy=False)
                break
            except ValueError:
                continue
        else:
            raise ValueError("a strided device array with more than 4 axes that no "
                             "reshape view brings to 4; make it contiguous first")
    pad = 4 - ghost.ndim
    return _strided_view(raw, (1,) * pad + ghost.shape, (0,) * pad + ghost.strides)


DEVICE = DeviceContext()


# ============================================================ replayed calls
class _Recorder:
    """What one general-path call did: its launches, allocations, scratch buffers."""

    def __init__(self):
        self.launches, self.allocs, self.scratch = [], [], []
        self.broken = False


class _Plan:
    """A recorded call, replayable with other arrays of the same description."""
    __slots__ = ("launches", "news", "scratch", "results", "single")


_MAX_PLANS = 4096


class _NothingLaunched(Exception):
    """A replay failed before its first launch went out."""


class Replay:
    """Per-call host work for CUDA arrays, cut to what changes between calls.

    The general path (argument checks, layouts, views, kernel choice, numba's launch
    marshalling) costs hundreds of microseconds a call on the host -- more than the
    kernel itself up to tens of MB (measured 2026-12-04 on an H200: 400 us for a
    softmax forward, 1.6 ms for a LayerNorm backward with dweight/dbias; a bare
    numba-cuda launch 26 us, torch's F.softmax 10 us). What it decides depends only
    on the *description* of the arguments: type, shape, strides, dtype, 16-byte
    alignment, which arguments are the same buffer, the dtype tag, the stream, the
    current CUDA context and thread. So the first call of a description runs the
    general path and records its launches (compiled kernel, grid, block, stream,
    the argument words numba packed) and allocations; later calls with the same
    description check what can differ (eps's value, out's overlap with the inputs),
    allocate the outputs and launch the recorded kernels with their own addresses
    patched in. Anything the recording cannot map (a copy to C order, a temporary
    output, an unknown scalar) is not replayed; invalid calls never are (the general
    path raises for them). CUDA array interface objects whose ``stream`` is not the
    launch stream take the general path (numba synchronizes on it)."""

    def __init__(self):
        self.plans = {}
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
        from numba.cuda.cudadrv.driver import Stream, binding
        from numba.cuda._compat import CUDA_CORE_GE_1_0
        from cuda.core import launch, LaunchConfig
        self._dna, self._stream_t, self._binding = DeviceNDArray, Stream, binding
        self._launch, self._config, self._ge10 = launch, LaunchConfig, CUDA_CORE_GE_1_0
        self._default_handle = None
        self.replayed = 0                 # calls served by a recording (tests)
        self.enabled = os.environ.get("NUMBA_FUSED_GPU_REPLAY", "1") != "0"

    # ------------------------------------------------------------ describe
    def _handle(self, stream):
        if stream is None:
            h = self._default_handle
            if h is None:
                h = self._default_handle = int(cuda.default_stream().handle or 0)
            return h
        if type(stream) is int:
            return stream
        if isinstance(stream, self._stream_t):
            return int(stream.handle or 0)
        h = getattr(stream, "cuda_stream", None)
        return h if type(h) is int else None

    def _arg(self, a, handle):
        """(description, address, low, high, readonly) of one array argument."""
        if a is None:
            return None
        if type(a) is self._dna:
            size = a.size
            if not size:
                return False
            shape, strides, itemsize = a.shape, a.strides, a.dtype.itemsize
            ptr = a.gpu_data.device_ctypes_pointer.value or 0
            desc = (shape, strides, a.dtype.str, ptr % _ALIGN == 0)
            ro = False
        else:
            cai = getattr(a, "__cuda_array_interface__", None)
            if type(cai) is not dict or cai.get("mask") is not None:
                return False
            st = cai.get("stream")
            if st is not None and (0 if st == 1 else st) != handle:
                return False
            shape, typestr = tuple(cai["shape"]), cai["typestr"]
            ptr, ro = cai["data"]
            itemsize = int(typestr[2:])
            strides = cai.get("strides")
            if strides is None:
                strides, step = [], itemsize
                for n in reversed(shape):
                    strides.append(step)
                    step *= n
                strides = tuple(reversed(strides))
            else:
                strides = tuple(strides)
            if not math.prod(shape):
                return False
            desc = (type(a), shape, strides, typestr, ptr % _ALIGN == 0, bool(ro))
        lo, hi = _span(ptr, shape, strides, itemsize)
        return desc, ptr, lo, hi, ro

    # ---------------------------------------------------------------- call
    def call(self, fn, inputs, eps, may_be, out, dtype, stream):
        """(result,) of ``fn`` on these arguments, replayed or recorded; None when
        the call is not for this cache (the caller runs its general path)."""
        if not self.enabled or getattr(_TLS, "rec", None) is not None:
            return None
        objs = inputs + (out,)
        for a in objs:      # CUDA arrays only: anything else is the general path's
            # (the class is asked first: torch computes its interface on each access)
            if a is not None and type(a) is not self._dna \
                    and not hasattr(type(a), "__cuda_array_interface__") \
                    and not hasattr(a, "__cuda_array_interface__"):
                return None
        try:
            handle = self._handle(stream)
        except Exception:
            return None
        if handle is None:
            return None
        infos = []
        for a in objs:
            i = self._arg(a, handle)
            if i is False:
                return None
            infos.append(i)
        if eps is not _NO_EPS and not (type(eps) is float and 0.0 <= eps < math.inf):
            return None
        err, ctx = self._binding.cuCtxGetCurrent()
        ctx = int(ctx)
        if int(err) or not ctx:
            return None                   # no current context yet: the general path
        alias = []
        for k, i in enumerate(infos):
            first = -1
            if i is not None:
                for j in range(k):
                    if infos[j] is not None and infos[j][1] == i[1]:
                        first = j
                        break
            alias.append(first)
        if out is not None:
            o = infos[-1]
            if o[4]:
                return None               # read-only out: the general path says so
            for k, i in enumerate(infos[:-1]):
                if i is not None and i[2] < o[3] and o[2] < i[3]:
                    if k != may_be or i[0] != o[0] or i[1] != o[1]:
                        return None       # overlap: the general path raises
        key = (fn, dtype, handle, ctx, threading.get_ident(),
               tuple(None if i is None else i[0] for i in infos), tuple(alias))
        try:
            plan = self.plans.get(key)
        except TypeError:                 # an unhashable dtype=: the general path
            return None
        if plan is not None:
            if plan is False:
                return None               # recorded before, not replayable
            try:
                res = self._replay(plan, objs, infos, eps)
            except _NothingLaunched:
                # a stale recording (say, its CUDA context was destroyed and a new one
                # got the same handle) fails at its first launch, before any work:
                # forget them all; the general path does the call and reports any
                # real error
                self.plans.clear()
                return None
            self.replayed += 1
            return (res,)
        return (self._record(key, fn, inputs, eps, out, dtype, stream, objs, infos),)

    def _record(self, key, fn, inputs, eps, out, dtype, stream, objs, infos):
        rec = _Recorder()
        _TLS.rec = rec
        try:
            args = inputs if eps is _NO_EPS else inputs + (eps,)
            res = fn(*args, out=out, dtype=dtype, stream=stream)
        finally:
            _TLS.rec = None
        try:
            plan = self._plan(rec, res, objs, infos, eps)
        except Exception:       # pragma: no cover - a recording we cannot read
            plan = None
        if len(self.plans) >= _MAX_PLANS:
            self.plans.clear()
        self.plans[key] = False if plan is None else plan
        return res

    def _plan(self, rec, res, objs, infos, eps):
        if rec.broken or not rec.launches:
            return None
        single = not isinstance(res, tuple)
        results = (res,) if single else res
        news, spec, alloc_of = [], [], {}
        allocated = {_dptr(a) for a in rec.allocs}
        for r in results:
            if r is None:
                spec.append(None)
                continue
            same = [k for k, a in enumerate(objs) if a is r]
            if same:
                spec.append(("arg", same[0]))
                continue
            if (type(r) is not self._dna or not r.is_c_contiguous()
                    or _dptr(r) not in allocated):
                return None               # e.g. a view of a wrapped out: not replayed
            alloc_of[_dptr(r)] = len(news)
            spec.append(("new", len(news)))
            news.append((r.shape, r.dtype, r.stream, r.size * r.dtype.itemsize))
        if any(_dptr(a) not in alloc_of for a in rec.allocs):
            return None                   # a temporary buffer: not replayed
        scratch = [(key, n, dtype, stream) for key, n, dtype, stream, _ in rec.scratch]
        sranges = [(p, p + n * np.dtype(dtype).itemsize, k)
                   for k, (_, n, dtype, _, p) in enumerate(rec.scratch)]
        launches = []
        for kernel, cfg, args in rec.launches:
            words, patches = [], []
            for ty, v in zip(kernel.argument_types, args):
                start = len(words)
                kernel._prepare_args(ty, v, cfg.stream, [], words)
                if isinstance(ty, types.Array):
                    src = self._source(words[start + 4], infos, alloc_of, news, sranges)
                    if src is None:
                        return None
                    if src is not True:
                        patches.append((start + 4,) + src)
                elif ty == types.float64 and eps is not _NO_EPS and v == eps:
                    patches.append((start, "eps", 0, 0))
                else:
                    return None
            if self._ge10:
                config = self._config(grid=cfg.griddim, block=cfg.blockdim,
                                      shmem_size=cfg.sharedmem,
                                      is_cooperative=kernel.cooperative)
            else:  # pragma: no cover - cuda.core < 1.0
                config = self._config(grid=cfg.griddim, block=cfg.blockdim,
                                      shmem_size=cfg.sharedmem,
                                      cooperative_launch=kernel.cooperative)
            launches.append((cfg.stream, config, kernel._codelibrary.get_cufunc().kernel,
                             words, patches))
        plan = _Plan()
        plan.launches, plan.news, plan.scratch = launches, news, scratch
        plan.results, plan.single = spec, single
        return plan

    @staticmethod
    def _source(p, infos, alloc_of, news, sranges):
        """Where a kernel argument's address comes from: ("arg", k, offset),
        ("new", j, offset), ("scratch", k, offset), True (a permanent buffer) or
        None (unknown: the call is not replayed)."""
        for k, i in enumerate(infos):
            if i is not None and i[2] <= p < i[3]:
                return ("arg", k, p - i[1])
        for base, j in alloc_of.items():
            if base <= p < base + news[j][3]:
                return ("new", j, p - base)
        for lo, hi, k in sranges:
            if lo <= p < hi:
                return ("scratch", k, p - lo)
        return True if p in _PERMANENT else None

    def _replay(self, plan, objs, infos, eps):
        news = [cuda.device_array(shape, dtype, stream=stream)
                for shape, dtype, stream, _ in plan.news]
        addr = {"arg": [None if i is None else i[1] for i in infos],
                "new": [a.gpu_data.device_ctypes_pointer.value for a in news],
                "scratch": [_dptr(_scratch_base(key, n, dtype, stream))
                            for key, n, dtype, stream in plan.scratch]}
        for n, (stream, config, kernel, words, patches) in enumerate(plan.launches):
            words = list(words)
            for at, kind, k, offset in patches:
                words[at] = ctypes.c_double(eps) if kind == "eps" else addr[kind][k] + offset
            try:
                self._launch(stream, config, kernel, *words)
            except Exception as e:
                if n:
                    raise                 # work is under way (out= may be dy): report
                raise _NothingLaunched() from e
        res = tuple(None if s is None else (objs[s[1]] if s[0] == "arg" else news[s[1]])
                    for s in plan.results)
        return res[0] if plan.single else res


from . import _dispatch  # noqa: E402  (loaded before this module)

_NO_EPS = _dispatch._NO_EPS
try:
    REPLAY = None if SIM else Replay()
except Exception:  # pragma: no cover - a numba-cuda without cuda.core: general path only
    REPLAY = None
_dispatch._replay = REPLAY

"""numba_fused._lanes: block loads/stores with the dtype conversions, masking, and
the documented summation order, replayed in NumPy bit for bit (the order is the
spec that makes every copy of a reduction agree: see the module docstring)."""
import numba
import numpy as np
import pytest
from numba import njit

from numba_fused import _dtypes as D
from numba_fused import _lanes as L
from numba_fused import _vecmath as V
from numba_fused import cpu
from conftest import BF16, F16, F32, F64, acc_dtype, at_line_offset, dtype_id
from test_dtypes import ALL16, F32_CASES


def _bits(a, dtype):
    return np.ascontiguousarray(a.astype(dtype)).view(D.storage_dtype(dtype))


def _acc(dtype):
    return acc_dtype(dtype).type


@njit(cache=False)
def _lane_counts(x):
    return L.lanes_count(L.lanes_zeros(x)), L.lanes_count(L.wide_lanes_zeros(x))


def _count(dtype, wide=False):
    """The library's lane count for rows of ``dtype`` (the replays' block size)."""
    return _lane_counts(np.zeros(1, D.storage_dtype(dtype)))[wide]


def _replay_tree(lanes):
    """The documented final order: parts (p0 + p1) + (p2 + p3), then halves."""
    parts = np.split(lanes, L.PARTS)
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    v = parts[0]
    while v.size > 1:
        v = v[:v.size // 2] + v[v.size // 2:]
    return v[0]


def _order(dtype, count):
    """The column each lane holds, lane by lane (``L.columns``: bfloat16 lanes are
    paired, even then odd columns of each 2n)."""
    lt = L.lanes_type(numba.from_dtype(D.storage_dtype(dtype)))
    assert lt.count == count
    return np.array(L.columns(lt)).ravel()


def _blocks(values, count, dtype=None):
    """values zero-padded to whole blocks of ``count`` lanes, one block per row;
    with ``dtype``, each block in the lane order of rows of that dtype."""
    pad = (-values.size) % count
    blocks = np.concatenate([values, np.zeros(pad, values.dtype)]).reshape(-1, count)
    return blocks if dtype is None else blocks[:, _order(dtype, count)]


@njit(cache=False)
def _sum_via_lanes(x):
    s = L.lanes_zeros(x)
    n, step = x.shape[0], L.lanes_count(s)
    for c in range(0, n - step + 1, step):
        s = s + L.lanes_load(x, c, step)
    if n % step:
        s = s + L.lanes_load(x, n - n % step, n % step)
    return L.lanes_sum(s)


@pytest.mark.parametrize("dtype", [F32, F64, F16, BF16], ids=dtype_id)
@pytest.mark.parametrize("cols", [1, 7, 31, 64, 100, 1000, 4096, 5003])
def test_sum_follows_the_documented_order(dtype, cols):
    rng = np.random.default_rng(cols)
    x = _bits(rng.standard_normal(cols) * 3, dtype)
    acc = _acc(dtype)
    values = (x.view(dtype) if dtype in (F16, BF16) else x).astype(acc)
    lanes = np.zeros(_count(dtype), acc)
    for block in _blocks(values, lanes.size, dtype):
        lanes = lanes + block                      # rounded in the accumulator type
    want = _replay_tree(lanes)
    got = _sum_via_lanes(x)
    assert acc(got) == want, (got, want)
    # the order matters: a sequential or pairwise sum differs (float32/float64; sums
    # of halves in float32 are often exact in any order)
    if cols >= 1000 and dtype in (F32, F64):
        seq = acc(0)
        for v in values:
            seq = acc(seq + v)
        assert not np.all([seq == got, np.sum(values) == got]), "test cannot tell orders apart"


@njit(cache=False)
def _fma_lanes(a, b, c):
    """a * b + c elementwise, each rounded once (llvm.fma: the kernels' primitive)."""
    out = np.empty_like(c)
    for i in range(c.shape[0]):
        out[i] = V._fma(a[i], b[i], c[i])
    return out


@pytest.mark.parametrize("dtype", [F32, F64, BF16], ids=dtype_id)
@pytest.mark.parametrize("cols", [5, 64, 1000, 4099])
def test_cpu_sum_sq_and_grad_sums_follow_the_documented_order(dtype, cols):
    """The kernels' reductions themselves, replayed: ss = fma(d, d, ss) and x - center
    per lane (d = x - center), dot = fma(dy * weight, x - center, dot) with x - center 0 in the
    zero-padded lanes, and dy * weight."""
    rng = np.random.default_rng(cols + 1)
    acc = _acc(dtype)
    x = _bits(rng.standard_normal(cols) + 0.5, dtype)
    dy = _bits(rng.standard_normal(cols), dtype)
    w = _bits(1 + 0.1 * rng.standard_normal(cols), dtype)
    xv, dyv, wv = ((a.view(dtype) if dtype == BF16 else a).astype(acc) for a in (x, dy, w))
    center = acc(0.3)
    count = _count(dtype)
    # block by block, the zero-padded tail masked where the kernels mask it
    ss = sd = dot = gsum = np.zeros(count, acc)
    order = _order(dtype, count)
    for b, (xb, dyb, wb) in enumerate(zip(_blocks(xv, count, dtype), _blocks(dyv, count, dtype),
                                          _blocks(wv, count, dtype))):
        keep = b * count + order < cols
        d = np.where(keep, xb - center, acc(0))
        ss = _fma_lanes(d, d, ss)
        sd = sd + d
        g = dyb * wb
        dot = _fma_lanes(g, d, dot)
        gsum = gsum + g
    got_ss, got_sd = cpu._sum_sq(x, center)
    got_dot, got_gsum = cpu._grad_sums(dy, w, x, center)
    assert (got_ss, got_sd) == (_replay_tree(ss), _replay_tree(sd))
    assert (got_dot, got_gsum) == (_replay_tree(dot), _replay_tree(gsum))


@njit(cache=False)
def _exp_sum(x, m, scratch):
    return cpu._exp_sum(x, m, scratch)


@pytest.mark.parametrize("cols", [3, 64, 1000, 4096])
def test_exp_sum_uses_wide_lanes_and_fills_scratch(cols):
    rng = np.random.default_rng(5)
    x = rng.standard_normal(cols).astype(np.float32)
    m = np.float32(x.max())
    scratch = np.full(cols + 8, np.nan, np.float32)
    s = _exp_sum(x, m, scratch[:cols])
    assert np.all(np.isnan(scratch[cols:])), "wrote past the row"
    e = scratch[:cols]
    # exp is within 1 ulp of the float32 difference the kernel forms
    np.testing.assert_allclose(e, np.exp((x - m).astype(np.float64)), rtol=2.5e-7)
    lanes = np.zeros(_count(F32, wide=True), np.float32)
    for block in _blocks(e, lanes.size):
        lanes = lanes + block
    assert s == _replay_tree(lanes)


@njit(cache=False)
def _copy_converted(src, dst, k):
    """dst[c:c+k] = src[c:c+k] block by block through lanes of dst's type."""
    n = src.shape[0]
    like = L.lanes_zeros(dst)
    step = L.lanes_count(like)
    for c in range(0, n, step):
        kk = min(step, n - c, k)
        L.lanes_store(dst, c, L.lanes_load_like(src, c, kk, like), kk)


@njit(cache=False)
def _copy_through(src, dst, k):
    """dst[c:c+k] = src[c:c+k] block by block through src's own lanes (paired for
    bfloat16), each block's lanes from k on replaced by -1 before the store."""
    n = src.shape[0]
    step = L.lanes_count(L.lanes_zeros(src))
    for c in range(0, n, step):
        kk = min(step, n - c)
        L.lanes_store(dst, c, L.lanes_keep(L.lanes_load(src, c, kk), k, -1.0), kk)


def test_paired_lanes_hold_their_columns():
    """bfloat16 rows load into paired lanes (``L.columns``: even, then odd columns
    of each 2n) and every store puts each column back in its place: into bfloat16
    and float32 rows, whole and partial blocks (every k up to the lane count,
    including a partial second pair), ``lanes_keep`` by column; nothing written
    past k. Float32 lanes stay in column order."""
    rng = np.random.default_rng(11)
    count = _count(BF16)
    lt = L.lanes_type(numba.from_dtype(D.storage_dtype(BF16)))
    assert lt.paired and not L.lanes_type(numba.from_dtype(np.dtype(np.float32))).paired
    cols = L.columns(lt)
    assert sorted(sum(cols, [])) == list(range(count))
    assert cols[0][:3] == [0, 2, 4] and cols[1][:3] == [1, 3, 5]
    for n in (2 * count, 2 * count + 37, count - 1, 33):
        src = _bits(rng.standard_normal(n) + 2, BF16)
        values = src.view(BF16).astype(np.float32)
        for k in range(0, count + 1, 3):
            keep = np.arange(n) % count < k
            for out_dtype in (np.float32, np.uint16):
                buf = np.full(n + 64, 0x7F7F if out_dtype == np.uint16 else 12345.0, out_dtype)
                dst = buf[:n]
                _copy_through(src, dst, k)
                got = dst.view(BF16).astype(np.float32) if out_dtype == np.uint16 else dst
                assert np.array_equal(got, np.where(keep, values, -1.0)), (n, k, out_dtype)
                assert np.array_equal(buf[n:], np.full(64, buf[-1]))


def test_paired_and_ordered_lanes_do_not_mix():
    """Lanes of the two layouts hold different columns in the same lane: an
    operation between them is a typing error, not a silent mismatch."""
    import numba.core.errors

    @njit(cache=False)
    def mixed(x):
        return L.lanes_sum(L.lanes_zeros(x) + L.ordered_lanes_zeros(x))

    @njit(cache=False)
    def same(x):
        return L.lanes_sum(L.ordered_lanes_zeros(x) + L.ordered_lanes_zeros(x))

    with pytest.raises(numba.core.errors.TypingError):
        mixed(np.zeros(4, np.uint16))
    assert mixed(np.zeros(4, np.float32)) == 0.0      # float32 lanes are never paired
    assert same(np.zeros(4, np.uint16)) == 0.0


def test_paired_loads_widen_without_shuffles():
    """A bfloat16 load into paired lanes: a shift and a mask per part, no
    zero-extending shuffle (the point of pairing)."""
    _sum_via_lanes(np.ones(256, np.uint16))
    asm = next(a for sig, a in _sum_via_lanes.inspect_asm().items()
               if str(sig[0].dtype) == "uint16")
    assert "vpslld" in asm and "vpand" in asm and "vpmovzxwd" not in asm


@njit(cache=False)
def _copy_streamed(src, dst, k, on):
    """``_copy_converted`` into ``streaming(dst, on)``."""
    n = src.shape[0]
    out = L.streaming(dst, on)
    like = L.lanes_zeros(dst)
    step = L.lanes_count(like)
    for c in range(0, n, step):
        kk = min(step, n - c, k)
        L.lanes_store(out, c, L.lanes_load_like(src, c, kk, like), kk)


@pytest.mark.parametrize("dtype", [F32, F64, BF16], ids=dtype_id)
def test_streamed_store_writes_what_the_store_writes(dtype):
    """lanes_store into ``streaming(row, on)``: the bytes of the ordinary store in
    the whole buffer around the row (nothing else written), on or off, some parts
    holding a subnormal float (bfloat16 rounds them on a branch of its own), aligned
    (non-temporal whole blocks) or not, whole blocks and partial ones; the
    non-temporal store is in the assembly."""
    rng = np.random.default_rng(3)
    st = D.storage_dtype(dtype)
    count = _count(dtype)
    for n in (3 * count, 3 * count + 5, count - 1):
        src = rng.standard_normal(n).astype(_acc(dtype))
        src[5::37] = 3e-39        # subnormal floats: bfloat16's exact branch, streamed too
        for offset in (0, 16, 32):
            for k in (1 << 30, count - 3):        # whole blocks, or k lanes of each
                _, want = at_line_offset(n, st, offset, 0xAB)
                _copy_converted(src, want, k)
                for on in (True, False):
                    buf, dst = at_line_offset(n, st, offset, 0xAB)
                    _copy_streamed(src, dst, k, on)
                    assert np.array_equal(dst.view(np.uint8), want.view(np.uint8))
                    o = dst.ctypes.data - buf.ctypes.data
                    assert (buf[:o] == 0xAB).all() and (buf[o + dst.nbytes:] == 0xAB).all()
    asm = next(a for sig, a in _copy_streamed.inspect_asm().items()
               if str(sig[1].dtype) == np.dtype(st).name)
    assert "vmovnt" in asm


@njit(cache=False)
def _head_of(dst, c, n, on, plain, least=0):
    """``stream_head`` of ``streaming(dst, on)`` from column c, or of the plain
    data pointer."""
    if plain:
        return L.stream_head(L.data(dst), c, n, least)
    return L.stream_head(L.streaming(dst, on), c, n, least)


@pytest.mark.parametrize("dtype", [F32, F64, BF16], ids=dtype_id)
def test_stream_head_reaches_the_next_cache_line(dtype):
    """stream_head: the columns from c to the row's next 64-byte boundary, for a
    streaming row of HEAD_MIN_BYTES (or the caller's larger ``least``) or more; 0
    for shorter rows, for rows that do not stream and for plain pointers. Every
    offset of the row in a line; the column it reaches is on the line."""
    st = np.dtype(D.storage_dtype(dtype))
    size = st.itemsize
    n = 2 * L.HEAD_MIN_BYTES // size
    seen = set()
    for offset in range(0, 64, size):
        _, dst = at_line_offset(n + 64, st, offset, 0)
        for c in (0, 1, 7):
            want = (-(dst.ctypes.data + c * size)) % 64 // size
            h = _head_of(dst, c, n, True, False)
            assert h == want and (dst.ctypes.data + (c + h) * size) % 64 == 0
            seen.add(h)
            assert _head_of(dst, c, min(want, 2), True, False) == 0     # short: none
            assert _head_of(dst, c, n, False, False) == 0
            assert _head_of(dst, c, n, True, True) == 0
    assert seen == set(range(64 // size))
    _, dst = at_line_offset(n + 64, st, size, 0)
    short = L.HEAD_MIN_BYTES // size - 1
    assert _head_of(dst, 0, short, True, False) == 0
    assert _head_of(dst, 0, short + 1, True, False) == 64 // size - 1
    least = 2 * L.HEAD_MIN_BYTES
    assert _head_of(dst, 0, least // size - 1, True, False, least) == 0
    assert _head_of(dst, 0, least // size, True, False, least) == 64 // size - 1
    assert _head_of(dst, 0, short + 1, True, False, 1) == 64 // size - 1


@pytest.mark.parametrize("half", [F16, BF16], ids=dtype_id)
def test_block_narrow_matches_numpy_bits(half):
    """Vector rounding float32 -> float16/bfloat16, every class of value (the same
    cases as the scalar conversions in test_dtypes)."""
    v = F32_CASES
    out = np.empty(v.size, D.storage_dtype(half))
    _copy_converted(v, out, 1 << 30)
    with np.errstate(over="ignore", invalid="ignore"):
        want = v.astype(half)
    got = out.view(half)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got.view(np.uint16)[~nan], want.view(np.uint16)[~nan])


def test_block_narrow_bfloat16_every_high_half():
    """Every bfloat16 result, each from floats with 8 kinds of low half (ties,
    just above and below them, odd and even), sorted: most 16-lane parts hold no
    subnormal (vcvtneps2bf16 where the CPU has it) and the parts around 0 hold
    only subnormals (the exact fallback)."""
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    low = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1234, 0xC000], np.uint32)
    v = (high[:, None] | low[None, :]).ravel().view(np.float32)
    out = np.empty(v.size, np.uint16)
    _copy_converted(v, out, 1 << 30)
    with np.errstate(over="ignore", invalid="ignore"):
        want = v.astype(BF16).view(np.uint16)
    nan = np.isnan(v)
    assert np.array_equal(out[~nan], want[~nan])
    assert np.array_equal(out[nan], (v[nan].view(np.uint32) >> 16) | 0x40)   # quieted


def test_block_narrow_bfloat16_one_subnormal_among_normals():
    """One subnormal in each lane position of a part of normal floats: the part
    takes the exact rounding (the instruction reads subnormals as zero)."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((64, 64)).astype(np.float32)
    for i in range(64):
        x[i, i] = np.float32(3e-39) * np.float32(1 + i / 64)
    out = np.empty(x.size, np.uint16)
    _copy_converted(x.ravel(), out, 1 << 30)
    assert np.array_equal(out, x.ravel().astype(BF16).view(np.uint16))
    assert np.count_nonzero(out.reshape(64, 64)[np.diag_indices(64)]) == 64


@pytest.mark.skipif(not L._BF16_HW, reason="no AVX512-BF16 on this CPU")
def test_block_narrow_bfloat16_uses_the_instruction():
    _copy_converted(np.ones(64, np.float32), np.empty(64, np.uint16), 64)
    asm = next(a for sig, a in _copy_converted.inspect_asm().items()
               if str(sig[0].dtype) == "float32" and str(sig[1].dtype) == "uint16")
    assert "vcvtneps2bf16" in asm and "vfpclassps" in asm


@pytest.mark.parametrize("half", [F16, BF16], ids=dtype_id)
def test_block_widen_matches_numpy_bits(half):
    bits = ALL16.view(D.storage_dtype(half))
    out = np.empty(bits.size, np.float32)
    _copy_converted(bits, out, 1 << 30)
    with np.errstate(invalid="ignore"):
        want = ALL16.view(half).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(out), nan)
    assert np.array_equal(out[~nan].view(np.uint32), want[~nan].view(np.uint32))


@njit(cache=False)
def _widen_in_own_lanes(src, dst, k):
    """dst[c:c+k] = src[c:c+k] through src's own lanes (zmm parts for halves)."""
    n = src.shape[0]
    step = L.lanes_count(L.lanes_load(src, 0, 0))
    for c in range(0, n, step):
        kk = min(step, n - c, k)
        L.lanes_store(dst, c, L.lanes_load(src, c, kk), kk)


@pytest.mark.parametrize("k", [1 << 30, 1, 16, 17, 63])
@pytest.mark.parametrize("half", [F16, BF16], ids=dtype_id)
def test_half_lanes_widen_every_value(half, k):
    """Loads in the halves' own lanes (zmm parts, the kernels' loads) give every
    value's exact float, in full and partial blocks, and nothing past k."""
    bits = ALL16.view(D.storage_dtype(half))
    out = np.full(bits.size, np.float32(7.0))
    _widen_in_own_lanes(bits, out, k)
    with np.errstate(invalid="ignore"):
        want = ALL16.view(half).astype(np.float32)
    step = _count(half)
    touched = (np.arange(bits.size) % step) < k
    assert np.all(out[~touched] == 7.0)
    got, want = out[touched], want[touched]
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("dtype", [F32, F64, F16, BF16], ids=dtype_id)
@pytest.mark.parametrize("k", [0, 1, 5, 17, 33, 62])
def test_partial_blocks_touch_only_their_elements(dtype, k):
    """A partial load reads k elements (the rest of the lanes are 0) and a partial
    store writes k: the poisoned elements around them stay as they were."""
    rng = np.random.default_rng(k)
    count = _count(dtype)
    src = _bits(rng.standard_normal(3 * count) + 2, dtype)
    poison = np.frombuffer(b"\x7f" * (3 * count * src.itemsize), src.dtype).copy()
    dst = poison.copy()
    _copy_converted(src[count:], dst[count:], k)      # every block stores k elements
    for b in range(2):
        lo = count * (b + 1)
        assert np.array_equal(dst[lo:lo + k], src[lo:lo + k])
        assert np.array_equal(dst[lo + k:lo + count], poison[lo + k:lo + count])
    assert np.array_equal(dst[:count], poison[:count])
    tail = _bits(rng.standard_normal(k) + 2, dtype)
    values = (tail.view(dtype) if dtype in (F16, BF16) else tail).astype(_acc(dtype))
    assert _sum_via_lanes(tail) == (_replay_tree(_blocks(values, count, dtype).sum(0))
                                    if k else 0)


@njit(cache=False)
def _prefetched_sum(a, ahead, l2):
    """sum(a), prefetching every block ``ahead`` elements on (prefetch_l2 or prefetch)."""
    p = L.data(a)
    total = 0.0
    for c in range(0, a.shape[0], 16):
        if l2:
            L.prefetch_l2(p, c + ahead)
        else:
            L.prefetch(p, c + ahead)
        for i in range(c, min(c + 16, a.shape[0])):
            total += a[i]
    return total


def test_prefetches_are_hints():
    """prefetch (into the L1: prefetcht0) and prefetch_l2 (the L2: prefetcht1) change
    no value and never fault, however far past the array's end they point (a
    stage's last rows prefetch rows that do not exist)."""
    a = np.arange(1000, dtype=np.float64)
    for ahead in (0, 64, 1 << 20, 1 << 40):
        for l2 in (True, False):
            assert _prefetched_sum(a, ahead, l2) == a.sum()
    asm = _prefetched_sum.inspect_asm(_prefetched_sum.signatures[0])
    assert "prefetcht1" in asm and "prefetcht0" in asm

"""Output placement (numba_fused._alloc): outputs the library allocates, and
numba_fused.empty_like, start where the kernels' stores do not alias their loads
(a multiple of 2**28 bytes from an input, give or take a few rows). Addresses
only: the big buffers below are never touched, so no page is ever faulted in."""
import numpy as np
import pytest

import numba_fused as nf
from numba_fused import _alloc, _dispatch
from conftest import HALVES, assert_bits_equal, draw, draw_param

SPAN = _alloc.ALIAS_SPAN


def _carved(nbytes, *offsets, dtype=np.float32, cols=1024):
    """Arrays of nbytes carved from one untouched buffer at the given byte
    offsets (page-aligned plus 16, as NumPy places large arrays)."""
    buf = np.empty(max(offsets) + nbytes + 8192, np.uint8)
    base = -buf.ctypes.data % 4096 + 16
    return [buf[base + o:base + o + nbytes].view(dtype).reshape(-1, cols) for o in offsets]


@pytest.mark.parametrize("gap", [SPAN + 4096, SPAN, SPAN - 4096, SPAN + 3 * 4096, 2 * SPAN + 4096])
def test_aliases_flags_outputs_a_multiple_of_the_span_from_an_input(gap):
    x, y = _carved(1 << 20, 0, gap)
    assert _alloc.aliases(y.ctypes.data, x, (x,))


@pytest.mark.parametrize("gap", [1 << 20, 3 * 4096 + (1 << 20), SPAN // 2 + 4096, SPAN + (1 << 20),
                                 SPAN - (1 << 20)])
def test_aliases_passes_outputs_clear_of_the_window(gap):
    x, y = _carved(1 << 20, 0, gap)
    assert not _alloc.aliases(y.ctypes.data, x, (x,))


def test_window_scales_with_the_row():
    # 4 rows of 256 KiB ahead are still in the window; 64 KiB rows' 4 rows are not
    wide = _carved(1 << 20, 0, SPAN + 4 * (1 << 18), cols=1 << 16)
    narrow = _carved(1 << 20, 0, SPAN + 4 * (1 << 18), cols=1 << 14)
    assert _alloc.aliases(wide[1].ctypes.data, wide[0], (wide[0],))
    assert not _alloc.aliases(narrow[1].ctypes.data, narrow[0], (narrow[0],))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, *HALVES])
def test_place_moves_an_aliasing_output_clear_of_every_input(dtype):
    itemsize = np.dtype(dtype).itemsize
    x, dy, out = _carved(1 << 21, 0, SPAN - (1 << 22), SPAN + 4096, dtype=dtype,
                         cols=4096 // itemsize)
    assert _alloc.aliases(out.ctypes.data, x, (x, dy))
    placed = _alloc.place(out, x, (x, dy))
    assert placed is not out
    assert placed.shape == x.shape and placed.dtype == x.dtype
    assert placed.flags.c_contiguous and placed.flags.writeable
    assert placed.ctypes.data % 64 == 0
    assert not _alloc.aliases(placed.ctypes.data, x, (x, dy))


def test_place_keeps_small_and_clear_aligned_outputs():
    x, y = _carved(1 << 19, 0, SPAN + 4096)          # under PLACE_MIN_BYTES
    assert _alloc.place(y, x, (x,)) is y
    x, y = _carved(1 << 21, 0, SPAN + (1 << 22) + 48)   # 16 + 48: 64-byte aligned
    assert y.ctypes.data % 64 == 0
    assert _alloc.place(y, x, (x,)) is y


def test_place_aligns_large_clear_outputs_to_a_cache_line():
    """A clear output of STREAM_BYTES or more 16 bytes past a cache line (NumPy's
    large arrays) is moved to one: the kernels' non-temporal stores need whole
    aligned lines. Smaller ones stay where they are."""
    n = _alloc.STREAM_BYTES
    x, y = _carved(n, 0, SPAN + (1 << 25))
    assert y.ctypes.data % 64 == 16 and not _alloc.aliases(y.ctypes.data, x, (x,))
    placed = _alloc.place(y, x, (x,))
    assert placed is not y and placed.ctypes.data % 64 == 0
    assert placed.shape == y.shape and placed.dtype == y.dtype and placed.flags.c_contiguous
    assert not _alloc.aliases(placed.ctypes.data, x, (x,))
    x, y = _carved(n - 4096, 0, SPAN + (1 << 25))
    assert _alloc.place(y, x, (x,)) is y
    assert nf.empty_like(np.empty((n // 4096, 1024), np.float32)).ctypes.data % 64 == 0


def test_empty_like_is_public_and_clear_of_its_inputs():
    x, dy = _carved(1 << 21, 0, SPAN - 4096)
    out = nf.empty_like(x, dy)
    assert out.shape == x.shape and out.dtype == x.dtype and out.flags.c_contiguous
    assert not _alloc.aliases(out.ctypes.data, x, (x, dy))
    f = np.ones((3, 5), np.float64, order="F")
    g = nf.empty_like(f)
    assert g.shape == (3, 5) and g.flags.c_contiguous


@pytest.mark.parametrize("args, name", [(([1.0, 2.0],), "like"),
                                        ((np.ones(4), [1.0]), r"inputs\[0\]")])
def test_empty_like_rejects_non_arrays_naming_the_argument(args, name):
    with pytest.raises(TypeError, match=name):
        nf.empty_like(*args)


@pytest.fixture
def always_moved(monkeypatch):
    """Every output the dispatcher allocates takes the relocation path."""
    real = _alloc.aliases
    calls = []

    def first_candidate_aliases(address, like, inputs):
        calls.append(address)
        return len(calls) == 1 or real(address, like, inputs)

    def place(out, like, inputs):
        calls.clear()
        return _place(out, like, inputs)
    _place = _alloc.place
    monkeypatch.setattr(_alloc, "PLACE_MIN_BYTES", 0)
    monkeypatch.setattr(_alloc, "aliases", first_candidate_aliases)
    monkeypatch.setattr(_alloc, "place", place)
    return calls


@pytest.mark.parametrize("dtype", [np.float32, *HALVES])
def test_relocated_outputs_hold_the_same_bits(rng, dtype, always_moved):
    shape = (3, 96, 700)          # 3-D: past the small 2-D entries, on the host path
    x, dy = draw(rng, shape, dtype), draw(rng, shape, dtype)
    w, b = (draw_param(rng, shape[-1], "random", dtype) for _ in range(2))
    y = nf.softmax_fwd(x)
    _, rstd = nf.rms_norm_fwd(x, w)
    _, mean, lrstd = nf.layer_norm_fwd(x, w, b)
    calls = {
        "softmax_fwd": lambda o: nf.softmax_fwd(x, out=o),
        "softmax_bwd": lambda o: nf.softmax_bwd(y, dy, out=o),
        "rms_norm_fwd": lambda o: nf.rms_norm_fwd(x, w, out=o)[0],
        "rms_norm_bwd": lambda o: nf.rms_norm_bwd(dy, x, w, rstd, out=o)[0],
        "layer_norm_fwd": lambda o: nf.layer_norm_fwd(x, w, b, out=o)[0],
        "layer_norm_bwd": lambda o: nf.layer_norm_bwd(dy, x, w, b, mean, lrstd, out=o)[0],
    }
    for name, call in calls.items():
        expected = call(np.full(shape, np.nan, dtype))
        always_moved.clear()
        got = call(None)
        assert always_moved, f"{name}: the output was not placed"
        assert got.base is not None and got.flags.c_contiguous and got.dtype == np.dtype(dtype)
        assert_bits_equal(got, expected, name)


def test_placed_or_passes_the_callers_out_through():
    x = np.ones((4, 8), np.float32)
    out = np.empty_like(x)
    assert _dispatch._placed_or(out, x, x) is out


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_torch_outputs_relocated_hold_the_same_bits(dtype_name, always_moved, monkeypatch):
    torch = pytest.importorskip("torch")
    import numba_fused.torch as nft
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 96, 700, generator=g).to(dtype)
    dy = torch.randn(3, 96, 700, generator=g).to(dtype)
    w = torch.randn(700, generator=g).to(dtype)
    b = torch.randn(700, generator=g).to(dtype)

    def run():
        y = nft._softmax_fwd_impl(x)
        out = [y, nft._softmax_bwd_impl(y, dy)]
        yr, rstd = nft._rms_norm_fwd_impl(x, w, 1e-6)
        out += [yr, nft._rms_norm_bwd_impl(dy, x, w, rstd, True)[0]]
        yl, mean, lrstd = nft._layer_norm_fwd_impl(x, w, b, 1e-5)
        out += [yl, nft._layer_norm_bwd_impl(dy, x, w, mean, lrstd, True, True)[0]]
        return out

    with monkeypatch.context() as m:
        m.setattr(_alloc, "aliases", lambda address, like, inputs: False)
        expected = run()
    moved = []

    def cpu_out(*args):
        always_moved.clear()
        t, a = real_cpu_out(*args)
        moved.append(bool(always_moved) and t.data_ptr() % 64 == 0 and t.is_contiguous()
                     and a.__array_interface__["data"][0] == t.data_ptr())
        return t, a
    real_cpu_out = nft._cpu_out
    monkeypatch.setattr(nft, "_cpu_out", cpu_out)
    got = run()
    assert moved == [True] * 6
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b)

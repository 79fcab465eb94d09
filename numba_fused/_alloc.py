"""Output buffers placed where the CPU kernels' stores do not alias their loads.

On AMD Zen the L1 predicts a line's way from a hash of linear-address bits 12-27
(its "utag"): lines a multiple of 2**28 bytes apart evict each other. The kernels
store row r of the output while they load rows r..r+2 of the inputs (the
pipelined stages), so an output that lies a multiple of 2**28 bytes, give or take
a few rows, from an input runs up to 2x slower. Allocators put arrays exactly
there: NumPy's ``empty_like`` of a 256 MiB array lands 2**28 + 4096 bytes from it
(65536x1024 float32; measured 2026-12-06 on the project's AMD EPYC VM, y at
x + 2**28 + 4096 against y at x + 2**28 + 16 KiB up to x + 2**29 - 64 KiB, two runs:
softmax fwd 27.5 against 21.8-24.3 ms and 20.2 against 16.1-18.9; layer_norm fwd
32.5 against 17.5-25.5 and 30.4 against 16.4-20.9; rms_norm fwd 18.5 against
15.7-17.4 and 18.6 against 15.9-17.4). ``place`` allocates such an
output a little larger and starts it where no input's rows are in the way; the
kernels give the same bits wherever their buffers lie. Inputs are the caller's:
two inputs that alias each other (dy and x of a backward) are not helped.

``place`` also starts outputs of STREAM_BYTES and more on a 64-byte boundary
(NumPy's large arrays start 16 bytes past one): the kernels write such outputs
with non-temporal stores, which need whole, aligned cache lines (``cpu``).
"""
import numpy as np

#: linear-address distance at which lines alias
ALIAS_SPAN = 1 << 28
#: bytes of margin on each side of the aliasing window
ALIAS_MARGIN = 1 << 16
#: rows of an input ahead of the stored row that a kernel may load
ALIAS_ROWS = 4
#: smaller outputs are never moved (their rows stay in cache, and an input
#: 2**28 bytes away is rare)
PLACE_MIN_BYTES = 1 << 20
#: outputs of this many bytes or more are written with non-temporal stores
#: (``cpu.STREAM_BYTES`` is this) and start on an ALIGN boundary. Not smaller
#: ones: moving a 1 MiB output for alignment alone cost 8-14% of a (256, 1024)
#: float32 call that allocates its result (a second allocation; 2026-12-06)
STREAM_BYTES = 1 << 24
#: a cache line
ALIGN = 64


def _window(like):
    """(low, length) of the distances out - input, modulo ALIAS_SPAN, that alias."""
    itemsize = like.itemsize if isinstance(like, np.ndarray) else like.element_size()
    row = (like.shape[-1] if like.ndim else 1) * itemsize
    return -ALIAS_MARGIN, ALIAS_ROWS * row + 2 * ALIAS_MARGIN


def _address(a):
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data_ptr()


def aliases(address, like, inputs):
    """Whether an output like ``like`` starting at ``address`` aliases one of the
    ``inputs`` (NumPy arrays or CPU tensors): it lies at least ALIAS_SPAN / 2
    bytes from the input's start, at a distance within the window modulo
    ALIAS_SPAN."""
    low, length = _window(like)
    for a in inputs:
        d = address - _address(a)
        if abs(d) >= ALIAS_SPAN // 2 and (d - low) % ALIAS_SPAN < length:
            return True
    return False


def padding(like, inputs):
    """Bytes to allocate beyond an output like ``like`` so that a start clear of
    every input exists (``clear_offset``): two windows per input."""
    return 2 * len(inputs) * _window(like)[1] + 4096 + 64


def clear_offset(address, like, inputs):
    """The first offset into a buffer at ``address`` (of ``padding`` extra bytes),
    64-byte aligned and in 4 KiB steps, where an output like ``like`` aliases no
    input."""
    start = -address % 64
    for o in range(start, start + padding(like, inputs) - 63, 4096):
        if not aliases(address + o, like, inputs):
            return o
    return start


def placed(address, nbytes, like, inputs):
    """Whether an output of ``nbytes`` at ``address`` needs no moving: clear of
    every input's aliases, and ALIGN-aligned if it has STREAM_BYTES or more."""
    return ((nbytes < STREAM_BYTES or address % ALIGN == 0)
            and not aliases(address, like, inputs))


def place(out, like, inputs):
    """``out`` (a fresh array like ``like``) where it needs no moving (``placed``),
    else a view at ``clear_offset`` into a buffer ``padding`` bytes larger: clear
    of the NumPy ``inputs`` (module docstring) and ALIGN-aligned."""
    if out.nbytes < PLACE_MIN_BYTES or placed(out.ctypes.data, out.nbytes, like, inputs):
        return out
    buf = np.empty(out.nbytes + padding(like, inputs), np.uint8)
    o = clear_offset(buf.ctypes.data, like, inputs)
    return buf[o:o + out.nbytes].view(out.dtype).reshape(out.shape)


def empty_like(like, *inputs):
    """An uninitialized C-contiguous array of like's shape and dtype, for ``out=``
    of an op over ``like`` and the other ``inputs``: ``np.empty`` placed where the
    kernels' stores into it do not alias their loads from the inputs on AMD Zen,
    64-byte aligned from 16 MiB (see ``numba_fused._alloc``). The outputs
    numba_fused allocates itself are placed so already."""
    for name, a in [("like", like)] + [(f"inputs[{i}]", a) for i, a in enumerate(inputs)]:
        if not isinstance(a, np.ndarray):
            raise TypeError(f"empty_like: {name} must be a NumPy array (CPU out= buffers "
                            f"only), not {type(a).__name__}")
    return place(np.empty(like.shape, like.dtype), like, (like,) + inputs)

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

Outputs of POOL_MIN_BYTES (1 MiB) and more come from ``POOL``, buffers of
outputs that died, so a call that allocates its result costs what a call with
``out=`` does. glibc maps every allocation of 32 MiB or more afresh (its mmap
threshold stops there) and unmaps it on free; the first touch of each fresh page
then faults and the kernel zeroes it. Measured on the project's AMD EPYC VM
(2026-12-06): 70-120 us per MiB, against ~20 us per MiB for a kernel's whole
pass; ``softmax_fwd`` of a 4096x4096 float32 array took 10.4-11.0 ms allocating
its result and 4.9-6.4 ms with ``out=``.

Smaller blocks fault too, depending on what else is alive: glibc gives the top of
its heap back to the OS once more than its trim threshold (twice the mmap
threshold, which rises with the largest block freed) lies free there. A loop
with one result alive at a time reuses one block and did not fault (the pool
threshold was 32 MiB until 2026-12-07, measured so); a forward's y alive during
its backward's dx did at 16 MiB (softmax fwd+bwd 2.9-3.1x pooled), and a
training step keeps its forwards' outputs until their backwards and frees them
together.
``benchmarks/pool_ab.py``, AMD EPYC, 2026-12-07, float32, pooled from 1 MiB
against from 32 MiB, two processes: four forwards kept, then their backwards,
softmax 2.2-7.6x at 1-16 MiB (one cell of nine even), rms_norm 4.3x at 4 MiB in
one process (0.94-1.04x elsewhere; layer_norm 0.93-1.06x, 2.3-3.9x in an earlier
process: glibc's state depends on the process's history); through
``numba_fused.torch`` and ``torch.autograd.grad``, softmax 1.3-4.0x and rms_norm
2.6-5.6x where glibc faulted (2-16 MiB); bfloat16 softmax 2.0-3.9x (four kept)
and 1.0-1.2x (torch) at 2-8 MiB. Where nothing faulted, the pool's bookkeeping
(3-4 us an output) cost up to 10% at 1 MiB (0.90-1.02x; the torch path
0.86-0.96x before it made one tensor of a buffer), noise beyond (0.93-1.11x;
torch's own ops, which the setting does not touch, moved 0.89-1.06x).
"""
import bisect
import collections
import math
import os
import threading

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
#: outputs of this many bytes or more come from POOL (module docstring)
POOL_MIN_BYTES = 1 << 20
#: pooled buffers of POOL_LARGE_BYTES and more are sized in steps of POOL_STEP (a
#: huge page), smaller ones in steps of POOL_FINE_STEP; an idle buffer serves
#: requests from 8/9 of its size less a step (``Pool``), so outputs of one shape
#: share buffers whatever padding their inputs ask for
POOL_STEP = 1 << 21
POOL_FINE_STEP = 1 << 16
POOL_LARGE_BYTES = 1 << 25


def pool_step(nbytes):
    """The size step of a pooled buffer for a request of nbytes."""
    return POOL_STEP if nbytes >= POOL_LARGE_BYTES else POOL_FINE_STEP


def _default_limit():
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return 1 << 30
    return min(1 << 30, ram // 8)


#: default cap on the bytes of idle buffers POOL holds: 1 GiB, or an eighth of the
#: machine's memory if that is less (NUMBA_FUSED_POOL_BYTES overrides it)
POOL_LIMIT = _default_limit()


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


class _Owner:
    """Owns a pooled buffer while arrays view it. ``np.asarray(owner)`` is an
    array whose base is the owner, and NumPy collapses the base of every view of
    that array to it, never further: the owner dies with the last view, and gives
    the buffer back."""
    __slots__ = ("raw", "pool", "__array_interface__")

    def __init__(self, raw, pool, interface):
        self.raw, self.pool = raw, pool
        self.__array_interface__ = interface     # raw's, kept with it: 1 us a dict

    def __del__(self):
        self.pool._give(self.raw, self.__array_interface__)


class Pool:
    """Buffers of dead outputs, reused by later outputs of about their size.

    ``take(n)`` returns a fresh 1-D uint8 array of at least n bytes. Its memory
    goes back to the pool when that array and every view of it (the outputs made
    from it, tensors made with ``torch.from_numpy``) are gone. An idle buffer of b
    bytes serves a request of n bytes if n <= b <= n + n // 8 + step(n)
    (``pool_step``): the smallest such size, and of those buffers the one given
    back last, whose lines are the likeliest still in cache. The pool holds at
    most ``limit`` bytes of idle buffers and frees the oldest beyond that.
    Thread-safe; ``release`` frees every idle buffer."""

    def __init__(self, limit):
        self.limit = limit
        self._idle = {}              # size -> [(age, buffer, interface), ...], oldest first
        self._sizes = []             # the keys of _idle, sorted
        self._ages = collections.OrderedDict()    # age -> size of every idle buffer, oldest first
        self._age = 0
        self._idle_bytes = 0
        self._reused = self._fresh = 0
        # reentrant: an owner may die, and give its buffer back, in the thread
        # that holds the lock (a garbage collection inside take)
        self._lock = threading.RLock()

    def _after_fork(self):
        # a thread of the parent may have held the lock when it forked
        self._lock = threading.RLock()

    def take(self, nbytes):
        step = pool_step(nbytes)
        raw = None
        with self._lock:
            i = bisect.bisect_left(self._sizes, nbytes)
            if i < len(self._sizes) and self._sizes[i] <= nbytes + nbytes // 8 + step:
                size = self._sizes[i]
                held = self._idle[size]
                age, raw, interface = held.pop()
                del self._ages[age]
                if not held:
                    del self._idle[size]
                    del self._sizes[i]
                self._idle_bytes -= raw.nbytes
                self._reused += 1
            else:
                self._fresh += 1
        if raw is None:
            raw = np.empty(-(-nbytes // step) * step, np.uint8)
            interface = raw.__array_interface__
        return np.asarray(_Owner(raw, self, interface))

    def _give(self, raw, interface):
        with self._lock:
            if raw.nbytes > self.limit:
                return
            held = self._idle.get(raw.nbytes)
            if held is None:
                held = self._idle[raw.nbytes] = []
                bisect.insort(self._sizes, raw.nbytes)
            self._age += 1
            held.append((self._age, raw, interface))
            self._ages[self._age] = raw.nbytes
            self._idle_bytes += raw.nbytes
            self._trim()

    def _trim(self):
        while self._idle_bytes > self.limit:
            _, size = self._ages.popitem(last=False)      # the oldest, first of its size
            held = self._idle[size]
            self._idle_bytes -= held.pop(0)[1].nbytes
            if not held:
                del self._idle[size]
                self._sizes.remove(size)

    def release(self):
        """Free every idle buffer; returns the bytes freed."""
        with self._lock:
            n = self._idle_bytes
            self._idle.clear()
            self._sizes.clear()
            self._ages.clear()
            self._idle_bytes = 0
        return n

    def set_limit(self, nbytes):
        """Cap the idle bytes (0: keep none); returns the previous cap."""
        nbytes = _limit_arg(nbytes, "nbytes")
        with self._lock:
            previous, self.limit = self.limit, nbytes
            self._trim()
        return previous

    def info(self):
        with self._lock:
            return {"limit": self.limit, "idle_bytes": self._idle_bytes,
                    "idle_buffers": len(self._ages),
                    "reused": self._reused, "fresh": self._fresh}


def _limit_arg(value, name):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int (bytes), not {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 bytes, got {value}")
    return int(value)


def _env_limit():
    text = os.environ.get("NUMBA_FUSED_POOL_BYTES")
    if text is None:
        return POOL_LIMIT
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"NUMBA_FUSED_POOL_BYTES must be a number of bytes, "
                         f"got {text!r}") from None
    return _limit_arg(value, "NUMBA_FUSED_POOL_BYTES")


POOL = Pool(_env_limit())
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: POOL._after_fork())


def set_pool_limit(nbytes):
    """Cap the bytes of idle output buffers numba_fused keeps for reuse (outputs of
    1 MiB and more; default 1 GiB or an eighth of the machine's memory, whichever
    is less, or the environment's NUMBA_FUSED_POOL_BYTES); 0 keeps none. Frees
    idle buffers beyond the new cap now; returns the old cap."""
    return POOL.set_limit(nbytes)


def release_pool():
    """Free the idle output buffers numba_fused keeps for reuse; returns the bytes
    freed. Buffers of live outputs return to the pool when those die."""
    return POOL.release()


def pool_info():
    """The output pool's state: ``limit`` and ``idle_bytes``/``idle_buffers`` (held
    for reuse), and how many large outputs were ``reused`` or ``fresh``."""
    return POOL.info()


def fresh(shape, dtype):
    """An uninitialized C-contiguous array: from POOL, on a cache line, when it
    has POOL_MIN_BYTES or more, else ``np.empty``."""
    dtype = np.dtype(dtype)
    nbytes = (math.prod(shape) if isinstance(shape, tuple) else int(shape)) * dtype.itemsize
    if nbytes < POOL_MIN_BYTES:
        return np.empty(shape, dtype)
    buf = POOL.take(nbytes + ALIGN)
    o = -_pooled_address(buf) % ALIGN
    return buf[o:o + nbytes].view(dtype).reshape(shape)


def on_line(buf, shape, dtype):
    """An array of ``shape`` and ``dtype`` at the first ALIGN boundary of the byte
    buffer ``buf`` (ALIGN bytes larger than the array)."""
    nbytes = (math.prod(shape) if isinstance(shape, tuple) else int(shape)) * dtype.itemsize
    o = -buf.ctypes.data % ALIGN
    return buf[o:o + nbytes].view(dtype).reshape(shape)


def output(like, inputs):
    """A fresh C-contiguous array like the array ``like`` for an op over the NumPy
    ``inputs``: placed clear of their aliases (``place``), and from POOL when it
    has POOL_MIN_BYTES or more."""
    if like.nbytes < POOL_MIN_BYTES:
        return place(np.empty(like.shape, like.dtype), like, inputs)
    return pooled(like.nbytes, like, inputs).view(like.dtype).reshape(like.shape)


def pooled(nbytes, like, inputs):
    """nbytes (a uint8 array) of a POOL buffer for an output like ``like`` of an op
    over ``inputs`` (NumPy arrays or CPU tensors): on a cache line and clear of
    the inputs' aliases. A buffer with room for the padding (``clear_offset``)
    only where the first one's line aliases an input: the padding, six windows
    of 144 KiB for a 1 MiB output of 1024-column float32 rows and three inputs,
    would be most of a small output's buffer."""
    buf = POOL.take(nbytes + ALIGN)
    address = _pooled_address(buf)
    o = -address % ALIGN
    if not aliases(address + o, like, inputs):
        return buf[o:o + nbytes]
    buf = POOL.take(nbytes + padding(like, inputs))
    o = clear_offset(_pooled_address(buf), like, inputs)
    return buf[o:o + nbytes]


def _pooled_address(buf):
    """The address of a buffer from ``Pool.take``, from its owner's interface
    (``buf.ctypes.data`` makes a ctypes helper object: ~1.5 us)."""
    return buf.base.__array_interface__["data"][0]


def place(out, like, inputs):
    """``out`` (a fresh array like ``like``) where it needs no moving (``placed``),
    else a view at ``clear_offset`` into a buffer ``padding`` bytes larger: clear
    of the NumPy ``inputs`` (module docstring) and ALIGN-aligned."""
    if out.nbytes < PLACE_MIN_BYTES or placed(out.ctypes.data, out.nbytes, like, inputs):
        return out
    return _carve(np.empty(out.nbytes + padding(like, inputs), np.uint8), out, like, inputs)


def _carve(buf, proto, like, inputs):
    """An array of proto's shape and dtype at ``clear_offset`` into the byte
    buffer ``buf`` (``padding`` bytes larger than proto)."""
    o = clear_offset(buf.ctypes.data, like, inputs)
    return buf[o:o + proto.nbytes].view(proto.dtype).reshape(proto.shape)


def empty_like(like, *inputs):
    """An uninitialized C-contiguous array of like's shape and dtype, for ``out=``
    of an op over ``like`` and the other ``inputs``: ``np.empty`` placed where the
    kernels' stores into it do not alias their loads from the inputs on AMD Zen,
    64-byte aligned from 16 MiB (see ``numba_fused._alloc``). The outputs
    numba_fused allocates itself are placed so already. From 1 MiB it comes
    from the output pool (``set_pool_limit``)."""
    for name, a in [("like", like)] + [(f"inputs[{i}]", a) for i, a in enumerate(inputs)]:
        if not isinstance(a, np.ndarray):
            raise TypeError(f"empty_like: {name} must be a NumPy array (CPU out= buffers "
                            f"only), not {type(a).__name__}")
    return output(like, (like,) + inputs)

"""The public functions: argument checks, layout normalization, kernel choice.

Every check runs before any kernel, and every failure is a ``TypeError`` (wrong
kind of thing: not an array, unsupported dtype) or a ``ValueError`` (right kind,
wrong value: shape, eps, read-only or aliasing ``out``) whose message starts with
the argument's name.

Where the data lives picks the backend: NumPy arrays run the CPU kernels
(``cpu.py``); objects exposing ``__cuda_array_interface__`` run the CUDA kernels
(``gpu.py``). A *context* object hides the difference: it wraps arrays, allocates
outputs and produces the kernel views. Both backends implement the same six
functions with the same argument order (see ``cpu.py``).
"""
import math
import numbers

import numpy as np

from . import _alloc, _dtypes as D

_DTYPE_NAMES = "float32, float64, float16 or bfloat16"


# ------------------------------------------------------------------ contexts
class HostContext:
    """NumPy arrays on the CPU."""

    name = "cpu"

    @property
    def kernels(self):
        from . import cpu   # numba compiles lazily; import only on first use
        HostContext.kernels = cpu
        return cpu

    def wrap(self, obj, name, dtype=None):
        if not isinstance(obj, np.ndarray):
            raise TypeError(f"{name} must be a numpy.ndarray or a CUDA array, "
                            f"got {type(obj).__name__}")
        if dtype is not None and D.as_dtype(dtype) != obj.dtype:
            raise TypeError(f"dtype={D.as_dtype(dtype)} disagrees with {name}'s dtype "
                            f"{obj.dtype}; dtype= only tags raw CUDA bit arrays")
        return obj

    def empty(self, shape, dtype):
        return _alloc.fresh(shape, dtype)

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype)

    def full(self, shape, dtype, value):
        return np.full(shape, value, dtype)

    def storage(self, a):
        return D.to_storage(a)

    def contiguous(self, a):
        if a.flags.c_contiguous or a.ndim == 0 or a.nbytes < _alloc.POOL_MIN_BYTES:
            return np.ascontiguousarray(a)
        c = _alloc.fresh(a.shape, a.dtype)     # a large copy: from the pool
        c[...] = a
        return c

    def reshape_view(self, a, shape):
        """``a`` reshaped without a copy, or None where that needs one."""
        if a.flags.c_contiguous:
            return a.reshape(shape)    # fast path: np.reshape(copy=False) costs ~2 us
        try:
            return np.reshape(a, shape, copy=False)
        except ValueError:
            return None

    def overlaps(self, a, b):
        return np.may_share_memory(a, b) and np.shares_memory(a, b)

    def same_buffer(self, a, b):
        return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
                and a.shape == b.shape and a.strides == b.strides)

    def writeable(self, a):
        return a.flags.writeable

    def copy_into(self, dst, src):
        dst[...] = src

    def result(self, a):
        return a

    def check_stream(self, stream):
        if stream is not None:
            raise ValueError("stream must be None for NumPy (CPU) arrays")


HOST = HostContext()

#: gpu.REPLAY once gpu.py is loaded (the first CUDA array): calls on CUDA arrays
#: replay the launches recorded from an earlier call of the same description
_replay = None
_NO_EPS = object()      # the softmax functions' stand-in for eps


def _is_device_array(obj):
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    # Simulator device arrays have no __cuda_array_interface__ (see NOTES-numba.md).
    return type(obj).__name__ in ("FakeCUDAArray", "FakeCUDAArrayBase")


def _context(named, stream):
    """The context of a call's array arguments; host and device must not mix."""
    if all(type(a) is np.ndarray or a is None for _, a in named):
        if stream is not None:
            HOST.check_stream(stream)
        return HOST                      # the common case, without the scans below
    present = [(n, a) for n, a in named if a is not None]
    on_device = [n for n, a in present if _is_device_array(a)]
    if not on_device:
        ctx = HOST
    else:
        on_host = [n for n, a in present if not _is_device_array(a)]
        if on_host:
            raise TypeError(f"{on_host[0]} is a host array but {on_device[0]} is a CUDA "
                            "array; pass all arrays on one device")
        from . import gpu
        ctx = gpu.DEVICE
    ctx.check_stream(stream)
    return ctx


# -------------------------------------------------------------------- checks
def _check_input(ctx, obj, name, dtype=None):
    a = ctx.wrap(obj, name, dtype)
    if not D.is_supported(a.dtype):
        raise TypeError(f"{name} has dtype {a.dtype}; expected {_DTYPE_NAMES}")
    if a.ndim == 0:
        raise ValueError(f"{name} must have at least one dimension, got a 0-d array")
    return a


def _check_like(ctx, obj, name, x, xname, dtype):
    a = _check_input(ctx, obj, name, dtype)
    if a.dtype != x.dtype:
        raise TypeError(f"{name} has dtype {a.dtype}; expected {xname}'s dtype {x.dtype}")
    if a.shape != x.shape:
        raise ValueError(f"{name} has shape {a.shape}; expected {xname}'s shape {x.shape}")
    return a


def _check_param(ctx, obj, name, x):
    if obj is None:
        return None
    # CUDA: a 16-bit integer weight/bias beside half x is read as x's dtype (gpu.py)
    tag = ctx.param_tag(obj, x.dtype) if hasattr(ctx, "param_tag") else None
    a = ctx.wrap(obj, name, tag)
    if a.dtype not in (x.dtype, D.float32):
        also = "" if x.dtype == D.float32 else " or float32"
        raise TypeError(f"{name} has dtype {a.dtype}; expected x's dtype {x.dtype}{also}")
    if a.shape != x.shape[-1:]:
        raise ValueError(f"{name} has shape {a.shape}; expected ({x.shape[-1]},), "
                         "the length of x's last axis")
    return a


def _check_stats(ctx, obj, name, x):
    a = ctx.wrap(obj, name)
    want = D.acc_dtype(x.dtype)
    if a.dtype != want:
        raise TypeError(f"{name} has dtype {a.dtype}; expected {want} (the statistics "
                        f"dtype for {x.dtype} inputs)")
    if a.shape != x.shape[:-1]:
        raise ValueError(f"{name} has shape {a.shape}; expected {x.shape[:-1]} "
                         "(x's shape without its last axis)")
    return a


def _check_eps(eps):
    if _fast_eps(eps):
        return eps
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    eps = float(eps)
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    return eps


def _check_out(ctx, out, shape, dtype, inputs, may_be=None, tag=None):
    """Validate ``out``; ``may_be`` names the one input ``out`` may be (in-place)."""
    if out is None:
        return None
    a = ctx.wrap(out, "out", tag)
    if a.dtype != dtype:
        raise TypeError(f"out has dtype {a.dtype}; expected {dtype}")
    if a.shape != shape:
        raise ValueError(f"out has shape {a.shape}; expected {shape}")
    if not ctx.writeable(a):
        raise ValueError("out is read-only")
    for name, arr in inputs:
        if arr is None or not ctx.overlaps(a, arr):
            continue
        if name == may_be and ctx.same_buffer(a, arr):
            continue
        if name == may_be:
            raise ValueError(f"out overlaps {name} without being {name} itself; pass "
                             f"out={name} for an in-place result, or a separate buffer")
        raise ValueError(f"out shares memory with {name}; only "
                         + (f"{may_be} may be overwritten" if may_be else
                            "a separate buffer is allowed"))
    return a


# ----------------------------------------------------------- kernel layouts
def _rows_views(ctx, inputs, output):
    """3-D (outer, inner, cols) storage views, unit last stride, of same-shaped
    inputs and the output buffer; None inputs stay None.

    One (outer, inner) split of the leading axes serves all arrays, so a flat row
    index means the same row in each: x.transpose(1, 0, 2) needs no copy. An array
    that fits no common split (last axis not unit-stride, leading axes that do not
    collapse to two) is copied to C order, which fits every split; an ``out`` that
    does not fit is swapped for a fresh buffer copied back at the end.

    An output that is one of the inputs (``out=dy``) gets that input's view
    object: the backend contract for an in-place kernel is ``dx is dy``.
    """
    raw = _views(ctx, list(inputs), output)
    views = [None if v is None else ctx.storage(v) for v in raw]
    if output.out is not None:      # compared as views: an input may have been copied
        for k, v in enumerate(raw[:-1]):
            if v is not None and ctx.same_buffer(v, raw[-1]):
                views[-1] = views[k]
    return views


def _views(ctx, inputs, output):
    """The 3-D views (not yet storage views) of inputs + [output.array]."""
    shape = output.array.shape
    if ctx is HOST and all(a is None or a.flags.c_contiguous for a in inputs) \
            and output.array.flags.c_contiguous:
        new = (1, math.prod(shape[:-1]), shape[-1])      # the common case
        return [None if a is None else a.reshape(new) for a in inputs + [output.array]]
    views = _split_views(ctx, inputs + [output.array], shape)
    if views is None:
        inputs = [a if a is None or _split_views(ctx, [a], shape) else ctx.contiguous(a)
                  for a in inputs]
        views = _split_views(ctx, inputs + [output.array], shape)
    if views is None:
        output.detach()
        views = _split_views(ctx, inputs + [output.array], shape)
    if views is None:   # each input fits a split of its own, but not a common one
        inputs = [None if a is None else ctx.contiguous(a) for a in inputs]
        views = _split_views(ctx, inputs + [output.array], shape)
    return views


def _split_views(ctx, arrays, shape):
    lead, cols = shape[:-1], shape[-1]
    for s in range(len(lead) + 1):
        new = (math.prod(lead[:s]), math.prod(lead[s:]), cols)
        views = []
        for a in arrays:
            v = None if a is None else _unit_last_view(ctx, a, new, cols)
            if a is not None and v is None:
                break
            views.append(v)
        else:
            return views
    return None


def _unit_last_view(ctx, a, new, cols):
    if cols > 1 and a.strides[-1] != a.itemsize:
        return None
    return ctx.reshape_view(a, new)


class _Output:
    """A result buffer: the caller's ``out`` when the kernels can write it in
    place, else a fresh C-order buffer copied into ``out`` at the end."""

    def __init__(self, ctx, out, shape, dtype):
        self.ctx, self.out = ctx, out
        self.array = out if out is not None else ctx.empty(shape, dtype)

    def detach(self):
        if self.array is self.out:
            self.array = self.ctx.empty(self.out.shape, self.out.dtype)

    def finish(self):
        if self.out is not None and self.array is not self.out:
            self.ctx.copy_into(self.out, self.array)
            return self.ctx.result(self.out)
        return self.ctx.result(self.array)


def _param_grad(ctx, p, x):
    """dweight/dbias buffer: the kernels write every element when x is not empty
    (fresh zeros would fault every page in again); a sum over no rows is 0."""
    if p is None:
        return None
    return ctx.empty(p.shape, p.dtype) if x.size else ctx.zeros(p.shape, p.dtype)


def _param_storage(ctx, p):
    return None if p is None else ctx.storage(ctx.contiguous(p))


def _stats_storage(ctx, s):
    return ctx.reshape_view(ctx.contiguous(s), (-1,))


# ------------------------------------------------------------ host fast path
# A call whose arrays are all C-contiguous NumPy arrays of exactly the expected
# dtypes and shapes, with no dtype=/stream= and an out= that is None or laid out
# as x (``_host_out``), needs none of the general path's normalization: it is
# recognized here in well under a microsecond (the general path cost ~8 us, most
# of a (1, 1024) call). Everything else, valid or
# not, takes the general path, which alone reports errors; the fast path only
# accepts what the general path would accept, and computes the same thing.
_HOST_STORAGE = D._STORAGE     # the shared tables: bfloat16 joins them on first sight
_HOST_ACC = D._ACC
_NDARRAY = np.ndarray


def _host_ok(x, like=(), params=(), stats=()):
    """True when x, the arrays ``like`` x (same dtype and shape), ``params``
    (weight/bias or None) and ``stats`` (mean/rstd) fit the fast path.

    Every attribute read costs ~50 ns on the project's VMs, so each is read once.
    Dtypes are compared by ``is`` first: NumPy's builtin dtypes are canonical
    objects, but some arrays (e.g. returned by cached numba code) carry equal,
    distinct ones, which ``==`` then accepts."""
    if type(x) is not _NDARRAY:
        return False
    dt, shape = x.dtype, x.shape
    if dt not in _HOST_STORAGE or not shape or 0 in shape or not x.flags.c_contiguous:
        return False
    if like:
        strides = x.strides
        for a in like:    # x's dtype, shape and strides: x's C-contiguous layout
            if (type(a) is not _NDARRAY or a.shape != shape or a.strides != strides
                    or (a.dtype is not dt and a.dtype != dt)):
                return False
    if params:
        cols = shape[-1:]
        for p in params:
            if p is not None and (type(p) is not _NDARRAY or p.shape != cols
                                  or (p.dtype is not dt and p.dtype != dt
                                      and p.dtype != D.float32)
                                  or not p.flags.c_contiguous):
                return False
    if stats:
        acc, lead = _HOST_ACC[dt], shape[:-1]
        for st in stats:
            if (type(st) is not _NDARRAY or st.shape != lead
                    or (st.dtype is not acc and st.dtype != acc) or not st.flags.c_contiguous):
                return False
    return True


def _host_rows(a):
    """The (1, rows, cols) storage view of a C-contiguous array."""
    v = a[None] if a.ndim == 2 else a.reshape(1, -1, a.shape[-1])
    st = _HOST_STORAGE[a.dtype]
    return v if st is a.dtype else v.view(st)


def _host_storage(a):
    return None if a is None else D.to_storage(a)


def _host_stats(a):
    return a if a.ndim == 1 else a.reshape(-1)


def _host_empty(p):
    """A fresh array like the NumPy array ``p`` (None for anything else, which the
    fast paths then reject): ``empty_like`` costs half of ``np.empty(p.shape,
    p.dtype)`` (measured 0.31 vs 0.57 us)."""
    return np.empty_like(p) if type(p) is _NDARRAY else None


_may_share = np.may_share_memory


def _host_out(out, x, inputs, in_place=None):
    """True when ``out`` fits the fast paths (None always does): a writeable NumPy
    array with x's dtype, shape and strides (x C-contiguous: checked by the fast
    path itself) whose memory bounds miss every input but ``in_place`` (dy, which
    out may be). Anything else, valid or not, takes the general path, which makes
    the exact overlap test and reports errors. ~0.2 us per input (a bounds test);
    the general path cost a (1, 1024) call ~6 us (7.7 vs 1.3 us, 2026-12-04)."""
    if out is None:
        return True
    if type(out) is not _NDARRAY or type(x) is not _NDARRAY:
        return False
    dt = x.dtype
    if (out.shape != x.shape or out.strides != x.strides
            or (out.dtype is not dt and out.dtype != dt) or not out.flags.writeable):
        return False
    for a in inputs:
        if a is not None and not (a is out and a is in_place) and _may_share(out, a):
            return False
    return True


def _fresh_or(out, x):
    """``out``, or a fresh array like x."""
    return np.empty_like(x) if out is None else out


def _placed_or(out, like, *inputs):
    """``out``, or a fresh array like ``like`` placed where the kernel's stores into
    it do not alias its loads from ``inputs``, pooled when large (``_alloc``)."""
    return _alloc.output(like, inputs) if out is None else out


def _host_in_place(dx, dy, dyv):
    """dx's rows view: dy's own view object ``dyv`` when dx is dy, the backend's
    in-place contract (its store loop then goes through one pointer)."""
    return dyv if dx is dy else _host_rows(dx)


def _small_target(dx, dy):
    """dx for a small entry: None in place (dx is dy), as the backend passes it."""
    return None if dx is dy else dx


class _SmallCall:
    """The compiled small-call entry of one op (``cpu.SMALL``), for 2-D arrays of a
    supported dtype below the kernel's serial threshold (``takes``); the caller
    allocates the outputs and ``run`` passes them with the inputs (float16/bfloat16
    arrays as their integer bits, the storage the kernels take). The entry runs
    with compilation disabled: numba's dispatcher then accepts only signatures
    compiled here, each for the argument types of a call that ``eligible`` (the
    fast path's own checks, ``_host_ok``) accepted, so a call of any other types
    fails in C (TypeError) instead of compiling, and a call of the right types
    but wrong shapes fails in the entry (ValueError). Either way ``run`` returns
    False and the caller takes its other paths, which report errors. numba does
    convert scalars to a compiled signature's types (a bool eps would run as
    1.0), so callers check eps's type first; arrays are never converted.
    Measured 2026-12-03, (1, 1024) float32: layer_norm bwd 2.97 vs 6.87 us;
    2026-12-07, (1, 1024) bfloat16, which took the host path before: layer_norm fwd
    5.1 -> 4.0 us, bwd 10.9 -> 5.9 us (float16 11.3 -> 5.8 us)."""

    def __init__(self, name, eligible):
        self.name, self.eligible = name, eligible
        self.kernel, self.below = None, math.inf      # bound on first use

    def takes(self, x):
        return (type(x) is _NDARRAY and x.ndim == 2 and x.dtype in _HOST_STORAGE
                and x.size < self.below)

    def run(self, x, args):
        if self.kernel is not None:
            try:
                self.kernel(*(tuple(map(_bits, args)) if x.dtype.itemsize == 2 else args))
                return True
            except (TypeError, ValueError, RuntimeError):
                pass         # RuntimeError: a call racing _compile's window
        return self._compile(x, args)

    def _compile(self, x, args):
        if not self.eligible(*args):
            return False
        bits = tuple(map(_bits, args)) if x.dtype.itemsize == 2 else args
        from numba import typeof
        from numba.core.compiler_lock import global_compiler_lock
        from . import cpu
        # held across the toggle: a call that sees compilation enabled meanwhile
        # waits on this lock in numba's compile() and then fails (RuntimeError)
        with global_compiler_lock:
            self.below = cpu.SMALL_BELOW[self.name]
            if not self.takes(x):
                return False
            kernel = cpu.SMALL[self.name]
            kernel.disable_compile(False)
            try:
                kernel.compile(tuple(typeof(a) for a in bits))
            finally:
                kernel.disable_compile(True)
            self.kernel = kernel      # published only with compilation disabled
        self.kernel(*bits)
        return True


def _bits(a):
    """A float16/bfloat16 array as its integer bits (``D.to_storage``); anything
    else (float32/float64 arrays, None, eps) as it is. A caller's own 16-bit
    integer array raises TypeError (the caller takes its other paths, which report
    it): as it is, it would pass for half bits."""
    if type(a) is not _NDARRAY:
        return a
    st = _HOST_STORAGE.get(a.dtype)
    if st is None:
        if a.dtype.itemsize == 2:
            raise TypeError("not a float16/bfloat16 array")
        return a
    return a if st is a.dtype else a.view(st)


# eligible(inputs..., outputs...): the fast path's checks of the inputs
_small_softmax_fwd = _SmallCall("softmax_fwd", lambda x, y: _host_ok(x))
_small_softmax_bwd = _SmallCall("softmax_bwd", lambda y, dy, dx: _host_ok(y, (dy,)))
_small_rms_norm_fwd = _SmallCall(
    "rms_norm_fwd", lambda x, w, eps, *out: _host_ok(x, (), (w,)) and _fast_eps(eps))
_small_rms_norm_bwd = _SmallCall(
    "rms_norm_bwd", lambda dy, x, w, rstd, *out: _host_ok(x, (dy,), (w,), (rstd,)))
_small_layer_norm_fwd = _SmallCall(
    "layer_norm_fwd",
    lambda x, w, b, eps, *out: _host_ok(x, (), (w, b)) and _fast_eps(eps))
_small_layer_norm_bwd = _SmallCall(
    "layer_norm_bwd",
    lambda dy, x, w, b, mean, rstd, *out: _host_ok(x, (dy,), (w, b), (mean, rstd)))


def _fast_eps(eps):
    """An eps ``_check_eps`` accepts as it is (the common case, without its checks)."""
    return type(eps) is float and 0.0 <= eps < math.inf


# -------------------------------------------------------------------- softmax
def softmax_fwd(x, *, out=None, dtype=None, stream=None):
    """Softmax over the last axis: y = exp(x - max) / sum(exp(x - max)).

    A row containing NaN, or +inf, or only -inf gives NaN; -inf entries of a
    finite row give exactly 0.
    """
    if dtype is None and stream is None and _host_out(out, x, (x,)):
        if _small_softmax_fwd.takes(x):
            y = _fresh_or(out, x)
            if _small_softmax_fwd.run(x, (x, y)):
                return y
        if _host_ok(x):
            y = _placed_or(out, x, x)
            HOST.kernels.softmax_fwd(_host_rows(x), _host_rows(y))
            return y
    if _replay is not None and type(x) is not _NDARRAY:
        r = _replay.call(softmax_fwd, (x,), _NO_EPS, -1, out, dtype, stream)
        if r is not None:
            return r[0]
    ctx = _context([("x", x), ("out", out)], stream)
    x = _check_input(ctx, x, "x", dtype)
    out = _check_out(ctx, out, x.shape, x.dtype, [("x", x)], tag=dtype)
    y = _Output(ctx, out, x.shape, x.dtype)
    if x.size:
        xv, yv = _rows_views(ctx, [x], y)
        ctx.kernels.softmax_fwd(xv, yv, **_stream_kw(ctx, stream))
    return y.finish()


def softmax_bwd(y, dy, *, out=None, dtype=None, stream=None):
    """Softmax backward from the forward's output: dx = y * (dy - sum(dy * y)).

    ``out=dy`` overwrites dy with dx (bit-identical to a separate buffer).
    """
    if dtype is None and stream is None and _host_out(out, y, (y, dy), dy):
        if _small_softmax_bwd.takes(y):
            dx = _fresh_or(out, y)
            if _small_softmax_bwd.run(y, (y, dy, _small_target(dx, dy))):
                return dx
        if _host_ok(y, (dy,)):
            dx = _placed_or(out, y, y, dy)
            dyv = _host_rows(dy)
            HOST.kernels.softmax_bwd(_host_rows(y), dyv, _host_in_place(dx, dy, dyv))
            return dx
    if _replay is not None and type(y) is not _NDARRAY:
        r = _replay.call(softmax_bwd, (y, dy), _NO_EPS, 1, out, dtype, stream)
        if r is not None:
            return r[0]
    ctx = _context([("y", y), ("dy", dy), ("out", out)], stream)
    y = _check_input(ctx, y, "y", dtype)
    dy = _check_like(ctx, dy, "dy", y, "y", dtype)
    out = _check_out(ctx, out, y.shape, y.dtype, [("y", y), ("dy", dy)], may_be="dy", tag=dtype)
    dx = _Output(ctx, out, y.shape, y.dtype)
    if y.size:
        yv, dyv, dxv = _rows_views(ctx, [y, dy], dx)
        ctx.kernels.softmax_bwd(yv, dyv, dxv, **_stream_kw(ctx, stream))
    return dx.finish()


def softmax(x, *, out=None, dtype=None, stream=None):
    """Softmax over the last axis (the forward's y)."""
    return softmax_fwd(x, out=out, dtype=dtype, stream=stream)


# -------------------------------------------------------------------- RMSNorm
def rms_norm_fwd(x, weight=None, eps=1e-6, *, out=None, dtype=None, stream=None):
    """RMSNorm over the last axis. Returns (y, rstd):
    rstd = 1 / sqrt(mean(x**2) + eps); y = x * rstd * weight.
    """
    if dtype is None and stream is None and _host_out(out, x, (x, weight)):
        if _small_rms_norm_fwd.takes(x) and type(eps) is float:    # numba would take a bool
            y, rstd = _fresh_or(out, x), np.empty(len(x), _HOST_ACC[x.dtype])
            if _small_rms_norm_fwd.run(x, (x, weight, eps, y, rstd)):
                return y, rstd
        if _host_ok(x, (), (weight,)) and _fast_eps(eps):
            y = _placed_or(out, x, x)
            rstd = np.empty(x.shape[:-1], _HOST_ACC[x.dtype])
            HOST.kernels.rms_norm_fwd(_host_rows(x), _host_storage(weight), eps,
                                      _host_rows(y), _host_stats(rstd))
            return y, rstd
    if _replay is not None and type(x) is not _NDARRAY:
        r = _replay.call(rms_norm_fwd, (x, weight), eps, -1, out, dtype, stream)
        if r is not None:
            return r[0]
    ctx = _context([("x", x), ("weight", weight), ("out", out)], stream)
    x = _check_input(ctx, x, "x", dtype)
    weight = _check_param(ctx, weight, "weight", x)
    eps = _check_eps(eps)
    out = _check_out(ctx, out, x.shape, x.dtype, [("x", x), ("weight", weight)], tag=dtype)
    y = _Output(ctx, out, x.shape, x.dtype)
    rstd = ctx.empty(x.shape[:-1], D.acc_dtype(x.dtype))
    if x.size:
        xv, yv = _rows_views(ctx, [x], y)
        ctx.kernels.rms_norm_fwd(xv, _param_storage(ctx, weight), eps, yv,
                                 _stats_storage(ctx, rstd), **_stream_kw(ctx, stream))
    elif rstd.size:
        rstd = ctx.full(rstd.shape, rstd.dtype, np.nan)   # mean of an empty row
    return y.finish(), ctx.result(rstd)


def rms_norm_bwd(dy, x, weight, rstd, *, out=None, dtype=None, stream=None):
    """RMSNorm backward from the saved rstd. Returns (dx, dweight); with
    xhat = x * rstd and g = dy * weight:
    dx = rstd * (g - xhat * mean(g * xhat)); dweight = sum over rows of dy * xhat.
    dweight is None exactly when weight is None. ``out=dy`` is allowed.
    """
    if dtype is None and stream is None and _host_out(out, x, (dy, x, weight, rstd), dy):
        if _small_rms_norm_bwd.takes(x):
            dx, dweight = _fresh_or(out, x), _host_empty(weight)
            if _small_rms_norm_bwd.run(x, (dy, x, weight, rstd, _small_target(dx, dy),
                                           dweight)):
                return dx, dweight
        if _host_ok(x, (dy,), (weight,), (rstd,)):
            dx = _placed_or(out, x, dy, x)
            dweight = _host_empty(weight)
            dyv = _host_rows(dy)
            HOST.kernels.rms_norm_bwd(dyv, _host_rows(x), _host_storage(weight),
                                      _host_stats(rstd), _host_in_place(dx, dy, dyv),
                                      _host_storage(dweight))
            return dx, dweight
    if _replay is not None and type(x) is not _NDARRAY:
        r = _replay.call(rms_norm_bwd, (dy, x, weight, rstd), _NO_EPS, 0, out, dtype,
                         stream)
        if r is not None:
            return r[0]
    ctx = _context([("dy", dy), ("x", x), ("weight", weight), ("rstd", rstd),
                    ("out", out)], stream)
    x = _check_input(ctx, x, "x", dtype)
    dy = _check_like(ctx, dy, "dy", x, "x", dtype)
    weight = _check_param(ctx, weight, "weight", x)
    rstd = _check_stats(ctx, rstd, "rstd", x)
    out = _check_out(ctx, out, x.shape, x.dtype,
                     [("dy", dy), ("x", x), ("weight", weight), ("rstd", rstd)],
                     may_be="dy", tag=dtype)
    dx = _Output(ctx, out, x.shape, x.dtype)
    dweight = _param_grad(ctx, weight, x)
    if x.size:
        dyv, xv, dxv = _rows_views(ctx, [dy, x], dx)
        ctx.kernels.rms_norm_bwd(dyv, xv, _param_storage(ctx, weight),
                                 _stats_storage(ctx, rstd), dxv,
                                 None if dweight is None else ctx.storage(dweight),
                                 **_stream_kw(ctx, stream))
    return dx.finish(), None if dweight is None else ctx.result(dweight)


def rms_norm(x, weight=None, eps=1e-6, *, out=None, dtype=None, stream=None):
    """RMSNorm over the last axis (the forward's y only)."""
    return rms_norm_fwd(x, weight, eps, out=out, dtype=dtype, stream=stream)[0]


# ------------------------------------------------------------------ LayerNorm
def layer_norm_fwd(x, weight=None, bias=None, eps=1e-5, *, out=None, dtype=None,
                   stream=None):
    """LayerNorm over the last axis. Returns (y, mean, rstd):
    rstd = 1 / sqrt(var + eps) with the biased variance, computed stably;
    y = (x - mean) * rstd * weight + bias.
    """
    if dtype is None and stream is None and _host_out(out, x, (x, weight, bias)):
        if _small_layer_norm_fwd.takes(x) and type(eps) is float:    # numba would take a bool
            acc = _HOST_ACC[x.dtype]
            y, mean, rstd = _fresh_or(out, x), np.empty(len(x), acc), np.empty(len(x), acc)
            if _small_layer_norm_fwd.run(x, (x, weight, bias, eps, y, mean, rstd)):
                return y, mean, rstd
        if _host_ok(x, (), (weight, bias)) and _fast_eps(eps):
            y = _placed_or(out, x, x)
            mean = np.empty(x.shape[:-1], _HOST_ACC[x.dtype])
            rstd = np.empty(x.shape[:-1], mean.dtype)
            HOST.kernels.layer_norm_fwd(_host_rows(x), _host_storage(weight),
                                        _host_storage(bias), eps, _host_rows(y),
                                        _host_stats(mean), _host_stats(rstd))
            return y, mean, rstd
    if _replay is not None and type(x) is not _NDARRAY:
        r = _replay.call(layer_norm_fwd, (x, weight, bias), eps, -1, out, dtype, stream)
        if r is not None:
            return r[0]
    ctx = _context([("x", x), ("weight", weight), ("bias", bias), ("out", out)], stream)
    x = _check_input(ctx, x, "x", dtype)
    weight = _check_param(ctx, weight, "weight", x)
    bias = _check_param(ctx, bias, "bias", x)
    eps = _check_eps(eps)
    out = _check_out(ctx, out, x.shape, x.dtype,
                     [("x", x), ("weight", weight), ("bias", bias)], tag=dtype)
    y = _Output(ctx, out, x.shape, x.dtype)
    mean = ctx.empty(x.shape[:-1], D.acc_dtype(x.dtype))
    rstd = ctx.empty(x.shape[:-1], D.acc_dtype(x.dtype))
    if x.size:
        xv, yv = _rows_views(ctx, [x], y)
        ctx.kernels.layer_norm_fwd(xv, _param_storage(ctx, weight),
                                   _param_storage(ctx, bias), eps, yv,
                                   _stats_storage(ctx, mean), _stats_storage(ctx, rstd),
                                   **_stream_kw(ctx, stream))
    elif rstd.size:
        mean = ctx.full(mean.shape, mean.dtype, np.nan)
        rstd = ctx.full(rstd.shape, rstd.dtype, np.nan)
    return y.finish(), ctx.result(mean), ctx.result(rstd)


def layer_norm_bwd(dy, x, weight, bias, mean, rstd, *, out=None, dtype=None,
                   stream=None):
    """LayerNorm backward from the saved mean and rstd. Returns (dx, dweight, dbias);
    with xhat = (x - mean) * rstd and g = dy * weight:
    dx = rstd * (g - xhat * mean(g * xhat) - mean(g));
    dweight = sum over rows of dy * xhat; dbias = sum over rows of dy.
    dweight/dbias are None exactly when weight/bias are None. ``out=dy`` is allowed.
    """
    if (dtype is None and stream is None
            and _host_out(out, x, (dy, x, weight, bias, mean, rstd), dy)):
        if _small_layer_norm_bwd.takes(x):
            dx, dweight, dbias = _fresh_or(out, x), _host_empty(weight), _host_empty(bias)
            if _small_layer_norm_bwd.run(x, (dy, x, weight, bias, mean, rstd,
                                             _small_target(dx, dy), dweight, dbias)):
                return dx, dweight, dbias
        if _host_ok(x, (dy,), (weight, bias), (mean, rstd)):
            dx = _placed_or(out, x, dy, x)
            dweight, dbias = _host_empty(weight), _host_empty(bias)
            dyv = _host_rows(dy)
            HOST.kernels.layer_norm_bwd(dyv, _host_rows(x),
                                        _host_storage(weight), _host_stats(mean),
                                        _host_stats(rstd), _host_in_place(dx, dy, dyv),
                                        _host_storage(dweight), _host_storage(dbias))
            return dx, dweight, dbias
    if _replay is not None and type(x) is not _NDARRAY:
        r = _replay.call(layer_norm_bwd, (dy, x, weight, bias, mean, rstd), _NO_EPS, 0,
                         out, dtype, stream)
        if r is not None:
            return r[0]
    ctx = _context([("dy", dy), ("x", x), ("weight", weight), ("bias", bias),
                    ("mean", mean), ("rstd", rstd), ("out", out)], stream)
    x = _check_input(ctx, x, "x", dtype)
    dy = _check_like(ctx, dy, "dy", x, "x", dtype)
    weight = _check_param(ctx, weight, "weight", x)
    bias = _check_param(ctx, bias, "bias", x)
    mean = _check_stats(ctx, mean, "mean", x)
    rstd = _check_stats(ctx, rstd, "rstd", x)
    out = _check_out(ctx, out, x.shape, x.dtype,
                     [("dy", dy), ("x", x), ("weight", weight), ("bias", bias),
                      ("mean", mean), ("rstd", rstd)], may_be="dy", tag=dtype)
    dx = _Output(ctx, out, x.shape, x.dtype)
    dweight = _param_grad(ctx, weight, x)
    dbias = _param_grad(ctx, bias, x)
    if x.size:
        dyv, xv, dxv = _rows_views(ctx, [dy, x], dx)
        ctx.kernels.layer_norm_bwd(dyv, xv, _param_storage(ctx, weight),
                                   _stats_storage(ctx, mean), _stats_storage(ctx, rstd),
                                   dxv,
                                   None if dweight is None else ctx.storage(dweight),
                                   None if dbias is None else ctx.storage(dbias),
                                   **_stream_kw(ctx, stream))
    return (dx.finish(), None if dweight is None else ctx.result(dweight),
            None if dbias is None else ctx.result(dbias))


def layer_norm(x, weight=None, bias=None, eps=1e-5, *, out=None, dtype=None,
               stream=None):
    """LayerNorm over the last axis (the forward's y only)."""
    return layer_norm_fwd(x, weight, bias, eps, out=out, dtype=dtype, stream=stream)[0]


def _stream_kw(ctx, stream):
    return {} if ctx is HOST else {"stream": stream}

"""PyTorch integration: differentiable ``softmax``, ``rms_norm`` and ``layer_norm``,
and drop-in ``RMSNorm`` / ``LayerNorm`` modules, running numba_fused's kernels.

    import numba_fused.torch as nft
    y = nft.softmax(scores, dim=-1)
    norm = nft.RMSNorm(512)              # a torch.nn.RMSNorm (subclass)

The kernels are ``torch.library`` custom ops (namespace ``numba_fused``) with fake
(meta) implementations and registered autograd, so ``torch.compile(fullgraph=True)``
traces through them and AOTAutograd sees the backward ops too:

    numba_fused::softmax_fwd(x) -> y
    numba_fused::softmax_bwd(y, dy) -> dx
    numba_fused::rms_norm_fwd(x, weight?, eps) -> (y, rstd)
    numba_fused::rms_norm_bwd(dy, x, weight?, rstd, need_dweight) -> (dx, dweight)
    numba_fused::layer_norm_fwd(x, weight?, bias?, eps) -> (y, mean, rstd)
    numba_fused::layer_norm_bwd(dy, x, weight?, mean, rstd, need_dweight, need_dbias)
        -> (dx, dweight, dbias)

Plain eager calls skip the dispatcher: the same implementations run through a
``torch.autograd.Function`` with the same save/backward logic (``EAGER_FAST_PATH``;
about 60 us less per forward+backward). Under torch.compile/export, make_fx,
FakeTensor/meta, jit tracing, functorch transforms or tensor subclasses the custom
ops are called, so tracers always see ``numba_fused::*``.

Data movement. CPU tensors reach the kernels as zero-copy NumPy views (bfloat16
through an int16 view re-viewed as ``ml_dtypes.bfloat16``); strided tensors keep
their strides (the library copies only where the last axis is not unit-stride).
CUDA tensors go through ``__cuda_array_interface__`` on torch's current stream
with x's device current (bfloat16 as an int16 view plus ``dtype="bfloat16"``;
non-contiguous tensors are made contiguous by torch on the device first, since the
GPU backend copies such layouts through the host; bfloat16 weight/bias travel as
float32, which the kernels accept, and dweight is cast back). Outputs y/dx are
always contiguous: on the CPU NumPy arrays made as the library makes its own
(from 1 MiB out of its output pool) and viewed by a tensor, on CUDA from torch's
caching allocator; mean/rstd/dweight/dbias are allocated by the library (numba's
allocator on CUDA) and wrapped zero-copy. The CUDA branch follows the GPU
backend's documented contract but has not been run on a GPU.

Numerics follow numba_fused: float32 accumulation (float64 for float64 inputs),
one rounding at the store; statistics in float32 (float64 for float64 inputs).
The output dtype is x's dtype (torch would type-promote x with a float32 weight).

What autograd saves: softmax saves y only; rms_norm saves x, weight and rstd;
layer_norm saves x, weight, mean and rstd (never bias: dbias needs only dy). When
bias needs no gradient, no dbias is computed; when weight needs no gradient dweight
is dropped, but the library's fused backward computes it in the same pass as dx
(dx needs weight), so that saves no kernel work. Measured on the CPU (2 cores,
RMSNorm backward): the dweight reduction is 25-50% of the backward's time
(512x256 f32: 40 vs 27 us; 2048x512 f32: 215 vs 140 us), and the alternative of
passing dy*weight with weight=None costs as much or more (an extra pass over dy;
216 us, bf16 354 vs 238 us) and rounds dy*weight to x's dtype, so it is not used.

Not supported: double backward (the backward ops have no autograd), autocast
(the ops run in the dtype they are given).
"""
import numbers
from typing import Optional

import numpy as np
import ml_dtypes
import torch   # absolute import: the real PyTorch, not this module

from . import _alloc, _dispatch as _F

__all__ = ["softmax", "rms_norm", "layer_norm", "RMSNorm", "LayerNorm"]

Tensor = torch.Tensor
_BF16_NP = np.dtype(ml_dtypes.bfloat16)
_SUPPORTED = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


# ------------------------------------------------------------ data movement
def _check_dtype(t, name):
    if t.dtype not in _SUPPORTED:
        raise TypeError(f"{name} has dtype {t.dtype}; expected torch.float32, "
                        "torch.float64, torch.float16 or torch.bfloat16")


def _np(t):
    """A CPU tensor as a NumPy array sharing its memory and strides (detached only
    where it needs a gradient: ``detach`` costs ~0.4 us)."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype is torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BF16_NP)
    return t.numpy()


def _from_np(a):
    """A NumPy array (from the library) as a tensor sharing its memory."""
    if a.dtype == _BF16_NP:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _acc_dtype(dtype):
    return torch.float64 if dtype is torch.float64 else torch.float32


def _as_dtype(t, dtype):
    """t in ``dtype``: ``t.to`` costs ~0.9 us even where t has it already."""
    return t if t.dtype is dtype else t.to(dtype)


class _Cuda:
    """Hands CUDA tensors to the GPU backend on torch's current stream, with x's
    device current (numba uses the context torch made current on the thread)."""

    def __init__(self, x):
        self.device = x.device
        self._guard = torch.cuda.device(x.device)
        # an int CUstream handle: the GPU backend wraps it with cuda.external_stream
        self.kw = {"stream": int(torch.cuda.current_stream(x.device).cuda_stream)}
        if x.dtype == torch.bfloat16:
            self.kw["dtype"] = "bfloat16"

    def __enter__(self):
        self._guard.__enter__()
        return self

    def __exit__(self, *exc):
        return self._guard.__exit__(*exc)

    @staticmethod
    def arr(t):
        """x-like tensor (x, y, dy, out) for the kernels: bf16 as int16 bits."""
        if t is None:
            return None
        # The GPU backend copies layouts it cannot view through the host; a
        # torch copy on the device (and on torch's stream) is far cheaper.
        t = t.detach().contiguous()
        return t.view(torch.int16) if t.dtype == torch.bfloat16 else t

    @staticmethod
    def param(t):
        """weight/bias: bf16 goes as float32 (the contract allows x's dtype or f32)."""
        if t is None:
            return None
        t = t.detach()
        return t.float() if t.dtype == torch.bfloat16 else t.contiguous()

    def back(self, a, dtype=None):
        """A library device array as a tensor (zero-copy), optionally cast."""
        if a is None:
            return None
        t = torch.as_tensor(a, device=self.device)
        return t if dtype is None or t.dtype == dtype else t.to(dtype)


def _cpu_out(like, *inputs):
    """(y, y's NumPy array): a contiguous CPU output like the NumPy view ``like``,
    made as the library makes its own (``_alloc.output``: from 1 MiB out of the
    output pool, on a cache line and clear of the input tensors' 2**28-byte
    aliases) and viewed by one tensor (torch's ``empty_like`` and a ``_np`` of it
    cost ~1.5 us more)."""
    a = _alloc.output(like, inputs)
    return _from_np(a), a


def _cuda_out(x):
    """A contiguous CUDA output like x (the fake impls promise contiguous outputs),
    from torch's caching allocator."""
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _none_to_empty(t, like):
    return like.new_empty((0,)) if t is None else t


# ------------------------------------------------- custom ops and the eager path
#: Plain eager calls skip the torch.library dispatch and its Python autograd
#: wrapper (about 50-80 us per forward+backward) and run the same implementations
#: through a torch.autograd.Function with the same setup_context/backward. Anything
#: else -- torch.compile/export, make_fx, FakeTensor/meta, jit tracing, vmap/grad,
#: tensor subclasses -- goes through the custom ops. Set False to always use them.
EAGER_FAST_PATH = True

_IMPLS = {}


def _custom_op(name, impl):
    op = torch.library.custom_op(f"numba_fused::{name}", impl, mutates_args=())
    _IMPLS[op] = impl
    return op


#: tensor types the eager path takes as they are. nn.Parameter is a Tensor subclass
#: without dispatch or torch_function overrides; a module's weight always is one,
#: and judged a subclass it sent every module call through the custom ops (RMSNorm
#: 512x256 float32 module forward: 51-55 us against 35 us on the eager path, 2026-12-06).
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _plain(args):
    """True where the arguments may bypass the dispatcher: eager mode, no tracing,
    no dispatch mode or functorch transform, plain CPU/CUDA tensors."""
    if not EAGER_FAST_PATH or torch.compiler.is_compiling() or torch._C._is_tracing() \
            or torch._C._len_torch_dispatch_stack() \
            or torch._C._are_functorch_transforms_active():
        return False
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) not in _PLAIN_TENSORS
                                            or not (a.is_cpu or a.is_cuda)):
            return False
    return True


def _call(op, *args):
    """A backward op: the implementation directly where plain, else the op."""
    return _IMPLS[op](*args) if _plain(args) else op(*args)


def _forward(op, fn, *args):
    """y of a forward op: through ``fn`` (its eager autograd.Function) where plain
    and some input needs a gradient, the implementation where plain and none does,
    else the op (whose registered autograd saves the same and runs the same
    backward)."""
    if not _plain(args):
        out = op(*args)
    elif torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                         for a in args):
        return fn.apply(*args)
    else:
        out = _IMPLS[op](*args)
    return out if isinstance(out, torch.Tensor) else out[0]


def _function(name, op, save, backward, stats=0):
    """The eager autograd.Function of a forward op, which returns y alone: the
    ``stats`` statistics after y in the op's outputs (mean, rstd) are saved for the
    backward, not returned, so the engine neither wraps them nor makes zero
    gradients for them (LayerNorm float32 fwd+grad, 2026-12-07: 1x1024 85 -> 76 us,
    64x1024 154 -> 140 us). Old-style (ctx in forward): with a separate
    setup_context, Function.apply binds arguments through inspect.signature on
    every call (~20 us)."""
    impl = _IMPLS[op]

    def forward(ctx, *args):
        out = impl(*args)
        save(ctx, args, out)
        return out[0] if stats else out

    def backward_y(ctx, grad_y):
        return backward(ctx, grad_y, *(None,) * stats)
    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward),
        "backward": staticmethod(backward_y if stats else backward)})


# ------------------------------------------------------------------ softmax ops
def _softmax_fwd_impl(x: Tensor) -> Tensor:
    _check_dtype(x, "x")
    if x.is_cpu:
        xn = _np(x)
        y, yn = _cpu_out(xn, x)
        _F.softmax_fwd(xn, out=yn)
        return y
    y = _cuda_out(x)
    with _Cuda(x) as c:
        _F.softmax_fwd(c.arr(x), out=c.arr(y), **c.kw)
    return y


_softmax_fwd = _custom_op("softmax_fwd", _softmax_fwd_impl)


@_softmax_fwd.register_fake
def _(x):
    return x.new_empty(x.shape)


def _softmax_bwd_impl(y: Tensor, dy: Tensor) -> Tensor:
    _check_dtype(y, "y")
    dy = _as_dtype(dy, y.dtype)
    if y.is_cpu:
        yn = _np(y)
        dx, dxn = _cpu_out(yn, y, dy)
        _F.softmax_bwd(yn, _np(dy), out=dxn)
        return dx
    dx = _cuda_out(y)
    with _Cuda(y) as c:
        _F.softmax_bwd(c.arr(y), c.arr(dy), out=c.arr(dx), **c.kw)
    return dx


_softmax_bwd = _custom_op("softmax_bwd", _softmax_bwd_impl)


@_softmax_bwd.register_fake
def _(y, dy):
    return y.new_empty(y.shape)


def _softmax_setup(ctx, inputs, output):
    ctx.save_for_backward(output)


def _softmax_backward(ctx, grad):
    (y,) = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return None
    return _call(_softmax_bwd, y, grad)


_softmax_fwd.register_autograd(_softmax_backward, setup_context=_softmax_setup)
_SoftmaxFn = _function("_SoftmaxFn", _softmax_fwd, _softmax_setup, _softmax_backward)


# ------------------------------------------------------------------ RMSNorm ops
def _rms_norm_fwd_impl(x: Tensor, weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    _check_dtype(x, "x")
    if x.is_cpu:
        xn = _np(x)
        y, yn = _cpu_out(xn, x)
        _, rstd = _F.rms_norm_fwd(xn, None if weight is None else _np(weight), eps, out=yn)
        return y, torch.from_numpy(rstd)
    y = _cuda_out(x)
    with _Cuda(x) as c:
        _, rstd = _F.rms_norm_fwd(c.arr(x), c.param(weight), eps, out=c.arr(y), **c.kw)
        return y, c.back(rstd)


_rms_norm_fwd = _custom_op("rms_norm_fwd", _rms_norm_fwd_impl)


@_rms_norm_fwd.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=_acc_dtype(x.dtype))


def _rms_norm_bwd_impl(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor,
                  need_dweight: bool) -> tuple[Tensor, Tensor]:
    dy = _as_dtype(dy, x.dtype)
    if x.is_cpu:
        xn = _np(x)
        dx, dxn = _cpu_out(xn, x, dy)
        _, dw = _F.rms_norm_bwd(_np(dy), xn, None if weight is None else _np(weight),
                                _np(rstd), out=dxn)
        dw = None if dw is None else _from_np(dw)
    else:
        dx = _cuda_out(x)
        with _Cuda(x) as c:
            _, dw = _F.rms_norm_bwd(c.arr(dy), c.arr(x), c.param(weight), c.arr(rstd),
                                    out=c.arr(dx), **c.kw)
            dw = None if dw is None else c.back(dw, weight.dtype)
    if not need_dweight:
        dw = None
    return dx, _none_to_empty(dw, x)


_rms_norm_bwd = _custom_op("rms_norm_bwd", _rms_norm_bwd_impl)


@_rms_norm_bwd.register_fake
def _(dy, x, weight, rstd, need_dweight):
    dw = weight.new_empty(weight.shape) if weight is not None and need_dweight \
        else x.new_empty((0,))
    return x.new_empty(x.shape), dw


def _rms_norm_save(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1])
    _rms_norm_save(ctx, inputs, output)


def _rms_norm_backward(ctx, grad_y, grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_dx or need_dw):
        return None, None, None
    dx, dw = _call(_rms_norm_bwd, grad_y, x, weight, rstd,
                   bool(need_dw and weight is not None))
    return (dx if need_dx else None), (dw if need_dw else None), None


_rms_norm_fwd.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)
_RMSNormFn = _function("_RMSNormFn", _rms_norm_fwd, _rms_norm_save, _rms_norm_backward,
                       stats=1)


# ---------------------------------------------------------------- LayerNorm ops
def _layer_norm_fwd_impl(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                    eps: float) -> tuple[Tensor, Tensor, Tensor]:
    _check_dtype(x, "x")
    if x.is_cpu:
        xn = _np(x)
        y, yn = _cpu_out(xn, x)
        _, mean, rstd = _F.layer_norm_fwd(xn, None if weight is None else _np(weight),
                                          None if bias is None else _np(bias), eps, out=yn)
        return y, torch.from_numpy(mean), torch.from_numpy(rstd)
    y = _cuda_out(x)
    with _Cuda(x) as c:
        _, mean, rstd = _F.layer_norm_fwd(c.arr(x), c.param(weight), c.param(bias), eps,
                                          out=c.arr(y), **c.kw)
        return y, c.back(mean), c.back(rstd)


_layer_norm_fwd = _custom_op("layer_norm_fwd", _layer_norm_fwd_impl)


@_layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    acc = _acc_dtype(x.dtype)
    return (x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=acc),
            x.new_empty(x.shape[:-1], dtype=acc))


def _layer_norm_bwd_impl(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor,
                    rstd: Tensor, need_dweight: bool,
                    need_dbias: bool) -> tuple[Tensor, Tensor, Tensor]:
    """dbias comes back in the accumulator dtype (float32, float64 for float64 x):
    bias is not saved, so a stand-in of that dtype (allowed for any x) selects it."""
    dy = _as_dtype(dy, x.dtype)
    acc = _acc_dtype(x.dtype)
    n = x.shape[-1]
    if x.is_cpu:
        xn = _np(x)
        dx, dxn = _cpu_out(xn, x, dy)
        stand_in = np.empty((n,), np.float64 if acc is torch.float64 else np.float32) \
            if need_dbias else None
        _, dw, db = _F.layer_norm_bwd(_np(dy), xn,
                                      None if weight is None else _np(weight), stand_in,
                                      _np(mean), _np(rstd), out=dxn)
        dw = None if dw is None else _from_np(dw)
        db = None if db is None else torch.from_numpy(db)
    else:
        dx = _cuda_out(x)
        with _Cuda(x) as c:
            stand_in = torch.empty((n,), dtype=acc, device=x.device) if need_dbias else None
            _, dw, db = _F.layer_norm_bwd(c.arr(dy), c.arr(x), c.param(weight), stand_in,
                                          c.arr(mean), c.arr(rstd), out=c.arr(dx),
                                          **c.kw)
            dw = None if dw is None else c.back(dw, weight.dtype)
            db = c.back(db)
    if not need_dweight:
        dw = None
    return dx, _none_to_empty(dw, x), _none_to_empty(db, x)


_layer_norm_bwd = _custom_op("layer_norm_bwd", _layer_norm_bwd_impl)


@_layer_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, need_dweight, need_dbias):
    dw = weight.new_empty(weight.shape) if weight is not None and need_dweight \
        else x.new_empty((0,))
    db = x.new_empty(x.shape[-1:], dtype=_acc_dtype(x.dtype)) if need_dbias \
        else x.new_empty((0,))
    return x.new_empty(x.shape), dw, db


def _layer_norm_save(ctx, inputs, output):
    x, weight, bias, _ = inputs
    ctx.has_bias = bias is not None
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.save_for_backward(x, weight, output[1], output[2])


def _layer_norm_setup(ctx, inputs, output):
    ctx.mark_non_differentiable(output[1], output[2])
    _layer_norm_save(ctx, inputs, output)


def _layer_norm_backward(ctx, grad_y, grad_mean, grad_rstd):
    x, weight, mean, rstd = ctx.saved_tensors
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    if not (need_dx or need_dw or need_db):
        return None, None, None, None
    dx, dw, db = _call(_layer_norm_bwd, grad_y, x, weight, mean, rstd,
                       bool(need_dw and weight is not None), bool(need_db and ctx.has_bias))
    if need_db:
        db = _as_dtype(db, ctx.bias_dtype)
    return (dx if need_dx else None), (dw if need_dw else None), \
        (db if need_db else None), None


_layer_norm_fwd.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)
_LayerNormFn = _function("_LayerNormFn", _layer_norm_fwd, _layer_norm_save,
                         _layer_norm_backward, stats=2)


# ---------------------------------------------------------------- functional
def _param(p, x, name):
    """weight/bias as the library takes them: x's dtype or float32 (cast otherwise,
    differentiably, so the gradient comes back in the parameter's own dtype)."""
    if p is None:
        return None
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(p).__name__}")
    if p.dtype in (x.dtype, torch.float32):
        return p
    return p.to(x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32)


def _eps(eps, x):
    if eps is None:                       # torch.nn.RMSNorm's eps=None convention
        return float(torch.finfo(x.dtype).eps)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a real number, got {type(eps).__name__}")
    return float(eps)


def _check_x(x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    _check_dtype(x, "x")


def softmax(x, dim=-1):
    """Softmax along ``dim`` (differentiable). For dim other than the last, the axis
    is moved last (a copy) and the result moved back (a non-contiguous view)."""
    _check_x(x)
    if x.dim() == 0:
        return _forward(_softmax_fwd, _SoftmaxFn, x.reshape(1)).reshape(())
    dim = _dim(dim, x.dim())
    if dim == x.dim() - 1:
        return _forward(_softmax_fwd, _SoftmaxFn, x)
    return _forward(_softmax_fwd, _SoftmaxFn, x.movedim(dim, -1)).movedim(-1, dim)


def _dim(dim, ndim):
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if not -ndim <= dim < ndim:
        raise IndexError(f"dim {dim} out of range for a {ndim}-d tensor")
    return dim % ndim


def rms_norm(x, weight=None, eps=1e-6):
    """RMSNorm over the last axis: x / sqrt(mean(x**2) + eps) * weight.
    ``eps=None`` means torch.finfo(x.dtype).eps, as in torch.nn.RMSNorm."""
    _check_x(x)
    return _forward(_rms_norm_fwd, _RMSNormFn, x, _param(weight, x, "weight"),
                    _eps(eps, x))


def layer_norm(x, weight=None, bias=None, eps=1e-5):
    """LayerNorm over the last axis: (x - mean) / sqrt(var + eps) * weight + bias
    (biased variance)."""
    _check_x(x)
    return _forward(_layer_norm_fwd, _LayerNormFn, x, _param(weight, x, "weight"),
                    _param(bias, x, "bias"), _eps(eps, x))


def _over_shape(fn, x, normalized_shape, params, eps):
    """Apply a last-axis norm over the trailing ``normalized_shape`` dims by
    flattening them (a view for contiguous x) and the parameters with them."""
    _check_x(x)
    k = len(normalized_shape)
    if x.dim() < k or tuple(x.shape[x.dim() - k:]) != tuple(normalized_shape):
        raise RuntimeError(f"Given normalized_shape={list(normalized_shape)}, expected "
                           f"input with shape [*, {', '.join(map(str, normalized_shape))}]"
                           f", but got input of size{list(x.shape)}")
    if k == 1:
        return fn(x, *params, eps=eps)
    flat = [None if p is None else p.reshape(-1) for p in params]
    return fn(x.flatten(x.dim() - k), *flat, eps=eps).reshape(x.shape)


# ------------------------------------------------------------------- modules
class RMSNorm(torch.nn.RMSNorm):
    """Drop-in for torch.nn.RMSNorm (a subclass: same constructor, parameter
    ``weight``, state_dict keys, isinstance), running numba_fused's kernels.

    Differs from torch only in the default eps: 1e-6 here, None (meaning
    torch.finfo(x.dtype).eps) in torch; pass eps=None for torch's behaviour.
    A normalized_shape of several dims is flattened into one last axis.
    """

    def __init__(self, normalized_shape, eps=1e-6, elementwise_affine=True,
                 device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine,
                         device=device, dtype=dtype)

    def forward(self, x):
        return _over_shape(rms_norm, x, self.normalized_shape, (self.weight,), self.eps)


class LayerNorm(torch.nn.LayerNorm):
    """Drop-in for torch.nn.LayerNorm (a subclass: same constructor and defaults,
    parameters ``weight``/``bias``, state_dict keys, isinstance), running
    numba_fused's kernels. A normalized_shape of several dims is flattened into one
    last axis."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
                 device=None, dtype=None):
        super().__init__(normalized_shape, eps=eps, elementwise_affine=elementwise_affine,
                         bias=bias, device=device, dtype=dtype)

    def forward(self, x):
        return _over_shape(layer_norm, x, self.normalized_shape, (self.weight, self.bias),
                           self.eps)

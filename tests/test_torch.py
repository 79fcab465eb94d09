"""numba_fused.torch: custom ops, autograd, modules, torch.compile, training, DDP.

Skipped as a whole when torch is not installed. CPU only (CUDA tensors take the
GPU backend, which these tests cannot reach without a GPU).
"""
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nft = pytest.importorskip("numba_fused.torch")
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import torch_ddp_worker as W  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = torch.ops.numba_fused


def _randn(*shape, dtype=torch.float32, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    return t.requires_grad_(requires_grad)


@pytest.fixture(params=["fast", "ops"])
def path(request, monkeypatch):
    """Run a test through the eager autograd.Function path and through the
    torch.library custom ops (their registered autograd)."""
    monkeypatch.setattr(nft, "EAGER_FAST_PATH", request.param == "fast")
    return request.param


# ------------------------------------------------------------------ packaging
def test_import_numba_fused_does_not_import_torch():
    code = "import sys, numba_fused; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": ROOT}, timeout=60)


def test_numba_fused_torch_imports_real_torch():
    assert nft.torch is torch and hasattr(nft.torch, "library")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16,
                                   torch.float64])
def test_cpu_views_are_zero_copy(dtype):
    t = _randn(6, 10, dtype=dtype)[:, 1:9:1].t()[:, ::2].t()   # strided, unit last
    a = nft._np(t)
    assert a.__array_interface__["data"][0] == t.data_ptr()
    assert a.strides == tuple(s * t.element_size() for s in t.stride())
    np.testing.assert_array_equal(a.astype(np.float64), t.double().numpy())
    back = nft._from_np(a)
    assert back.dtype == dtype and back.data_ptr() == t.data_ptr()


# ----------------------------------------------------------------- custom ops
def _op_cases():
    x = _randn(3, 4, 9, dtype=torch.float64, requires_grad=True)
    w = _randn(9, dtype=torch.float64, seed=1, requires_grad=True)
    b = _randn(9, dtype=torch.float64, seed=2, requires_grad=True)
    return [(OPS.softmax_fwd, (x,)), (OPS.rms_norm_fwd, (x, w, 1e-6)),
            (OPS.rms_norm_fwd, (x, None, 1e-6)), (OPS.layer_norm_fwd, (x, w, b, 1e-5)),
            (OPS.layer_norm_fwd, (x, None, None, 1e-5))]


@pytest.mark.parametrize("case", range(5))
def test_opcheck_forward_ops(case):
    op, args = _op_cases()[case]
    torch.library.opcheck(op, args)


def test_opcheck_backward_ops():
    x, dy = _randn(5, 9), _randn(5, 9, seed=3)
    w, b = _randn(9, seed=1), _randn(9, seed=2)
    y = OPS.softmax_fwd(x)
    torch.library.opcheck(OPS.softmax_bwd, (y, dy))
    _, rstd = OPS.rms_norm_fwd(x, w, 1e-6)
    for need in (True, False):
        torch.library.opcheck(OPS.rms_norm_bwd, (dy, x, w, rstd, need))
    _, mean, rstd = OPS.layer_norm_fwd(x, w, b, 1e-5)
    for nw, nb in ((True, True), (False, True), (True, False)):
        torch.library.opcheck(OPS.layer_norm_bwd, (dy, x, w, mean, rstd, nw, nb))


# ------------------------------------------------------------------- gradcheck
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_gradcheck_softmax(dim, path):
    x = _randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: nft.softmax(x, dim), (x,))


@pytest.mark.parametrize("affine", [True, False])
def test_gradcheck_rms_norm(affine, path):
    x = _randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    w = _randn(7, dtype=torch.float64, seed=1, requires_grad=True) if affine else None
    args = (x, w) if affine else (x,)
    assert torch.autograd.gradcheck(lambda *a: nft.rms_norm(*a, eps=1e-6), args)


@pytest.mark.parametrize("weight,bias", [(True, True), (True, False), (False, True),
                                         (False, False)])
def test_gradcheck_layer_norm(weight, bias, path):
    x = _randn(2, 3, 7, dtype=torch.float64, requires_grad=True)
    w = _randn(7, dtype=torch.float64, seed=1, requires_grad=True)
    b = _randn(7, dtype=torch.float64, seed=2, requires_grad=True)

    def fn(x, w, b):
        return nft.layer_norm(x, w if weight else None, b if bias else None, eps=1e-5)
    assert torch.autograd.gradcheck(fn, (x, w, b))


def test_gradcheck_strided_input(path):
    base = _randn(7, 10, dtype=torch.float64, requires_grad=True)
    w5 = _randn(5, dtype=torch.float64, seed=1, requires_grad=True)
    w7 = _randn(7, dtype=torch.float64, seed=2, requires_grad=True)
    # (10, 5) with last stride 10: the library copies; (5, 7) with row stride 20: a view
    assert torch.autograd.gradcheck(lambda b, w: nft.rms_norm(b[2:].t(), w), (base, w5))
    assert torch.autograd.gradcheck(lambda b, w: nft.layer_norm(b[::2, 1:8], w, w),
                                    (base, w7))
    assert torch.autograd.gradcheck(lambda b: nft.softmax(b[::2], 0), (base,))


# ------------------------------------------------------------- torch parity
def _torch_fn(name):
    return {"softmax": lambda x, w, b: F.softmax(x, dim=-1),
            "rms_norm": lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, eps=1e-6),
            "layer_norm": lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, eps=1e-5)}[name]


def _our_fn(name):
    return {"softmax": lambda x, w, b: nft.softmax(x, dim=-1),
            "rms_norm": lambda x, w, b: nft.rms_norm(x, w, eps=1e-6),
            "layer_norm": lambda x, w, b: nft.layer_norm(x, w, b, eps=1e-5)}[name]


def _run(fn, dtype, shape=(6, 33, 160), seed=0):
    """Forward and gradients (x, weight, bias) of fn in ``dtype`` for fixed data."""
    x = _randn(*shape, dtype=torch.float64, seed=seed) * 2 + 0.5
    w = _randn(shape[-1], dtype=torch.float64, seed=seed + 1) * 0.5 + 1
    b = _randn(shape[-1], dtype=torch.float64, seed=seed + 2) * 0.1
    dy = _randn(*shape, dtype=torch.float64, seed=seed + 3)
    x, w, b = (t.to(dtype).requires_grad_() for t in (x, w, b))
    y = fn(x, w, b)
    y.backward(dy.to(dtype))
    return [t.detach().double() for t in (y, x.grad,
                                          w.grad if w.grad is not None else torch.zeros(1),
                                          b.grad if b.grad is not None else torch.zeros(1))]


def _maxrel(a, ref):
    return float((a - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("name", ["softmax", "rms_norm", "layer_norm"])
def test_parity_float32(name, path):
    ours = _run(_our_fn(name), torch.float32)
    theirs = _run(_torch_fn(name), torch.float32)
    for what, a, t in zip(["y", "dx", "dweight", "dbias"], ours, theirs):
        assert _maxrel(a, t) < 2e-5, (what, _maxrel(a, t))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["softmax", "rms_norm", "layer_norm"])
def test_parity_half_relative_to_torch_error(name, dtype):
    """Our error against float64 is within 1.5x torch's own error (+ one ulp-ish
    floor), output by output."""
    ref = _run(_torch_fn(name), torch.float64)
    ours = _run(_our_fn(name), dtype)
    theirs = _run(_torch_fn(name), dtype)
    ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    for what, a, t, r in zip(["y", "dx", "dweight", "dbias"], ours, theirs, ref):
        ours_err, torch_err = _maxrel(a, r), _maxrel(t, r)
        assert ours_err <= 1.5 * torch_err + ulp, (what, ours_err, torch_err)


def test_weight_float32_with_bf16_input():
    """Mixed precision: bf16 activations with float32 parameters; grads come back
    in the parameters' dtype."""
    x = _randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    w = _randn(64, seed=1, requires_grad=True)
    b = _randn(64, seed=2, requires_grad=True)
    y = nft.layer_norm(x, w, b)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    ref = F.layer_norm(x.detach().float(), (64,), w.detach(), b.detach())
    assert _maxrel(y.detach().double(), ref.double()) < 2 ** -7


def test_weight_dtype_cast_is_differentiable():
    x = _randn(4, 16, dtype=torch.float64, requires_grad=True)
    w = _randn(16, seed=1, dtype=torch.float16, requires_grad=True)
    y = nft.rms_norm(x, w)
    assert y.dtype == torch.float64
    y.sum().backward()
    assert w.grad.dtype == torch.float16


def test_softmax_masking_and_dims():
    x = _randn(2, 5, 5)
    mask = torch.ones(5, 5, dtype=torch.bool).triu(1)
    y = nft.softmax(x.masked_fill(mask, float("-inf")))
    assert torch.all(y[:, mask] == 0)
    torch.testing.assert_close(y, F.softmax(x.masked_fill(mask, float("-inf")), -1))
    for dim in range(-3, 3):
        torch.testing.assert_close(nft.softmax(x, dim), F.softmax(x, dim))
    torch.testing.assert_close(nft.softmax(torch.tensor(3.0)), torch.tensor(1.0))
    with pytest.raises(IndexError):
        nft.softmax(x, 3)


def test_empty_and_1d_inputs(path):
    for shape in [(0, 8), (3, 0, 8), (8,)]:
        x = _randn(*shape, requires_grad=True)
        w = torch.ones(8, requires_grad=True)
        for fn in (lambda x: nft.softmax(x), lambda x: nft.rms_norm(x, w),
                   lambda x: nft.layer_norm(x, w, w)):
            y = fn(x)
            assert y.shape == x.shape
            y.sum().backward()


def test_errors():
    with pytest.raises(TypeError, match="dtype"):
        nft.softmax(torch.ones(3, 4, dtype=torch.int32))
    with pytest.raises(TypeError):
        nft.rms_norm(np.ones((3, 4), np.float32))
    with pytest.raises(ValueError, match="weight"):
        nft.rms_norm(torch.ones(3, 4), torch.ones(5))
    with pytest.raises(RuntimeError, match="normalized_shape"):
        nft.LayerNorm(5)(torch.ones(3, 4))


# ------------------------------------------------ saved tensors, needs_input_grad
def _saved(fn):
    packed = []

    def pack(t):
        packed.append(t)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, packed


def test_saves_only_what_backward_needs(path):
    x = _randn(4, 16, requires_grad=True)
    w, b = _randn(16, seed=1, requires_grad=True), _randn(16, seed=2, requires_grad=True)
    y, saved = _saved(lambda: nft.softmax(x))
    assert len(saved) == 1 and saved[0].data_ptr() == y.data_ptr()
    _, saved = _saved(lambda: nft.rms_norm(x, w))
    assert [s.shape for s in saved] == [(4, 16), (16,), (4,)]
    assert saved[0].data_ptr() == x.data_ptr() and saved[1].data_ptr() == w.data_ptr()
    _, saved = _saved(lambda: nft.layer_norm(x, w, b))       # no bias
    assert [s.shape for s in saved] == [(4, 16), (16,), (4,), (4,)]
    assert all(s.data_ptr() != b.data_ptr() for s in saved)


def test_needs_input_grad(monkeypatch, path):
    calls = []
    real = nft._F.layer_norm_bwd

    def spy(dy, x, weight, bias, mean, rstd, **kw):
        calls.append((weight is not None, bias is not None))
        return real(dy, x, weight, bias, mean, rstd, **kw)
    monkeypatch.setattr(nft._F, "layer_norm_bwd", spy)

    x0 = _randn(4, 16)
    w0, b0 = _randn(16, seed=1), _randn(16, seed=2)
    ref = [x0.clone().requires_grad_(), w0.clone().requires_grad_(),
           b0.clone().requires_grad_()]
    F.layer_norm(ref[0], (16,), ref[1], ref[2]).pow(2).sum().backward()
    for grads in [(True, False, False), (True, True, False), (False, False, True),
                  (True, False, True), (False, True, False)]:
        x, w, b = (t.clone().requires_grad_(g) for t, g in zip((x0, w0, b0), grads))
        calls.clear()
        nft.layer_norm(x, w, b).pow(2).sum().backward()
        assert calls == [(True, grads[2])]          # dbias only when needed
        for t, r, g in zip((x, w, b), ref, grads):
            if g:
                torch.testing.assert_close(t.grad, r.grad)
            else:
                assert t.grad is None
    # nothing needs a gradient: no autograd graph at all
    y = nft.layer_norm(x0, w0, b0)
    assert not y.requires_grad


def test_rms_norm_weight_frozen(path):
    x = _randn(4, 16, requires_grad=True)
    w = _randn(16, seed=1)                     # no grad
    nft.rms_norm(x, w).sum().backward()
    xr = x.detach().clone().requires_grad_()
    F.rms_norm(xr, (16,), w, 1e-6).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)
    assert w.grad is None


def test_eager_calls_take_the_fast_path_and_ops_otherwise(path):
    x = _randn(3, 8, requires_grad=True)
    names = [type(nft.softmax(x).grad_fn).__name__, type(nft.rms_norm(x).grad_fn).__name__,
             type(nft.layer_norm(x).grad_fn).__name__]
    if path == "fast":
        assert names == ["_SoftmaxFnBackward", "_RMSNormFnBackward", "_LayerNormFnBackward"]
    else:
        assert all(n.startswith("GeneratedBackwardFor_numba_fused_") for n in names)
    # meta tensors always take the ops (their fake implementations)
    m = nft.layer_norm(torch.empty(5, 8, device="meta"), torch.empty(8, device="meta"))
    assert m.device.type == "meta" and m.shape == (5, 8)


def test_modules_take_the_fast_path_both_ways(path, monkeypatch):
    """A module's weight/bias are nn.Parameters (a Tensor subclass): the eager path
    still takes them, forward (the Function's node) and backward (the backward
    implementation called directly, not through its op)."""
    calls = []
    for op in (nft._rms_norm_bwd, nft._layer_norm_bwd):
        impl = nft._IMPLS[op]
        monkeypatch.setitem(nft._IMPLS, op, lambda *a, impl=impl: calls.append(1) or impl(*a))
    x = _randn(3, 8, requires_grad=True)
    for m, name in ((nft.RMSNorm(8), "_RMSNormFnBackward"),
                    (nft.LayerNorm(8), "_LayerNormFnBackward")):
        y = m(x)
        fast = type(y.grad_fn).__name__ == name
        y.square().sum().backward()
        assert m.weight.grad is not None
        assert fast == (path == "fast")
    assert len(calls) == (2 if path == "fast" else 0)


def test_activation_checkpointing_and_retain_graph():
    from torch.utils.checkpoint import checkpoint
    ln, rms = nft.LayerNorm(16), nft.RMSNorm(16)

    def f(x):
        return rms(nft.softmax(ln(x)) * 4)
    x = _randn(6, 16, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    checkpoint(f, x, use_reentrant=False).square().sum().backward()
    y = f(xr).square().sum()
    y.backward(retain_graph=True)
    torch.testing.assert_close(x.grad, xr.grad)
    g1 = xr.grad.clone()
    y.backward()                              # saved tensors reused, not mutated
    torch.testing.assert_close(xr.grad, 2 * g1)


def test_stats_are_not_differentiable():
    x = _randn(4, 16, requires_grad=True)
    y, rstd = OPS.rms_norm_fwd(x, None, 1e-6)
    assert y.requires_grad and not rstd.requires_grad
    y, mean, rstd = OPS.layer_norm_fwd(x, None, None, 1e-5)
    assert not mean.requires_grad and not rstd.requires_grad


# -------------------------------------------------------------------- modules
def test_modules_mirror_torch_constructors():
    r, tr = nft.RMSNorm(12), torch.nn.RMSNorm(12)
    assert isinstance(r, torch.nn.RMSNorm) and r.eps == 1e-6 and tr.eps is None
    assert r.normalized_shape == tr.normalized_shape == (12,)
    assert list(r.state_dict()) == list(tr.state_dict()) == ["weight"]
    assert nft.RMSNorm(12, elementwise_affine=False).weight is None
    ln, tln = nft.LayerNorm(12), torch.nn.LayerNorm(12)
    assert isinstance(ln, torch.nn.LayerNorm) and ln.eps == tln.eps == 1e-5
    assert list(ln.state_dict()) == list(tln.state_dict()) == ["weight", "bias"]
    assert list(nft.LayerNorm(12, bias=False).state_dict()) == ["weight"]
    assert nft.LayerNorm(12, elementwise_affine=False).weight is None
    assert repr(ln).replace("numba_fused", "") == repr(tln).replace("torch.nn", "")
    m = nft.LayerNorm(12, dtype=torch.float64)
    assert m.weight.dtype == torch.float64


@pytest.mark.parametrize("kind", ["rms", "ln", "ln_nobias", "rms_noaffine", "rms_2d",
                                  "ln_2d", "rms_eps_none"])
def test_modules_load_torch_state_dict(kind):
    shape = (6, 10) if kind.endswith("2d") else 10
    make = {"rms": lambda m: m.RMSNorm(shape, eps=1e-6),
            "rms_2d": lambda m: m.RMSNorm(shape, eps=1e-6),
            "rms_noaffine": lambda m: m.RMSNorm(shape, eps=1e-6, elementwise_affine=False),
            "rms_eps_none": lambda m: m.RMSNorm(shape, eps=None),
            "ln": lambda m: m.LayerNorm(shape),
            "ln_2d": lambda m: m.LayerNorm(shape),
            "ln_nobias": lambda m: m.LayerNorm(shape, bias=False)}[kind]
    theirs, ours = make(torch.nn), make(nft)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(_randn(*p.shape, seed=p.numel()))
    ours.load_state_dict(theirs.state_dict())
    x = _randn(3, 6, 10) * 3
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ours(xa), theirs(xb)
    torch.testing.assert_close(ya, yb, rtol=2e-5, atol=2e-5)
    dy = _randn(3, 6, 10, seed=5)
    ya.backward(dy)
    yb.backward(dy)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=2e-5, atol=2e-5)
    for (na, pa), (nb, pb) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert na == nb
        torch.testing.assert_close(pa.grad, pb.grad, rtol=2e-5, atol=2e-5)


# ----------------------------------------------------------------- torch.compile
class _Block(torch.nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.norm1, self.norm2 = nft.RMSNorm(d), nft.LayerNorm(d)
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        h = self.lin(self.norm1(x))
        a = nft.softmax(h @ h.transpose(-1, -2), dim=-1)
        return self.norm2(x + a @ h)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = _Block()
    x = _randn(2, 8, 32)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref = block(xa)
    ref.sum().backward()
    ref_grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    t0 = time.perf_counter()
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    out = compiled(xb)
    out.sum().backward()
    elapsed = time.perf_counter() - t0
    print(f"torch.compile(backend={backend!r}, fullgraph=True): first fwd+bwd {elapsed:.1f} s")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-5, atol=1e-5)
    for p, g in zip(block.parameters(), ref_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-5)


def test_compile_dynamic_shapes_aot_eager():
    torch._dynamo.reset()
    ln = nft.LayerNorm(16)
    fn = torch.compile(lambda x: ln(nft.softmax(x, dim=0)), backend="aot_eager",
                       fullgraph=True, dynamic=True)
    for rows in (3, 5, 9):
        x = _randn(rows, 16, seed=rows, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        y = fn(x)
        ref = F.layer_norm(F.softmax(xr, 0), (16,), ln.weight, ln.bias)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        y.sum().backward()


def test_inference_mode_and_no_grad():
    x = _randn(4, 16)
    w = torch.ones(16, requires_grad=True)
    with torch.inference_mode():
        y = nft.rms_norm(x, w)
    assert not y.requires_grad
    with torch.no_grad():
        y2 = nft.rms_norm(x, w)
    torch.testing.assert_close(y, y2)


def test_compile_graph_contains_custom_ops():
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm
    fn = torch.compile(lambda x, w: nft.layer_norm(nft.softmax(x), w), backend=backend,
                       fullgraph=True)
    fn(_randn(4, 8), torch.ones(8))
    code = graphs[0].code
    assert "numba_fused.softmax_fwd" in code and "numba_fused.layer_norm_fwd" in code


# --------------------------------------------------------------------- training
def test_tiny_transformer_loss_curve_matches_torch():
    theirs = W.make_model("torch")
    ours = W.make_model("nf")
    ours.load_state_dict(theirs.state_dict())
    curves = []
    for model in (theirs, ours):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for step in range(20):
            opt.zero_grad()
            loss = model.loss(W.make_batch(step))
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(losses)
    np.testing.assert_allclose(curves[1], curves[0], rtol=1e-5)
    assert curves[0][-1] < curves[0][0] - 0.1        # it did learn something


# -------------------------------------------------------------------------- DDP
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_two_processes_gloo(tmp_path):
    # single-process reference (also compiles/caches the kernels before the workers)
    ref = W.grads_after(W.make_model("nf"), [W.make_batch(s) for s in range(W.STEPS)])
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    worker = os.path.join(os.path.dirname(__file__), "torch_ddp_worker.py")
    deadline = time.monotonic() + 120
    for attempt in range(2):                      # a second try if the port was taken
        port = _free_port()
        procs = [subprocess.Popen([sys.executable, worker, str(r), "2", str(port),
                                   str(tmp_path)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT) for r in range(2)]
        logs = []
        try:
            for p in procs:
                out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                logs.append(out.decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.wait()
            pytest.fail("DDP workers did not finish within 120 s")
        if all(p.returncode == 0 for p in procs):
            break
        if attempt or "address already in use" not in "".join(logs).lower():
            pytest.fail("DDP worker failed:\n" + "\n".join(logs))
    g0, g1 = (torch.load(tmp_path / f"grads{r}.pt") for r in range(2))
    assert len(g0) == len(g1) == len(ref) == W.STEPS
    for step in range(W.STEPS):
        assert g0[step].keys() == ref[step].keys()
        for name in ref[step]:
            assert torch.equal(g0[step][name], g1[step][name]), (step, name)
            torch.testing.assert_close(g0[step][name], ref[step][name], rtol=1e-4,
                                       atol=1e-6, msg=f"step {step} {name}")

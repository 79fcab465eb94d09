"""Every GPU kernel x dtype compiles for the real CUDA target (NVVM, no GPU needed),
and the PTX / SASS show what the design promises:

* ``shfl.sync`` in every row kernel (warp-shuffle reductions);
* no local memory in the PTX (``.local``: the register caches and partial rows were
  promoted to registers);
* 16-byte vector loads and stores (``ld.global.v2/.v4``, ``st.global.v2/.v4``) in
  the vectorized configurations;
* float64 arithmetic in the float64 kernels and none in the float32/half ones
  (float32 accumulation for halves; the seed bug was f64 kernels accumulating in
  float);
* with nvJitLink (numba-cuda[cu13] ships it): ptxas reports no spills and at most
  64 registers a thread (the launch bounds the table was sized for).

Skipped when numba-cuda's NVVM is not installed; CI installs numba-cuda[cu13].
"""
import re

import numpy as np
import pytest

cuda = pytest.importorskip("numba.cuda")
from numba import types  # noqa: E402

from numba_fused import gpu  # noqa: E402

if gpu.SIM:
    pytest.skip("NUMBA_ENABLE_CUDASIM is set: no real CUDA target", allow_module_level=True)


def _nvvm_works():
    def k(a):
        a[0] = 1.0
    try:
        cuda.compile_ptx(k, (types.float32[::1],), cc=(8, 0))
        return None
    except Exception as e:       # NvvmSupportError, missing libnvvm, ...
        return f"{type(e).__name__}: {e}"


_why = _nvvm_works()
if _why:
    pytest.skip(f"numba-cuda NVVM unavailable ({_why[:200]})", allow_module_level=True)

OPS = ["softmax_fwd", "softmax_bwd", "rms_norm_fwd", "rms_norm_bwd",
       "layer_norm_fwd", "layer_norm_bwd"]
FWD = {"softmax_fwd", "rms_norm_fwd", "layer_norm_fwd"}
STORAGE = {"f32": types.float32, "f64": types.float64, "f16": types.int16,
           "bf16": types.uint16}
FLAGS = {"softmax_fwd": {}, "softmax_bwd": {}, "rms_norm_fwd": dict(has_w=True),
         "rms_norm_bwd": dict(has_w=True),
         "layer_norm_fwd": dict(has_w=True, has_b=True),
         "layer_norm_bwd": dict(has_w=True, need_dw=True, need_db=True)}
# (label, cols, vectorized): register-cached, streaming, and scalar (misaligned cols)
SHAPES = [("cached", 4096, True), ("stream", 262144, True), ("scalar", 4097, False),
          ("short", 256, True)]   # bf16: a warp per row; float64: its register cache
CCS = [(8, 0), (9, 0)]


def _signature(op, st, wst):
    acc = types.float64 if st == types.float64 else types.float32
    a3 = st[:, :, ::1]
    w = wst[::1]
    s1 = acc[::1]
    p2 = acc[:, ::1]
    return {"softmax_fwd": (a3, a3), "softmax_bwd": (a3, a3, a3),
            "rms_norm_fwd": (a3, w, types.float64, a3, s1),
            "layer_norm_fwd": (a3, w, w, types.float64, a3, s1, s1),
            "rms_norm_bwd": (a3, a3, w, s1, s1, a3, p2, p2),
            "layer_norm_bwd": (a3, a3, w, s1, s1, a3, p2, p2)}[op]


def _config(op, dt, cols, vec):
    st = STORAGE[dt]
    W = 16 // (st.bitwidth // 8) if vec else 1
    nparams = 2 if op == "layer_norm_bwd" else 1
    return gpu.HW_TABLE.choose(cols, W, dt == "f64", backward=op.endswith("bwd"),
                               nparams=nparams)


_PTX = {}


def ptx_of(op, dt, shape, cc, wdt=None):
    key = (op, dt, shape, cc, wdt)
    if key not in _PTX:
        label, cols, vec = next(s for s in SHAPES if s[0] == shape)
        cfg = _config(op, dt, cols, vec)
        acc = np.float64 if dt == "f64" else np.float32
        f, lb = gpu.kernel_source(op, cfg, acc, **FLAGS[op])
        st = STORAGE[dt]
        sig = _signature(op, st, STORAGE[wdt] if wdt else st)
        _PTX[key] = (cuda.compile_ptx(f, sig, cc=cc, launch_bounds=lb)[0], cfg)
    return _PTX[key]


CASES = ([(op, dt, "cached", cc) for op in OPS for dt in STORAGE for cc in CCS]
         + [(op, dt, shape, (9, 0)) for op in OPS for dt in ("f32", "f64", "bf16")
            for shape in ("stream", "scalar")]     # f16 differs from bf16 only in cvt
         + [(op, dt, "short", (9, 0)) for op in OPS for dt in ("f64", "bf16")])


def _ids(c):
    return f"{c[0]}-{c[1]}-{c[2]}-sm{c[3][0]}{c[3][1]}"


_F64_OPS = re.compile(r"\b(add|sub|mul|fma\.rn|div\.rn|sqrt\.rn|rcp\.rn)(\.\w+)*\.f64\b")
_VLOAD = re.compile(r"\bld\.global(\.\w+)*\.v[24]\.")
_VSTORE = re.compile(r"\bst\.global(\.\w+)*\.v[24]\.")


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_ptx_promises(case):
    op, dt, shape, cc = case
    ptx, cfg = ptx_of(op, dt, shape, cc)
    assert f".target sm_{cc[0]}{cc[1]}" in ptx
    assert "shfl.sync" in ptx, f"{op}/{dt}/{cfg}: no warp shuffles"
    assert ".local" not in ptx and "ld.local" not in ptx and "st.local" not in ptx, \
        f"{op}/{dt}/{cfg}: local memory in the PTX"
    vec = cfg.W > 1
    if vec:
        assert _VLOAD.search(ptx), f"{op}/{dt}/{cfg}: no 16-byte vector loads"
        assert _VSTORE.search(ptx), f"{op}/{dt}/{cfg}: no 16-byte vector stores"
    else:
        assert not _VLOAD.search(ptx), f"{op}/{dt}/{cfg}: vector loads in the scalar path"
    if dt == "f64":
        assert _F64_OPS.search(ptx), f"{op}: float64 kernel without float64 arithmetic"
    else:
        bad = _F64_OPS.search(ptx)
        assert not bad, f"{op}/{dt}: float64 arithmetic {bad.group(0)!r} in a float32 path"


@pytest.mark.parametrize("op", ["rms_norm_fwd", "layer_norm_fwd", "rms_norm_bwd",
                                "layer_norm_bwd"])
@pytest.mark.parametrize("dt", ["bf16", "f16"])
def test_fp32_weights_with_half_activations(op, dt):
    ptx, cfg = ptx_of(op, dt, "cached", (9, 0), wdt="f32")
    assert ".local" not in ptx and _VLOAD.search(ptx) and not _F64_OPS.search(ptx)


def test_config_table_variety():
    """The PTX cases above cover warp... block-per-row, cached and streaming."""
    cfgs = {ptx_of(*c)[1].key() for c in CASES if c[3] == (9, 0)}
    assert any(k[3] > 0 for k in cfgs) and any(k[3] == 0 for k in cfgs)
    assert any(k[2] == 1 for k in cfgs) and any(k[2] > 1 for k in cfgs)
    short = gpu.HW_TABLE.choose(128, 8, False)
    assert short.G == 32 and short.RPB == 4      # a warp per row for short rows
    assert any(k[0] == 32 and k[1] > 1 for k in cfgs)          # ... and compiled above
    assert any(ptx_of(op, "f64", "short", (9, 0))[1].NV > 0 for op in FWD)


def _aux_sigs():
    return [("reduce", (types.float32[:, ::1], types.uint16[::1])),
            ("reduce", (types.float32[:, ::1], types.float32[::1])),
            ("reduce", (types.float64[:, ::1], types.float64[::1])),
            ("reduce", (types.float64[:, ::1], types.float32[::1])),
            ("fill", (types.uint16[::1], types.uint16)),
            ("copy4", (types.float32[:, :, :, :], types.float32[:, :, :, ::1]))]


@pytest.mark.parametrize("name,sig", _aux_sigs(), ids=lambda v: str(v)[:40])
def test_aux_kernels_compile(name, sig):
    args = (np.float64 if sig[0].dtype == types.float64 else np.float32,) \
        if name == "reduce" else ()
    src = {"reduce": gpu._reduce_partials_src, "fill": gpu._fill_src,
           "copy4": gpu._copy4_src}[name](*args)
    ptx = cuda.compile_ptx(src, sig, cc=(9, 0))[0]
    assert ".local" not in ptx


# ------------------------------------------------------------- ptxas via nvJitLink
def _sass_info(ptx, cc):
    J = pytest.importorskip("cuda.bindings.nvjitlink")
    opts = [f"-arch=sm_{cc[0]}{cc[1]}", "-Xptxas=-v"]
    h = J.create(len(opts), opts)
    try:
        b = ptx.encode()
        J.add_data(h, J.InputType.PTX, b, len(b), "kernel.ptx")
        J.complete(h)
        n = J.get_info_log_size(h)
        buf = bytearray(n)
        J.get_info_log(h, buf)
    finally:
        J.destroy(h)
    log = buf.decode(errors="replace")
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spill = sum(int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    stack = re.search(r"(\d+) bytes stack frame", log)
    return regs, spill, int(stack.group(1)) if stack else 0, log


@pytest.mark.parametrize("case", [c for c in CASES if c[3] == (9, 0)], ids=_ids)
def test_sass_no_spills(case):
    ptx, cfg = ptx_of(*case)
    regs, spill, stack, log = _sass_info(ptx, case[3])
    assert spill == 0 and stack == 0, f"{case}/{cfg}: {spill} bytes spilled\n{log[-800:]}"
    assert regs <= 65536 // (cfg.tpb * gpu.launch_bounds(cfg.tpb)[1]), (case, cfg, regs)


# ------------------------------------------------- host-side logic, no driver
class _FakeCAI:
    """A bare ``__cuda_array_interface__``; ``fields`` add or replace its keys
    (strides, stream, mask, data ...)."""

    def __init__(self, typestr, shape=(4,), **fields):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (0, False), "version": 3, **fields}


def test_param_tag_reads_16_bit_params_as_x_dtype():
    ctx = gpu.DEVICE
    bf16 = np.dtype("bfloat16")
    for ts in ("<u2", "<i2", "|V2", "<V2"):
        assert ctx.param_tag(_FakeCAI(ts), bf16) == bf16
        assert ctx.param_tag(_FakeCAI(ts), np.float16) == np.dtype(np.float16)
    assert ctx.param_tag(_FakeCAI("<f4"), bf16) is None       # float32 weights stay
    assert ctx.param_tag(_FakeCAI("<u2"), np.float32) is None  # only beside halves


def test_void2_needs_a_dtype_tag():
    with pytest.raises(TypeError, match="bfloat16"):
        gpu.DEVICE.wrap(_FakeCAI("<V2", (2, 4)), "x")


def test_cai_shim_retypes_void2():
    s = gpu._CAIShim(_FakeCAI("<V2", (2, 4)), "<u2")
    assert s.__cuda_array_interface__["typestr"] == "<u2"
    assert s.__cuda_array_interface__["shape"] == (2, 4)


def test_bad_stream_rejected_without_a_driver():
    with pytest.raises(TypeError, match="stream"):
        gpu.DEVICE.check_stream("nope")
    with pytest.raises(TypeError, match="stream"):
        gpu.DEVICE.check_stream(True)


def test_compiles_where_numpy_has_no_row_stack():
    """NumPy 2.5 removed np.row_stack, which numba-cuda 0.30.4 overloads when its
    registries load at the first compile (AttributeError on the project's H200 image);
    importing numba_fused.gpu restores the alias. A fresh process, since this one's
    registries are loaded already."""
    import subprocess
    import sys
    code = (
        "import numpy as np\n"
        "if hasattr(np, 'row_stack'):\n"
        "    del np.row_stack\n"
        "from numba_fused import gpu\n"
        "from numba import cuda, types\n"
        "f, lb = gpu.kernel_source('softmax_fwd', gpu.HW_TABLE.choose(1024, 4, False),"
        " np.float32)\n"
        "sig = (types.float32[:, :, ::1], types.float32[:, :, ::1])\n"
        "ptx = cuda.compile_ptx(f, sig, cc=(9, 0), launch_bounds=lb)[0]\n"
        "assert 'shfl.sync' in ptx\n"
        "print('ok')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-2000:]


def _CAI(shape, ptr=4096, **fields):
    return _FakeCAI("<f4", shape, data=(ptr, False), **fields)


def test_replay_describes_cuda_array_interfaces_without_a_driver():
    """gpu.Replay's view of CAI arguments (the part that needs no GPU): extents,
    alignment, and the cases left to the general path (mask, a producer stream other
    than the launch stream, empty arrays)."""
    r = gpu.REPLAY
    assert r is not None
    desc, ptr, lo, hi, ro = r._arg(_CAI((3, 5)), 0)
    assert (ptr, lo, hi, ro) == (4096, 4096, 4096 + 60, False)
    assert desc[2] == (20, 4) and desc[4] is True          # C strides, 16-byte aligned
    assert r._arg(_CAI((3, 5), ptr=4100), 0)[0][4] is False
    _, _, lo, hi, _ = r._arg(_CAI((3, 5), strides=(-20, 4), ptr=4096 + 40), 0)
    assert (lo, hi) == (4096, 4096 + 60)                   # negative row stride
    assert r._arg(_CAI((3, 5), stream=1), 0)[1] == 4096    # 1: the legacy default stream
    assert r._arg(_CAI((3, 5), stream=7), 7)[1] == 4096
    assert r._arg(_CAI((3, 5), stream=7), 0) is False      # numba would synchronize
    assert r._arg(_CAI((3, 5), mask=(0, False)), 0) is False
    assert r._arg(_CAI((0, 5)), 0) is False
    assert r._arg(None, 0) is None
    # host arrays never reach the driver: the general path takes (and checks) them
    x = np.ones((2, 3), np.float32)
    assert r.call(gpu._dispatch.softmax_fwd, (x,), gpu._NO_EPS, -1, None, None, None) is None
    assert r.call(gpu._dispatch.softmax_fwd, ([1.0],), gpu._NO_EPS, -1, None, None,
                  None) is None


class _FakeDev:
    """Stands in for a numba device array in the replay-plan test: shape, strides,
    dtype and an address, nothing on a device."""

    def __init__(self, ptr, shape, dtype=np.float32, strides=None):
        import types as pytypes
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.strides = strides or tuple(
            int(np.prod(shape[k + 1:])) * self.dtype.itemsize for k in range(len(shape)))
        self.size = int(np.prod(shape))
        self.itemsize = self.dtype.itemsize
        self.ptr = ptr
        self.device_ctypes_pointer = pytypes.SimpleNamespace(value=ptr)
        self.gpu_data = pytypes.SimpleNamespace(device_ctypes_pointer=self.device_ctypes_pointer)
        self.stream = 0

    def is_c_contiguous(self):
        return True


class _FakeKernel:
    """numba-cuda's _Kernel as the replay plan uses it: argument_types and the
    argument words of _prepare_args (meminfo, parent, size, itemsize, data, shape...,
    strides... per array; a ctypes double per float64)."""
    cooperative = False

    def __init__(self, *argtypes):
        import types as pytypes
        self.argument_types = argtypes
        self._codelibrary = pytypes.SimpleNamespace(
            get_cufunc=lambda: pytypes.SimpleNamespace(kernel=self))

    def _prepare_args(self, ty, v, stream, retr, words):
        import ctypes
        if isinstance(ty, types.Array):
            words += [0, 0, v.size, v.itemsize, v.ptr, *v.shape, *v.strides]
        else:
            words.append(ctypes.c_double(v))


def test_replay_plan_patches_addresses_without_a_driver(monkeypatch):
    """gpu.Replay's record -> plan -> replay on stand-ins: every array argument of
    every recorded launch is traced to a call argument, a fresh output or a scratch
    buffer (with its offset), eps is patched by value, and a replay launches the same
    words with the new call's addresses; unknown buffers and temporaries are refused."""
    import types as pytypes
    r = gpu.Replay()
    monkeypatch.setattr(r, "_dna", _FakeDev)
    monkeypatch.setattr(r, "_config", lambda **kw: kw)
    launched = []
    monkeypatch.setattr(r, "_launch", lambda stream, config, kernel, *words:
                        launched.append((stream, kernel, words)))
    f32_3d, f32_1d = types.float32[:, :, ::1], types.float32[::1]
    # a norm-like call: x (rows, cols) and weight in; out= given; rstd allocated;
    # the main kernel writes partials to a scratch buffer, the second reduces them
    rows, cols = 6, 8
    x, w, out = (_FakeDev(1 << 20, (rows, cols)), _FakeDev(2 << 20, (cols,)),
                 _FakeDev(3 << 20, (rows, cols)))
    rstd = _FakeDev(4 << 20, (rows,))
    scratch = _FakeDev(5 << 20, (4, cols))
    dweight = _FakeDev(6 << 20, (cols,))
    infos = [r._arg(a, 0) for a in (x, w, out)]
    rec = gpu._Recorder()
    rec.allocs += [rstd, dweight]
    rec.scratch.append((("key",), 4 * cols, np.float32, 0, scratch.ptr))
    cfg = pytypes.SimpleNamespace(griddim=(3, 1, 1), blockdim=(32, 1, 1), sharedmem=0,
                                  stream="S")
    main = _FakeKernel(f32_3d, f32_1d, types.float64, f32_3d, f32_1d, types.float32[:, ::1])
    red = _FakeKernel(types.float32[:, ::1], f32_1d)
    x3 = _FakeDev(x.ptr, (1, rows, cols))
    out3 = _FakeDev(out.ptr + 0, (1, rows, cols))
    part = _FakeDev(scratch.ptr + 2 * cols * 4, (2, cols))       # an offset view
    rec.launches.append((main, cfg, (x3, w, 1e-5, out3, rstd, part)))
    rec.launches.append((red, cfg, (part, dweight)))
    plan = r._plan(rec, (out, rstd, dweight), (x, w, out), infos, 1e-5)
    assert plan is not None
    assert plan.results == [("arg", 2), ("new", 0), ("new", 1)]
    # replay with other addresses and another eps
    x2, w2, o2 = (_FakeDev(11 << 20, (rows, cols)), _FakeDev(12 << 20, (cols,)),
                  _FakeDev(13 << 20, (rows, cols)))
    fresh = iter([_FakeDev(14 << 20, (rows,)), _FakeDev(16 << 20, (cols,))])
    monkeypatch.setattr(gpu, "cuda", pytypes.SimpleNamespace(
        device_array=lambda shape, dtype, stream=0: next(fresh)))
    base2 = _FakeDev(15 << 20, (4 * cols,))
    monkeypatch.setattr(gpu, "_scratch_base", lambda key, n, dtype, stream: base2)
    res = r._replay(plan, (x2, w2, o2), [r._arg(a, 0) for a in (x2, w2, o2)],
                    0.25)
    assert res[0] is o2 and res[1].ptr == 14 << 20 and res[2].ptr == 16 << 20
    (s1, k1, m), (s2, k2, d) = launched
    assert (s1, k1, s2, k2) == ("S", main, "S", red)
    # main's words: x3 (11 words, data at 4), w (7, data at 15), eps (18), out3 (data
    # at 23), rstd (data at 34), part (data at 41)
    addrs = [m[4], m[15], m[23], m[34], m[41]]
    assert addrs == [x2.ptr, w2.ptr, o2.ptr, 14 << 20, base2.ptr + 2 * cols * 4]
    assert m[18].value == 0.25
    assert [d[4], d[13]] == [base2.ptr + 2 * cols * 4, 16 << 20]
    # an address that maps to nothing known, or an allocation not returned: refused
    rec.launches.append((red, cfg, (_FakeDev(9 << 20, (2, cols)), dweight)))
    assert r._plan(rec, (out, rstd, dweight), (x, w, out), infos, 1e-5) is None
    rec.launches.pop()
    rec.allocs.append(_FakeDev(10 << 20, (rows,)))
    assert r._plan(rec, (out, rstd, dweight), (x, w, out), infos, 1e-5) is None


def test_replay_reports_a_failure_after_work_went_out(monkeypatch):
    """A replay whose first launch fails leaves the call to the general path (nothing
    ran); one that fails later raises (an in-place call may have overwritten dy)."""
    r = gpu.Replay()
    plan = gpu._Plan()
    plan.news, plan.scratch, plan.results, plan.single = [], [], [("arg", 0)], True
    plan.launches = [("S", {}, "k1", [0], []), ("S", {}, "k2", [0], [])]
    x = _FakeDev(1 << 20, (2, 4))
    info = [(None, x.ptr, x.ptr, x.ptr + 32, False)]
    calls = []

    def fail_on(name):
        def launch(stream, config, kernel, *words):
            calls.append(kernel)
            if kernel == name:
                raise RuntimeError("CUDA_ERROR_INVALID_HANDLE")
        return launch
    monkeypatch.setattr(r, "_launch", fail_on("k1"))
    with pytest.raises(gpu._NothingLaunched):
        r._replay(plan, (x,), info, gpu._NO_EPS)
    monkeypatch.setattr(r, "_launch", fail_on("k2"))
    with pytest.raises(RuntimeError, match="INVALID_HANDLE"):
        r._replay(plan, (x,), info, gpu._NO_EPS)
    monkeypatch.setattr(r, "_launch", lambda *a: calls.append(a[2]))
    assert r._replay(plan, (x,), info, gpu._NO_EPS) is x
    assert calls == ["k1", "k1", "k2", "k1", "k2"]

"""The benchmark CLI (``numba-fused bench`` / ``python -m numba_fused``) on tiny
shapes: argument parsing, the columns, the JSON/CSV schema, the error gate,
absent peers and the GPU path without a GPU."""
import csv
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import numba_fused as nf
from numba_fused import bench as B
from numba_fused import cli

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--shapes", "8x64", "--repeat", "2"]


@pytest.fixture(autouse=True)
def _fast(monkeypatch):
    """Short warm-up and samples: the tests check plumbing, not speed."""
    monkeypatch.setattr(B, "MIN_SAMPLE_S", 1e-4)
    monkeypatch.setattr(B, "WARM_S", 0.0)
    monkeypatch.setattr(B, "SETTLE_S", 0.0)


def _bench(capsys, *args):
    rc = cli.main(["bench", "--quiet", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def _table_cells(out):
    lines = out.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith("device"))
    head = lines[i].split()
    rows = []
    for ln in lines[i + 2:]:
        if not ln.strip():
            break
        rows.append(ln.split())
    return head, rows


# ------------------------------------------------------------------ parsing
def test_parse_lists_aliases_and_shapes():
    a = cli.build_parser().parse_args(
        ["bench", "--ops", "softmax,rmsnorm", "--dtypes", "f32,bf16", "--direction",
         "fwd,fwdbwd", "--shapes", "4096x4096,65536x1024,7", "--peers", "torch,jax",
         "--repeat", "3", "--threads", "1", "--device", "cpu"])
    assert a.ops == ("softmax", "rms_norm")
    assert a.dtypes == ("float32", "bfloat16")
    assert a.directions == ("fwd", "fwd+bwd")
    assert a.shapes == ((4096, 4096), (65536, 1024), (1, 7))
    assert a.peers == ("torch", "jax") and a.repeat == 3 and a.threads == 1
    d = cli.build_parser().parse_args(["bench"])
    assert d.ops == B.OPS and d.directions == B.DIRECTIONS
    assert d.dtypes == ("float32", "bfloat16") and d.shapes == B.DEFAULT_SHAPES
    assert d.peers is None and d.device is None
    t = cli.build_parser().parse_args(["bench", "--shapes", "targets", "--peers", "none"])
    assert t.shapes == B.TARGET_SHAPES and t.peers == ()


@pytest.mark.parametrize("bad", [["--shapes", "4096by4096"], ["--shapes", "0x8"],
                                 ["--ops", "gelu"], ["--dtypes", "int8"],
                                 ["--direction", "sideways"], ["--peers", "tensorflow"],
                                 ["--repeat", "0"], ["--device", "tpu"]])
def test_bad_arguments_exit_2(capsys, bad):
    assert cli.main(["bench", *bad]) == 2
    assert "error" in capsys.readouterr().err


def test_help_documents_the_method(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for word in ("minimal traffic", "copy", "autograd", "vjp", "Tolerances", "--plot",
                 "interleaved", "Exit status 1"):
        assert word in out


def test_threads_above_numba_limit_is_a_usage_error(capsys):
    import numba
    assert cli.main(["bench", "--threads", str(numba.config.NUMBA_NUM_THREADS + 1)]) == 2


# --------------------------------------------------------------- a real run
def test_tiny_run_every_column_json_and_csv(capsys, tmp_path):
    j, c = tmp_path / "r.json", tmp_path / "r.csv"
    rc, out, err = _bench(capsys, *TINY, "--dtypes", "float32,bfloat16", "--peers",
                          "numpy", "--json", str(j), "--csv", str(c), "--seed", "1")
    assert rc == 0, out + err
    head, rows = _table_cells(out)
    assert head[:9] == ["device", "op", "dir", "dtype", "shape", "median", "min-max",
                        "GB/s", "%"] or head[:8] == ["device", "op", "dir", "dtype",
                                                     "shape", "median", "min-max", "GB/s"]
    for col in ("copy", "vs", "numpy", "max", "err", "ok"):
        assert col in head
    assert len(rows) == 3 * 3 * 2
    cases = {(r[1], r[2], r[3]) for r in rows}
    assert cases == {(o, d, t) for o in B.OPS for d in B.DIRECTIONS
                     for t in ("float32", "bfloat16")}
    assert "first call" in out and "error gate: ok" in out

    doc = json.loads(j.read_text())
    assert set(doc) == {"meta", "records", "notes", "failures"} and doc["failures"] == []
    meta = doc["meta"]
    for k in ("schema", "date", "command", "seed", "repeat", "tolerances", "machine"):
        assert k in meta
    assert meta["seed"] == 1 and meta["command"].startswith("numba-fused bench")
    for k in ("cpu", "cores", "numba", "threading_layer", "numba_threads", "commit"):
        assert k in meta["machine"]
    recs = doc["records"]
    assert {r["impl"] for r in recs} == {"numba_fused", "numpy", "copy"}
    assert len(recs) == 18 * 3
    for r in recs:
        assert set(B.CSV_KEYS) <= set(r)
        assert r["min_s"] <= r["median_s"] <= r["max_s"] and r["runs"] == 2
        assert r["gbps"] > 0 and r["copy_gbps"] > 0 and r["bytes"] > 0
        if r["impl"] == "numba_fused":
            assert r["ok"] is True and r["max_err"] <= r["tol"] and r["speedup"] == 1.0
        if r["impl"] == "numpy":
            assert r["max_err"] < B.TOLERANCES[r["dtype"]] * 4 and r["speedup"] > 0
    with open(c, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(recs) and tuple(rows[0]) == B.CSV_KEYS


def test_all_dtypes_pass_the_gate_markdown(capsys):
    rc, out, _ = _bench(capsys, "--shapes", "3x40,1x300", "--repeat", "1", "--peers",
                        "none", "--dtypes", "float32,bfloat16,float16,float64",
                        "--markdown")
    assert rc == 0, out
    assert "| device | op |" in out
    assert out.count("| cpu |") == 3 * 3 * 4 * 2


def test_python_dash_m_entry_point(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "numba_fused", "bench", "--ops", "softmax",
                        "--direction", "fwd", "--dtypes", "float32", "--shapes", "4x32",
                        "--repeat", "1", "--peers", "none"],
                       capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "softmax" in p.stdout and "error gate: ok" in p.stdout
    assert "[1/1] cpu softmax fwd float32 4x32" in p.stderr      # progress on stderr
    p = subprocess.run([sys.executable, "-m", "numba_fused"], capture_output=True,
                       text=True, cwd=tmp_path, env=env, timeout=60)
    assert p.returncode == 0 and "bench" in p.stdout


# ---------------------------------------------------------- the error gate
class _Broken:
    """numba_fused with softmax_fwd off by 1e-3 of the scale (test hook)."""

    def __getattr__(self, name):
        return getattr(nf, name)

    @staticmethod
    def softmax_fwd(x, out=None, **kw):
        y = nf.softmax_fwd(x, out=out, **kw)
        y[..., 0] += (1e-3 * y.max()).astype(y.dtype)
        return y


def test_error_gate_fails_on_a_wrong_kernel(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(B, "KERNELS", _Broken())
    j = tmp_path / "r.json"
    rc, out, _ = _bench(capsys, *TINY, "--ops", "softmax,rms_norm", "--dtypes", "float32",
                        "--peers", "none", "--json", str(j))
    assert rc == 1
    assert "error gate: FAIL" in out and "FAIL" in out
    recs = [r for r in json.loads(j.read_text())["records"] if r["impl"] == "numba_fused"]
    bad = {(r["op"], r["direction"]) for r in recs if not r["ok"]}
    assert bad == {("softmax", "fwd"), ("softmax", "fwd+bwd")}
    assert {r["err_output"] for r in recs if not r["ok"] and r["direction"] == "fwd"} == {"y"}


def test_max_error_is_relative_to_scale_and_catches_nan():
    r = {"y": np.array([[1.0, -4.0]]), "rstd": np.array([2.0])}
    assert B.max_error({"y": np.array([[1.0, -4.0]]), "rstd": np.array([2.0])}, r)[0] == 0
    e, where = B.max_error({"y": np.array([[1.4, -4.0]]), "rstd": np.array([2.0])}, r)
    assert math.isclose(e, 0.1) and where == "y"
    e, where = B.max_error({"y": np.array([[np.nan, -4.0]]), "rstd": np.array([2.0])}, r)
    assert e == math.inf and where == "y"


def test_max_error_scales_mean_by_the_rows_std():
    """A mean near 0 is judged against the row's std (1/rstd), not against itself."""
    r = {"mean": np.array([1e-6]), "rstd": np.array([0.5])}
    e, where = B.max_error({"mean": np.array([1e-6 + 1e-8]), "rstd": np.array([0.5])}, r)
    assert math.isclose(e, 1e-8 / 2.0) and where == "mean"
    r = {"mean": np.array([40.0, 1e-6]), "rstd": np.array([0.5, 1.0])}
    e, _ = B.max_error({"mean": np.array([40.0, 1e-6 + 1e-4]), "rstd": r["rstd"]}, r)
    assert math.isclose(e, 1e-4 / 40.0)


def test_traffic_counts_each_input_and_output_once():
    x = np.zeros((4, 8), np.float32)
    w = np.zeros(8, np.float32)
    assert B.traffic_bytes("softmax", "fwd", {"x": x}) == 2 * 128
    assert B.traffic_bytes("softmax", "fwd+bwd", {"x": x}) == 5 * 128
    inp = {"x": x, "weight": w}
    assert B.traffic_bytes("rms_norm", "fwd", inp) == 2 * 128 + 32 + 16
    assert B.traffic_bytes("rms_norm", "bwd", inp) == 3 * 128 + 64 + 16
    assert B.traffic_bytes("layer_norm", "fwd", inp) == 2 * 128 + 64 + 32
    assert B.traffic_bytes("layer_norm", "bwd", inp) == 3 * 128 + 96 + 32
    xb = np.zeros((4, 8), B._np_dtype("bfloat16"))
    assert B.traffic_bytes("softmax", "bwd", {"x": xb}) == 3 * 64


def test_inputs_are_random_and_fresh():
    rng = np.random.default_rng()
    a, _ = B.make_inputs("layer_norm", "bwd", "bfloat16", (4, 16), rng)
    b, _ = B.make_inputs("layer_norm", "bwd", "bfloat16", (4, 16), rng)
    for k in ("x", "dy", "weight", "bias"):
        assert np.count_nonzero(a[k].astype(np.float32)) > 0
        assert not np.array_equal(a[k], b[k])


# ------------------------------------------------------------------- peers
def test_absent_peers_are_a_note_not_an_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)        # import torch -> ImportError
    monkeypatch.setitem(sys.modules, "jax", None)
    monkeypatch.setitem(sys.modules, "cupy", None)
    rc, out, _ = _bench(capsys, *TINY, "--ops", "softmax", "--direction", "fwd",
                        "--dtypes", "float32", "--peers", "torch,jax,numpy,cupy")
    assert rc == 0
    notes = [ln for ln in out.splitlines() if ln.startswith("note:")]
    assert any("peer torch: not installed" in n for n in notes)
    assert any("peer jax: not installed" in n for n in notes)
    assert any("peer cupy: not available on device cpu" in n for n in notes)
    head, rows = _table_cells(out)
    assert "numpy" in head and "torch" not in head and "jax" not in head


def test_default_peers_when_installed(capsys):
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    rc, out, _ = _bench(capsys, *TINY, "--ops", "layer_norm", "--dtypes", "bfloat16")
    assert rc == 0, out
    head, rows = _table_cells(out)
    assert {"numpy", "torch", "jax"} <= set(head)
    assert len(rows) == 3 and all(r[-1] == "ok" for r in rows)
    assert not any("failed" in ln for ln in out.splitlines())


def test_peer_errors_are_recorded(capsys, tmp_path):
    torch = pytest.importorskip("torch")
    j = tmp_path / "r.json"
    rc, out, _ = _bench(capsys, *TINY, "--dtypes", "float32,bfloat16", "--peers",
                        "torch", "--json", str(j), "--threads", "1")
    assert rc == 0, out
    doc = json.loads(j.read_text())
    assert torch.get_num_threads() >= 1
    peers = [r for r in doc["records"] if r["impl"] == "torch"]
    assert len(peers) == 18
    for r in peers:
        assert r["max_err"] < 8 * B.TOLERANCES[r["dtype"]], r
        assert r["ok"] is None and r["tol"] is None and r["threads"] == 1


def test_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "p.png"
    rc, out, _ = _bench(capsys, "--shapes", "8x64,4x256", "--repeat", "1", "--peers",
                        "numpy", "--ops", "softmax,rms_norm", "--dtypes", "float32",
                        "--plot", str(png))
    assert rc == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------- GPU
def test_gpu_without_a_gpu_is_a_one_line_note(capsys, monkeypatch):
    monkeypatch.setattr(B, "gpu_available", lambda: (False, "no CUDA GPU is available"))
    rc, out, _ = _bench(capsys, *TINY, "--device", "gpu")
    assert rc == 0
    assert "note: device gpu skipped: no CUDA GPU is available" in out
    rc, out, _ = _bench(capsys, *TINY, "--device", "all", "--peers", "none", "--ops",
                        "softmax", "--direction", "fwd", "--dtypes", "float32")
    assert rc == 0 and "device gpu skipped" in out
    head, rows = _table_cells(out)
    assert [r[0] for r in rows] == ["cpu"]
    assert cli._devices(None) == ("cpu",)


def test_gpu_peer_list_and_notes():
    cfg = B.Config(peers=("numpy", "torch", "cupy"))
    assert B._peer_list(cfg, "gpu") == (["torch", "cupy"], ["numpy"])
    assert B._peer_list(cfg, "cpu") == (["numpy", "torch"], ["cupy"])
    assert B._peer_list(B.Config(), "gpu") == (list(B.GPU_PEERS), [])


def test_gpu_path_in_the_cuda_simulator(tmp_path):
    """The device code path (device arrays, dtype tag, sync, D2D copy roofline)
    through numba-cuda's simulator, in a subprocess (the flag is read at import)."""
    pytest.importorskip("numba.cuda")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = (
        "import sys; from numba_fused import bench as B, cli\n"
        "B.MIN_SAMPLE_S = 1e-9; B.WARM_S = 0.0; B.WARM_CALLS = 1; B.SETTLE_S = 0\n"
        "ok, why = B.gpu_available()\n"
        "if not ok: print('SKIP', why); sys.exit(0)\n"
        "sys.exit(cli.main(['bench', '--device', 'gpu', '--ops', 'softmax,rms_norm',"
        " '--direction', 'fwd', '--dtypes', 'float32,bfloat16,float16', '--shapes',"
        " '2x32', '--repeat', '1', '--peers', 'none', '--quiet']))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=240)
    if p.stdout.startswith("SKIP"):
        pytest.skip(p.stdout.strip())
    assert p.returncode == 0, p.stdout + p.stderr
    rows = [ln.split() for ln in p.stdout.splitlines() if ln.startswith("gpu ")]
    assert len(rows) == 6 and all(r[-1] == "ok" for r in rows), p.stdout


# ------------------------------------------------------------------ warmup
def test_warmup_subcommand_reports_total(capsys, monkeypatch):
    from numba_fused import cpu
    calls = []

    def fake(dtypes=None, verbose=False, jobs=1):
        calls.append((dtypes, jobs))
        return {"float32/float32/serial": 0.25, "float32/float32/parallel": 0.5}
    monkeypatch.setattr(cpu, "warmup", fake)
    assert cli.main(["warmup"]) == 0
    out = capsys.readouterr().out
    assert "float32/float32/parallel" in out and "warmup: 2 kernel groups" in out
    assert " s" in out.splitlines()[-1]
    assert calls[-1] == (None, cli.default_warmup_jobs())
    assert 1 <= cli.default_warmup_jobs() <= cli.WARMUP_JOBS
    assert cli.main(["warmup", "--dtypes", "bf16", "-j", "3"]) == 0
    assert calls[-1] == (("bfloat16",), 3)
    assert "(3 processes)" in capsys.readouterr().out
    assert cli.main(["warmup", "--jobs", "1"]) == 0
    assert calls[-1] == (None, 1) and "processes" not in capsys.readouterr().out
    assert cli.main(["warmup", "--jobs", "0"]) == 2 and "--jobs" in capsys.readouterr().err


def test_warmup_missing_is_reported(capsys, monkeypatch):
    from numba_fused import cpu
    monkeypatch.delattr(cpu, "warmup", raising=False)
    assert cli.main(["warmup"]) == 1
    assert "warmup() does not exist" in capsys.readouterr().err


def test_float32_weights_for_16_bit_inputs(capsys, tmp_path):
    j = tmp_path / "r.json"
    rc, out, _ = _bench(capsys, *TINY, "--ops", "rms_norm,layer_norm", "--dtypes",
                        "bfloat16", "--weight-dtype", "float32", "--peers", "numpy",
                        "--json", str(j))
    assert rc == 0, out
    recs = json.loads(j.read_text())["records"]
    assert {r["param_dtype"] for r in recs} == {"float32"}
    assert all(r["ok"] for r in recs if r["impl"] == "numba_fused")


class _Raising(_Broken):
    @staticmethod
    def softmax_bwd(y, dy, out=None, **kw):
        raise RuntimeError("kernel exploded")


def test_a_raising_kernel_fails_the_run_but_not_the_others(capsys, monkeypatch):
    monkeypatch.setattr(B, "KERNELS", _Raising())
    rc, out, _ = _bench(capsys, *TINY, "--ops", "softmax", "--dtypes", "float32",
                        "--direction", "bwd,fwd", "--peers", "numpy")
    assert rc == 1
    assert "numba_fused FAILED: cpu softmax bwd float32 8x64: RuntimeError: kernel exploded" in out
    head, rows = _table_cells(out)
    assert [(r[1], r[2]) for r in rows] == [("softmax", "fwd")]


def test_copy_roofline_copies_with_the_kernels_stores():
    """The CPU roofline copies correctly, every thread count and length, with the
    kernels' stores: non-temporal ones (whole aligned blocks) only from
    cpu.STREAM_BYTES of dst, and no memcpy call (LLVM's memcpy for ``dst[i] =
    src[i]`` switches to non-temporal stores above a glibc size threshold: the
    roofline changed kind with the size)."""
    from numba_fused import cpu
    kern = B.make_copy_kernel(cache=False)
    rng = np.random.default_rng(7)
    for n in (4099, 64, 5, cpu.STREAM_BYTES // 4 + 37):
        src = rng.standard_normal(n, dtype=np.float32)
        for threads in (1, 2, 3):
            dst = np.zeros_like(src)
            kern(src, dst, np.int64(threads))
            assert np.array_equal(dst, src)
    asm = kern.inspect_asm(kern.signatures[0])
    assert "memcpy" not in asm and "vmovnt" in asm
    imp = B.cpu_copy_impl(1 << 16, rng)
    imp.fn()
    assert imp.bytes == 1 << 16


def test_sample_leads_with_an_untimed_call():
    """A sample calls its implementation once untimed, then times ``number``
    calls: a slow first (cold) call is not in the time."""
    calls = []

    def fn():
        calls.append(None)
        time.sleep(0.2 if len(calls) == 1 else 0.001)
    impl = B.Impl("slow first", fn)
    impl.number = 3
    t = B._sample(impl)
    assert len(calls) == 4
    assert t < 0.05


def test_pauses_are_longer_after_a_runtime_that_keeps_spinning(monkeypatch):
    """Each sample waits SETTLE_S first, SPIN_SETTLE_S after a sample of an
    implementation whose threads go on spinning (``Impl.settle``: JAX's); the
    rounds rotate the starting implementation; SETTLE_S = 0 pauses never."""
    monkeypatch.setattr(B, "SETTLE_S", 0.003)
    pauses, order = [], []
    monkeypatch.setattr(B.time, "sleep", pauses.append)
    impls = [B.Impl(name, lambda name=name: order.append(name)) for name in ("a", "jax", "b")]
    impls[1].settle = 0.02
    B.time_interleaved(impls, 2)
    assert order[1::2] == ["a", "jax", "b", "jax", "b", "a"]   # lead-in call, then timed
    assert pauses == [0.003, 0.003, 0.02, 0.003, 0.02, 0.003]
    monkeypatch.setattr(B, "SETTLE_S", 0.0)
    pauses.clear()
    B.time_interleaved(impls, 1)
    assert pauses == [] and [len(i.samples) for i in impls] == [3, 3, 3]
    assert B.SPIN_SETTLE_S > 0.003

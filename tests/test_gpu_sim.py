"""The GPU path in the CUDA simulator: tests/gpu_cases.py in its own process.

``NUMBA_ENABLE_CUDASIM=1`` has to be set before numba is first imported, so the
cases run in a child pytest; its output is shown when it fails. The simulator runs
one Python thread per CUDA thread, so the cases use tiny shapes and gpu.SIM_TABLE's
tiny blocks (~2.5 min of one core; the child starts when the cases are collected and
runs beside the rest of the suite, see ``start_cases``).
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _simulator_available():
    code = "import numba.cuda.simulator"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                          capture_output=True).returncode == 0


SIMULATOR = _simulator_available()
_cases = None       # (child process, its output file) once started


def start_cases():
    """Start the simulator cases' child process (once). conftest.py calls this when
    the cases are collected, so the child (one core, ~2.5 min) runs beside the rest
    of the suite instead of after it (CI has two cores); the test waits for it."""
    global _cases
    if _cases is None and SIMULATOR:
        cmd = [sys.executable, "-m", "pytest", "tests/gpu_cases.py", "-q", "-p",
               "no:cacheprovider", "-W", "ignore::RuntimeWarning", "-o", "addopts=", "-rfEs"]
        out = tempfile.TemporaryFile("w+")
        _cases = subprocess.Popen(cmd, env=_sim_env(), cwd=ROOT, stdout=out,
                                  stderr=subprocess.STDOUT, text=True), out
    return _cases


def stop_cases():
    """Kill the child if the session ends before its test waited for it."""
    if _cases is not None and _cases[0].poll() is None:
        _cases[0].kill()
        _cases[0].wait()


@pytest.mark.skipif(not SIMULATOR, reason="numba's CUDA simulator is missing")
def test_gpu_cases_in_simulator():
    child, out = start_cases()
    try:
        rc = child.wait(timeout=900)
    except subprocess.TimeoutExpired:
        child.kill()
        raise
    out.seek(0)
    log = out.read()
    assert rc == 0, f"simulator cases failed (rc={rc}):\n{log[-12000:]}"
    assert " passed" in log and " failed" not in log, log[-3000:]


def _sim_env():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@pytest.mark.skipif(not SIMULATOR, reason="numba's CUDA simulator is missing")
def test_gpu_check_script_in_simulator(tmp_path):
    """benchmarks/gpu_check.sh end to end in the simulator (GPU_CHECK_SIMULATOR=1):
    versions, the benchmark's argument handling and the Markdown table."""
    out = tmp_path / "table.md"
    env = dict(_sim_env(), GPU_CHECK_SIMULATOR="1", PYTHON=sys.executable)
    p = subprocess.run(["bash", "benchmarks/gpu_check.sh", str(out), "--ops", "softmax,rms_norm",
                        "--dtypes", "bfloat16", "--directions", "fwd,bwd"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-6000:]
    assert "numba.cuda implementation" in log and "== benchmark" in log
    text = out.read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert lines[0].startswith("| op | dir | dtype | shape | ms | GB/s | % copy"), text
    body = lines[1:]
    assert len(body) == 2 * 2, text                          # ops x directions
    assert {(r.split("|")[1].strip(), r.split("|")[2].strip(), r.split("|")[3].strip())
            for r in body} == {(o, d, t) for o in ("softmax", "rms_norm")
                               for d in ("fwd", "bwd") for t in ("bfloat16",)}
    assert "FAIL" not in text and "SIMULATOR" in text


@pytest.mark.parametrize("args,msg", [(["--shapes", "3y4"], "ROWSxCOLS"),
                                      (["--dtypes", "int8"], "unsupported dtype"),
                                      (["--ops", "gelu"], "--ops"),
                                      (["--repeat", "0"], ">= 1")])
def test_gpu_bench_rejects_bad_arguments(tmp_path, args, msg):
    p = subprocess.run([sys.executable, "benchmarks/gpu_bench.py", str(tmp_path / "t.md")] + args,
                       env=_sim_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and msg in p.stderr, p.stderr[-2000:]
    assert not (tmp_path / "t.md").exists()


def test_gpu_check_script_needs_an_output_path():
    p = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 2 and "usage" in p.stderr

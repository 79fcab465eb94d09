"""The GPU path in the CUDA simulator: tests/gpu_cases.py in its own process.

``NUMBA_ENABLE_CUDASIM=1`` has to be set before numba is first imported, so the
cases run in a child pytest; its output is shown when it fails. The simulator runs
one Python thread per CUDA thread, so the cases use tiny shapes and gpu.SIM_TABLE's
tiny blocks (about a minute on two cores).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _simulator_available():
    code = "import numba.cuda.simulator"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT,
                          capture_output=True).returncode == 0


@pytest.mark.skipif(not _simulator_available(), reason="numba's CUDA simulator is missing")
def test_gpu_cases_in_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [sys.executable, "-m", "pytest", "tests/gpu_cases.py", "-q", "-p", "no:cacheprovider",
           "-W", "ignore::RuntimeWarning", "-o", "addopts=", "-rfEs"]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"simulator cases failed (rc={p.returncode}):\n{out[-12000:]}"
    assert " passed" in out and " failed" not in out, out[-3000:]


def _sim_env():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@pytest.mark.skipif(not _simulator_available(), reason="numba's CUDA simulator is missing")
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

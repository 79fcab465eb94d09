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

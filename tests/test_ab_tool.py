"""benchmarks/ab.py: the in-process A/B timer runs a git revision beside the tree."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which("git") is None
                    or not os.path.isdir(os.path.join(ROOT, ".git")),
                    reason="needs a git checkout")
def test_ab_runs_base_beside_working_tree():
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "ab.py"), "--base", "HEAD",
         "--ops", "rms_fwd,softmax_bwd", "--shapes", "4x64", "--dtypes", "float32",
         "--rounds", "2"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = [l for l in r.stdout.splitlines() if "median ratio" in l]
    assert [l.split()[0] for l in rows] == ["rms_fwd", "softmax_bwd"]
    for l in rows:
        ratio = float(l.split("median ratio")[1])
        assert 0 < ratio < 100


def test_ab_rejects_unknown_op():
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "ab.py"), "--ops", "softmax"],
        capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--ops: unknown ['softmax']" in r.stderr


@pytest.mark.skipif(shutil.which("git") is None
                    or not os.path.isdir(os.path.join(ROOT, ".git")),
                    reason="needs a git checkout")
def test_ab_evict_option():
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "ab.py"), "--base", "HEAD",
         "--ops", "softmax_fwd", "--shapes", "4x64", "--dtypes", "float32",
         "--rounds", "2", "--evict", "1"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "1 MiB written before each" in r.stdout
    assert len([l for l in r.stdout.splitlines() if "median ratio" in l]) == 1
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "ab.py"), "--evict", "-1"],
        capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--evict" in r.stderr

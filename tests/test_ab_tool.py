"""benchmarks/ab.py: the in-process A/B timer runs a git revision beside the tree."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_git = pytest.mark.skipif(shutil.which("git") is None
                               or not os.path.isdir(os.path.join(ROOT, ".git")),
                               reason="needs a git checkout")


def ab(*args, timeout=600):
    return subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "ab.py"), *args],
                          capture_output=True, text=True, timeout=timeout)


def timed_rows(stdout):
    return [l for l in stdout.splitlines() if "median ratio" in l]


@needs_git
def test_ab_runs_base_beside_working_tree():
    """One run (each compiles the base revision's kernels afresh: ~10 s), with
    ``--evict`` and ``--weight-dtype``."""
    r = ab("--base", "HEAD", "--ops", "rms_fwd,softmax_bwd", "--shapes", "4x64",
           "--dtypes", "float32", "--rounds", "2", "--evict", "1", "--weight-dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert "1 MiB written before each; float32 weight and bias" in r.stdout
    rows = timed_rows(r.stdout)
    assert [l.split()[0] for l in rows] == ["rms_fwd", "softmax_bwd"]
    for l in rows:
        ratio = float(l.split("median ratio")[1])
        assert 0 < ratio < 100


def test_ab_rejects_unknown_op():
    r = ab("--ops", "softmax", timeout=120)
    assert r.returncode == 2 and "--ops: unknown ['softmax']" in r.stderr


def test_ab_rejects_negative_evict():
    r = ab("--evict", "-1", timeout=120)
    assert r.returncode == 2 and "--evict" in r.stderr


def test_pool_ab_times_each_pattern_at_each_threshold_and_restores_it():
    """benchmarks/pool_ab.py: one row per shape, op and pattern, a time per
    POOL_MIN_BYTES value and the ratios to the first; run in-process, it leaves
    the library's threshold as it found it."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import pool_ab
    finally:
        sys.path.pop(0)
    import contextlib
    import io
    from numba_fused import _alloc
    before = _alloc.POOL_MIN_BYTES
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pool_ab.main(["--from", f"{1 << 25},{1 << 12},{1 << 14}", "--shapes", "8x256",
                      "--ops", "softmax,layer_norm", "--rounds", "2", "--elements", "1e4",
                      "--no-torch"])
    assert _alloc.POOL_MIN_BYTES == before
    rows = [l.split() for l in out.getvalue().splitlines()[1:]]
    assert [r[:3] for r in rows] == [["8x256", op, pat] for op in ("softmax", "layer_norm")
                                    for pat in ("fb", "step4")]
    for r in rows:
        times = [float(v) for v in r[3:8:2]]         # "t1 / t2 / t3"
        assert r[4] == r[6] == "/" and all(t > 0 for t in times)
        assert len(r) == 10 and all(v.endswith("x") for v in r[8:])

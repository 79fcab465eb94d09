"""Runtime behaviour of the CPU backend: concurrent callers, the on-disk cache
shared by processes starting at once, and ahead-of-use compilation."""
import ast
import inspect
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numba
import numpy as np
import pytest
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

import numba_fused as nf
from numba_fused import cpu

ROOT = Path(__file__).resolve().parents[1]


def _ops(x, dy, w):
    y = nf.softmax_fwd(x)
    out = [y, nf.softmax_bwd(y, dy)]
    yr, rstd = nf.rms_norm_fwd(x, w)
    out += [yr, rstd, *nf.rms_norm_bwd(dy, x, w, rstd)]
    yl, mean, rstd = nf.layer_norm_fwd(x, w, w)
    out += [yl, mean, rstd, *nf.layer_norm_bwd(dy, x, w, w, mean, rstd)]
    return out


def test_eight_threads_launching_parallel_kernels_at_once():
    rng = np.random.default_rng(7)
    shape = (64, cpu.SERIAL_BELOW // 32)          # run on the parallel kernels (forced)
    x = rng.standard_normal(shape).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    with cpu.forced(parallel=False):
        expected = _ops(x, dy, w)
    barrier = threading.Barrier(8)
    results, errors = [None] * 8, []

    def worker(i):
        try:
            barrier.wait()
            for _ in range(5):
                results[i] = _ops(x, dy, w)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    with cpu.forced(parallel=True):
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    assert not errors, errors
    for got in results:
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a, b)   # deterministic: same bits


_SMALL_THREADS = textwrap.dedent("""
    # 8 threads making the process's first small calls at once: each signature
    # is compiled (or loaded from the cache) while other threads call the entry
    import threading, ml_dtypes, numpy as np, numba_fused as nf
    rng = np.random.default_rng(5)
    cases = []
    for dt, pdt in ((np.float32, np.float32), (np.float64, np.float64),
                    (np.float64, np.float32), (ml_dtypes.bfloat16, ml_dtypes.bfloat16),
                    (np.float16, np.float32)):
        x = rng.standard_normal((4, 96)).astype(dt)
        w = rng.standard_normal(96).astype(pdt)
        cases.append((x, w))
    def run(x, w):
        y, mean, rstd = nf.layer_norm_fwd(x, w, None)
        dx, dw, db = nf.layer_norm_bwd(x, x, w, None, mean, rstd)
        s = nf.softmax_bwd(nf.softmax_fwd(x), x)
        return [y, mean, rstd, dx, dw, s, *nf.rms_norm_fwd(x, None)]
    barrier, results, errors = threading.Barrier(8), {}, []
    def worker(i):
        try:
            barrier.wait()
            for k in range(6):
                c = (i + k) % len(cases)
                results[i, k] = (c, run(*cases[c]))
        except Exception as e:
            errors.append(repr(e))
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads: t.start()
    for t in threads: t.join(600)
    assert not errors, errors
    expected = [run(*c) for c in cases]
    for c, got in results.values():
        for a, b in zip(got, expected[c]):
            assert a.tobytes() == b.tobytes()
    print("ok", len(results))
""")


def test_calibrated_thresholds(monkeypatch):
    """The serial/parallel thresholds follow the measured launch cost: the floors
    at ~2 us, 2 * launch * serial rate above them, capped; forced() overrides and
    restores them."""
    monkeypatch.setattr(cpu, "_serial_below", dict(cpu._serial_below))
    monkeypatch.setattr(cpu, "_calibrated", False)
    monkeypatch.setattr(cpu, "launch_cost", lambda: 2e-6)
    cpu._calibrate()
    assert cpu._calibrated
    assert abs(cpu._serial_below["softmax_fwd"] - 2 * 2 * cpu._SERIAL_RATE["softmax_fwd"]) <= 1
    assert cpu._serial_below["softmax_bwd"] == cpu.SERIAL_BELOW
    assert cpu._serial_below["rms_norm_bwd+params"] == 1 << 17
    monkeypatch.setattr(cpu, "launch_cost", lambda: 60e-6)
    cpu._calibrate()
    assert abs(cpu._serial_below["softmax_bwd"] - 2 * 60 * cpu._SERIAL_RATE["softmax_bwd"]) <= 1
    monkeypatch.setattr(cpu, "launch_cost", lambda: 1e-3)
    cpu._calibrate()
    assert set(cpu._serial_below.values()) == {cpu.SERIAL_CAP}
    saved = dict(cpu._serial_below)
    with cpu.forced(parallel=True):
        assert set(cpu._serial_below.values()) == {0}
    assert cpu._serial_below == saved
    assert cpu.SMALL_BELOW["softmax_fwd"] == 1 << 13      # entries keep the floors
    assert 0 < cpu.launch_cost() < 1.0                    # the real probe runs


def test_eight_threads_first_small_calls_at_once():
    r = subprocess.run([sys.executable, "-c", _SMALL_THREADS], capture_output=True, text=True,
                       timeout=900, env=dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep
                                             + os.environ.get("PYTHONPATH", "")))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ok", "48"]


_FORK = textwrap.dedent("""
    import hashlib, os, numpy as np, numba, numba_fused as nf
    from numba_fused import cpu
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 1000)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    w = rng.standard_normal(1000).astype(np.float32)

    def run():
        y, mean, rstd = nf.layer_norm_fwd(x, w, w)
        return hashlib.sha256(b"".join(a.tobytes() for a in (
            y, mean, rstd, *nf.layer_norm_bwd(dy, x, w, w, mean, rstd)))).hexdigest()

    with cpu.forced(True):
        parent = run()                    # numba's threads are up from here
    print(numba.threading_layer(), cpu._gnu_omp_running())
    r, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        with cpu.forced(True):            # as warmup would: still serial here
            os.write(wr, run().encode())
        os._exit(0)
    os.close(wr)
    _, status = os.waitpid(pid, 0)
    print(status, os.read(r, 64).decode() == parent)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_after_parallel_calls_runs_them_serially():
    """A process runs parallel kernels, then forks (multiprocessing, a DataLoader's
    workers): on numba's omp layer with GNU OpenMP numba would end the child at its
    first parallel launch (SIGTERM). The child runs the serial kernels instead,
    even under ``forced(True)``, and gets the parent's bits."""
    r = subprocess.run([sys.executable, "-c", _FORK], capture_output=True, text=True,
                       timeout=900, env=dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep
                                             + os.environ.get("PYTHONPATH", "")))
    assert r.returncode == 0, r.stderr[-3000:]
    (layer, gnu), (status, same) = (line.split() for line in r.stdout.splitlines())
    assert status == "0", (layer, gnu, r.stderr[-3000:])
    assert same == "True"


_CHILD = textwrap.dedent("""
    import hashlib, sys, numpy as np, ml_dtypes, numba_fused as nf
    from numba_fused import cpu
    dtype = np.dtype(ml_dtypes.bfloat16 if sys.argv[1] == "bfloat16" else sys.argv[1])
    x = np.random.default_rng(3).standard_normal((8, 96)).astype(dtype)
    y = nf.softmax_fwd(x)
    dx = nf.softmax_bwd(y, x)
    misses = sum(sum(d.stats.cache_misses.values()) for d in cpu.SERIAL.values())
    print(hashlib.sha256(y.tobytes() + dx.tobytes()).hexdigest(), misses)
""")

#: one dtype a process: each compiles its own signatures of the same kernels (the
#: softmax pair: a process compiles it in ~5 s, the LayerNorm pair in ~12 s, and
#: this test runs 5 at once beside the other pytest worker)
CACHE_DTYPES = ("bfloat16", "float16", "float32", "float64")


def crossed_cache_entries(cache):
    """Index entries of the on-disk cache under ``cache`` whose data file holds
    another signature than the entry's key."""
    import pickle
    crossed = []
    for index in Path(cache).rglob("*.nbi"):
        with open(index, "rb") as f:
            pickle.load(f)                                  # numba's version
            _, overloads = pickle.loads(f.read())
        for key, name in overloads.items():
            with open(index.parent / name, "rb") as f:
                data = pickle.loads(f.read())
            if tuple(data[3].args) != tuple(key[0]):        # CompileResult._reduce()
                crossed.append((index.name, key[0], data[3].args))
    return crossed


def test_processes_filling_one_empty_cache_at_once(tmp_path):
    """Processes filling one empty cache at once, two of them with one dtype and
    the others with other dtypes (other signatures of the same kernels): every
    index entry names its own signature's code, the two of one dtype compile each
    kernel once between them, and a later process of each dtype loads all its
    kernels from the cache and computes the same bits."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    dtypes = CACHE_DTYPES + CACHE_DTYPES[:1]
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, dtype], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for dtype in dtypes]
    outs = [p.communicate(timeout=900) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    digests = [out.split()[0] for out, _ in outs]
    assert digests[0] == digests[-1] and len(set(digests)) == len(CACHE_DTYPES), digests
    # the two processes of one dtype compiled between them (each entry once, by
    # whichever took its lock first) what the float16 process compiled alone
    misses = [int(out.split()[1]) for out, _ in outs]
    assert misses[0] + misses[-1] == misses[CACHE_DTYPES.index("float16")] > 0, misses
    assert any((tmp_path / "cache").rglob("*.nbc")), "nothing was cached"
    assert crossed_cache_entries(tmp_path / "cache") == []
    for dtype, digest in zip(CACHE_DTYPES, digests):
        again = subprocess.run([sys.executable, "-c", _CHILD, dtype], env=env,
                               capture_output=True, text=True, timeout=600)
        assert again.returncode == 0, again.stderr[-3000:]
        assert again.stdout.split() == [digest, "0"], dtype


def _compile_result(*args):
    """What numba's cache stores for a kernel of signature ``args`` (its
    ``CompileResult._reduce()``; only the signature matters here)."""
    from numba.core.typing import signature
    return (b"code", None, None, signature(types.void, *args), False, (), "", None, ())


def test_cache_entries_of_processes_saving_at_once_never_cross(tmp_path):
    """Two processes save two signatures of one kernel at once, each against the
    index as it read it before the other's save, and the index written last is
    the one whose data was written first. With numba's numbered data files both
    pick the first number and the index names the other signature's code (the
    harness checks it does); with the keyed files every entry the index names
    loads its own signature (one lost to the stale index is a miss)."""
    from numba.core import caching
    from numba_fused._cache import KeyedDataCacheFile
    sig_a = (types.int64, types.CPointer(types.int16), types.float32)
    sig_b = (types.int64, types.CPointer(types.float32), types.float32)
    key_a, key_b = ((sig, ("x86_64",), ("code", "")) for sig in (sig_a, sig_b))

    def race(cls, path):
        a, b = (cls(str(path), "cpu._kernel-10.py311", ("stamp",)) for _ in range(2))
        path.mkdir()
        stale = a._load_index()
        deferred = []
        a._save_data = lambda name, data: deferred.append((name, data))
        b._load_index = lambda: dict(stale)         # b read the index before a wrote it
        a.save(key_a, _compile_result(*sig_a))      # a: its index entry, data deferred
        b.save(key_b, _compile_result(*sig_b))      # b: its data and its (stale) index
        for name, data in deferred:                  # a's data last
            cls._save_data(a, name, data)
        reader = cls(str(path), "cpu._kernel-10.py311", ("stamp",))
        loaded = {sig: reader.load(key) for sig, key in ((sig_a, key_a), (sig_b, key_b))}
        return {sig: None if data is None else tuple(data[3].args)
                for sig, data in loaded.items()}

    numbered = race(caching.IndexDataCacheFile, tmp_path / "numbered")
    assert any(got is not None and got != sig for sig, got in numbered.items()), numbered
    keyed = race(KeyedDataCacheFile, tmp_path / "keyed")
    assert all(got is None or got == sig for sig, got in keyed.items()), keyed
    assert keyed[sig_b] == sig_b


def test_cache_drops_the_data_of_other_sources(tmp_path):
    """The first save after the sources changed deletes the data files the old
    index named (keyed names are never reused, so they would pile up), whichever
    layout wrote them; the other functions' files stay."""
    from numba.core import caching
    from numba_fused._cache import KeyedDataCacheFile
    sig = (types.int64, types.CPointer(types.float32), types.float32)
    key = (sig, ("x86_64",), ("code", ""))
    base = "cpu._kernel-10.py311"
    old = caching.IndexDataCacheFile(str(tmp_path), base, ("v0",))
    old.save(key, _compile_result(*sig))
    other = KeyedDataCacheFile(str(tmp_path), "cpu._other-20.py311", ("v1",))
    other.save(key, _compile_result(*sig))
    v1 = KeyedDataCacheFile(str(tmp_path), base, ("v1",))
    v1.save(key, _compile_result(*sig))
    v2 = KeyedDataCacheFile(str(tmp_path), base, ("v2",))
    v2.save(key, _compile_result(*sig))
    names = sorted(p.name for p in tmp_path.glob("*.nbc"))
    assert names == sorted([v2.data_name(key), other.data_name(key)]), names
    assert tuple(v2.load(key)[3].args) == sig and v1.load(key) is None


_STAMP_CHILD = textwrap.dedent("""
    import numpy as np, numba_fused as nf
    from numba_fused import cpu
    with cpu.forced(False):
        nf.softmax_fwd(np.arange(12, dtype=np.float32).reshape(3, 4))
    st = cpu.SERIAL["softmax_fwd"].stats
    print(sum(st.cache_hits.values()), sum(st.cache_misses.values()))
""")


def test_cache_follows_the_modules_inlined_into_kernels(tmp_path):
    """A cached kernel of cpu.py holds code of _dtypes/_lanes/_vecmath: a change in
    one of those alone recompiles it (numba itself checks only cpu.py's hash)."""
    import shutil
    pkg = tmp_path / "src" / "numba_fused"
    shutil.copytree(ROOT / "numba_fused", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(pkg.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def run():
        p = subprocess.run([sys.executable, "-c", _STAMP_CHILD], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        return tuple(map(int, p.stdout.split()))

    assert run()[1] > 0                     # compiled
    assert run()[1] == 0                    # loaded
    with open(pkg / "_lanes.py", "a") as f:
        f.write("\n# an edit that changes no code\n")
    hits, misses = run()
    assert misses > 0, "the kernel was loaded from a cache made with another _lanes.py"
    assert run()[1] == 0                    # and cached again


def _kernel_misses():
    """Signatures this process compiled (not loaded) so far, over cpu's kernels."""
    from numba.core.registry import CPUDispatcher
    kernels = [v for v in vars(cpu).values() if isinstance(v, CPUDispatcher)]
    kernels += [d for v in vars(cpu).values() if isinstance(v, dict)
                for d in v.values() if isinstance(d, CPUDispatcher)]
    return sum(sum(k.stats.cache_misses.values()) for k in set(kernels))


def test_warmup_compiles_in_worker_processes_and_loads_here():
    """With jobs, spawned processes compile (or load) the groups into the on-disk
    cache and this process loads every kernel from it: it compiles nothing. In
    process (jobs=1), the same keys."""
    keys = {"float32/float32/serial", "float32/float32/parallel", "float32/float32/blocked"}
    before = _kernel_misses()
    timings = cpu.warmup(dtypes=[np.float32], jobs=2)
    assert set(timings) == keys and all(t > 0 for t in timings.values())
    assert _kernel_misses() == before, "this process compiled what the workers had cached"
    timings = cpu.warmup(dtypes=["float32"])
    assert set(timings) == keys and all(t >= 0 for t in timings.values())


_LOCK_CHILD = textwrap.dedent("""
    from numba.core import errors, event
    from numba_fused import _cache, cpu
    held = []

    class Seen(event.Listener):
        def on_start(self, ev):
            if ev.data["dispatcher"] is cpu._param_chunks:
                held.append(len(_cache._held))

        def on_end(self, ev):
            pass

    with event.install_listener("numba:compile", Seen()):
        cpu._param_chunks(7, 9)
        after_saved = len(_cache._held)
        try:
            cpu._param_chunks(1j, "cols")
        except errors.TypingError:
            pass
        after_failed = len(_cache._held)
    print(held, after_saved, after_failed)
""")


def test_a_compile_holds_its_entry_lock_until_saved_or_failed(tmp_path):
    """A kernel signature missing from the cache is compiled under its entry's lock
    (other processes wait for it and load it), released once the entry is saved,
    and also when the compile fails (else the others would wait COMPILE_WAIT_S)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", _LOCK_CHILD], env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["[1,", "1]", "0", "0"], p.stdout


_HOLDER_CHILD = textwrap.dedent("""
    import sys, time
    from numba_fused import _cache, cpu
    _cache.KeyedDataCacheFile.save = lambda self, key, data: None     # saves nothing
    _cache._CompileOnce._release = lambda self, which: None           # and keeps the lock
    cpu._param_chunks(7, 9)
    print("held", flush=True)
    time.sleep(float(sys.argv[1]))
""")

_WAITER_CHILD = textwrap.dedent("""
    import time
    from numba_fused import _cache, cpu
    _cache.COMPILE_WAIT_S = 2.0
    t0 = time.monotonic()
    cpu._param_chunks(7, 9)
    st = cpu._param_chunks.stats
    print(round(time.monotonic() - t0, 1), sum(st.cache_misses.values()), len(_cache._held))
""")


def test_a_process_stuck_in_a_compile_delays_others_by_compile_wait_s_at_most(tmp_path):
    """Another process holds an entry's lock and never saves it: a process missing
    that entry waits COMPILE_WAIT_S, then compiles it itself, unlocked."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER_CHILD, "120"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()[-3000:]
        p = subprocess.run([sys.executable, "-c", _WAITER_CHILD], env=env,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-3000:]
        waited, misses, held = p.stdout.split()
        assert float(waited) >= 2.0 and misses == "1" and held == "0", p.stdout
    finally:
        holder.kill()
        holder.wait()


def test_lock_errors_other_than_held_do_not_wait(monkeypatch):
    """EACCES/EAGAIN: another process holds the entry (wait); any other error, as
    ENOLCK on a file system without locks: compile without waiting."""
    import errno
    from numba_fused import _cache

    def lockf(err):
        def f(*args):
            raise OSError(err, os.strerror(err))
        return f
    for err, expected in ((errno.EAGAIN, False), (errno.EACCES, False),
                          (errno.ENOLCK, None), (errno.EBADF, None)):
        monkeypatch.setattr(_cache.fcntl, "lockf", lockf(err))
        assert _cache._try_lock(0, 1) is expected, err


_LAZY_CHILD = textwrap.dedent("""
    import sys, numpy as np, numba_fused as nf
    y = nf.softmax_fwd(np.arange(12, dtype=np.float32).reshape(3, 4))
    assert "ml_dtypes" not in sys.modules, "a float32 call imported ml_dtypes"
    import ml_dtypes
    xb = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
    yb = nf.softmax_fwd(xb)                       # bfloat16 registers on first sight
    assert yb.dtype == ml_dtypes.bfloat16
    assert np.array_equal(yb, y.astype(ml_dtypes.bfloat16))
    assert nf.softmax_fwd(xb, dtype="bfloat16").dtype == yb.dtype
    print("ok")
""")


def test_float32_use_does_not_import_ml_dtypes():
    """ml_dtypes 0.7 takes ~0.85 s to import: numba_fused loads it only for bfloat16."""
    env = dict(os.environ,
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _LAZY_CHILD], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


_SERIAL_PARALLEL_CHILD = textwrap.dedent("""
    import sys, numpy as np, numba_fused as nf
    from numba_fused import cpu
    rng = np.random.default_rng(7)
    out = {}
    for shape in ((64, 1000), (40, 1000)):          # pipelined, row by row
        x = (2 * rng.standard_normal(shape)).astype(np.float32)
        w = (1 + 0.1 * rng.standard_normal(shape[1])).astype(np.float32)
        for mode in sys.argv[1].split(","):
            with cpu.forced(mode == "parallel"):
                r = (nf.softmax_fwd(x), nf.rms_norm_fwd(x, w)[0],
                     nf.layer_norm_fwd(x, w, w)[0])
            out.setdefault(shape, {})[mode] = b"".join(a.tobytes() for a in r)
    np.save(sys.argv[2], np.array([out[s][m] for s in sorted(out) for m in sorted(out[s])]))
    for name in ("softmax_fwd", "rms_norm_fwd", "layer_norm_fwd"):    # loaded or compiled
        for build, kernels in (("serial", cpu.SERIAL), ("parallel", cpu.PARALLEL)):
            st = kernels[name].stats
            print(build, name, sum(st.cache_hits.values()), sum(st.cache_misses.values()))
""")


def test_parallel_bits_equal_serial_compiled_or_cached(tmp_path):
    """A row's bits do not depend on the build (serial or parallel) nor on whether
    the process compiled the kernels or loaded them from the on-disk cache. (Seen
    2026-12-04 with reassociated sums: a process that loaded both builds from
    numba's cache computed the forwards 1 ulp apart on some rows.) Process 1
    compiles the serial kernels, process 2 loads them and compiles the parallel
    ones, process 3 loads both."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    runs, stats = [], []
    for k, modes in enumerate(("serial", "parallel,serial", "parallel,serial")):
        f = tmp_path / f"r{k}.npy"
        p = subprocess.run([sys.executable, "-c", _SERIAL_PARALLEL_CHILD, modes, str(f)],
                           env=env, capture_output=True, text=True, timeout=900)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(np.load(f))
        stats.append({tuple(line.split()[:2]): tuple(map(int, line.split()[2:]))
                      for line in p.stdout.splitlines()})
    for name in ("softmax_fwd", "rms_norm_fwd", "layer_norm_fwd"):
        assert stats[1][("serial", name)][0] > 0, "process 2 did not load the serial kernels"
        assert stats[1][("parallel", name)][1] > 0, "process 2 did not compile the parallel ones"
        for build in ("serial", "parallel"):
            hits, misses = stats[2][(build, name)]
            assert hits > 0 and misses == 0, f"process 3 compiled the {build} {name}"
    serial = runs[0]                         # [shape0 serial, shape1 serial]
    for k in (1, 2):                          # [s0 parallel, s0 serial, s1 parallel, ...]
        for s in range(2):
            assert runs[k][2 * s + 1] == serial[s], f"process {k + 1}: serial bits moved"
            assert runs[k][2 * s] == serial[s], f"process {k + 1}: parallel != serial"


# --------------------------------------------------------------- stack frames
@intrinsic
def _stack_here(typingctx):
    """The stack pointer where it runs (llvm.stacksave)."""
    def codegen(context, builder, sig, args):
        i8p = ir.IntType(8).as_pointer()
        save = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i8p, []),
                                              "llvm.stacksave")
        return builder.ptrtoint(builder.call(save, []), ir.IntType(64))
    return types.int64(), codegen


@njit
def _callee_stack():
    return _stack_here()


@njit(parallel=True)
def _framed(out):
    for k in prange(out.shape[0]):
        frame = cpu._frame_on_page()
        out[k] = _callee_stack()
        cpu._frame_back(frame)


@njit(parallel=True)
def _unframed(out):
    for k in prange(out.shape[0]):
        out[k] = _callee_stack()


def _nested(depth, fn):
    """fn() called ``depth`` C-level calls deeper (a ``*args`` call recurses in C)."""
    return fn() if depth == 0 else _nested(*(depth - 1, fn))


def test_frames_sit_at_one_page_offset_for_every_caller_and_thread():
    """``_frame_on_page`` puts the prange body's callees at FRAME_OFFSET (less the
    64-byte floor of its pad) within a page on every thread, however deep the
    caller's stack: kernel speed once depended on where a stage's frame fell."""
    seen = {}
    for name, kernel in (("framed", _framed), ("unframed", _unframed)):
        offsets = set()
        for depth in range(0, 24, 3):
            out = np.zeros(8 * numba.get_num_threads(), np.int64)
            _nested(depth, lambda: kernel(out))
            offsets |= {int(v) % 4096 for v in out}
        seen[name] = offsets
    assert len(seen["unframed"]) > 1          # the depth moves an unplaced frame
    assert len(seen["framed"]) == 1, sorted(hex(v) for v in seen["framed"])
    below = (cpu.FRAME_OFFSET - seen["framed"].pop()) % 4096
    assert 64 <= below <= 256, below


#: prange loops that need no placed frame: they call no stage (``_lanes_fn``)
_UNFRAMED_LOOPS = {"sum_partials_by_blocks", "_launch_probe"}


def test_every_stage_aligns_its_frame_and_every_driver_places_it():
    """Every ``_lanes_fn`` stage asks for an aligned frame (its vector spills can
    then not straddle a page), and every driver loop body starts with
    ``_frame_on_page()`` and ends with ``_frame_back`` (source check: a new stage
    or driver cannot silently miss them)."""
    tree = ast.parse(inspect.getsource(cpu))
    stages, loops = 0, 0
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        if any(getattr(d, "id", None) == "_lanes_fn" for d in fn.decorator_list):
            stages += 1
            calls = {c.func.id for c in ast.walk(fn)
                     if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
            assert "_aligned_frame" in calls, fn.name
        if fn.name in _UNFRAMED_LOOPS:
            continue
        for loop in ast.walk(fn):
            if not (isinstance(loop, ast.For) and isinstance(loop.iter, ast.Call)
                    and getattr(loop.iter.func, "id", None) in ("prange", "loop")):
                continue
            loops += 1
            first, last = ast.unparse(loop.body[0]), ast.unparse(loop.body[-1])
            assert first == "frame = _frame_on_page()", (fn.name, first)
            assert last == "_frame_back(frame)", (fn.name, last)
    assert stages >= 17 and loops >= 14, (stages, loops)


#: calls that may pass a constant stream flag: the softmax pipeline's spare
#: scratch row and the in-place target (dy, whose lines were just read)
_CONSTANT_STREAM_OK = {"_fwd_stream(spare, False)", "streaming(dy, False)"}


def test_output_stores_take_the_run_time_stream_flag():
    """Every store of a kernel's output row gets its non-temporal flag from the
    output (``cpu._streams``), never a constant: the norm backwards' row path once
    stored dx with a literal False, so rows under 8 KiB read every line of dx
    before writing it (float32 rms_norm bwd 1.12-1.23x once fixed). Source check
    over the calls that take the flag last."""
    takes_flag = {"streaming", "_fwd_stream", "_target", "_softmax_bwd_store",
                  "_layer_norm_bwd_store", "_norm_bwd_two_passes"}
    seen = set()
    for call in ast.walk(ast.parse(inspect.getsource(cpu))):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                and call.func.id in takes_flag and call.args):
            continue
        seen.add(call.func.id)
        constant = isinstance(call.args[-1], ast.Constant)
        if constant and ast.unparse(call) not in _CONSTANT_STREAM_OK:
            raise AssertionError(f"constant stream flag: {ast.unparse(call)}")
    assert seen == takes_flag, takes_flag - seen

"""The memory floor of each op on this machine: how fast its bytes can move at all.

A forward reads x and writes y, a backward reads two arrays (y or x, and dy) and
writes dx. This times exactly those access patterns with no arithmetic, on arrays
of the case's shape and byte size, with the kernels' threads and stores
(``_lanes``: non-temporal where the output has ``cpu.STREAM_BYTES`` or more), outputs
placed as the library places them (``numba_fused.empty_like``):

* read     -- one array summed (read bandwidth alone);
* write    -- one array filled (write bandwidth alone);
* fwd      -- y = x (one read stream, one write stream);
* bwd      -- dx = a + b (two read streams, one write stream).

The floor of a fwd+bwd is fwd + bwd. With ``--bench FILE`` (the JSON of a
``numba-fused bench --direction fwd+bwd`` run with peers) it also prints, per op, the
fwd+bwd time each of the CPU-speed issue's multiples (10x NumPy, 5x torch, 2.5x
JAX) asks for, against this floor and numba_fused's time in that run: a multiple
whose time is under the floor cannot be met by any kernel on this machine (the
statistics, weight and partials are left out, so the true floor is higher still).

    python benchmarks/mem_floor.py --shape 4096x4096 --dtype float32 \\
        --bench benchmarks/fwdbwd-2026-12-07a-amd-at-4242fb3.json
"""
import argparse
import json
import time

import numba
import numpy as np

MULTIPLES = {"numpy": 10.0, "torch": 5.0, "jax": 2.5}


def _kernels():
    from numba_fused._lanes import (data, lanes_count, lanes_load, lanes_store, lanes_sum,
                                    lanes_zeros, streaming)
    from numba_fused.cpu import _streams

    def bounds(t, n, threads, step):
        lo = t * n // threads // step * step
        return lo, n if t == threads - 1 else (t + 1) * n // threads // step * step

    bounds = numba.njit(inline="always")(bounds)

    @numba.njit(parallel=True, nogil=True)
    def read(a, threads):
        step = lanes_count(lanes_zeros(a))
        total = 0.0
        for t in numba.prange(threads):
            lo, hi = bounds(t, a.shape[0], threads, step)
            acc = lanes_zeros(a)
            for c in range(lo, hi - step + 1, step):
                acc = acc + lanes_load(a, c, step)
            total += lanes_sum(acc)
        return total

    @numba.njit(parallel=True, nogil=True)
    def write(a, out, threads):
        step = lanes_count(lanes_zeros(a))
        dst = streaming(data(out), _streams(out))
        for t in numba.prange(threads):
            lo, hi = bounds(t, out.shape[0], threads, step)
            v = lanes_load(a, 0, step)
            for c in range(lo, hi - step + 1, step):
                lanes_store(dst, c, v, step)

    @numba.njit(parallel=True, nogil=True)
    def fwd(a, out, threads):
        step = lanes_count(lanes_zeros(a))
        dst = streaming(data(out), _streams(out))
        for t in numba.prange(threads):
            lo, hi = bounds(t, out.shape[0], threads, step)
            for c in range(lo, hi - step + 1, step):
                lanes_store(dst, c, lanes_load(a, c, step), step)

    @numba.njit(parallel=True, nogil=True)
    def bwd(a, b, out, threads):
        step = lanes_count(lanes_zeros(a))
        dst = streaming(data(out), _streams(out))
        for t in numba.prange(threads):
            lo, hi = bounds(t, out.shape[0], threads, step)
            for c in range(lo, hi - step + 1, step):
                lanes_store(dst, c, lanes_load(a, c, step) + lanes_load(b, c, step), step)

    return read, write, fwd, bwd


def floors(shape, dtype, rounds):
    """Median seconds of each pattern over ``rounds`` interleaved rounds, on
    float32 views of arrays of ``shape`` and ``dtype`` (the same bytes)."""
    import numba_fused as nf
    from numba_fused import _dtypes as D
    itemsize = np.dtype(D.storage_dtype(np.dtype(getattr(D, dtype, dtype)))).itemsize
    nbytes = int(np.prod(shape)) * itemsize
    n = nbytes // 4
    rng = np.random.default_rng(0)
    a = rng.standard_normal(n, dtype=np.float32)
    b = rng.standard_normal(n, dtype=np.float32)
    out = nf.empty_like(a, a, b)
    threads = np.int64(numba.get_num_threads())
    read, write, fwd, bwd = _kernels()
    cases = {"read": (lambda: read(a, threads), nbytes),
             "write": (lambda: write(a, out, threads), nbytes),
             "fwd": (lambda: fwd(a, out, threads), 2 * nbytes),
             "bwd": (lambda: bwd(a, b, out, threads), 3 * nbytes)}
    times = {k: [] for k in cases}
    for fn, _ in cases.values():
        fn()
    for _ in range(rounds):
        for k, (fn, _) in cases.items():
            fn()                      # as the benchmark: each sample follows a call of its own
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: (float(np.median(v)), cases[k][1]) for k, v in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="4096x4096")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--bench", help="JSON of a numba-fused bench fwd+bwd run with peers")
    args = ap.parse_args(argv)
    shape = tuple(int(v) for v in args.shape.split("x"))
    f = floors(shape, args.dtype, args.rounds)
    print(f"# {args.shape} {args.dtype}, {numba.get_num_threads()} threads, "
          f"medians of {args.rounds} rounds")
    for k, (t, nb) in f.items():
        print(f"{k:6s} {t * 1e3:8.3f} ms  {nb / t / 1e9:6.1f} GB/s")
    floor_fb = f["fwd"][0] + f["bwd"][0]
    print(f"fwd+bwd floor {floor_fb * 1e3:.3f} ms")
    if not args.bench:
        return
    records = json.load(open(args.bench))["records"]
    rows = [r for r in records if r["direction"] == "fwd+bwd" and r["dtype"] == args.dtype
            and r["shape"] == args.shape and r["device"] == "cpu"]
    print(f"\nfwd+bwd multiples of the CPU-speed issue, from {args.bench}:")
    print(f"{'op':10s} {'ours':>8s}  {'peer':6s} {'peer ms':>8s} {'needs':>8s} "
          f"{'vs floor':>8s}  {'ours vs floor':>13s}")
    for op in ("softmax", "rms_norm", "layer_norm"):
        mine = [r for r in rows if r["op"] == op and r["impl"] == "numba_fused"]
        if not mine:
            continue
        ours = mine[0]["median_s"]
        for peer, mult in MULTIPLES.items():
            p = [r for r in rows if r["op"] == op and r["impl"] == peer]
            if not p:
                continue
            need = p[0]["median_s"] / mult
            verdict = "below" if need < floor_fb else "above"
            print(f"{op:10s} {ours * 1e3:7.2f}   {peer:6s} {p[0]['median_s'] * 1e3:8.2f} "
                  f"{need * 1e3:8.2f} {verdict:>8s}  {floor_fb / ours:12.0%}")


if __name__ == "__main__":
    main()

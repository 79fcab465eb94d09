"""Training-step benchmark: numba_fused.torch modules against torch's own.

Times forward+backward (+ optimizer-free: gradients only) of

* ``block``: a pre-norm transformer block -- RMSNorm -> causal attention (softmax
  over scores) -> residual -> LayerNorm -> MLP (4x, GELU) -> residual -> LayerNorm;
* ``norms``: the block's norm/softmax layers alone on the same activations (what
  numba_fused replaces, without the matmuls around it);

each with torch's ``nn.RMSNorm``/``nn.LayerNorm``/``torch.softmax`` ("torch") and
with ``numba_fused.torch``'s ("numba_fused"), the same weights, in float32 and
bfloat16. The two implementations are timed in interleaved rounds (so drift in
machine load hits both alike); the best and the median round are reported. It also times the library's
norm backward with and without a weight (the cost of the dweight reduction that a
frozen weight cannot skip; see numba_fused/torch.py).

    python benchmarks/torch_train_step.py            # markdown table to stdout
    python benchmarks/torch_train_step.py --quick    # small shapes, few rounds
    OMP_WAIT_POLICY=PASSIVE python benchmarks/torch_train_step.py

torch (its bundled libgomp) and numba's omp layer (the system libgomp) share one
OpenMP runtime in practice (numba first: torch's libgomp.so.1 dependency is met by
the loaded copy; torch first: numba's pool binds to torch's copy, which torch loads
into the global symbol scope; LD_DEBUG=bindings, 2026-12-06). On 2026-12-02,
with other jobs keeping a 2-core machine's load at 4-6, spin-waiting made medians
10-100x the best rounds and OMP_WAIT_POLICY=PASSIVE (read at start-up) removed
that; on an otherwise idle machine (2026-12-06) PASSIVE doubled both torch's and
numba_fused's times at the default shapes. --threads 1 avoids the question.
"""
import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numba_fused  # noqa: E402
import numba_fused.torch as nft  # noqa: E402


class Block(nn.Module):
    def __init__(self, impl, dim, heads):
        super().__init__()
        if impl == "torch":
            rms, ln, self.softmax = nn.RMSNorm, nn.LayerNorm, torch.softmax
        else:
            rms, ln, self.softmax = nft.RMSNorm, nft.LayerNorm, nft.softmax
        self.heads = heads
        self.norm1 = rms(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = ln(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.norm_f = ln(dim)

    def forward(self, h):
        b, t, _ = h.shape
        q, k, v = self.qkv(self.norm1(h)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        mask = torch.ones(t, t, dtype=torch.bool, device=h.device).triu(1)
        attn = self.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        h = h + self.proj((attn @ v).transpose(1, 2).reshape(b, t, -1))
        h = h + self.fc2(nn.functional.gelu(self.fc1(self.norm2(h))))
        return self.norm_f(h)


class Norms(nn.Module):
    """The block's norm and softmax layers only, on block-shaped activations."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, h, scores):
        b = self.block
        return (b.norm_f(b.norm2(b.norm1(h))).sum()
                + b.softmax(scores, dim=-1).mul(scores).sum())


def _median_ms(samples):
    return 1e3 * statistics.median(samples)


def _time(fns, rounds, number):
    """Interleaved rounds; each sample is the mean of ``number`` calls."""
    samples = {k: [] for k in fns}
    for fn in fns.values():                   # warm-up (numba compile / cache load)
        for _ in range(3):
            fn()
    for r in range(rounds):
        keys = list(fns)
        keys = keys[r % len(keys):] + keys[:r % len(keys)]
        for k in keys:
            t0 = time.perf_counter()
            for _ in range(number):
                fns[k]()
            samples[k].append((time.perf_counter() - t0) / number)
    return {k: (1e3 * min(v), _median_ms(v)) for k, v in samples.items()}


def bench_block(dtype, batch, seq, dim, heads, rounds, number):
    torch.manual_seed(0)
    ref = Block("torch", dim, heads).to(dtype)
    ours = Block("nf", dim, heads).to(dtype)
    ours.load_state_dict(ref.state_dict())
    h = torch.randn(batch, seq, dim, dtype=dtype)
    scores = torch.randn(batch, heads, seq, seq, dtype=dtype)

    def step(model):
        def run():
            x = h.detach().requires_grad_()
            model.zero_grad(set_to_none=True)
            model(x).float().square().mean().backward()
        return run

    def norms(model):
        n = Norms(model)

        def run():
            x = h.detach().requires_grad_()
            s = scores.detach().requires_grad_()
            model.zero_grad(set_to_none=True)
            n(x, s).float().backward()
        return run

    out = {}
    out["block"] = _time({"torch": step(ref), "numba_fused": step(ours)}, rounds, number)
    out["norms"] = _time({"torch": norms(ref), "numba_fused": norms(ours)}, rounds, number)
    return out


def bench_dweight(dtype, rows, cols, rounds, number):
    """Library backward with weight (dx + dweight) against weight=None (dx only)."""
    import ml_dtypes
    npdt = ml_dtypes.bfloat16 if dtype == torch.bfloat16 else np.float32
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, cols)).astype(npdt)
    dy = rng.standard_normal((rows, cols)).astype(npdt)
    w = (1 + 0.1 * rng.standard_normal(cols)).astype(npdt)
    _, rstd = numba_fused.rms_norm_fwd(x, w)
    _, mean, rstd2 = numba_fused.layer_norm_fwd(x, w, w)
    fns = {"rms dx+dw": lambda: numba_fused.rms_norm_bwd(dy, x, w, rstd),
           "rms dx only": lambda: numba_fused.rms_norm_bwd(dy, x, None, rstd),
           "ln dx+dw+db": lambda: numba_fused.layer_norm_bwd(dy, x, w, w, mean, rstd2),
           "ln dx+dw": lambda: numba_fused.layer_norm_bwd(dy, x, w, None, mean, rstd2),
           "ln dx only": lambda: numba_fused.layer_norm_bwd(dy, x, None, None, mean, rstd2)}
    return _time(fns, rounds, number)


def machine():
    import numba
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    try:
        layer = numba.threading_layer()
    except ValueError:
        layer = "not started"
    load = open("/proc/loadavg").read().split()[:3] if os.path.exists("/proc/loadavg") else "?"
    return (f"{cpu}, {os.cpu_count()} cores (load average {' '.join(load)} at the end); "
            f"{platform.platform()}; Python "
            f"{platform.python_version()}; torch {torch.__version__} "
            f"({torch.get_num_threads()} threads); numba {numba.__version__} "
            f"({layer}, {numba.get_num_threads()} threads); numba_fused "
            f"{numba_fused.__version__}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--number", type=int, default=3)
    p.add_argument("--threads", type=int, default=None,
                   help="torch and numba thread count (default: as configured)")
    p.add_argument("--quick", action="store_true", help="small shapes, few rounds")
    p.add_argument("--pool-from", type=int, default=None, metavar="BYTES",
                   help="numba_fused's outputs come from its pool from this many bytes "
                        "(default: the library's POOL_MIN_BYTES; see benchmarks/pool_ab.py)")
    a = p.parse_args(argv)
    if a.pool_from is not None:
        numba_fused._alloc.POOL_MIN_BYTES = a.pool_from
    if a.threads:
        import numba
        torch.set_num_threads(a.threads)
        numba.set_num_threads(a.threads)
    if a.quick:
        a.batch, a.seq, a.dim, a.heads, a.rounds, a.number = 2, 64, 128, 4, 3, 2
    dtypes = [getattr(torch, d) for d in a.dtypes.split(",")]
    rows = a.batch * a.seq
    lines = []
    results = {}
    for dt in dtypes:
        results[dt] = bench_block(dt, a.batch, a.seq, a.dim, a.heads, a.rounds, a.number)
    dweight = {dt: bench_dweight(dt, rows, a.dim, a.rounds, a.number * 3) for dt in dtypes}

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines.append(f"Training step (forward+backward), {stamp}")
    lines.append(f"Machine: {machine()}")
    env = ", ".join(f"{k}={os.environ[k]}" for k in (
        "OMP_WAIT_POLICY", "NUMBA_THREADING_LAYER", "OMP_NUM_THREADS", "NUMBA_NUM_THREADS")
        if k in os.environ)
    lines.append(f"Environment: {env or 'no threading variables set'}; numba_fused's "
                 f"output pool from {numba_fused._alloc.POOL_MIN_BYTES} bytes")
    lines.append(f"Shapes: batch {a.batch}, seq {a.seq}, dim {a.dim}, heads {a.heads} "
                 f"(norm rows {rows} x {a.dim}; softmax rows "
                 f"{a.batch * a.heads * a.seq} x {a.seq}); {a.rounds} interleaved rounds "
                 f"of {a.number} steps")
    lines.append("")
    lines.append("Each cell: best of the rounds (median in parentheses).")
    lines.append("")
    lines.append("| dtype | what | torch (ms) | numba_fused (ms) | speedup |")
    lines.append("| --- | --- | ---: | ---: | ---: |")
    for dt, res in results.items():
        for what, r in res.items():
            (tb, tm), (ob, om) = r["torch"], r["numba_fused"]
            lines.append(f"| {str(dt).split('.')[-1]} | {what} | {tb:.2f} ({tm:.2f}) | "
                         f"{ob:.2f} ({om:.2f}) | {tb / ob:.2f}x ({tm / om:.2f}x) |")
    lines.append("")
    lines.append(f"Library norm backward, {rows} x {a.dim} (the dweight/dbias reductions' "
                 "cost):")
    lines.append("")
    lines.append("| dtype | " + " | ".join(next(iter(dweight.values()))) + " |")
    lines.append("| --- |" + " ---: |" * len(next(iter(dweight.values()))))
    for dt, r in dweight.items():
        lines.append(f"| {str(dt).split('.')[-1]} | "
                     + " | ".join(f"{b * 1e3:.0f} ({m * 1e3:.0f}) us" for b, m in r.values())
                     + " |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

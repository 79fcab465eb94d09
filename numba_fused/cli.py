"""``numba-fused`` (also ``python -m numba_fused``): ``bench`` and ``warmup``."""
import argparse
import os
import sys
import time

from . import bench as B

BENCH_HELP = """\
Times numba_fused's fused kernels against the composed NumPy formulation and the
installed peers, on the CPU (and on a CUDA GPU when one is available), and checks
every result against the float64 reference (numba_fused.reference).

What is measured
  median time   median of --repeat samples (min-max shown); a sample is one call,
                or the mean of several back-to-back calls for short kernels.
                Peers and the copy are timed the same way, interleaved round-robin
                in the same process. The first call (compile or cache load) is
                timed separately and excluded, then warm-up calls follow.
  GB/s          minimal traffic / median time: every input read once and every
                output written once, at its own dtype (x, dy, y, dx; weight,
                bias, dweight, dbias; float32 mean/rstd). softmax fwd: x->y;
                bwd: y,dy->dx. rms_norm fwd: x,w->y,rstd; bwd: dy,x,w,rstd->dx,dw.
                layer_norm fwd: x,w,b->y,mean,rstd; bwd: dy,x,w,mean,rstd->dx,dw,db.
                fwd+bwd counts the sum of both calls.
  % copy        GB/s as a share of a parallel copy of the same byte count (half
                read, half written) measured in the same run on the same device:
                a numba prange copy with the same threads and the kernels'
                stores on the CPU (non-temporal where the output has 16 MiB or
                more, ordinary below), a device-to-device copy on the GPU.
  vs PEER       speedup: the peer's median time / numba_fused's (>1: we are faster).
  max err       max |out - ref| / max |ref| over every output (y, stats, dx,
                dweight, dbias) against float64; the scale of mean is at least
                the rows' std (1/rstd): a row's mean is computed from values of
                that size and cannot be closer. NaN/inf where the reference is
                finite counts as infinite. Tolerances: float32 1e-5, float16
                2**-9, bfloat16 2**-6 (two ulps at the scale), float64 1e-12.
                Exit status 1 when any numba_fused kernel exceeds its tolerance.

Implementations
  numba_fused   the public functions, called with preallocated out= buffers
                (like the copy) from numba_fused.empty_like; --alloc lets them
                allocate per call.
  numpy         the composed NumPy formulas in the benchmark's dtype: float32
                (float16/bfloat16 inputs are computed in float32 and cast back,
                as a NumPy user would). Not the float64 reference.
  torch         eager F.softmax / F.rms_norm / F.layer_norm. bwd: the autograd
                backward (torch.autograd.grad, graph retained) of a forward run
                once at setup, i.e. backward given the saved forward; fwd+bwd
                runs the forward and its backward every call.
  jax           jax.jit of jax.nn.softmax and of RMSNorm/LayerNorm formulas with
                float32 statistics. bwd: the jitted jax.vjp function of a forward
                run once at setup; fwd+bwd: one jitted forward + vjp.
  cupy (GPU)    the composed formulas in CuPy (no bfloat16).
A peer that is not installed is skipped with a one-line note.
Weights and biases are in the input's dtype (bfloat16 on a GPU: uint16 bits), or
float32 with --weight-dtype float32.
Inputs are fresh normal random numbers (--seed to repeat them).

On a GPU each sample is bracketed by cuda.synchronize().

Output: progress on stderr, the table (one row per case) to stdout. --json writes
{"meta": {date, command, seed, tolerances, machine: {cpu, cores, numba,
threading_layer, numba_threads, commit, loadavg, peer versions}}, "records": [one
per case and implementation, the --csv columns], "notes": [...], "failures": [...]}.
"""


def _csv(s):
    return [p.strip() for p in s.split(",") if p.strip()]


def _choices(s, allowed, alias, what, everything=None):
    """A comma-separated list of names from ``allowed`` (after ``alias``), in order;
    ``everything`` stands for all of ``allowed``."""
    if everything is not None and s == everything:
        return tuple(allowed)
    out = []
    for p in _csv(s):
        p = alias.get(p.lower(), p.lower())
        if p not in allowed:
            raise argparse.ArgumentTypeError(f"unknown {what} {p!r}; choose from "
                                             + ", ".join(allowed))
        out.append(p)
    return tuple(out)


def _ops(s):
    return _choices(s, B.OPS, {"rmsnorm": "rms_norm", "layernorm": "layer_norm",
                               "rms": "rms_norm", "ln": "layer_norm"}, "op", "all")


def _dtypes(s):
    return _choices(s, tuple(B.TOLERANCES),
                    {"f32": "float32", "fp32": "float32", "bf16": "bfloat16",
                     "f16": "float16", "fp16": "float16", "half": "float16",
                     "f64": "float64", "fp64": "float64"}, "dtype")


def _directions(s):
    return _choices(s, B.DIRECTIONS, {"fwdbwd": "fwd+bwd", "fwd_bwd": "fwd+bwd",
                                      "both": "fwd+bwd", "forward": "fwd",
                                      "backward": "bwd"}, "direction", "all")


def _shapes(s):
    out = []
    for p in _csv(s):
        if p == "default":
            out.extend(B.DEFAULT_SHAPES)
            continue
        if p == "targets":
            out.extend(B.TARGET_SHAPES)
            continue
        try:
            dims = tuple(int(d) for d in p.lower().split("x"))
        except ValueError:
            dims = ()
        if not dims or any(d < 1 for d in dims):
            raise argparse.ArgumentTypeError(
                f"bad shape {p!r}; write ROWSxCOLS (e.g. 4096x4096), dims >= 1")
        if len(dims) == 1:
            dims = (1,) + dims
        out.append(dims)
    if not out:
        raise argparse.ArgumentTypeError("no shapes given")
    return tuple(out)


def _peers(s):
    if s.lower() == "none":
        return ()
    if s.lower() == "all":
        return None
    out = []
    for p in _csv(s):
        p = p.lower()
        if p not in B.PEER_BUILDERS:
            raise argparse.ArgumentTypeError(f"unknown peer {p!r}; choose from "
                                             + ", ".join(B.PEER_BUILDERS) + " or none")
        out.append(p)
    return tuple(out)


def _positive(s):
    try:
        v = int(s)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {s!r}")
    return v


def build_parser():
    p = argparse.ArgumentParser(prog="numba-fused",
                                description="numba_fused command line: benchmark and "
                                            "warm up the fused kernels.")
    sub = p.add_subparsers(dest="command", metavar="{bench,warmup}")
    b = sub.add_parser("bench", help="time the kernels against NumPy and peers, "
                                     "check them against float64",
                       description=BENCH_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--ops", type=_ops, default=B.OPS, metavar="LIST",
                   help="softmax,rms_norm,layer_norm (default: all)")
    b.add_argument("--direction", "--directions", dest="directions", type=_directions,
                   default=B.DIRECTIONS, metavar="LIST",
                   help="fwd,bwd,fwd+bwd (default: all)")
    b.add_argument("--dtypes", type=_dtypes, default=B.DEFAULT_DTYPES, metavar="LIST",
                   help="float32,bfloat16,float16,float64 (default: float32,bfloat16)")
    b.add_argument("--shapes", type=_shapes, default=B.DEFAULT_SHAPES, metavar="LIST",
                   help="ROWSxCOLS list, e.g. 4096x4096,65536x1024; 'default' = "
                        + ",".join("x".join(map(str, s)) for s in B.DEFAULT_SHAPES)
                        + "; 'targets' = "
                        + ",".join("x".join(map(str, s)) for s in B.TARGET_SHAPES))
    b.add_argument("--device", choices=("cpu", "gpu", "all"), default=None,
                   help="cpu, gpu, or all (default: cpu, plus gpu when available)")
    b.add_argument("--peers", type=_peers, default=None, metavar="LIST",
                   help="numpy,torch,jax (CPU), cupy,torch (GPU), or none "
                        "(default: every installed peer)")
    b.add_argument("--repeat", type=_positive, default=B.DEFAULT_REPEAT, metavar="N",
                   help=f"timed samples per implementation (default {B.DEFAULT_REPEAT})")
    b.add_argument("--threads", type=_positive, default=None, metavar="N",
                   help="numba.set_num_threads(N) and torch.set_num_threads(N) "
                        "(JAX keeps its own pool); default: numba's default")
    b.add_argument("--seed", type=int, default=None, help="random seed for the inputs")
    b.add_argument("--alloc", action="store_true",
                   help="numba_fused allocates its outputs each call (no out=)")
    b.add_argument("--weight-dtype", choices=("same", "float32"), default="same",
                   help="weight/bias dtype: the input's (default) or float32 (mixed "
                        "precision: float32 master weights, 16-bit activations)")
    b.add_argument("--json", metavar="FILE", help="write the records and machine info")
    b.add_argument("--csv", metavar="FILE", help="write the records")
    b.add_argument("--plot", metavar="FILE.png",
                   help="GB/s vs columns per op and direction (needs matplotlib: "
                        "pip install numba-fused[plot])")
    b.add_argument("--markdown", action="store_true", help="print a Markdown table")
    b.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    w = sub.add_parser("warmup", help="compile (or load from the on-disk cache) every "
                                      "CPU kernel and report the time")
    w.add_argument("--dtypes", type=_dtypes, default=None, metavar="LIST",
                   help="dtypes to compile (default: all supported)")
    w.add_argument("--jobs", "-j", type=_positive, default=None, metavar="N",
                   help="processes compiling at once into the cache, then loaded here "
                        f"(default: the CPUs this process may use, at most {WARMUP_JOBS}; "
                        "1: all in this process)")
    return p


def _devices(arg):
    if arg == "cpu":
        return ("cpu",)
    if arg in ("gpu", "all"):
        return ("cpu", "gpu") if arg == "all" else ("gpu",)
    ok, _ = B.gpu_available()
    return ("cpu", "gpu") if ok else ("cpu",)


def cmd_bench(args, argv):
    if args.threads is not None:
        import numba
        if args.threads > numba.config.NUMBA_NUM_THREADS:
            print(f"numba-fused bench: error: --threads {args.threads} exceeds "
                  f"NUMBA_NUM_THREADS={numba.config.NUMBA_NUM_THREADS}", file=sys.stderr)
            return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("numba-fused bench: error: --plot needs matplotlib "
                  "(pip install numba-fused[plot])", file=sys.stderr)
            return 2
    cfg = B.Config(ops=args.ops, directions=args.directions, dtypes=args.dtypes,
                   shapes=args.shapes, devices=_devices(args.device), peers=args.peers,
                   repeat=args.repeat, threads=args.threads, seed=args.seed,
                   alloc=args.alloc, weight_dtype=args.weight_dtype, quiet=args.quiet,
                   argv=list(argv))
    result = B.run(cfg)
    recs = result["records"]
    m = result["meta"]["machine"]
    fails = result["failures"]
    if not recs:
        for n in result["notes"]:
            print(f"note: {n}")
        for f in fails:
            print(f"numba_fused FAILED: {f}")
        print("numba-fused bench: nothing was run")
        return 1 if fails else 0
    print(f"# {result['meta']['date']}  {m['cpu']}, {m['cores']} cores, numba "
          f"{m['numba']} ({m['threading_layer']}, {m['numba_threads']} threads), "
          f"numba_fused {m.get('commit') or m.get('numba_fused')}")
    print(f"# {result['meta']['command']}")
    print(B.format_table(recs, markdown=args.markdown))
    print()
    print(B.format_compile(recs))
    for n in result["notes"]:
        print(f"note: {n}")
    if args.json:
        B.write_json(args.json, result)
    if args.csv:
        B.write_csv(args.csv, recs)
    if args.plot:
        B.write_plot(args.plot, recs)
    bad = [r for r in recs if r["impl"] == B.OURS and not r["ok"]]
    for f in fails:
        print(f"numba_fused FAILED: {f}")
    if bad or fails:
        print(f"error gate: FAIL: {len(bad)} case(s) exceed their dtype's tolerance, "
              f"{len(fails)} raised:")
        for r in bad:
            print(f"  {r['device']} {r['op']} {r['direction']} {r['dtype']} {r['shape']}: "
                  f"{r['err_output']} error {r['max_err']:.2e} > {r['tol']:.1e}")
        return 1
    print(f"error gate: ok ({sum(r['impl'] == B.OURS for r in recs)} cases within "
          "tolerance)")
    return 0


#: the most processes ``warmup`` starts by default (each runs a compiler: the larger
#: of two float32 workers peaked at 0.9 GB resident, 2026-12-07)
WARMUP_JOBS = 8


def default_warmup_jobs():
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:          # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, WARMUP_JOBS))


def cmd_warmup(args):
    try:
        from . import cpu
    except ImportError as e:
        print(f"numba-fused warmup: the CPU kernels cannot be imported: {e}",
              file=sys.stderr)
        return 1
    if not hasattr(cpu, "warmup"):
        print("numba-fused warmup: numba_fused.cpu.warmup() does not exist yet",
              file=sys.stderr)
        return 1
    jobs = args.jobs or default_warmup_jobs()
    t0 = time.perf_counter()
    timings = cpu.warmup(args.dtypes or None, jobs=jobs)
    total = time.perf_counter() - t0
    for k, v in timings.items():
        print(f"  {k:40s} {v:7.2f} s")
    print(f"warmup: {len(timings)} kernel groups compiled or loaded in {total:.2f} s"
          + (f" ({jobs} processes)" if jobs > 1 else ""))
    return 0


def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    argv = list(argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:       # argparse: usage error (2) or --help (0)
        return e.code if isinstance(e.code, int) else 2
    if args.command == "bench":
        return cmd_bench(args, argv)
    if args.command == "warmup":
        return cmd_warmup(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())

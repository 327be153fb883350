"""Benchmark creditrl losses (a script, not a test).

1. apply_trace (O(T) chunked scan) vs the dense trace-matrix product the GRPO-λ paper uses
   (matrix precomputed outside the timing, as in the paper), B = 64, T ∈ {512, 2048, 8192},
   styles recent/both: time, ratio, peak extra memory (each case in a fresh process).
2. policy_loss forward+backward with every option on vs the plain clipped loss.

    python benchmarks/bench_losses.py            # full
    python benchmarks/bench_losses.py --quick    # small sizes, seconds
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import sys
import time

import torch

from creditrl import StapoOptions, TraceOptions, apply_trace, policy_loss

LAM, GAMMA, FLOOR = 0.99, 1.0, 1e-3


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def dense_matrix(length: int, style: str) -> torch.Tensor:
    t = torch.arange(length, dtype=torch.float32)[:, None]
    j = torch.arange(length, dtype=torch.float32)[None, :]
    c = torch.tensor(GAMMA * LAM)
    m = torch.maximum(torch.tensor(FLOOR), c ** (t - j).clamp(min=0))
    if style == "both":
        m = torch.maximum(m, c ** j)
    return torch.where(t > j, m, (t == j).float())


def _trace_case(method: str, rows: int, length: int, style: str, repeats: int, threads: int,
                out) -> None:
    """Run in a fresh process so ru_maxrss measures this case alone."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    values = torch.randn(rows, length)
    mask = torch.ones(rows, length, dtype=torch.bool)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if method == "dense":
        matrix = dense_matrix(length, style)
        seconds = timed(lambda: values @ matrix.T, repeats)
    else:
        seconds = timed(lambda: apply_trace(values, mask, lam=LAM, gamma=GAMMA, style=style, floor=FLOOR),
                        repeats)
    peak_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) / 1024
    out.put((seconds, peak_mb))


def run_trace_case(method, rows, length, style, repeats):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_trace_case, args=(method, rows, length, style, repeats, torch.get_num_threads(), queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def bench_traces(lengths, rows, repeats) -> None:
    print(f"apply_trace vs dense trace matrix  (B={rows}, λ={LAM}, γ={GAMMA}, floor={FLOOR}; "
          f"median of {repeats}; extra peak RSS)")
    print(f"{'T':>6} {'style':>7} {'dense ms':>10} {'O(T) ms':>9} {'speed-up':>9} {'dense MB':>9} {'O(T) MB':>8}")
    for length in lengths:
        for style in ("recent", "both"):
            dense_s, dense_mb = run_trace_case("dense", rows, length, style, repeats)
            fast_s, fast_mb = run_trace_case("fast", rows, length, style, repeats)
            print(f"{length:>6} {style:>7} {dense_s * 1e3:>10.2f} {fast_s * 1e3:>9.2f} "
                  f"{dense_s / fast_s:>8.1f}x {dense_mb:>9.1f} {fast_mb:>8.1f}")


def bench_policy_loss(rows, length, repeats) -> None:
    torch.manual_seed(0)
    logp = -torch.rand(rows, length) * 3
    old = logp + 0.1 * torch.randn(rows, length)
    data = dict(old_logp=old, advantages=torch.randn(rows), mask=torch.rand(rows, length) > 0.1)
    everything = dict(clip_high=0.28, clip_c=3.0, ref_logp=old - 0.05, kl_coef=0.01,
                      rollout_logp=old + 0.05 * torch.randn(rows, length), rollout_correction="tis",
                      stapo=StapoOptions(), entropy=torch.rand(rows, length) * 2)
    variants = {
        "plain": {},
        "all on, ε-trace": dict(everything, trace=TraceOptions(lam=LAM, style="both", floor=FLOOR)),
        "all on, ε-weight": dict(everything, trace=TraceOptions(lam=LAM, update="weight")),
        "all on, seq-mis, no trace": dict(everything, rollout_correction="seq-mis"),
    }

    def step(kwargs):
        lp = logp.clone().requires_grad_()
        loss, _ = policy_loss(lp, **data, **kwargs)
        loss.backward()
    print(f"\npolicy_loss forward+backward (B={rows}, T={length}; median of {repeats}; target ≤ 1.5x plain)")
    plain = timed(lambda: step(variants["plain"]), repeats)
    for name, kwargs in variants.items():
        seconds = plain if name == "plain" else timed(lambda: step(kwargs), repeats)
        print(f"{name:>28}: {seconds * 1e3:8.2f} ms  {seconds / plain:5.2f}x plain")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 = steadier timings on a shared machine)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, CPU")
    if args.quick:
        bench_traces([256, 1024], rows=8, repeats=3)
        bench_policy_loss(rows=8, length=512, repeats=5)
    else:
        bench_traces([512, 2048, 8192], rows=64, repeats=5)
        bench_policy_loss(rows=64, length=2048, repeats=10)


if __name__ == "__main__":
    main(sys.argv[1:])

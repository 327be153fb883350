"""Benchmark creditrl losses (a script, not a test).

1. apply_trace (O(T) blocked scan) vs the dense trace-matrix product the GRPO-λ paper uses
   (matrix precomputed outside the timing, as in the paper), B = 64, T ∈ {512, 2048, 8192},
   styles recent/both: time, ratio, peak extra memory (memory: each case in a fresh process).
2. policy_loss forward+backward with every option on vs the plain clipped loss.

Timings alternate the compared methods round by round and report medians, so load from other
jobs on a shared machine hits both sides alike.

    python benchmarks/bench_losses.py                # full, 1 thread
    python benchmarks/bench_losses.py --threads 0    # torch's default thread count
    python benchmarks/bench_losses.py --quick        # small sizes, seconds
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import sys

import torch
from timing import interleaved

from creditrl import StapoOptions, TraceOptions, apply_trace, policy_loss

LAM, GAMMA, FLOOR = 0.99, 1.0, 1e-3


def dense_matrix(length: int, style: str) -> torch.Tensor:
    t = torch.arange(length, dtype=torch.float32)[:, None]
    j = torch.arange(length, dtype=torch.float32)[None, :]
    c = torch.tensor(GAMMA * LAM)
    m = torch.maximum(torch.tensor(FLOOR), c ** (t - j).clamp(min=0))
    if style == "both":
        m = torch.maximum(m, c ** j)
    return torch.where(t > j, m, (t == j).float())


def _trace_call(method: str, values, mask, matrix, style: str):
    if method == "dense":
        return lambda: values @ matrix.T
    if method == "padded":          # right padding (lengths T/2..T): the masked path, for reference
        lengths = torch.randint(values.shape[1] // 2, values.shape[1] + 1, (values.shape[0], 1))
        mask = torch.arange(values.shape[1]) < lengths
    return lambda: apply_trace(values, mask, lam=LAM, gamma=GAMMA, style=style, floor=FLOOR)


def _trace_memory(method: str, rows: int, length: int, style: str, threads: int, out) -> None:
    """One call in a fresh process, so ru_maxrss measures this case alone (matrix included)."""
    torch.set_num_threads(threads)
    values = torch.randn(rows, length)
    mask = torch.ones(rows, length, dtype=torch.bool)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    matrix = dense_matrix(length, style) if method == "dense" else None
    _trace_call(method, values, mask, matrix, style)()
    out.put((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) / 1024)


def trace_memory_mb(method, rows, length, style):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_trace_memory, args=(method, rows, length, style, torch.get_num_threads(), queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def bench_traces(lengths, rows, repeats) -> None:
    print(f"apply_trace vs dense trace matrix  (B={rows}, λ={LAM}, γ={GAMMA}, floor={FLOOR}; "
          f"interleaved, median of {repeats}; extra peak RSS; target ≥ 50x at T=8192)")
    print(f"{'T':>6} {'style':>7} {'dense ms':>10} {'O(T) ms':>9} {'speed-up':>9} {'dense MB':>9} {'O(T) MB':>8}"
          f"   {'O(T) ms, right-padded mask':>26}")
    # Memory first: a child inherits this process's peak RSS, so measure before the big matrices.
    cases = [(length, style) for length in lengths for style in ("recent", "both")]
    memory = {case: [trace_memory_mb(m, rows, *case) for m in ("dense", "fast")] for case in cases}
    torch.manual_seed(0)
    for length in lengths:
        values = torch.randn(rows, length)
        mask = torch.ones(rows, length, dtype=torch.bool)
        for style in ("recent", "both"):
            matrix = dense_matrix(length, style)
            fns = {m: _trace_call(m, values, mask, matrix, style) for m in ("dense", "fast", "padded")}
            got = interleaved(fns, repeats)
            del matrix, fns
            dense_mb, fast_mb = memory[length, style]
            print(f"{length:>6} {style:>7} {got['dense'] * 1e3:>10.2f} {got['fast'] * 1e3:>9.2f} "
                  f"{got['dense'] / got['fast']:>8.1f}x {dense_mb:>9.1f} {fast_mb:>8.1f}"
                  f"   {got['padded'] * 1e3:>9.2f} ({got['dense'] / got['padded']:.1f}x)")


def bench_policy_loss(rows, length, repeats) -> None:
    torch.manual_seed(0)
    logp = -torch.rand(rows, length) * 3
    logp[torch.rand(rows, length) < 0.01] = -7.0     # 1% of tokens with π < τ_p: STAPO candidates
    old = logp + 0.1 * torch.randn(rows, length)
    data = dict(old_logp=old, advantages=torch.randn(rows), mask=torch.rand(rows, length) > 0.1)
    everything = dict(clip_high=0.28, clip_c=3.0, ref_logp=old - 0.05, kl_coef=0.01,
                      rollout_logp=old + 0.05 * torch.randn(rows, length), rollout_correction="tis",
                      stapo=StapoOptions(), entropy=torch.rand(rows, length) * 2)
    variants = {
        "plain": {},
        "+ clip-higher, dual clip": dict(clip_high=0.28, clip_c=3.0),
        "+ KL k3": dict(ref_logp=old - 0.05, kl_coef=0.01),
        "+ TIS": dict(rollout_logp=everything["rollout_logp"], rollout_correction="tis"),
        "+ STAPO": dict(stapo=StapoOptions(), entropy=everything["entropy"]),
        "+ ε-trace": dict(trace=TraceOptions(lam=LAM, style="both", floor=FLOOR)),
        "+ ε-weight": dict(trace=TraceOptions(lam=LAM, update="weight")),
        "all on, ε-trace": dict(everything, trace=TraceOptions(lam=LAM, style="both", floor=FLOOR)),
        "all on, ε-weight": dict(everything, trace=TraceOptions(lam=LAM, update="weight")),
        "all on, seq-mis, no trace": dict(everything, rollout_correction="seq-mis"),
    }

    def step(kwargs):
        lp = logp.clone().requires_grad_()
        loss, _ = policy_loss(lp, **data, **kwargs)
        loss.backward()
    print(f"\npolicy_loss forward+backward (B={rows}, T={length}, 10% masked gaps; interleaved, "
          f"median of {repeats}, each after an untimed call; target ≤ 1.5x plain; '+' rows: one option alone)")
    got = interleaved({name: (lambda kw=kwargs: step(kw)) for name, kwargs in variants.items()}, repeats, settle=1)
    for name, seconds in got.items():
        print(f"{name:>28}: {seconds * 1e3:8.2f} ms  {seconds / got['plain']:5.2f}x plain")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 = steadier timings on a shared machine; 0 = torch default)")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, CPU")
    if args.quick:
        bench_traces([256, 1024], rows=8, repeats=3)
        bench_policy_loss(rows=8, length=512, repeats=5)
    else:
        bench_traces([512, 2048, 8192], rows=64, repeats=9)
        bench_policy_loss(rows=64, length=2048, repeats=21)


if __name__ == "__main__":
    main(sys.argv[1:])

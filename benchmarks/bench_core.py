"""Benchmark max@K and token statistics against the papers' methods, side by side.

    python benchmarks/bench_core.py            # the issue's sizes
    python benchmarks/bench_core.py --quick    # small smoke run

(OTB and the other advantage estimators are timed against verl's own functions in
``bench_peers.py``; their loop references live in the tests, for correctness only.)

1. ``maxpo`` for N in {8, 64, 512, 4096}, K = N/4 vs the O(N^2) ReLU-matrix method of the
   MaxPO paper (App. E); results must agree to 1e-9.
2. ``token_stats`` on logits [8, 2048, 32000] (fp32, bf16): time vs one ``torch.logsumexp``
   over the same logits, and peak extra memory vs the naive full-softmax path. Memory is
   counted per tensor allocation by a dispatch mode (CPU) or by the CUDA allocator.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from creditrl import maxk_quantities, token_stats
from creditrl.utils.memory import PeakMemory


def timed(fn, repeats: int) -> tuple[float, object]:
    """Median wall time of ``repeats`` calls (after one warm-up) and the last result."""
    out = fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def row(*cells, widths=(28, 14, 14, 10, 26)):
    print("  ".join(str(c).ljust(w) for c, w in zip(cells, widths)))


def binom_ratio(n, k, n_den, k_den) -> torch.Tensor:
    """C(n, k) / C(n_den, k_den) via lgamma (the binomials alone overflow float64 at N = 4096)."""
    def log_binom(a, b):
        a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
        ok = (b >= 0) & (b <= a)
        a, b = a.clamp(min=0), b.clamp(min=0)
        return torch.lgamma(a + 1) - torch.lgamma(b + 1) - torch.lgamma((a - b).clamp(min=0) + 1), ok
    num, ok = log_binom(n, k)
    den, _ = log_binom(n_den, k_den)
    return torch.where(ok, torch.exp(num - den), torch.zeros_like(num))


def maxpo_relu_matrix(r: torch.Tensor, k: int) -> torch.Tensor:
    """MaxPO App. E: EI = ReLU-difference matrix @ hypergeometric weights; L2O baseline from the
    leave-one-out column sums with the pool-without-i weights. O(N^2) time and memory."""
    n = r.numel()
    a, order = torch.sort(r.double())
    q = torch.arange(1, n + 1, dtype=torch.float64, device=r.device)
    relu = (a[:, None] - a[None, :]).clamp(min=0)
    ei = relu @ binom_ratio(q - 1, k - 2, n - 1, k - 1)
    rank = q[None, :] - (q[None, :] > q[:, None]).double()
    weights = binom_ratio(rank - 1, k - 2, n - 2, k - 1)
    weights.fill_diagonal_(0)
    base = (weights * (relu.sum(0)[None, :] - relu)).sum(1) / (n - 1)
    return torch.empty_like(ei).index_copy_(0, order, ei - base)


def bench_maxpo(sizes: list[int], device: str):
    print("\n== maxpo: one group of N, K = N/4, vs the O(N^2) ReLU-matrix method; target >= 50x at N = 4096 ==")
    row("N", "ours s", "O(N^2) s", "speedup", "max |diff| (<= 1e-9)")
    for n in sizes:
        k = max(2, n // 4)
        r = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64).to(device)
        group = torch.zeros(n, dtype=torch.long, device=device)
        ours_s, ours = timed(lambda: maxk_quantities(r, group, k).advantage, repeats=5)
        ref_s, ref = timed(lambda: maxpo_relu_matrix(r, k), repeats=3 if n >= 4096 else 5)
        diff = float((ours - ref).abs().max())
        row(n, f"{ours_s:.5f}", f"{ref_s:.5f}", f"{ref_s / ours_s:.1f}x", f"{diff:.1e} {'ok' if diff <= 1e-9 else 'FAIL'}")


# ---------------------------------------------------------------------------------- token_stats


def peak_extra_bytes(fn, device: str) -> int:
    if device.startswith("cuda"):
        sync()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        sync()
        return torch.cuda.max_memory_allocated() - base
    with PeakMemory() as tracker:
        fn()
    return tracker.peak


def naive_stats(logits, tokens):
    """The naive path: a float32 log-softmax over the whole [B,T,V] tensor."""
    logp_all = torch.log_softmax(logits.float(), -1)
    probs = logp_all.exp()
    entropy = -(probs * logp_all).sum(-1)
    sum_p2 = (probs * probs).sum(-1)
    logp = logp_all.gather(-1, tokens[..., None]).squeeze(-1)
    return logp, entropy, sum_p2, 1 - 2 * logp.exp() + sum_p2


def bench_token_stats(shape: tuple[int, int, int], mem_batch: int, device: str):
    print(f"\n== token_stats on logits {list(shape)}: time vs one torch.logsumexp (target <= 2x), "
          "peak extra memory vs naive softmax (target <= 1/8) ==")
    row("dtype", "token_stats s", "logsumexp s", "time ratio", "peak MiB ours/naive (ratio)")
    num, steps, vocab = shape
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (num, steps), generator=gen).to(device)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(shape, generator=gen) * 2).to(dtype).to(device)
        ours_s, _ = timed(lambda: token_stats(logits, tokens), repeats=3)
        lse_s, _ = timed(lambda: torch.logsumexp(logits, -1), repeats=3)
        small, small_tokens = logits[:mem_batch], tokens[:mem_batch]
        ours_mem = peak_extra_bytes(lambda: token_stats(small, small_tokens), device)
        naive_mem = peak_extra_bytes(lambda: naive_stats(small, small_tokens), device)
        logits = None                                   # free it before the next dtype
        note = "" if mem_batch == num else f" [mem on B={mem_batch}]"
        row(str(dtype).replace("torch.", ""), f"{ours_s:.3f}", f"{lse_s:.3f}", f"{ours_s / lse_s:.2f}x",
            f"{ours_mem / 2**20:.0f}/{naive_mem / 2**20:.0f} (1/{naive_mem / max(ours_mem, 1):.0f}){note}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--mem-batch", type=int, default=2,
                        help="B used for the token_stats memory comparison (the naive path needs ~4x the logits)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    print(f"creditrl bench_core on {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.quick:
        bench_maxpo([8, 64, 512], args.device)
        bench_token_stats((2, 128, 4096), mem_batch=2, device=args.device)
    else:
        bench_maxpo([8, 64, 512, 4096], args.device)
        bench_token_stats((8, 2048, 32000), mem_batch=args.mem_batch, device=args.device)


if __name__ == "__main__":
    main()

"""Benchmark creditrl losses (a script, not a test).

1. apply_trace (O(T) blocked scan) vs the dense trace-matrix product the GRPO-λ paper uses
   (matrix precomputed outside the timing, as in the paper), B = 64, T ∈ {512, 2048, 8192},
   styles recent/both: time, ratio, peak extra memory (memory: each case in a fresh process).
2. policy_loss forward+backward (the autograd composition of the loss terms) with each option
   and every option on, vs the plain clipped loss; with ``--baseline SRC``, side by side with the
   ``policy_loss`` of another source tree, e.g. the closed-form-gradient implementation the
   composition replaced (commit 1c812f2):

       mkdir -p /tmp/base && git archive 1c812f2 src | tar -x -C /tmp/base
       python benchmarks/bench_losses.py --baseline /tmp/base/src
3. The verl-named losses (cispo, gspo, sapo, geo_mean, dppo_tv, dppo_kl, clip_cov, kl_cov, and the
   clip surrogate with the KL penalty "k3+") forward+backward, side by side with verl's own functions
   (verl's ppo_loss adds its KL to the vanilla loss) on the same float32
   inputs (verl's defaults for each loss's options), with the relative difference of the values
   and gradients in float64 beside (``--verl-only`` runs this table alone).

Timings alternate the compared methods round by round and report medians, so load from other
jobs on a shared machine hits both sides alike.

    python benchmarks/bench_losses.py                # full, 1 thread
    python benchmarks/bench_losses.py --threads 0    # torch's default thread count
    python benchmarks/bench_losses.py --quick        # small sizes, seconds
    python benchmarks/bench_losses.py --losses-only --shape 32 32   # the trainer's batch of SmolLM2-addition
"""
from __future__ import annotations

import argparse
import importlib
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


def load_policy_loss(src: str):
    """(policy_loss, StapoOptions, TraceOptions) of the creditrl package under ``src``, imported
    beside the current one (its modules are set aside again, its functions keep their globals)."""
    ours = {k: v for k, v in sys.modules.items() if k == "creditrl" or k.startswith("creditrl.")}
    for name in ours:
        del sys.modules[name]
    sys.path.insert(0, src)
    try:
        losses = importlib.import_module("creditrl.core.losses")
        return losses.policy_loss, losses.StapoOptions, losses.TraceOptions
    finally:
        sys.path.remove(src)
        for name in [k for k in sys.modules if k == "creditrl" or k.startswith("creditrl.")]:
            del sys.modules[name]
        sys.modules.update(ours)


def loss_variants(old, rows: int, length: int, stapo_cls, trace_cls) -> dict:
    gen = torch.Generator().manual_seed(1)
    rollout = dict(rollout_logp=(old + 0.05 * torch.randn(rows, length, generator=gen)).clamp(max=0),
                   rollout_correction="tis")
    stapo = dict(stapo=stapo_cls(), entropy=torch.rand(rows, length, generator=gen) * 2)
    everything = dict(clip_high=0.28, clip_c=3.0, ref_logp=old - 0.05, kl_coef=0.01, **rollout, **stapo)
    return {
        "plain": {},
        "+ clip-higher, dual clip": dict(clip_high=0.28, clip_c=3.0),
        "+ KL k3": dict(ref_logp=old - 0.05, kl_coef=0.01),
        "+ TIS": rollout,
        "+ STAPO": stapo,
        "+ ε-trace": dict(trace=trace_cls(lam=LAM, style="both", floor=FLOOR)),
        "+ ε-weight": dict(trace=trace_cls(lam=LAM, update="weight")),
        "all on, ε-trace": dict(everything, trace=trace_cls(lam=LAM, style="both", floor=FLOOR)),
        "all on, ε-weight": dict(everything, trace=trace_cls(lam=LAM, update="weight")),
        "all on, seq-mis, no trace": dict(everything, rollout_correction="seq-mis"),
    }


def bench_policy_loss(rows, length, repeats, baseline: str | None = None) -> None:
    torch.manual_seed(0)
    logp = -torch.rand(rows, length) * 3
    logp[torch.rand(rows, length) < 0.01] = -7.0     # 1% of tokens with π < τ_p: STAPO candidates
    old = (logp + 0.1 * torch.randn(rows, length)).clamp(max=0)    # log-probs: <= 0 (policy_loss checks)
    data = dict(old_logp=old, advantages=torch.randn(rows), mask=torch.rand(rows, length) > 0.1)
    impls = {"composition": (policy_loss, StapoOptions, TraceOptions)}
    if baseline:
        impls["baseline"] = load_policy_loss(baseline)

    def step(fn, kwargs):
        lp = logp.clone().requires_grad_()
        loss, _ = fn(lp, **data, **kwargs)
        loss.backward()
    fns = {(impl, name): (lambda fn=fn, kw=kwargs: step(fn, kw))
           for impl, (fn, stapo_cls, trace_cls) in impls.items()
           for name, kwargs in loss_variants(old, rows, length, stapo_cls, trace_cls).items()}
    print(f"\npolicy_loss forward+backward (B={rows}, T={length}, 10% masked gaps; interleaved, median of "
          f"{repeats}, each after an untimed call; '+' rows: one option alone)")
    got = interleaved(fns, repeats, settle=1)
    header = f"{'':>28}  {'composition':>12} {'x plain':>8}"
    print(header + (f"  {'baseline':>9} {'x plain':>8}  {'composition/baseline':>20}" if baseline else ""))
    for name in loss_variants(old, rows, length, StapoOptions, TraceOptions):
        ours = got["composition", name]
        line = f"{name:>28}: {ours * 1e3:9.2f} ms {ours / got['composition', 'plain']:7.2f}x"
        if baseline:
            theirs = got["baseline", name]
            line += f"  {theirs * 1e3:6.2f} ms {theirs / got['baseline', 'plain']:7.2f}x  {ours / theirs:19.2f}x"
        print(line)


VERL_AGG = {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean", "gspo": "seq-mean-token-mean"}


def verl_cases():
    """name -> (creditrl policy_loss keywords, verl callable(log_prob, mode, config)) for section 3."""
    from verl.trainer.ppo import core_algos

    def verl_loss(name):
        return lambda lp, data, mode, config: core_algos.get_policy_loss_fn(name)(
            old_log_prob=data["old_logp"], log_prob=lp, advantages=data["advantages"],
            response_mask=data["mask"].to(lp.dtype), loss_agg_mode=mode, config=config)[0]

    def verl_kl(lp, data, mode, config):          # verl's ppo_loss: the vanilla loss + kl_loss_coef·agg(k3+)
        kl = core_algos.agg_loss(core_algos.kl_penalty(lp, data["ref"], "k3+"), data["mask"].to(lp.dtype), mode)
        return verl_loss("vanilla")(lp, data, mode, config) + kl
    cases = {name: ({name: True}, verl_loss(name)) for name in
             ("cispo", "gspo", "sapo", "geo_mean", "dppo_tv", "dppo_kl", "clip_cov", "kl_cov")}
    cases["dppo_tv"][0]["clip_c"] = cases["dppo_kl"][0]["clip_c"] = 3.0      # verl's ActorConfig clip_ratio_c
    cases["clip + k3+"] = ({"clip_c": 3.0, "kl_coef": 1.0, "kl_estimator": "k3+"}, verl_kl)
    return cases


def verl_inputs(rows, length, dtype):
    gen = torch.Generator().manual_seed(3)
    old = torch.log(torch.rand(rows, length, generator=gen, dtype=dtype) * 0.9 + 0.05)
    logp = old + 0.3 * torch.randn(rows, 1, generator=gen, dtype=dtype) + 0.3 * torch.randn(rows, length, generator=gen,
                                                                                          dtype=dtype)
    logp = torch.where(logp > -1e-3, -1e-3 - 0.1 * torch.rand(rows, length, generator=gen, dtype=dtype), logp)
    mask = torch.rand(rows, length, generator=gen) > 0.1
    mask[:, 0] = True
    adv = torch.randn(rows, 1, generator=gen, dtype=dtype).expand(rows, length) * mask
    ref = logp + 0.3 * torch.randn(rows, length, generator=gen, dtype=dtype)
    return logp, dict(old_logp=old, advantages=adv, mask=mask, ref=ref)


def ours_and_verl(name, kwargs, verl_fn, logp, data, config):
    """(creditrl step, verl step): each a forward+backward from the same inputs."""
    mode = VERL_AGG.get(name, "token-mean")
    adv = data["advantages"]
    extra = {"ref_logp": data["ref"]} if "kl_coef" in kwargs else {}

    def ours():
        lp = logp.clone().requires_grad_()
        loss, _ = policy_loss(lp, data["old_logp"], adv, data["mask"], agg=mode, clip_low=0.2, clip_high=0.2,
                              **extra, **kwargs)
        loss.backward()
        return loss.detach(), lp.grad

    def theirs():
        lp = logp.clone().requires_grad_()
        loss = verl_fn(lp, data, mode, config)
        loss.backward()
        return loss.detach(), lp.grad
    return ours, theirs


def bench_verl_losses(rows, length, repeats) -> None:
    try:
        from verl.workers.config import ActorConfig
    except ImportError:
        print("\nverl is not installed: the side-by-side table is skipped (pip install creditrl[verl])")
        return
    config = ActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=2)
    logp, data = verl_inputs(rows, length, torch.float32)
    logp64, data64 = verl_inputs(rows, length, torch.float64)
    cases = verl_cases()
    fns = {}
    for name, (kwargs, verl_fn) in cases.items():
        ours, theirs = ours_and_verl(name, kwargs, verl_fn, logp, data, config)
        fns[name, "creditrl"], fns[name, "verl"] = ours, theirs
    print(f"\nverl-named losses forward+backward vs verl 0.9.1's functions (B={rows}, T={length}, float32, 10% "
          f"masked; interleaved, median of {repeats}, each after an untimed call; rel. diff.: float64, same inputs)")
    got = interleaved(fns, repeats, settle=1)
    print(f"{'':>10}  {'creditrl':>9} {'verl':>9} {'creditrl/verl':>14}   {'value rel.diff':>14} {'grad rel.diff':>13}")
    for name, (kwargs, verl_fn) in cases.items():
        ours, theirs = ours_and_verl(name, kwargs, verl_fn, logp64, data64, config)
        (v1, g1), (v2, g2) = ours(), theirs()
        value = float((v1 - v2).abs() / v2.abs().clamp(min=1e-300))
        grad = float((g1 - g2).abs().max() / g2.abs().max().clamp(min=1e-300))
        a, b = got[name, "creditrl"], got[name, "verl"]
        diffs = f"{value:14.1e} {grad:13.1e}" if name != "clip_cov" else f"{'(random draw: equal where forced, tests)':>28}"
        print(f"{name:>10}: {a * 1e3:6.2f} ms {b * 1e3:6.2f} ms {a / b:13.2f}x   {diffs}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument("--losses-only", action="store_true", help="skip the apply_trace table")
    parser.add_argument("--shape", type=int, nargs=2, metavar=("B", "T"), default=None,
                        help="policy_loss batch shape (default 64 2048; --quick: 8 512)")
    parser.add_argument("--baseline", metavar="SRC", help="a creditrl source tree whose policy_loss to time beside")
    parser.add_argument("--verl-only", action="store_true", help="only the verl-named losses beside verl's")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 = steadier timings on a shared machine; 0 = torch default)")
    args = parser.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, CPU")
    if args.verl_only:
        bench_verl_losses(*(args.shape or ((8, 512) if args.quick else (64, 2048))), repeats=5 if args.quick else 21)
        return
    if args.quick:
        if not args.losses_only:
            bench_traces([256, 1024], rows=8, repeats=3)
        bench_policy_loss(*(args.shape or (8, 512)), repeats=5, baseline=args.baseline)
        bench_verl_losses(*(args.shape or (8, 512)), repeats=5)
    else:
        if not args.losses_only:
            bench_traces([512, 2048, 8192], rows=64, repeats=9)
        bench_policy_loss(*(args.shape or (64, 2048)), repeats=21, baseline=args.baseline)
        bench_verl_losses(*(args.shape or (64, 2048)), repeats=21)


if __name__ == "__main__":
    main(sys.argv[1:])

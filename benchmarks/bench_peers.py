"""creditrl's advantage estimators against verl's own functions (verl from PyPI), side by side.

    python benchmarks/bench_peers.py            # the issue's sizes: B = 1024 (64 x 16), T in {4096, 16384}
    python benchmarks/bench_peers.py --quick    # small smoke run (also run by the tests)

For every case the same inputs go to
- ``verl``:     verl's function (``compute_optimal_token_baseline_advantage`` or, for masks with
                holes, ``compute_multi_turn_optimal_token_baseline_advantage`` (``tir_``), which
                aligns valid steps as creditrl does; ``grpo_vectorized``, ``rloo_vectorized``,
                ``opo``; ``dr_grpo`` = ``grpo_vectorized`` without the std division;
                ``reinforce_plus_plus`` (gamma 1) and ``reinforce_plus_plus_baseline``);
- ``direct``:   ``creditrl.compute_advantages`` (OTB's energy computed from the same
                ``old_log_probs``/``sum_pi_squared`` inside the timed call);
- ``plug-in``:  creditrl through verl's registry (``get_adv_estimator_fn("creditrl_<name>")``),
                i.e. what a verl run calls;
with token rewards [B,T] as verl passes them (the score on each row's last valid token), and
for ``direct`` also with sequence rewards [B]. Masks are right-padded (lengths uniform in
[T/4, T]) or have 5% holes (masked tool tokens) inside each response. Times are medians of
``--repeats`` interleaved rounds on ``--threads`` torch threads; ``speed-up`` is verl's time
over creditrl's; ``max|diff|`` compares advantages on valid tokens (verl's OTB runs with
``handle_zero_tail=False``, the variant that estimates the same baseline; on steps where a
group has one live member creditrl gives exactly 0 and verl G·(1 - W/(W + 1e-8)), both ≈ 0).
"""
from __future__ import annotations

import argparse
import platform

import numpy as np
import torch
from timing import interleaved

ESTIMATORS = ("otb", "grpo", "dr_grpo", "rloo", "opo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")


def make_inputs(num_groups: int, size: int, length: int, holes: bool, seed: int = 0,
                mask_dtype: torch.dtype = torch.float32) -> dict:
    """verl-style inputs: token rewards, response mask, uids, old log-probs and sum pi^2."""
    gen = torch.Generator().manual_seed(seed)
    batch = num_groups * size
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=gen)
    steps = torch.arange(length)
    mask = steps[None, :] < lengths[:, None]
    if holes:  # masked tool tokens inside the response; the first and last tokens stay valid
        hole = torch.rand(batch, length, generator=gen) < 0.05
        hole[:, 0] = False
        hole[torch.arange(batch), lengths - 1] = False
        mask &= ~hole
    last = length - 1 - mask.flip(1).float().argmax(1)
    scores = (torch.rand(batch, generator=gen) < 0.4).float()
    token_rewards = torch.zeros(batch, length)
    token_rewards[torch.arange(batch), last] = scores
    vocab_p = torch.rand(batch, length, generator=gen)
    old_log_probs = torch.log(vocab_p.clamp(min=1e-4))
    sum_pi_squared = vocab_p.square() + (1 - vocab_p).square() * torch.rand(batch, length, generator=gen)
    index = np.array([f"uid-{g}" for g in range(num_groups) for _ in range(size)], dtype=object)
    return {"token_level_rewards": token_rewards, "response_mask": mask.to(mask_dtype), "index": index,
            "old_log_probs": old_log_probs, "sum_pi_squared": sum_pi_squared, "scores": scores,
            "group": torch.arange(num_groups).repeat_interleave(size)}


def verl_call(name: str, holes: bool, inputs: dict):
    from verl.trainer.ppo import core_algos as ca

    common = {k: inputs[k] for k in ("token_level_rewards", "response_mask", "index")}
    if name == "otb":
        fn = (ca.compute_multi_turn_optimal_token_baseline_advantage if holes
              else ca.compute_optimal_token_baseline_advantage)
        return lambda: fn(**common, old_log_probs=inputs["old_log_probs"], sum_pi_squared=inputs["sum_pi_squared"],
                          handle_zero_tail=False)[0]
    if name in ("grpo", "dr_grpo"):
        return lambda: ca.compute_grpo_vectorized_outcome_advantage(
            **common, norm_adv_by_std_in_grpo=name == "grpo")[0]
    if name == "rloo":
        return lambda: ca.compute_rloo_vectorized_outcome_advantage(**common)[0]
    if name == "reinforce_plus_plus":
        from verl.trainer.config import AlgoConfig
        config = AlgoConfig(gamma=1.0)
        return lambda: ca.compute_reinforce_plus_plus_outcome_advantage(
            token_level_rewards=common["token_level_rewards"], response_mask=common["response_mask"], config=config)[0]
    if name == "reinforce_plus_plus_baseline":
        return lambda: ca.compute_reinforce_plus_plus_baseline_outcome_advantage(**common)[0]
    return lambda: ca.compute_opo_outcome_advantage(**common)[0]


def creditrl_call(name: str, inputs: dict, sequence_rewards: bool):
    from creditrl import compute_advantages
    from creditrl.integrations import energy_from_logp

    rewards = inputs["scores"] if sequence_rewards else inputs["token_level_rewards"]

    def call():
        energy = (energy_from_logp(inputs["old_log_probs"], inputs["sum_pi_squared"]) if name == "otb" else None)
        return compute_advantages(name, rewards=rewards, mask=inputs["response_mask"], group=inputs["group"],
                                  energy=energy)
    return call


def plugin_call(name: str, inputs: dict):
    from verl.trainer.ppo import core_algos as ca

    import creditrl.integrations.verl  # noqa: F401  (registers creditrl_* as on ``import verl``)
    fn = ca.get_adv_estimator_fn(f"creditrl_{name}")
    kwargs = {k: inputs[k] for k in ("token_level_rewards", "response_mask", "index")}
    if name == "otb":
        kwargs.update(old_log_probs=inputs["old_log_probs"], sum_pi_squared=inputs["sum_pi_squared"])
    return lambda: fn(**kwargs, config=None)[0]


def bench(lengths: list[int], num_groups: int, size: int, repeats: int, mask_dtype: torch.dtype) -> list[dict]:
    print(f"{'case':<54}{'verl ms':>9}{'direct ms':>11}{'[B] ms':>9}{'plug-in ms':>12}"
          f"{'speed-up':>10}{'plug/direct':>13}{'max|diff|':>11}")
    rows = []
    for length in lengths:
        for holes in (False, True):
            inputs = make_inputs(num_groups, size, length, holes, mask_dtype=mask_dtype)
            valid = inputs["response_mask"].bool()
            for name in ESTIMATORS:
                fns = {"verl": verl_call(name, holes, inputs), "direct": creditrl_call(name, inputs, False),
                       "seq": creditrl_call(name, inputs, True), "plugin": plugin_call(name, inputs)}
                times = interleaved(fns, repeats, settle=1)
                outs = {k: fn() for k, fn in fns.items()}
                diff = max(float((outs[k] - outs["verl"])[valid].abs().max()) for k in ("direct", "seq", "plugin"))
                ms = {k: 1e3 * t for k, t in times.items()}
                case = f"{name:<28} T={length:<6} {'5% holes' if holes else 'right-padded'}"
                row = {"case": case, **ms, "speedup": ms["verl"] / ms["direct"],
                       "plugin_ratio": ms["plugin"] / ms["direct"], "diff": diff}
                rows.append(row)
                print(f"{case:<54}{ms['verl']:>9.1f}{ms['direct']:>11.1f}{ms['seq']:>9.1f}{ms['plugin']:>12.1f}"
                      f"{row['speedup']:>9.2f}x{row['plugin_ratio']:>12.2f}x{diff:>11.1e}")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="B = 64 (4 x 16), T in {256}: a smoke run")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mask-dtype", default="float32", choices=["float32", "int64", "bool"],
                        help="dtype of response_mask (verl's attention-mask slice is int64; float32 is "
                        "what its vectorized tests use; bool what creditrl's trainer passes)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import verl

    mask_dtype = getattr(torch, args.mask_dtype)
    print(f"verl {verl.__version__}, torch {torch.__version__}, {args.threads} threads, "
          f"{platform.processor() or platform.machine()}; median of {args.repeats} interleaved rounds; "
          f"response_mask {args.mask_dtype}")
    if args.quick:
        rows = bench([256], 4, 16, 3, mask_dtype)
    else:
        rows = bench([4096, 16384], 64, 16, args.repeats, mask_dtype)
    worst = {name: min(r["speedup"] for r in rows if r["case"].startswith(name + " ")) for name in ESTIMATORS}
    print("slowest speed-up per estimator (verl / direct): " +
          ", ".join(f"{k} {v:.2f}x" for k, v in worst.items()))
    print(f"largest plug-in / direct ratio: {max(r['plugin_ratio'] for r in rows):.2f}x; "
          f"largest max|diff|: {max(r['diff'] for r in rows):.1e}")


if __name__ == "__main__":
    main()

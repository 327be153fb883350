"""creditrl's advantage estimators against verl's own functions (verl from PyPI), side by side,
with what creditrl's plug-ins (verl's registry, TRL's CreditGRPOTrainer) and input checks cost.

    python benchmarks/bench_peers.py                  # the issue's sizes: B = 1024 (64 x 16), T in {4096, 16384}
    python benchmarks/bench_peers.py --lengths 4096   # one length
    python benchmarks/bench_peers.py --quick          # small smoke run (also run by the tests)

For every case the same inputs go to
- ``verl``:     verl's function (``compute_optimal_token_baseline_advantage`` or, for masks with
                holes, ``compute_multi_turn_optimal_token_baseline_advantage`` (``tir_``), which
                aligns valid steps as creditrl does; ``grpo_vectorized``, ``rloo_vectorized``,
                ``opo``; ``dr_grpo`` = ``grpo_vectorized`` without the std division;
                ``reinforce_plus_plus`` (gamma 1) and ``reinforce_plus_plus_baseline``);
- ``direct``:   ``creditrl.compute_advantages`` (OTB's energy computed from the same
                ``old_log_probs``/``sum_pi_squared`` inside the timed call);
- ``plug-in``:  creditrl through verl's registry (``get_adv_estimator_fn("creditrl_<name>")``),
                i.e. what a verl run calls (uids mapped, actor stats checked, returns built);
- ``TRL hook``: ``CreditGRPOTrainer._advantages`` (what TRL's generation step calls: gathers,
                the estimator, its logged metrics) against ``TRL direct``, the direct call on the
                same inputs (sequence rewards, TRL's bool mask, the masked energy);
with token rewards [B,T] as verl passes them (the score on each row's last valid token). A
direct call with sequence rewards [B] and the bench's mask runs once per case (not timed) and is
compared with verl's result too. Masks are right-padded (lengths uniform in [T/4, T]) or
have 5% holes (masked tool tokens) inside each response.

Times are the median and the best of ``--repeats`` interleaved rounds on ``--threads`` torch
threads; ratios are given for both (the best is what a busy machine cannot inflate) and paired:
the median over rounds of the two calls' ratio within a round, so a load that comes and goes
between rounds scales both sides of each ratio it enters. All of
them run on a steady allocator (``--allocator steady``, the default: freed memory stays mapped),
so page faults do not land on whichever callable runs after another returned memory.
``speed-up`` is verl's time over creditrl's direct call; ``max|diff|`` compares advantages on
valid tokens (verl's OTB runs with ``handle_zero_tail=False``, the variant that estimates the
same baseline; on steps where a group has one live member creditrl gives exactly 0 and verl
G·(1 - W/(W + 1e-8)), both ≈ 0).

The checks table times each input check of creditrl alone, on the same inputs, as a share of
the direct call it guards (budget: all validation <= 10%): best against best, and paired (a check
run inside another pass costs the median of the rounds' differences between that pass with and
without it; the share is of the direct call's median). The plug-in's mapping of verl's uids
to group ids is printed beside its share, not in it: a conversion that verl's own functions make
too (``as_torch_index``), not a check.

The hook sweep times the TRL hook against the direct call for every other registered estimator
(those verl has no function for) at the first length, both masks: k = 4 for the k-estimators;
gdpo is left out (it reads the reward functions' components, which the bench does not make).
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import torch
from timing import cpu_name, interleaved_samples, steady_allocator

ESTIMATORS = ("otb", "grpo", "dr_grpo", "rloo", "opo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
TARGETS = {"plug-in / direct": 1.2, "TRL hook / TRL direct": 1.2, "creditrl otb (plug-in) / verl otb": 1.8,
           "validation share": 0.10}


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
    # verl zero-pads the actor's per-token stats (no_padding_2_padding): 0 off the response
    old_log_probs = torch.log(vocab_p.clamp(min=1e-4)) * mask
    sum_pi_squared = (vocab_p.square() + (1 - vocab_p).square() * torch.rand(batch, length, generator=gen)) * mask
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
        mask = common["response_mask"]   # verl's loop computes 1 - mask, which a bool mask refuses: its int64 copy
        mask = mask.long() if mask.dtype == torch.bool else mask
        return lambda: ca.compute_reinforce_plus_plus_outcome_advantage(
            token_level_rewards=common["token_level_rewards"], response_mask=mask, config=config)[0]
    if name == "reinforce_plus_plus_baseline":
        return lambda: ca.compute_reinforce_plus_plus_baseline_outcome_advantage(**common)[0]
    return lambda: ca.compute_opo_outcome_advantage(**common)[0]


def creditrl_call(name: str, inputs: dict, sequence_rewards: bool):
    from creditrl import compute_advantages
    from creditrl.integrations.energy import energy_from_logp

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


def trl_inputs(name: str, inputs: dict) -> dict:
    """What CreditGRPOTrainer hands its estimator: sequence rewards, bool mask, masked energy."""
    from creditrl.core.estimators.registry import get_estimator
    from creditrl.integrations.energy import energy_from_logp

    mask = inputs["response_mask"].bool()
    energy = None
    if get_estimator(name).needs_energy:
        energy = torch.where(mask, energy_from_logp(inputs["old_log_probs"], inputs["sum_pi_squared"]), 0.0)
    return {"rewards": inputs["scores"], "group": inputs["group"], "mask": mask, "energy": energy}


def trl_direct_call(name: str, inputs: dict, options: dict | None = None):
    from creditrl import compute_advantages

    given = trl_inputs(name, inputs)
    return lambda: compute_advantages(name, **given, **(options or {}))


def trl_hook_call(name: str, inputs: dict, options: dict | None = None):
    """``CreditGRPOTrainer._advantages`` on a trainer holding only what that method reads
    (one CPU process: TRL's gathers return the tensors as they are)."""
    from accelerate import Accelerator
    from creditrl.integrations.trl import CreditGRPOTrainer

    threads = torch.get_num_threads()
    trainer = object.__new__(CreditGRPOTrainer)
    trainer.accelerator = Accelerator(cpu=True)
    torch.set_num_threads(threads)
    trainer.estimator, trainer.estimator_kwargs = name, dict(options or {})
    trainer.args = SimpleNamespace(log_completions=False)
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    given = trl_inputs(name, inputs)
    scorable = torch.ones_like(given["rewards"], dtype=torch.bool)
    return lambda: trainer._advantages("train", given["rewards"], given["group"], scorable, given["mask"],
                                       given["energy"])


def summarize(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """ms per callable: the median and the best of its samples."""
    return {k: {"median": 1e3 * statistics.median(v), "best": 1e3 * min(v)} for k, v in samples.items()}


def paired_ratio(samples: dict[str, list[float]], a: str, b: str) -> float:
    """The median over rounds of a's time over b's in the same round: a load that comes and goes
    between rounds scales both, where a ratio of medians (or of bests) takes each from other rounds."""
    return statistics.median(x / y for x, y in zip(samples[a], samples[b]))


def paired_difference(samples: dict[str, list[float]], a: str, b: str) -> float:
    """ms: the median over rounds of a's time minus b's in the same round (>= 0 where a does b's
    work and more; the median of differences, not a difference of medians or bests)."""
    return max(0.0, 1e3 * statistics.median(x - y for x, y in zip(samples[a], samples[b])))


COLUMNS = (("verl", "verl"), ("direct", "direct"), ("plugin", "plug-in"), ("trl_direct", "TRL direct"),
           ("trl_hook", "TRL hook"))
# each ratio's two callables, for the paired statistic
PAIRS = {"speedup": ("verl", "direct"), "plugin_ratio": ("plugin", "direct"), "hook_ratio": ("trl_hook", "trl_direct"),
         "otb_plugin_speedup": ("verl", "plugin")}


def bench(lengths: list[int], num_groups: int, size: int, repeats: int, mask_dtype: torch.dtype) -> list[dict]:
    print("ms, median / best of the interleaved rounds; ratios: of the medians / of the bests / the median of "
          "the rounds' own ratios (paired)")
    print(f"{'case':<32}" + "".join(f"{label:>15}" for _, label in COLUMNS) +
          f"{'verl/direct':>18}{'plug-in/direct':>18}{'hook/TRL direct':>18}{'max|diff|':>10}")
    rows = []
    for length in lengths:
        for holes in (False, True):
            inputs = make_inputs(num_groups, size, length, holes, mask_dtype=mask_dtype)
            valid = inputs["response_mask"].bool()
            for name in ESTIMATORS:
                fns = {"verl": verl_call(name, holes, inputs), "direct": creditrl_call(name, inputs, False),
                       "seq": creditrl_call(name, inputs, True), "plugin": plugin_call(name, inputs),
                       "trl_direct": trl_direct_call(name, inputs), "trl_hook": trl_hook_call(name, inputs)}
                # every printed column is timed; ``seq`` only joins the agreement check below
                samples = interleaved_samples({k: fn for k, fn in fns.items() if k != "seq"}, repeats, settle=1)
                times = summarize(samples)
                outs = {k: fn() for k, fn in fns.items()}
                diff = max(float((outs[k] - outs["verl"])[valid].abs().max())
                           for k in ("direct", "seq", "plugin", "trl_direct", "trl_hook"))
                case = f"{name:<8} T={length:<6} {'5% holes' if holes else 'right-padded'}"
                row = {"case": case, "name": name, "length": length, "holes": holes, "ms": times, "diff": diff}
                for stat in ("median", "best"):
                    t = {k: v[stat] for k, v in times.items()}
                    row[stat] = {"speedup": t["verl"] / t["direct"], "plugin_ratio": t["plugin"] / t["direct"],
                                 "hook_ratio": t["trl_hook"] / t["trl_direct"],
                                 "otb_plugin_speedup": t["verl"] / t["plugin"]}
                row["paired"] = {key: paired_ratio(samples, a, b) for key, (a, b) in PAIRS.items()}
                rows.append(row)
                cells = "".join(f"{times[k]['median']:>8.1f}/{times[k]['best']:<6.1f}" for k, _ in COLUMNS)
                ratios = "".join(f"{row['median'][k]:>{w - 11}.2f}/{row['best'][k]:.2f}/{row['paired'][k]:<5.2f}"
                                 for k, w in (("speedup", 18), ("plugin_ratio", 18), ("hook_ratio", 18)))
                print(f"{case:<32}{cells}{ratios}{diff:>10.1e}")
    return rows


def hook_sweep(num_groups: int, size: int, length: int, repeats: int) -> list[dict]:
    """The TRL hook against the direct call for every other registered estimator (those verl has
    no function for), both masks at one length: what ``CreditGRPOTrainer`` costs whichever
    estimator a user picks. k-estimators run at k = 4; gdpo reads the reward functions' components,
    which this bench does not make."""
    from creditrl.core.estimators.registry import get_estimator, list_estimators

    names = [n for n in list_estimators() if n not in ESTIMATORS and not get_estimator(n).reward_components]
    print(f"\nTRL hook / TRL direct, the other estimators (T={length}; k = 4 where it applies; "
          "ms median / best; hook/direct median / best / paired)")
    rows = []
    for holes in (False, True):
        inputs = make_inputs(num_groups, size, length, holes)
        for name in names:
            options = {"k": 4} if get_estimator(name).k_range is not None else {}
            fns = {"trl_direct": trl_direct_call(name, inputs, options), "trl_hook": trl_hook_call(name, inputs, options)}
            samples = interleaved_samples(fns, repeats, settle=1)
            times = summarize(samples)
            row = {stat: times["trl_hook"][stat] / times["trl_direct"][stat] for stat in ("median", "best")}
            row["paired"] = paired_ratio(samples, "trl_hook", "trl_direct")
            rows.append(row)
            case = f"{name:<14} {'5% holes' if holes else 'right-padded'}"
            print(f"  {case:<28}" + "".join(f"{times[k]['median']:>8.1f}/{times[k]['best']:<6.1f}" for k in fns) +
                  f"{row['median']:>8.2f}/{row['best']:.2f}/{row['paired']:.2f}")
    return rows


def check_costs(inputs: dict, repeats: int) -> dict[str, dict[str, float]]:
    """ms of each of creditrl's input checks alone, on the inputs of one case: ``best`` (its best
    time; for a check inside another pass, that pass's best minus the best of the pass without it)
    and ``paired`` (its median time; inside another pass, the median over rounds of the two passes'
    difference in the same round)."""
    from creditrl.core.estimators import _non_negative_stats
    from creditrl.integrations.energy import energy_from_logp
    from creditrl.integrations.verl import check_actor_stats, group_ids
    from creditrl.utils.validate import FusedChecks, check_mask, float32_bits, float_mask, mask_verdict, \
        non_negative_range_and_rule, row_sums_with_rule, times_mask_with_rule

    mask, rewards = inputs["response_mask"], inputs["token_level_rewards"]
    energy = energy_from_logp(inputs["old_log_probs"], inputs["sum_pi_squared"])
    totals = rewards.sum(1)

    def one_read(stats):
        checks = FusedChecks()
        checks.add(stats, lambda v: None)
        checks.run()

    if mask.dtype != torch.bool and not mask.is_floating_point():
        # an integer mask is checked on its float32 copy, which the estimators multiply by anyway
        # (``integer_mask_copy``): the check's own cost is the one integer pass over the copy
        mask = mask.to(torch.float32)
        mask_rule = lambda: one_read(torch.stack(torch.aminmax(float32_bits(mask))))  # noqa: E731
    else:
        mask_rule = lambda: check_mask("mask", mask)  # noqa: E731
    # the plug-in tests the actor's stats against the batch's float32 ``valid`` (the mask itself, or its copy)
    valid = float_mask(mask)
    fns = {"mask: 0/1 rule": mask_rule,
           "rewards: finite": lambda: one_read(totals.sum()),        # a NaN/inf makes the total non-finite
           "energy: finite, >= 0": lambda: one_read(_non_negative_stats(energy)),
           "plug-in: uids -> group ids": lambda: group_ids(inputs["index"], mask.shape[0], mask.device),
           # the actor-stats check runs in the energy's own pass: its cost is the difference
           "energy": lambda: energy_from_logp(inputs["old_log_probs"], inputs["sum_pi_squared"]),
           "energy, actor stats checked": lambda: check_actor_stats(valid, inputs["old_log_probs"],
                                                                    inputs["sum_pi_squared"])}
    if inputs["response_mask"].dtype == torch.float32:
        # without energies the rule runs inside the first pass over the mask, a broadcast's or the row
        # sums': its cost is that pass over the same pass without the rule
        fns[BROADCAST_RULE] = lambda: mask_verdict("mask", mask, times_mask_with_rule(totals, mask)[1].tolist())
        fns["product"] = lambda: totals[:, None] * mask
        fns[ROW_SUMS_RULE] = lambda: mask_verdict("mask", mask, row_sums_with_rule(mask)[1].tolist())
        fns["row sums"] = lambda: mask.sum(1)
        # with energies, the direct call's rule runs in the energies' check, the plug-in's in the actor stats' pass
        fns[ENERGY_RULE] = lambda: one_read(non_negative_range_and_rule(energy, mask))
        fns[PLUGIN_RULE] = lambda: check_actor_stats(mask, inputs["old_log_probs"], inputs["sum_pi_squared"],
                                                     lambda stats: mask_verdict("mask", mask, stats.tolist()))
    samples = interleaved_samples(fns, repeats, settle=1)
    # a check inside another pass costs that pass over the same pass without it
    within = {"plug-in: actor stats on valid tokens": ("energy, actor stats checked", "energy")}
    if BROADCAST_RULE in fns:
        within.update({BROADCAST_RULE: (BROADCAST_RULE, "product"), ROW_SUMS_RULE: (ROW_SUMS_RULE, "row sums"),
                       ENERGY_RULE: (ENERGY_RULE, "energy: finite, >= 0"),
                       PLUGIN_RULE: (PLUGIN_RULE, "energy, actor stats checked")})
    alone = summarize(samples)
    costs = {k: {"best": v["best"], "paired": v["median"]} for k, v in alone.items()}
    for name, (pass_with, pass_without) in within.items():
        costs[name] = {"best": max(0.0, alone[pass_with]["best"] - alone[pass_without]["best"]),
                       "paired": paired_difference(samples, pass_with, pass_without)}
    for helper in ("energy, actor stats checked", "energy", "product", "row sums"):
        costs.pop(helper, None)
    return costs


BROADCAST_RULE, ROW_SUMS_RULE = "mask: 0/1 rule in a broadcast's pass", "mask: 0/1 rule in the row sums' pass"
ENERGY_RULE, PLUGIN_RULE = "mask: 0/1 rule in the energy check's pass", "plug-in: mask rule in the actor stats' pass"


def fused_rule(name: str, inputs: dict) -> str | None:
    """Which pass ran the mask's 0/1 rule in estimator ``name``'s direct call: ``BROADCAST_RULE``,
    ``ROW_SUMS_RULE`` (a float32 mask on a CPU, without energies), or None (the rule's own pass)."""
    import creditrl.core.estimators.registry as registry
    from creditrl import compute_advantages
    from creditrl.integrations.energy import energy_from_logp

    ran, originals = [], {key: getattr(registry, key) for key in ("times_mask_with_rule", "row_sums_with_rule")}

    def spy(key: str, label: str):
        return lambda *args: ran.append(label) or originals[key](*args)
    try:
        registry.times_mask_with_rule = spy("times_mask_with_rule", BROADCAST_RULE)
        registry.row_sums_with_rule = spy("row_sums_with_rule", ROW_SUMS_RULE)
        energy = energy_from_logp(inputs["old_log_probs"], inputs["sum_pi_squared"]) if name == "otb" else None
        compute_advantages(name, rewards=inputs["token_level_rewards"], mask=inputs["response_mask"],
                           group=inputs["group"], energy=energy)
    finally:
        registry.times_mask_with_rule, registry.row_sums_with_rule = originals.values()
    return ran[0] if ran else None


# which of a call's times each statistic of the checks' costs is a share of
SHARE_OF = {"best": "best", "paired": "median"}


def validation_ms(name: str, costs: dict, inputs: dict) -> dict[str, tuple[float, float]]:
    """ms of the checks that estimator ``name``'s direct call and plug-in call run, by each statistic."""
    from creditrl.core.estimators import FUSED_RULE_MIN_ELEMENTS

    # the passes that run a float32 mask's rule inside them, for masks of >= FUSED_RULE_MIN_ELEMENTS
    float32 = ENERGY_RULE in costs and inputs["response_mask"].numel() >= FUSED_RULE_MIN_ELEMENTS
    if name == "otb":
        own = ["rewards: finite", "energy: finite, >= 0", ENERGY_RULE if float32 else "mask: 0/1 rule"]
        # the plug-in checks the energy from the actor's stats (with_energy), and those stats
        plug = own[:2] + ["plug-in: actor stats on valid tokens", PLUGIN_RULE if float32 else "mask: 0/1 rule"]
    else:
        fused = fused_rule(name, inputs) if float32 else None
        own = plug = ["rewards: finite", fused or "mask: 0/1 rule"]
    return {stat: (sum(costs[c][stat] for c in own), sum(costs[c][stat] for c in plug)) for stat in SHARE_OF}


def print_check_costs(rows: list[dict], inputs: dict, repeats: int) -> dict[str, float]:
    """The checks' cost against the direct and plug-in calls they guard; returns the largest share by
    each statistic: ``best`` (best costs over the calls' best times) and ``paired`` (median and paired
    costs over the calls' median times)."""
    costs = check_costs(inputs, repeats)
    print(f"\ninput checks, ms, best / paired (median; inside another pass, the median of the rounds' "
          f"differences), on the inputs of T={rows[0]['length']} right-padded, {repeats} interleaved rounds "
          "(the direct call runs the mask's, the rewards' and the energy's; a float32 mask's inside another pass "
          "over it: the energy check's, else the first use's; the plug-in all, a float32 mask's in the actor "
          "stats' pass)")
    for name, cost in costs.items():
        print(f"  {name:<44}{cost['best']:>8.3f} /{cost['paired']:>6.3f}")
    worst = dict.fromkeys(SHARE_OF, 0.0)
    for row in rows:
        if row["length"] != rows[0]["length"] or row["holes"]:
            continue
        parts = []
        for stat, (own, plug) in validation_ms(row["name"], costs, inputs).items():
            of = SHARE_OF[stat]
            direct, plugin = row["ms"]["direct"][of], row["ms"]["plugin"][of]
            worst[stat] = max(worst[stat], own / direct, plug / plugin)
            parts.append(f"{stat}: {own:5.2f} ms = {own / direct:6.1%} of the direct call ({direct:.1f} ms), "
                         f"plug-in {plug:5.2f} ms = {plug / plugin:6.1%} of {plugin:.1f} ms")
        uids = costs["plug-in: uids -> group ids"]["paired"]
        print(f"  {row['name']:<8} validation {'; '.join(parts)} (+ {uids:.2f} ms mapping uids in the plug-in, "
              "as verl's functions do)")
    return worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="B = 64 (4 x 16), T in {256}: a smoke run")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384], help="response lengths T")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mask-dtype", default="float32", choices=["float32", "int64", "bool"],
                        help="dtype of response_mask (verl's attention-mask slice is int64; float32 is "
                        "what its vectorized tests use; bool what creditrl's trainer passes)")
    parser.add_argument("--allocator", default="steady", choices=["steady", "default"],
                        help="steady (default): freed memory stays mapped, so no call pays page faults for "
                        "memory the one before it returned (timing.steady_allocator); default: glibc as it is")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    allocator = steady_allocator() if args.allocator == "steady" else "default allocator"
    import verl

    mask_dtype = getattr(torch, args.mask_dtype)
    lengths, groups, repeats = ([256], 4, 3) if args.quick else (args.lengths, 64, args.repeats)
    print(f"verl {verl.__version__}, torch {torch.__version__}, {args.threads} threads, {cpu_name()}; "
          f"B = {groups * 16} ({groups} x 16); {repeats} interleaved rounds; response_mask {args.mask_dtype}; "
          f"{allocator}")
    rows = bench(lengths, groups, 16, repeats, mask_dtype)
    # the checks cost ~1 ms each: 4x the rounds, so the paired medians settle
    share = print_check_costs(rows, make_inputs(groups, 16, lengths[0], False, mask_dtype=mask_dtype), 4 * repeats)
    others = hook_sweep(groups, 16, lengths[0], repeats)
    print()
    for stat in ("median", "best", "paired"):
        worst = {name: min(r[stat]["speedup"] for r in rows if r["name"] == name) for name in ESTIMATORS}
        otb = min(r[stat]["otb_plugin_speedup"] for r in rows if r["name"] == "otb")
        print(f"{stat}: slowest speed-up per estimator (verl / direct): " +
              ", ".join(f"{k} {v:.2f}x" for k, v in worst.items()) +
              f"; largest plug-in / direct {max(r[stat]['plugin_ratio'] for r in rows):.2f}x "
              f"(target <= {TARGETS['plug-in / direct']}x); largest TRL hook / TRL direct "
              f"{max(r[stat]['hook_ratio'] for r in rows):.2f}x (target <= {TARGETS['TRL hook / TRL direct']}x); "
              f"creditrl otb through the plug-in / verl's otb, slowest {otb:.2f}x "
              f"(target >= {TARGETS['creditrl otb (plug-in) / verl otb']}x)")
    print("largest TRL hook / TRL direct of the other estimators, median / best / paired: " +
          "/".join(f"{max(r[stat] for r in others):.2f}" for stat in ("median", "best", "paired")) +
          f"x (target <= {TARGETS['TRL hook / TRL direct']}x)")
    print(f"largest validation share: of the best times {share['best']:.1%}, paired {share['paired']:.1%} "
          f"(target <= {TARGETS['validation share']:.0%}); largest max|diff|: {max(r['diff'] for r in rows):.1e}")


if __name__ == "__main__":
    main()

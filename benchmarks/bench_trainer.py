"""creditrl's trainer vs TRL's GRPOTrainer: the same model, task, batch and loss.

Both sides: task ``addition`` (2 digits), GRPO advantages, token-mean ("dapo") loss with
clip 0.2/0.28, no KL (beta 0), one optimizer step per batch, float32 weights on CPU, the same
torch thread count, in each precision of ``--precision``: ``fp32``, or ``bf16`` autocast
(creditrl's ``train.precision=bf16`` for sampling and update; TRL's ``bf16=True``, its default,
through accelerate). TRL is timed twice per precision: with its defaults (gradient checkpointing
on) and with gradient checkpointing off (its fastest setting here). A step = sampling + update.
The ratios compare each precision side by side and then each trainer at its best precision.

``--model builtin:tiny`` (default): the builtin:tiny architecture (fresh init, seed 0) with the
char tokenizer, compact prompts, 8 prompts x 8 = 64 completions per step, temperature 1.
``--model builtin:smollm2-135m``: SmolLM2-135M-Instruct (the ``smollm2`` extra), natural-language
prompts in its chat template (TRL applies it to the conversational dataset itself), 2 prompts
x 8 = 16 completions per step, <= 32 new tokens, temperature 0.7; both stop at ``<|im_end|>``.

    python benchmarks/bench_trainer.py                # 12 timed steps each (after 2 warm-up), 3 repeats
    python benchmarks/bench_trainer.py --quick        # 4 timed steps each, 1 repeat
    python benchmarks/bench_trainer.py --threads 1 2  # one table per thread count
    python benchmarks/bench_trainer.py --model builtin:smollm2-135m --threads 2 --steps 6
    python benchmarks/bench_trainer.py --precision fp32  # one precision only
    python benchmarks/bench_trainer.py --trl-overhead [--model ...]  # CreditGRPOTrainer vs GRPOTrainer
    python benchmarks/bench_trainer.py --profile --model builtin:smollm2-135m --threads 2 --precision fp32
                                                      # (3 runs: median share and spread of each part)

Prints the median steps/s and completion tokens/s of interleaved repeats, their spread
((max - min) / median) and each run's steps/s, and the ratio creditrl / TRL (target >= 1.5x on
builtin:tiny, >= 2.5x on SmolLM2, best against best). Timings on a shared machine are noisy;
run it on an idle one for numbers you quote.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import tempfile
import time
import warnings

import torch
from timing import cpu_name

from creditrl.config import load_config
from creditrl.runtime.models.tiny import TinyModelConfig, char_tokenizer, tiny_model
from creditrl.tasks import get_task
from creditrl.tasks.base import Problem
from creditrl.runtime.rollout import generate_rollouts
from creditrl.recipe.resolve import resolve_config
from creditrl.runtime.precision import Precision
from creditrl.trainer.update import Learner

SETTINGS = {  # model -> prompts per step, completions per prompt, temperature, default max new tokens
    "builtin:tiny": {"prompts": 8, "group": 8, "temperature": 1.0, "max_len": 16},
    "builtin:smollm2-135m": {"prompts": 2, "group": 8, "temperature": 0.7, "max_len": 32},
}
MODEL = "builtin:tiny"


def setup(seed: int = 0):
    if MODEL == "builtin:tiny":
        task = get_task("addition", digits=2)
        tok = char_tokenizer(task.alphabet())
        return task, tok, tiny_model(tok, TinyModelConfig(), seed=seed)
    from creditrl.runtime.models import load_policy
    task = get_task("addition", digits=2, chat_model=True)
    model, tok = load_policy(MODEL, task, progress=False)
    return task, tok, model


def bench_creditrl(steps: int, warmup: int, max_len: int, precision: str, clock=None) -> dict:
    task, tok, model = setup()
    s = SETTINGS[MODEL]
    prompts, group = s["prompts"], s["group"]
    cfg = resolve_config(load_config(None, [
        "algorithm.estimator=grpo", "loss.agg=token-mean", "loss.clip_low=0.2", "loss.clip_high=0.28",
        "loss.kl_coef=0", f"rollout.max_new_tokens={max_len}", f"rollout.group_size={group}",
        f"rollout.prompts_per_step={prompts}", "optim.lr=2e-5", f"rollout.temperature={s['temperature']}",
        f"train.precision={precision}"]))
    learner = Learner(model, cfg)
    gen, rng = torch.Generator().manual_seed(0), random.Random(0)
    tokens, start = 0, None
    for i in range(warmup + steps):
        if i == warmup:
            start, tokens = time.perf_counter(), 0
            if clock is not None:
                clock.attach(model)
        timed = clock if clock is not None and i >= warmup else None   # warm-up steps stay out of the profile
        with (timed.phase("sampling") if timed else contextlib.nullcontext()), Precision(precision).autocast(model):
            batch = generate_rollouts(model, tok, task, [task.sample(rng) for _ in range(prompts)], group_size=group,
                                      max_new_tokens=max_len, generator=gen, temperature=s["temperature"])
        with timed.phase("update") if timed else contextlib.nullcontext():
            learner.update(batch, gen)
        tokens += batch.num_tokens
    elapsed = time.perf_counter() - start
    if clock is not None:
        clock.detach()
    return {"steps_per_s": steps / elapsed, "tokens_per_s": tokens / elapsed,
            "mean_len": tokens / steps / (prompts * group)}


def bench_trl(steps: int, warmup: int, max_len: int, checkpointing: bool, estimator: str | None = None,
              precision: str = "fp32") -> dict:
    """TRL's GRPOTrainer, or creditrl's CreditGRPOTrainer with ``estimator`` (same settings)."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    if estimator is not None:
        from creditrl.integrations.trl import CreditGRPOConfig as GRPOConfig  # noqa: F811
        from creditrl.integrations.trl import CreditGRPOTrainer as GRPOTrainer  # noqa: F811

    task, tok, model = setup()
    s = SETTINGS[MODEL]
    prompts, group = s["prompts"], s["group"]
    rng = random.Random(0)
    problems = [task.sample(rng) for _ in range(prompts * (steps + warmup + 2))]
    data = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])

    def reward(prompts, completions, answer, **_):   # conversational completions are message lists
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [task.reward(Problem(p, a), c) for p, a, c in zip(prompts, answer, texts)]

    class Clock(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, per_device_train_batch_size=prompts * group, num_generations=group,
                          max_completion_length=max_len, learning_rate=2e-5, beta=0.0, loss_type="dapo",
                          epsilon=0.2, epsilon_high=0.28, num_iterations=1, temperature=s["temperature"],
                          bf16=precision == "bf16",
                          use_cpu=True,
                          report_to=[], logging_steps=1, max_steps=steps + warmup, save_strategy="no",
                          gradient_checkpointing=checkpointing, seed=0, dataloader_num_workers=0, disable_tqdm=True,
                          **({} if estimator is None else {"advantage_estimator": estimator}))
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                              processing_class=tok, callbacks=[clock])
        trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    elapsed = clock.times[-1] - clock.times[warmup - 1]
    mean_len = sum(lengths[warmup:]) / max(1, len(lengths[warmup:]))
    return {"steps_per_s": steps / elapsed, "tokens_per_s": steps * prompts * group * mean_len / elapsed,
            "mean_len": mean_len}


def trainers(precisions: list[str]) -> tuple:
    """(name, bench) of creditrl and TRL (gradient checkpointing on, its default, and off) in each precision."""
    out = []
    for p in precisions:
        out += [(f"creditrl {p}", lambda *a, p=p: bench_creditrl(*a, precision=p)),
                (f"TRL GRPOTrainer {p} (defaults, grad ckpt on)", lambda *a, p=p: bench_trl(*a, checkpointing=True,
                                                                                             precision=p)),
                (f"TRL GRPOTrainer {p} (grad ckpt off)", lambda *a, p=p: bench_trl(*a, checkpointing=False,
                                                                                    precision=p))]
    return tuple(out)


OVERHEAD = (("TRL GRPOTrainer", lambda *a: bench_trl(*a, checkpointing=False)),
            ("CreditGRPOTrainer grpo", lambda *a: bench_trl(*a, checkpointing=False, estimator="grpo")),
            ("CreditGRPOTrainer otb", lambda *a: bench_trl(*a, checkpointing=False, estimator="otb")))
OVERHEAD_TARGETS = {"CreditGRPOTrainer grpo": 1.05, "CreditGRPOTrainer otb": 1.15}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 timed steps instead of 12, one repeat")
    parser.add_argument("--steps", type=int, help="timed steps per trainer")
    parser.add_argument("--model", choices=sorted(SETTINGS), default="builtin:tiny", help="the policy (both trainers)")
    parser.add_argument("--max-len", type=int, help="max completion tokens (both trainers; default 16 for "
                        "builtin:tiny, 32 for builtin:smollm2-135m)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1], help="torch CPU threads for both trainers; "
                        "several values give one table each (default 1, creditrl's default for builtin:tiny)")
    parser.add_argument("--repeats", type=int, help="interleaved runs per trainer; medians are reported (default 3)")
    parser.add_argument("--precision", nargs="+", choices=["fp32", "bf16"], default=["fp32", "bf16"],
                        help="precisions timed for both trainers (default both; the ratios take each trainer's best)")
    parser.add_argument("--trl-overhead", action="store_true", help="time CreditGRPOTrainer (grpo, otb) against "
                        "plain GRPOTrainer with identical settings (gradient checkpointing off) instead")
    parser.add_argument("--profile", action="store_true", help="where creditrl's step goes (first --precision, "
                        "first --threads): sampling / update split into forward, token_stats, backward, optimizer "
                        "and the rest, against this CPU's matmul throughput, instead of the comparison")
    args = parser.parse_args()
    global MODEL
    MODEL = args.model
    args.max_len = args.max_len or SETTINGS[MODEL]["max_len"]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    steps = args.steps or (4 if args.quick else 12)
    repeats = args.repeats or (1 if args.quick else 3)
    warmup = 2
    if args.profile:
        return profile(steps, warmup, args.max_len, args.precision[0], args.threads[0], repeats)
    # interleave trainers and thread counts so a load change on a shared machine hits all alike
    benches = OVERHEAD if args.trl_overhead else trainers(args.precision)
    runs = {(threads, name): [] for threads in args.threads for name, _ in benches}
    for _ in range(repeats):
        for threads in args.threads:
            torch.set_num_threads(threads)
            for name, bench in benches:
                runs[threads, name].append(bench(steps, warmup, args.max_len))
    s = SETTINGS[MODEL]
    print(f"trainer benchmark: {MODEL} ({sum(p.numel() for p in setup()[2].parameters()) / 1e6:.2f}M params), "
          f"addition, {s['prompts']}x{s['group']}={s['prompts'] * s['group']} completions/step, max {args.max_len} "
          f"tokens, temperature {s['temperature']}, {steps} timed steps, median of {repeats} interleaved runs")
    for threads in args.threads:
        med = {name: {k: statistics.median(r[k] for r in runs[threads, name]) for k in runs[threads, name][0]}
               for name, _ in benches}  # per-metric medians
        print(f"\ntorch threads {threads}")
        print(f"{'':<48}{'steps/s':>9}{'spread':>9}{'tokens/s':>10}{'mean len':>10}   steps/s of each run")
        for name, r in med.items():
            each = [x["steps_per_s"] for x in runs[threads, name]]
            spread = (max(each) - min(each)) / r["steps_per_s"]
            print(f"{name:<48}{r['steps_per_s']:>9.3f}{spread:>9.0%}{r['tokens_per_s']:>10.1f}{r['mean_len']:>10.2f}"
                  f"   {' '.join(f'{x:.3f}' for x in each)}")
        if args.trl_overhead:
            plain = med["TRL GRPOTrainer"]["steps_per_s"]
            for name, target in OVERHEAD_TARGETS.items():
                ratio = plain / med[name]["steps_per_s"]
                print(f"time per step {name} / TRL GRPOTrainer: {ratio:.3f}x  (target <= {target}x)")
            continue
        print_ratios(med, args.precision)


def profile(steps: int, warmup: int, max_len: int, precision: str, threads: int, repeats: int = 3) -> None:
    """creditrl's step, part by part (``step_profile``), against this CPU's matmul throughput: ``repeats``
    runs, each part's median time and share with the share's spread over the runs."""
    from step_profile import StepClock, matmul_gflops, report_runs

    torch.set_num_threads(threads)
    hidden = setup()[2].config.hidden_size
    inner = setup()[2].config.intermediate_size
    peak = {rows: matmul_gflops(rows, hidden, inner) for rows in (16, 512)}
    clocks, results = [], []
    for _ in range(repeats):
        clocks.append(StepClock())
        results.append(bench_creditrl(steps, warmup, max_len, precision, clocks[-1]))
    each = [r["steps_per_s"] for r in results]
    median = statistics.median(each)
    print(f"creditrl {precision}, {MODEL}, {threads} torch thread(s), {cpu_name()}: {median:.3f} steps/s "
          f"(median of {repeats} runs, spread {(max(each) - min(each)) / median:.0%}: "
          f"{' '.join(f'{x:.3f}' for x in each)}), "
          f"{statistics.median(r['mean_len'] for r in results):.1f} tokens per completion; {steps} timed steps each")
    print(f"this CPU's fp32 matmul [rows, {hidden}] @ [{hidden}, {inner}]: {peak[16]:.0f} GFLOP/s at 16 rows "
          f"(a decoding step's shape), {peak[512]:.0f} GFLOP/s at 512 rows (the peak below)")
    print("\n".join(report_runs(clocks, steps, peak[512])))


def print_ratios(med: dict, precisions: list[str]) -> None:
    """creditrl / TRL in each precision side by side, then each trainer at its best precision."""
    target = 1.5 if MODEL == "builtin:tiny" else 2.5
    for p in precisions:
        ours = med[f"creditrl {p}"]
        for name, r in med.items():
            if name.startswith("TRL") and f" {p} " in name:
                print(f"ratio creditrl {p} / {name}: steps/s {ours['steps_per_s'] / r['steps_per_s']:.2f}x, "
                      f"tokens/s {ours['tokens_per_s'] / r['tokens_per_s']:.2f}x")
    best_ours = max((n for n in med if n.startswith("creditrl")), key=lambda n: med[n]["steps_per_s"])
    best_trl = max((n for n in med if n.startswith("TRL")), key=lambda n: med[n]["steps_per_s"])
    print(f"best against best: {best_ours} / {best_trl}: steps/s "
          f"{med[best_ours]['steps_per_s'] / med[best_trl]['steps_per_s']:.2f}x, tokens/s "
          f"{med[best_ours]['tokens_per_s'] / med[best_trl]['tokens_per_s']:.2f}x  (target >= {target}x)")


if __name__ == "__main__":
    main()

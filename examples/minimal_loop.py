"""The whole RL recipe in one file: sample -> token_stats -> compute_advantages -> policy_loss -> AdamW.

Start reading creditrl here. This is the loop `creditrl train` runs, without its checkpoints,
trackers, micro-batching and checks, written against the public API only (in the spirit of
nanochat's chat_rl.py and CleanRL's ppo.py):

    python examples/minimal_loop.py                       # builtin:tiny on 2-digit addition, ~1 min
    python examples/minimal_loop.py --estimator otb --lr 1e-4

Each step: draw P prompts, sample a group of N responses to each from the current policy (so the
"old" policy is the current one: one on-policy update per batch, ratio 1), score them, and take
one AdamW step on the clipped policy-gradient loss with the chosen estimator's advantages.
"""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import torch

import creditrl


@dataclass
class Args:
    estimator: str = "rloo"       # any of creditrl.list_estimators() (otb/ogb need energies: token_stats gives them)
    steps: int = 200
    prompts: int = 8              # P prompts per step
    group: int = 8                # N responses per prompt (the group the estimator compares within)
    lr: float = 5e-5
    max_new_tokens: int = 5       # 2-digit sums and EOS
    temperature: float = 1.0
    eval_every: int = 50
    eval_problems: int = 128
    digits: int = 2
    width: int = 64
    warm_start_steps: int = 500   # supervised warm start of builtin:tiny (cached after the first run)
    warm_start_accuracy: float = 0.3
    seed: int = 0


def load(args: Args):
    """The task and a small builtin:tiny policy, warm-started on the task (cached)."""
    task = creditrl.get_task("addition", digits=args.digits, seed=args.seed)
    shape = creditrl.TinyModelConfig(hidden_size=args.width, num_layers=2, num_heads=4, intermediate_size=4 * args.width)
    warm = creditrl.WarmStartConfig(max_steps=args.warm_start_steps, target_accuracy=args.warm_start_accuracy)
    model, tokenizer = creditrl.load_policy("builtin:tiny", task, model_cfg=shape, warm_start=warm, seed=args.seed,
                                            progress=False)
    return task, model, tokenizer


@torch.no_grad()
def sample(model, tokenizer, prompts: list[str], args: Args, greedy: bool = False):
    """Left-padded prompts -> (sequences [B, P+R], response mask [B, R], texts): each response ends
    at its first EOS, which is trained on; what follows it is masked."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    out = model.generate(**enc, do_sample=not greedy, temperature=args.temperature if not greedy else None,
                         top_k=None, top_p=None, max_new_tokens=args.max_new_tokens,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    response = out[:, enc["input_ids"].shape[1]:]
    is_eos = response == tokenizer.eos_token_id
    mask = (is_eos.cumsum(1) - is_eos.long()) == 0          # up to and including the first EOS
    texts = tokenizer.batch_decode(torch.where(mask, response, tokenizer.pad_token_id), skip_special_tokens=True)
    return out, enc["attention_mask"], mask, texts


def evaluate(model, tokenizer, task, args: Args) -> float:
    """Greedy accuracy on the first ``eval_problems`` held-out problems."""
    model.eval()
    problems = task.test_set()[:args.eval_problems]
    _, _, _, texts = sample(model, tokenizer, [p.prompt for p in problems], args, greedy=True)
    return sum(task.reward(p, t) for p, t in zip(problems, texts)) / len(problems)


def train_step(model, tokenizer, task, optimizer, rng: random.Random, args: Args) -> dict[str, float]:
    # 1. sample a group of N responses to each of P prompts
    problems = [task.sample(rng) for _ in range(args.prompts)]
    prompts = [p.prompt for p in problems for _ in range(args.group)]
    model.eval()
    sequences, prompt_mask, mask, texts = sample(model, tokenizer, prompts, args)
    rewards = torch.tensor([task.reward(p, t) for p, t in zip((p for p in problems for _ in range(args.group)), texts)])
    group = torch.arange(args.prompts).repeat_interleave(args.group)

    # 2. one forward: log-probs, entropies and logit-gradient energies of the response tokens
    model.train()
    attention = torch.cat([prompt_mask, mask.long()], dim=1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=sequences, attention_mask=attention, position_ids=positions).logits
    plen = prompt_mask.shape[1]
    stats = creditrl.token_stats(logits[:, plen - 1:-1], sequences[:, plen:], mask, temperature=args.temperature)

    # 3. advantages from the rewards, the groups and (OTB/OGB) the energies of the sampling policy
    advantages = creditrl.compute_advantages(args.estimator, rewards=rewards, mask=mask, group=group,
                                             energy=stats.energy.detach())

    # 4. the clipped surrogate (ratio 1 here: we sampled from these very weights), token-mean
    loss, metrics = creditrl.policy_loss(stats.logp, stats.logp.detach(), advantages, mask)

    # 5. AdamW
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return {"loss": float(loss.detach()), "reward": float(rewards.mean()), "grad_norm": float(grad_norm),
            "zero_spread": float((rewards.view(args.prompts, -1).std(1) == 0).float().mean()),
            "length": float(mask.sum(1).float().mean()), **{"adv_abs_mean": metrics["adv_abs_mean"]}}


def main(args: Args) -> list[tuple[int, float]]:
    """Train; returns the held-out greedy accuracy at each eval, (step, accuracy)."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)                # a ~0.2M-parameter model gains nothing from more threads
    task, model, tokenizer = load(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    rng = random.Random(args.seed)
    curve = [(0, evaluate(model, tokenizer, task, args))]
    print(f"step 0  held-out greedy accuracy {curve[-1][1]:.3f}")
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        m = train_step(model, tokenizer, task, optimizer, rng, args)
        if step % args.eval_every == 0 or step == args.steps:
            curve.append((step, evaluate(model, tokenizer, task, args)))
            print(f"step {step}  reward {m['reward']:.3f}  zero-spread groups {m['zero_spread']:.0%}  "
                  f"loss {m['loss']:+.4f}  held-out greedy accuracy {curve[-1][1]:.3f}  "
                  f"({time.perf_counter() - start:.0f}s)")
    return curve


def parse(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, value in vars(Args()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    return Args(**vars(parser.parse_args(argv)))


if __name__ == "__main__":
    main(parse())

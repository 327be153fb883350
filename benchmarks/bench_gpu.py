"""creditrl on a GPU against the peers' own code, side by side in one run.

    python benchmarks/bench_gpu.py                       # the issue's sizes (needs CUDA)
    python benchmarks/bench_gpu.py --quick               # small sizes, on CUDA if present else CPU (CI smoke)
    python benchmarks/bench_gpu.py --only token_stats estimators trainer --json out.json
    python benchmarks/bench_gpu.py --device cpu --lengths 1024 --only token_stats   # CPU, chosen sizes

1. ``token_stats`` (logp, entropy, Σπ², energy) of bf16 logits [T, V = 151,936] (Qwen2.5's
   vocabulary), T in {8k, 16k, 32k}: time and peak memory above the inputs, forward and
   forward + backward (of logp + entropy), against
   - ``full``: the straightforward computation (float32 copy, log_softmax, softmax, sums; autograd);
   - ``verl``: verl's own ``logprobs_from_logits`` + ``entropy_from_logits`` +
     ``calculate_sum_pi_squared_from_logits`` (energy = 1 − 2π(y) + Σπ², as verl's OTB forms
     it), called on [1, T, V] as its actor does without remove-padding. flash-attn's Triton
     cross-entropy, which verl uses when installed, is not (the row is labelled with the path
     verl took).
   Accuracy: each method's max relative error against float64 on the first 256 rows.
   A chunk-size sweep of ``token_stats`` at T = 16k follows.
2. Every estimator at B = 1024 (64 groups × 16), T = 16k on the same device, creditrl's
   ``compute_advantages`` against verl's functions where verl has one (``bench_peers``'s
   cases: right-padded masks and masks with 5% holes).
3. ``creditrl``'s trainer step (sampling + update) against TRL's ``GRPOTrainer`` on the same
   randomly initialised Llama (Qwen2.5-0.5B's shape, 494M parameters; ``--quick``: a tiny one),
   the same prompts (2-digit additions), 8 prompts × 8 completions, every response exactly
   ``--max-len`` tokens (the tokenizer's EOS id lies outside the model's vocabulary, so it is
   never sampled), GRPO, token-mean loss, clip 0.2/0.28, no KL, one optimizer step per batch.
   Precision: TRL ``bf16=True`` (fp32 weights, bf16 autocast); creditrl with fp32 weights
   (fp32 sampling, bf16-autocast update) and with ``model.dtype=bfloat16`` weights. creditrl's
   arms also report the rollout's (sampling + rewards) share of the step.

Times are medians of CUDA-synchronised wall-clock repeats after a warm-up; peak memory is
``torch.cuda.max_memory_allocated`` above what was allocated before the call (CPU: not measured).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_peers import ESTIMATORS as VERL_ESTIMATORS, make_inputs, verl_call  # noqa: E402

QWEN_VOCAB = 151936
QWEN_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                intermediate_size=4864, max_position_embeddings=4096, rope_theta=1e6, tie_word_embeddings=True)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=128, max_position_embeddings=256, tie_word_embeddings=True)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(fn, device, repeats: int, warmup: int = 1) -> dict:
    """Median seconds of ``fn()`` and its peak memory above the memory allocated before it."""
    for _ in range(warmup):
        fn()
    sync(device)
    times, peak = [], None
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
        if device.type == "cuda":
            peak = max(peak or 0, torch.cuda.max_memory_allocated() - base)
    return {"ms": 1e3 * statistics.median(times), "peak_MiB": None if peak is None else peak / 2**20}


def guarded(fn, device, repeats: int) -> dict:
    """``measure``, or {"error": ...} when it runs out of memory."""
    try:
        return measure(fn, device, repeats)
    except torch.OutOfMemoryError as exc:
        return {"error": "OOM: " + str(exc).split("\n")[0][:80]}
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ verl

def import_verl() -> tuple[object | None, str]:
    """(verl.utils.torch_functional or None, a line saying what happened)."""
    try:
        import verl
        from verl.utils import torch_functional as tf
        from verl.trainer.ppo import core_algos  # noqa: F401  (the estimators)
    except Exception as exc:  # the import itself is what is being reported
        return None, f"verl not importable here: {type(exc).__name__}: {str(exc)[:200]}"
    path = "flash-attn Triton CE" if tf.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE else "logprobs_from_logits_v2"
    return tf, f"verl {verl.__version__} (log-probs through {path})"


# ------------------------------------------------------------------------------------ 1. token_stats

def stats_methods(tf) -> dict:
    from creditrl import token_stats

    def creditrl(logits, tokens, chunk=None):
        s = token_stats(logits, tokens, chunk_size=chunk)
        return s.logp, s.entropy, s.sum_p2, s.energy

    def full(logits, tokens):
        logp_all = torch.log_softmax(logits.float(), dim=-1)
        p = logp_all.exp()
        logp = logp_all.gather(-1, tokens[..., None]).squeeze(-1)
        sum_p2 = p.square().sum(-1)
        return logp, -(p * logp_all).sum(-1), sum_p2, 1 - 2 * logp.exp() + sum_p2

    methods = {"creditrl": creditrl, "full": full}
    if tf is not None:
        def verl(logits, tokens):
            logp = tf.logprobs_from_logits(logits, tokens)
            sum_p2 = tf.calculate_sum_pi_squared_from_logits(logits)
            return logp, tf.entropy_from_logits(logits), sum_p2, 1 - 2 * logp.exp() + sum_p2
        methods["verl"] = verl
    return methods


def float64_reference(logits, tokens, rows: int = 256) -> list[torch.Tensor]:
    z = logits[0, :rows].double()
    logp_all = torch.log_softmax(z, dim=-1)
    p = logp_all.exp()
    logp = logp_all.gather(-1, tokens[0, :rows, None]).squeeze(-1)
    sum_p2 = p.square().sum(-1)
    return [logp, -(p * logp_all).sum(-1), sum_p2, 1 - 2 * logp.exp() + sum_p2]


def bench_token_stats(device, lengths: list[int], vocab: int, repeats: int, tf, chunk_sweep: int | None) -> list[dict]:
    from creditrl.core.token_stats import default_chunk_size

    methods, rows = stats_methods(tf), []
    print(f"\n== token_stats: bf16 logits [T, V={vocab}] on {device.type}; ms and peak MiB above the inputs")
    print(f"{'T':>6} {'method':<10}{'fwd ms':>9}{'fwd MiB':>10}{'f+b ms':>9}{'f+b MiB':>10}   "
          f"max rel err vs float64 (logp, H, Σπ², energy)")
    for length in lengths:
        gen = torch.Generator(device=device).manual_seed(length)
        logits = (torch.randn(1, length, vocab, generator=gen, device=device) * 2.5).to(torch.bfloat16)
        tokens = torch.randint(0, vocab, (1, length), generator=gen, device=device)
        head = (logits[:, :256].contiguous(), tokens[:, :256].contiguous())
        ref = float64_reference(*head)
        for name, fn in methods.items():
            with torch.no_grad():
                errors = [float(((o[0].double() - r).abs() / r.abs().clamp(min=1e-6)).max())
                          for o, r in zip(fn(*head), ref)]
                fwd = guarded(lambda: fn(logits, tokens), device, repeats)

            def step():
                leaf = logits.detach().requires_grad_()
                logp, entropy, *_ = fn(leaf, tokens)
                (logp.float().sum() + entropy.float().sum()).backward()
            both = guarded(step, device, repeats)
            row = {"T": length, "method": name, "fwd": fwd, "fwd+bwd": both, "rel_err": errors}
            rows.append(row)
            print(f"{length:>6} {name:<10}{fmt(fwd, 'ms')}{fmt(fwd, 'peak_MiB', 10)}{fmt(both, 'ms')}"
                  f"{fmt(both, 'peak_MiB', 10)}   " + ", ".join(f"{e:.1e}" for e in errors))
        del logits, tokens
    if chunk_sweep:
        length = chunk_sweep
        logits = (torch.randn(1, length, vocab, device=device) * 2.5).to(torch.bfloat16)
        tokens = torch.randint(0, vocab, (1, length), device=device)
        print(f"\ntoken_stats chunk sweep at T={length} (chunk_size = tokens per chunk; default here "
              f"{default_chunk_size(vocab, device)})")
        for elements in (1 << 22, 1 << 24, 1 << 25, 1 << 26, 1 << 27, 1 << 28):
            chunk = max(1, elements // vocab)
            with torch.no_grad():
                fwd = guarded(lambda: methods["creditrl"](logits, tokens, chunk), device, repeats)
            print(f"  chunk {chunk:>5} tokens ({elements * 4 / 2**20:>4.0f} MiB fp32 scratch each): "
                  f"fwd {fmt(fwd, 'ms').strip()} ms, peak {fmt(fwd, 'peak_MiB').strip()} MiB")
            rows.append({"T": length, "method": f"creditrl chunk={chunk}", "fwd": fwd})
    return rows


def fmt(result: dict, key: str, width: int = 9) -> str:
    if "error" in result:
        return f"{'OOM' if 'OOM' in result['error'] else 'error':>{width}}"
    value = result.get(key)
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.1f}"


# ------------------------------------------------------------------------------------ 2. estimators

def bench_estimators(device, num_groups: int, size: int, length: int, repeats: int, tf) -> list[dict]:
    from creditrl import compute_advantages, list_estimators
    from creditrl.integrations.energy import energy_from_logp

    print(f"\n== estimators: B={num_groups * size} ({num_groups} x {size}), T={length} on {device.type}; ms "
          f"(verl: its own function, same inputs; creditrl: compute_advantages incl. the energy for otb/ogb)")
    print(f"{'estimator':<30}{'mask':<14}{'verl ms':>9}{'creditrl ms':>13}{'verl/creditrl':>15}{'max|diff|':>11}")
    rows = []
    for holes in (False, True):
        inputs = make_inputs(num_groups, size, length, holes, mask_dtype=torch.bool)
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        valid = inputs["response_mask"]
        for name in list_estimators():
            options = {"k": 4} if name in ("maxpo", "pkpo", "passk_chen", "maxk_bon", "ei") else {}
            needs_energy = name in ("otb", "otb_isolated", "ogb")

            def ours(name=name, options=options, needs_energy=needs_energy):
                energy = energy_from_logp(inputs["old_log_probs"], inputs["sum_pi_squared"]) if needs_energy else None
                return compute_advantages(name, rewards=inputs["scores"], mask=valid, group=inputs["group"],
                                          energy=energy, **options)
            mine = measure(ours, device, repeats)
            theirs, diff = None, None
            if tf is not None and name in VERL_ESTIMATORS:
                fn = verl_call(name, holes, {**inputs, "response_mask": valid.float()})
                theirs = measure(fn, device, repeats)
                diff = float((fn() - ours())[valid].abs().max())
            ratio = theirs["ms"] / mine["ms"] if theirs else None
            rows.append({"estimator": name, "holes": holes, "creditrl_ms": mine["ms"],
                         "verl_ms": theirs and theirs["ms"], "ratio": ratio, "diff": diff})
            print(f"{name:<30}{'5% holes' if holes else 'right-padded':<14}"
                  f"{'-' if theirs is None else format(theirs['ms'], '.2f'):>9}{mine['ms']:>13.2f}"
                  f"{'-' if ratio is None else format(ratio, '.2f') + 'x':>15}{'-' if diff is None else format(diff, '.1e'):>11}")
    return rows


# ------------------------------------------------------------------------------------ 3. trainers

def fixed_length_tokenizer(alphabet: str, vocab: int):
    """A character tokenizer over ``alphabet`` padded with filler tokens to ``vocab`` ids, and an
    EOS with id ``vocab``: outside a ``vocab``-sized model, so no response ever stops early."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(alphabet))
    names = ["<pad>", "<unk>"] + chars
    names += [f"w{i}" for i in range(vocab - len(names))] + ["<eos>"]
    tok = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(["<pad>", "<unk>", "<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>",
                                   padding_side="left", model_max_length=4096)


def random_llama(shape: dict, vocab: int, tokenizer, device, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=None, **shape)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def sevens(text: str) -> float:
    """A reward with a spread for random text: the share of '7' among the response's characters."""
    return 10.0 * text.count("7") / max(1, len(text))


def trainer_setup(args, device, dtype=torch.float32):
    from creditrl.tasks import get_task

    task = get_task("addition", digits=2)
    tok = fixed_length_tokenizer(task.alphabet(), args.vocab)
    return task, tok, random_llama(args.shape, args.vocab, tok, device, dtype)


def bench_creditrl(args, device, dtype_name: str) -> dict:
    from creditrl.config import load_config
    from creditrl.runtime.rollout import generate_rollouts
    from creditrl.trainer.update import Learner

    task, tok, model = trainer_setup(args, device, getattr(torch, dtype_name))
    task.reward = lambda problem, text: sevens(text)           # the same reward TRL gets
    cfg = load_config(None, ["algorithm.estimator=grpo", "loss.agg=token-mean", "loss.clip_low=0.2",
                             "loss.clip_high=0.28", "loss.kl_coef=0", f"rollout.max_new_tokens={args.max_len}",
                             f"rollout.group_size={args.group}", f"rollout.prompts_per_step={args.prompts}",
                             "optim.lr=1e-6", f"model.dtype={dtype_name}"])
    learner = Learner(model, cfg)
    gen, rng = torch.Generator().manual_seed(0), random.Random(0)
    times, sampling, tokens = [], [], []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        problems = [task.sample(rng) for _ in range(args.prompts)]
        batch = generate_rollouts(model, tok, task, problems, group_size=args.group, max_new_tokens=args.max_len,
                                  generator=gen, temperature=1.0)
        sync(device)        # the step's split: sampling (with scoring) | update
        sampling.append(time.perf_counter() - start)
        learner.update(batch, gen)
        sync(device)
        times.append(time.perf_counter() - start)
        tokens.append(batch.num_tokens)
    return {**summarize(times[args.warmup:], tokens[args.warmup:], args),
            "sampling_share": sum(sampling[args.warmup:]) / sum(times[args.warmup:])}


def bench_trl(args, device, weights_dtype: str = "float32") -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    task, tok, model = trainer_setup(args, device, getattr(torch, weights_dtype))
    rng = random.Random(0)
    data = Dataset.from_list([{"prompt": task.sample(rng).prompt} for _ in range(args.prompts * (args.steps + args.warmup + 2))])

    def reward(prompts, completions, **_):
        return [sevens(c) for c in completions]

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.start = [], None

        def on_step_begin(self, a, state, control, **kw):
            sync(device)
            self.start = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            sync(device)
            self.times.append(time.perf_counter() - self.start)

    clock = Clock()
    cuda = device.type == "cuda"
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(output_dir=out, per_device_train_batch_size=args.prompts * args.group,
                            num_generations=args.group, max_completion_length=args.max_len, learning_rate=1e-6,
                            beta=0.0, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, num_iterations=1,
                            temperature=1.0, bf16=cuda, use_cpu=not cuda, report_to=[], logging_steps=1,
                            max_steps=args.steps + args.warmup, save_strategy="no", gradient_checkpointing=False,
                            seed=0, dataloader_num_workers=0, disable_tqdm=True)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tok,
                              callbacks=[clock])
        trainer.remove_callback(PrinterCallback)
        trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    tokens = [round(n * args.prompts * args.group) for n in lengths]
    return summarize(clock.times[args.warmup:], tokens[args.warmup:], args)


def summarize(times: list[float], tokens: list[int], args) -> dict:
    total = sum(times)
    return {"steps_per_s": len(times) / total, "tokens_per_s": sum(tokens) / total,
            "mean_len": sum(tokens) / len(tokens) / (args.prompts * args.group), "step_s": times}


def bench_trainers(args, device) -> dict:
    n_params = sum(p.numel() for p in trainer_setup(args, "meta")[2].parameters())
    print(f"\n== trainer step (sampling + update): random-init Llama {n_params / 1e6:.2f}M params, V={args.vocab}, "
          f"{args.prompts}x{args.group} completions of exactly {args.max_len} tokens, {args.steps} timed steps "
          f"after {args.warmup} warm-up, on {device.type}")
    autocast = ", bf16-autocast update" if device.type == "cuda" else ""
    runs = {f"creditrl (fp32 weights{autocast})": lambda: bench_creditrl(args, device, "float32")}
    if device.type == "cuda":
        runs["creditrl (model.dtype=bfloat16)"] = lambda: bench_creditrl(args, device, "bfloat16")
    runs["TRL GRPOTrainer (" + ("bf16=True" if device.type == "cuda" else "fp32") + ")"] = lambda: bench_trl(args, device)
    results = {}
    print(f"{'trainer':<50}{'steps/s':>9}{'tokens/s':>11}{'mean len':>10}   seconds per step")
    for name, run in runs.items():
        try:
            results[name] = run()
        except Exception as exc:          # a peer failing on this stack is a result to report
            results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"{name:<50} failed: {results[name]['error']}")
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        r = results[name]
        print(f"{name:<50}{r['steps_per_s']:>9.3f}{r['tokens_per_s']:>11.0f}{r['mean_len']:>10.1f}   "
              + " ".join(f"{t:.2f}" for t in r["step_s"])
              + (f"   (sampling {r['sampling_share']:.0%})" if "sampling_share" in r else ""))
    trl = next((v for k, v in results.items() if k.startswith("TRL") and "error" not in v), None)
    for name, r in results.items():
        if trl is not None and not name.startswith("TRL") and "error" not in r:
            print(f"ratio {name} / TRL: steps/s {r['steps_per_s'] / trl['steps_per_s']:.2f}x, "
                  f"tokens/s {r['tokens_per_s'] / trl['tokens_per_s']:.2f}x")
    return results


# ------------------------------------------------------------------------------------ main

def environment(device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "device": device.type}
    if device.type == "cuda":
        env.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = "unknown"
    else:
        env["cpu"] = platform.processor() or platform.machine()
        env["threads"] = torch.get_num_threads()
    for name in ("transformers", "trl", "accelerate"):
        try:
            env[name] = __import__(name).__version__
        except Exception:  # absent or broken: say so
            env[name] = "not importable"
    return env


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run; CPU when no CUDA)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    parser.add_argument("--only", nargs="+", default=["token_stats", "estimators", "trainer"],
                        choices=["token_stats", "estimators", "trainer"])
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="timed trainer steps (default 3; quick 1)")
    parser.add_argument("--max-len", type=int, default=None, help="response tokens (default 128; quick 8)")
    parser.add_argument("--lengths", type=int, nargs="+", help="token_stats T values (default 8k 16k 32k; quick 64)")
    parser.add_argument("--estimator-shape", type=int, nargs=3, metavar=("GROUPS", "SIZE", "T"),
                        help="estimator batch (default 64 16 16384; quick 4 16 256)")
    parser.add_argument("--json", default=None, help="write every number here")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sized = "token_stats" not in args.only or args.lengths, "estimators" not in args.only or args.estimator_shape
    if device.type == "cpu" and not args.quick and not (all(sized) and "trainer" not in args.only):
        parser.error("the default sizes need a CUDA device; on a CPU use --quick, or --lengths / --estimator-shape "
                     "without the trainer section")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    quick = args.quick
    repeats = args.repeats or (1 if quick else 5)
    args.steps = args.steps or (1 if quick else 3)
    args.warmup = 1
    args.max_len = args.max_len or (8 if quick else 128)
    args.prompts, args.group = (2, 4) if quick else (8, 8)
    args.shape, args.vocab = (TINY, 1000) if quick else (QWEN_05B, QWEN_VOCAB)
    env = environment(device)
    tf, verl_line = import_verl()
    env["verl"] = verl_line
    print("bench_gpu: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    results = {"env": env, "argv": sys.argv[1:]}

    def save() -> None:  # after every section, so a run cut off by a time limit keeps what it measured
        if args.json:
            with open(args.json + ".tmp", "w") as f:
                json.dump(results, f, indent=1, default=str)
            os.replace(args.json + ".tmp", args.json)        # never a half-written file

    save()
    if "token_stats" in args.only:
        lengths = args.lengths or ([64] if quick else [8192, 16384, 32768])
        results["token_stats"] = bench_token_stats(device, lengths, QWEN_VOCAB, repeats, tf,
                                                   16384 if device.type == "cuda" and not quick else None)
        save()
    if "estimators" in args.only:
        sizes = args.estimator_shape or ((4, 16, 256) if quick else (64, 16, 16384))
        results["estimators"] = bench_estimators(device, *sizes, min(repeats, 3), tf)
        save()
    if "trainer" in args.only:
        results["trainer"] = bench_trainers(args, device)
        save()


if __name__ == "__main__":
    main()

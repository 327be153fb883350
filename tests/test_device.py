"""Device-sensitive tests: the library, the sampler and the trainers on CUDA (``make test-gpu``).

Every test here carries the ``cuda`` marker, directly or through the ``device`` fixture (which
also runs it on the CPU). Without a CUDA device the CUDA cases are skipped and counted as
skipped. CUDA results are checked against the CPU (already tested against loop references in
the other test files) or against float64 references computed here.
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from creditrl import compute_advantages, policy_loss, token_stats
from creditrl.core.losses.policy import LOG_PROBS
from creditrl.core.token_stats import default_chunk_size
from creditrl.runtime.models.tiny import TinyModelConfig, char_tokenizer, tiny_model
from creditrl.runtime.sampling import cut_at_stop, generate, stop_token_ids
from creditrl.runtime.scoring import response_stats
from host_transfers import HostTransfers
from test_estimators import ALL as ESTIMATORS
from test_estimators import make_batch as estimator_batch
from test_losses import COMBOS
from test_policy_gradients import grad_rtol, loss_atol, option_batch
from test_resume import records, train_cmd
from tolerances import assert_close_normwise, logp_atol, sum_rtol

QWEN_VOCAB = 151936          # Qwen2.5's vocabulary: the size the issue asks token_stats to hold at
PAIRWISE = sum_rtol(math.ceil(math.log2(QWEN_VOCAB)) + 16)   # pairwise/tree sums over V (tests/tolerances.py)
MAXK = {"maxpo": 2, "maxk_bon": 2, "passk_chen": 2, "pkpo": 2, "ei": 2}
REPORT = os.environ.get("CREDITRL_DEVICE_REPORT")   # a directory: transfer counts are written there


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """‖x − ref‖ / ‖ref‖ in float64 (0 when both are 0)."""
    x, ref = x.detach().double(), ref.detach().double().to(x.device)
    den = float(ref.norm())
    return float((x - ref).norm()) / den if den else float(x.norm())


def report(name: str, payload: dict) -> None:
    if REPORT:
        os.makedirs(REPORT, exist_ok=True)
        with open(os.path.join(REPORT, "transfers.jsonl"), "a") as f:
            f.write(json.dumps({"test": name, **payload}) + "\n")


def to(batch: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


# ------------------------------------------------------------------------------- estimators

def estimator_inputs(name: str, token_rewards: bool, seed: int = 0) -> tuple[dict, dict]:
    """A batch with holey masks, an empty row, a singleton group and T = 300 (several scan blocks)."""
    batch = estimator_batch(seed, sizes=(8, 8, 1, 5, 8, 6), steps=300, token_rewards=token_rewards)
    options = {"k": MAXK[name]} if name in MAXK else {}
    if name == "passk_chen":
        batch["rewards"] = (batch["rewards"] > 0).float() if batch["rewards"].dim() == 1 else \
            (batch["rewards"].sum(-1) > 0).float()
    if name in ("otb", "otb_isolated", "ogb"):
        gen = torch.Generator().manual_seed(seed + 1)
        batch["is_weights"] = torch.rand(batch["mask"].shape, generator=gen) * 2
    if name == "reinforce":
        options["gamma"] = 0.9
    return batch, options


@pytest.mark.cuda
@pytest.mark.parametrize("name,token_rewards",   # max@K estimators take one outcome reward per response
                         [(n, t) for n in ESTIMATORS for t in (False, True) if not (t and n in MAXK)],
                         ids=lambda v: v if isinstance(v, str) else ("r[B,T]" if v else "R[B]"))
def test_estimator_on_cuda_equals_cpu(name, token_rewards):
    batch, options = estimator_inputs(name, token_rewards)
    cpu = compute_advantages(name, **batch, **options)
    cuda = compute_advantages(name, **to(batch, "cuda"), **options)
    assert cuda.device.type == "cuda" and cuda.dtype == torch.float32 and cuda.shape == cpu.shape
    assert torch.equal(cuda.cpu()[~batch["mask"]], torch.zeros(int((~batch["mask"]).sum())))
    # float32 sums over <= one group's 8 x 300 tokens, in the CPU's and the GPU's orders: each within
    # (2400 + 8)·eps32 of the values' magnitude (tests/tolerances.py)
    scale = max(1.0, float(cpu.abs().max()))
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=0, atol=2 * sum_rtol(8 * 300 + 8) * scale)
    assert cpu.abs().sum() > 0   # not vacuous


# ------------------------------------------------------------------------------- token_stats

def reference_stats(logits: torch.Tensor, tokens: torch.Tensor, temperature: float, g_logp: torch.Tensor,
                    g_ent: torch.Tensor, rows: int = 256) -> dict:
    """float64 autograd reference on the flat [N,V] logits (as given, upcast), ``rows`` at a time:
    logp, entropy, Σπ², energy [N] and d(Σ g_logp·logp + g_ent·H)/dlogits [N,V] float64."""
    out = {k: [] for k in ("logp", "entropy", "sum_p2", "energy")}
    grad = torch.empty(logits.shape, dtype=torch.float64, device=logits.device)
    for s in range(0, logits.shape[0], rows):
        z = logits[s:s + rows].double().requires_grad_()
        logp_all = torch.log_softmax(z / temperature, dim=-1)
        p = logp_all.exp()
        logp = logp_all.gather(-1, tokens[s:s + rows, None]).squeeze(-1)
        entropy = -(p * logp_all).sum(-1)
        (g_logp[s:s + rows].double() * logp + g_ent[s:s + rows].double() * entropy).sum().backward()
        grad[s:s + rows] = z.grad
        sum_p2 = p.detach().square().sum(-1)
        py = logp.detach().exp()
        out["logp"].append(logp.detach())
        out["entropy"].append(entropy.detach())
        out["sum_p2"].append(sum_p2)
        out["energy"].append((1 - 2 * py + sum_p2).clamp(min=0))
    return {**{k: torch.cat(v) for k, v in out.items()}, "grad": grad}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_token_stats_at_qwen_vocab_matches_float64(device, dtype, temperature):
    """V = 151,936; on CUDA 2 rows of 3,000 tokens (long rows), on the CPU 2 x 12. Forward and the logits'
    gradient normwise to (⌈log2 V⌉ + 16)·eps32 of float64 (the reference sees the same, possibly bf16, logits
    upcast): every sum over V is pairwise on the CPU and a tree on CUDA (token_stats' design), whose rounding
    grows with log2 V, not V (a sequential float32 sum could lose 151,936·eps32/2 ≈ 1%); a bf16 gradient is
    rounded to bf16 (eps 2^-7) on top. On CUDA the peak memory: no float32 [B,T,V] copy in either pass."""
    rows, steps = (2, 3000) if device.type == "cuda" else (2, 12)
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(rows, steps, QWEN_VOCAB, generator=gen, device=device) * 2.5
    tokens = torch.randint(0, QWEN_VOCAB, (rows, steps), generator=gen, device=device)
    peaked = torch.rand(rows, steps, generator=gen, device=device) < 0.2      # near-certain tokens
    logits[peaked] = logits[peaked].scatter_add(-1, tokens[peaked][:, None],
                                                torch.full((int(peaked.sum()), 1), 30.0, device=device))
    logits = logits.to(dtype)
    mask = torch.rand(rows, steps, generator=gen, device=device) > 0.1
    mask[0, 0] = False
    g_logp = torch.randn(rows, steps, generator=gen, device=device)
    g_ent = torch.randn(rows, steps, generator=gen, device=device)

    leaf = logits.clone().requires_grad_()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    stats = token_stats(leaf, tokens, mask, temperature=temperature)
    if device.type == "cuda":
        forward_extra = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    ((stats.logp * g_logp).sum() + (stats.entropy * g_ent).sum()).backward()
    if device.type == "cuda":
        backward_extra = torch.cuda.max_memory_allocated() - base
        fp32_copy = rows * steps * QWEN_VOCAB * 4
        grad_bytes = rows * steps * QWEN_VOCAB * logits.element_size()
        report(f"token_stats[{dtype}]", {"forward_extra_MiB": forward_extra / 2**20,
                                          "backward_extra_MiB": backward_extra / 2**20,
                                          "fp32_copy_MiB": fp32_copy / 2**20})
        # O(chunk) scratch: a few float32 [chunk, V] temporaries, far below a float32 [B,T,V] copy
        scratch = 4 * 4 * default_chunk_size(QWEN_VOCAB, device) * QWEN_VOCAB
        assert forward_extra < min(scratch, fp32_copy / 4), f"forward peak {forward_extra / 2**20:.0f} MiB above the inputs"
        assert backward_extra < grad_bytes + scratch, \
            f"backward peak {backward_extra / 2**20:.0f} MiB; the gradient itself is {grad_bytes / 2**20:.0f} MiB"

    valid = mask.flatten()
    flat_tokens = tokens.flatten()[valid]
    ref = reference_stats(logits.reshape(-1, QWEN_VOCAB)[valid], flat_tokens, temperature,
                          g_logp.flatten()[valid], g_ent.flatten()[valid])
    for name in ("logp", "entropy", "sum_p2", "energy"):
        got = getattr(stats, name)
        assert got.dtype == torch.float32 and got.device.type == device.type
        assert torch.equal(got[~mask], torch.zeros_like(got[~mask])), name
        assert rel_err(got.flatten()[valid], ref[name]) < PAIRWISE, name
    grad = leaf.grad.reshape(-1, QWEN_VOCAB)
    assert leaf.grad.dtype == dtype
    assert float(grad[~valid].abs().max()) == 0.0
    assert rel_err(grad[valid], ref["grad"]) < PAIRWISE + (0 if dtype == torch.float32 else torch.finfo(dtype).eps)


# ------------------------------------------------------------------------------- policy_loss

def loss_inputs(combo, token_adv: bool):
    return option_batch(combo, token_adv, length=200)      # rows long enough for several trace blocks


def loss_and_grad(logp, old, adv, mask, kwargs, device):
    lp = logp.detach().to(device).requires_grad_()     # a leaf on every device (.to("cuda") of a leaf is not one)
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    loss, metrics = policy_loss(lp, old.to(device), adv.to(device), mask.to(device), **moved)
    loss.backward()
    return loss.detach(), lp.grad, metrics


@pytest.mark.cuda
@pytest.mark.parametrize("token_adv", [False, True], ids=["adv[B]", "adv[B,T]"])
@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "+".join(c))
def test_policy_loss_on_cuda_equals_cpu(combo, token_adv):
    """Every option alone and every compatible pair: value, gradient and metrics."""
    logp, old, adv, mask, kwargs = loss_inputs(combo, token_adv)
    value, grad, metrics = loss_and_grad(logp, old, adv, mask, kwargs, "cpu")
    value_cuda, grad_cuda, metrics_cuda = loss_and_grad(logp, old, adv, mask, kwargs, "cuda")
    assert grad_cuda.device.type == "cuda" and grad.abs().sum() > 0
    # both within test_policy_gradients' float32 bounds of the exact loss and gradient
    torch.testing.assert_close(value_cuda.cpu(), value, atol=2 * loss_atol(logp, old, adv, mask, **kwargs), rtol=0)
    assert_close_normwise(grad_cuda.cpu(), grad, 2 * grad_rtol(mask), "gradient")
    assert metrics.keys() == metrics_cuda.keys()
    for k in metrics:   # means over the B·T tokens of terms of a few operations
        assert metrics_cuda[k] == pytest.approx(metrics[k], rel=2 * sum_rtol(mask.numel() + 12), abs=0), k


# ------------------------------------------------------------------------------- the sampler

ALPHABET = "0123456789+=abc"


def tiny_policy(device, seed: int = 0):
    tokenizer = char_tokenizer(ALPHABET)
    cfg = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    return tiny_model(tokenizer, cfg, seed=seed).to(device).eval(), tokenizer


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sampler_on_device(device, top_p):
    """Valid tokens, stop tokens and strings, clipped rows, the behaviour log-probs (= a
    teacher-forced forward's when top_p = 1) and determinism on one device."""
    model, tok = tiny_policy(device)
    prompts = [tok.encode(p, add_special_tokens=False) for p in ("12+3=", "7+88=", "a=", "1+1=")]
    stops, max_new = ("7",), 10
    run = [generate(model, tok, prompts, group_size=6, temperature=1.0, top_p=top_p, max_new_tokens=max_new,
                    generator=torch.Generator().manual_seed(s), stop_strings=stops) for s in (3, 3)]
    out = run[0]
    for field in ("input_ids", "attention_mask", "response_mask", "rollout_logp", "stopped"):
        assert torch.equal(getattr(out, field), getattr(run[1], field)), field   # same seed, same draws
        assert getattr(out, field).device.type == "cpu"                          # results come back
    p, vocab = out.prompt_len, model.config.vocab_size
    ids, sampled = out.input_ids[:, p:], out.response_mask[:, p:].bool()
    assert int(ids.min()) >= 0 and int(ids.max()) < vocab
    stop_ids = set(stop_token_ids(model, tok))
    ended = {"token": 0, "string": 0, "clipped": 0}
    for b in range(ids.shape[0]):
        row = ids[b][sampled[b]].tolist()
        assert sampled[b].sum() == len(row) and sampled[b][:len(row)].all()       # contiguous from column P
        text = tok.decode(row, skip_special_tokens=True)
        if out.stopped[b]:
            last_is_stop = row[-1] in stop_ids
            by_string = cut_at_stop(text, stops) == text and any(s in text for s in stops)
            assert last_is_stop or by_string, (row, text)
            assert not any(t in stop_ids for t in row[:-1])
            assert not any(s in tok.decode(row[:-1], skip_special_tokens=True) for s in stops)
            ended["token" if last_is_stop else "string"] += 1
        else:
            assert len(row) == max_new and not stop_ids & set(row) and not any(s in text for s in stops)
            ended["clipped"] += 1
    assert all(ended.values()), ended            # every way of ending a row occurred
    logp = out.rollout_logp[:, p:]
    assert bool((logp[sampled] <= 0).all()) and bool((logp[~sampled] == 0).all())
    if top_p == 1.0:
        with torch.no_grad():
            stats = response_stats(model, out.input_ids.to(device), out.attention_mask.to(device),
                                   (out.attention_mask.cumsum(-1) - 1).clamp(min=0).to(device),
                                   out.response_mask.to(device), p, temperature=1.0)
            scale = float(model(input_ids=out.input_ids.to(device), attention_mask=out.attention_mask.to(device)
                                ).logits.abs().max())
        atol = logp_atol(model, out.input_ids.shape[1], scale)   # the sampler's cached forward vs one forward
        torch.testing.assert_close(stats.logp.cpu(), logp, rtol=0, atol=atol)


# ------------------------------------------------------------------------------- host transfers

def check_transfers(rec: HostTransfers, device, *, largest: int, scalars: int, copies: int, name: str) -> None:
    """No copy or scalar read of more than ``largest`` elements from ``device``; at most
    ``scalars`` scalar reads and ``copies`` copies asked for by creditrl's own code."""
    own = [r for r in rec.on(device) if r.creditrl]
    report(name, {"device": str(device), "summary": rec.summary(),
                  "creditrl_scalars": sum(r.kind == "scalar" for r in own),
                  "creditrl_copies": sum(r.kind == "copy" for r in own)})
    big = [r for r in rec.on(device) if r.numel > largest]
    assert not big, f"{name}: tensors of more than {largest} elements moved to the host: {big}"
    n_scalars, n_copies = sum(r.kind == "scalar" for r in own), sum(r.kind == "copy" for r in own)
    assert n_scalars <= scalars and n_copies <= copies, \
        f"{name}: {n_scalars} scalar reads (documented: <= {scalars}), {n_copies} copies (<= {copies}): {rec.summary()}"


@pytest.mark.cuda
def test_transfer_recorder_sees_copies_and_scalar_reads():
    x = torch.arange(12.0, device="cuda").reshape(3, 4)
    with HostTransfers() as rec:
        x.cpu(), x.tolist(), float(x.sum()), bool(x.any()), x.to("cpu", non_blocking=True)
    kinds = [(r.kind, r.shape) for r in rec.on("cuda")]
    assert kinds == [("copy", (3, 4)), ("copy", (3, 4)), ("scalar", ()), ("scalar", ()), ("copy", (3, 4))], kinds


@pytest.mark.cuda
def test_sampler_moves_only_tokens_and_logps_per_step():
    """``runtime.sampling`` (and docs/performance.md): per decoding step the sampled tokens [N]
    and their log-probs [N] come to the host; no [N,V] logits, no scalar reads by creditrl."""
    model, tok = tiny_policy("cuda")
    prompts = [tok.encode(p, add_special_tokens=False) for p in ("12+3=", "7+88=", "a=", "1+1=")]
    with HostTransfers() as rec:
        out = generate(model, tok, prompts, group_size=8, max_new_tokens=12, generator=torch.Generator().manual_seed(0))
    steps = out.input_ids.shape[1] - out.prompt_len
    check_transfers(rec, "cuda", largest=out.input_ids.shape[0], scalars=0, copies=2 * steps, name="sampler")


def test_token_stats_reads_one_flag_per_chunk(device):
    """docs/performance.md: per call 2 scalar reads and, on CUDA, one copy of the chunk bounds
    [2, chunks] in each pass, whatever the number of chunks; nothing of [B,T] or [B,T,V]."""
    rows, steps, vocab, chunk = 4, 96, 1000, 64
    logits = torch.randn(rows, steps, vocab, device=device, requires_grad=True)
    tokens = torch.randint(0, vocab, (rows, steps), device=device)
    mask = torch.rand(rows, steps, device=device) > 0.2
    with HostTransfers() as rec:
        stats = token_stats(logits, tokens, mask, chunk_size=chunk)
        (stats.logp.sum() + stats.entropy.sum()).backward()
    chunks = math.ceil(int(mask.sum()) / chunk)
    check_transfers(rec, device, largest=2 * chunks, scalars=2, copies=2, name="token_stats")


@pytest.mark.parametrize("name", ESTIMATORS)
def test_estimators_read_no_per_token_scalars(device, name):
    """docs/performance.md: compute_advantages reads its input checks' statistics back in one
    copy of at most 9 numbers (``FusedChecks``) and makes at most 6 scalar reads per call,
    whatever B and T; nothing of [B] or [B,T] moves to the host."""
    batch, options = estimator_inputs(name, False)
    with HostTransfers() as rec:
        compute_advantages(name, **to(batch, device), **options)
    check_transfers(rec, device, largest=9, scalars=6, copies=1, name=f"estimator {name}")


@pytest.mark.parametrize("combo", [("clip_high",), ("kl", "stapo"), ("mis", "trace"), ("weight", "dual_clip")],
                         ids=lambda c: "+".join(c))
def test_policy_loss_reads_its_metrics_in_one_copy(device, combo):
    """docs/performance.md: the metrics, their counts and the log-prob inputs' largest valid values come
    back in one copy; at most 16 scalar reads per call guard the rare paths (clamps, non-finite
    inputs, STAPO's quantile)."""
    logp, old, adv, mask, kwargs = loss_inputs(combo, True)
    with HostTransfers() as rec:
        _, _, metrics = loss_and_grad(logp, old, adv, mask, kwargs, device)
    # the copy: the metrics, the counts of those that are means (``LossMetrics.counts``), the loss
    # and, on a GPU, the largest valid value of each log-prob input
    # given and the negated lowest of each but logp (``policy._zeroed_log_probs``), and the entropy's
    # lowest when one is given; on the CPU those are checked before, by aminmax reads
    given = ["logp", "old_logp", *(k for k in kwargs if k in LOG_PROBS and kwargs[k] is not None)]
    bounds = sum(1 if name == "logp" else 2 for name in given) + (kwargs.get("entropy") is not None)
    largest = len(metrics) + len(metrics.counts) + 1 + (bounds if device.type == "cuda" else 0)
    check_transfers(rec, device, largest=largest, scalars=16, copies=1, name=f"policy_loss {'+'.join(combo)}")


def test_learner_update_moves_no_token_tensors_to_the_host(device):
    """One ``Learner.update`` (statistics, advantages, loss, optimizer, metrics): no [B,T] tensor
    comes back; docs/performance.md: at most 64 scalar reads (validation guards and the step's
    metrics; none per parameter tensor) and 16 small copies (chunk bounds, loss metrics, the
    packing's sizes) per step of one micro-batch."""
    from creditrl.config import load_config
    from creditrl.runtime.rollout import generate_rollouts
    from creditrl.tasks import get_task
    from creditrl.trainer.update import Learner

    task = get_task("addition", digits=2)
    tok = char_tokenizer(task.alphabet())
    model = tiny_model(tok, TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)).to(device)
    cfg = load_config(None, ["algorithm.estimator=otb", "rollout.group_size=8", "rollout.prompts_per_step=4",
                             "rollout.max_new_tokens=8", "loss.stapo.enabled=true"])
    learner = Learner(model, cfg)
    gen = torch.Generator().manual_seed(0)
    import random
    problems = [task.sample(random.Random(0)) for _ in range(4)]
    batches = [generate_rollouts(model, tok, task, problems, group_size=8, max_new_tokens=8, generator=gen)
               for _ in range(2)]
    for i, batch in enumerate(batches):            # an untrained policy earns 0: rewards with a spread
        batch.rewards = torch.rand(len(batch.rewards), generator=torch.Generator().manual_seed(i))
    learner.update(batches[0], gen)                # the first step creates the optimizer state
    batch = batches[1]
    with HostTransfers() as rec:
        result = learner.update(batch, gen)
    metrics = getattr(result, "metrics", result)   # a dict, or main's Update(metrics, advantages)
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    check_transfers(rec, device, largest=batch.input_ids.shape[0], scalars=64, copies=16, name="Learner.update")


# ------------------------------------------------------------------------------- creditrl train on CUDA

TINY_RUN = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
            "model.warm_start.max_steps=400", "model.warm_start.eval_every=25", "model.warm_start.eval_size=32",
            "model.warm_start.target_accuracy=0.3", "model.warm_start.lr=3e-3", "task.options.digits=1",
            "train.eval_problems=8", "train.eval_samples=4", "train.pass_k=[1,4]", "logging.progress=false",
            "train.device=cuda", "algorithm.estimator=otb", "loss.stapo.enabled=true"]


@pytest.mark.cuda
@pytest.mark.parametrize("variant", [[], ["model.lora.enabled=true", "model.lora.r=4", "optim.lr=1e-3"],
                                     ["model.dtype=bfloat16"]], ids=["fp32", "lora", "bf16"])
def test_train_three_steps_on_cuda(tmp_path, variant):
    """``creditrl train`` with ``train.device=cuda``. bf16 is ``model.dtype=bfloat16`` (bf16
    weights); mixed precision with float32 master weights arrives with issue 22."""
    from creditrl.config import load_config
    from creditrl.trainer.loop import Trainer

    cfg = load_config(None, TINY_RUN + variant + ["train.steps=3", "train.save_every=3", f"train.output_dir={tmp_path}",
                                                  "train.run_name=run", "train.eval_every=0"])
    trainer = Trainer(cfg, tmp_path / "run", progress=False)
    trainable = {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    assert all(v.device.type == "cuda" for v in trainable.values())
    if "model.dtype=bfloat16" in variant:
        assert all(v.dtype == torch.bfloat16 for v in trainable.values())
    trainer.run()
    metrics = records(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
        assert m["skipped_updates"] == 0
    assert any(m["grad_norm"] > 0 for m in metrics)
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(v, after[k].detach()) for k, v in trainable.items())
    assert (tmp_path / "run" / "summary.md").is_file() and (tmp_path / "run" / "final").is_dir()


@pytest.mark.cuda
def test_resume_after_sigkill_on_cuda_is_bit_exact(tmp_path):
    """A run killed after step 3 (checkpoint at 2) and resumed logs the same metrics as an
    uninterrupted one, to the last bit, on the same GPU (train.deterministic=true). When some
    kernel is not deterministic the failure names the ops torch warned about."""
    from creditrl.config import load_config
    from creditrl.runtime.models import load_policy
    from creditrl.tasks import get_task

    common = TINY_RUN + ["train.steps=6", "train.save_every=2", "train.eval_every=3", f"train.output_dir={tmp_path}",
                         "optim.epochs=2", "optim.minibatch_size=32", "loss.rollout_correction=tis"]
    cfg = load_config(None, common)
    load_policy(cfg.model.name, get_task(cfg.task.name, **cfg.task.options), model_cfg=cfg.model.tiny,
                warm_start=cfg.model.warm_start, cache_dir=cfg.model.cache_dir, seed=cfg.train.seed, progress=False)
    full = subprocess.run(train_cmd(*common, "train.run_name=full"), capture_output=True, text=True, timeout=300)
    assert full.returncode == 0, full.stderr[-3000:]
    warned = sorted({line.strip() for line in full.stderr.splitlines() if "deterministic" in line})

    run = tmp_path / "killed"
    proc = subprocess.Popen(train_cmd(*common, "train.run_name=killed"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "summary.json").exists(), "the run finished before it could be killed"
    resumed = subprocess.run(train_cmd("--resume", str(run)), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = records(tmp_path / "full" / "metrics.jsonl"), records(metrics)
    assert [r["step"] for r in b] == list(range(1, 7))
    differ = sorted({k for x, y in zip(a, b) for k in x if x[k] != y.get(k)})
    assert not differ, f"metrics differ after resume: {differ}; non-deterministic ops torch warned about: {warned}"
    assert records(tmp_path / "full" / "eval.jsonl") == records(run / "eval.jsonl")
    assert any(r["grad_norm"] > 0 for r in a)


# ------------------------------------------------------------------------------- CreditGRPOTrainer on CUDA

@pytest.mark.cuda
@pytest.mark.parametrize("estimator", ["grpo", "otb"])
def test_credit_grpo_trainer_two_steps_on_cuda(tmp_path, estimator):
    pytest.importorskip("trl")
    from datasets import Dataset

    from creditrl.integrations.trl import CreditGRPOConfig, CreditGRPOTrainer

    tokenizer = char_tokenizer("abcdefgh0123456789+= ")
    model = tiny_model(tokenizer, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                                                  max_position_embeddings=64))
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")

    def count_digits(completions, **kwargs):
        return [float(sum(c.isdigit() for c in text)) for text in completions]

    args = CreditGRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        max_steps=2, learning_rate=5e-2, logging_steps=1, report_to="none", bf16=True, save_strategy="no", seed=0,
        advantage_estimator=estimator, stapo=True)
    trainer = CreditGRPOTrainer(model=model, reward_funcs=count_digits, args=args,
                                train_dataset=Dataset.from_dict({"prompt": ["ab", "cd", "12", "ef", "34", "gh"] * 4}),
                                processing_class=tokenizer)
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    trainer.train()
    assert next(trainer.model.parameters()).device.type == "cuda"
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.named_parameters())
    logged = [h for h in trainer.state.log_history if "creditrl/advantage_abs_mean" in h]
    assert len(logged) == 2 and all(math.isfinite(h["loss"]) for h in logged)
    rollout = trainer.last_rollout
    want = compute_advantages(estimator, rewards=rollout["rewards"], mask=rollout["estimator_mask"],
                              group=rollout["group"], energy=rollout["energy"])
    torch.testing.assert_close(rollout["advantages"], want[:, :rollout["advantages"].shape[1]])


# ------------------------------------------------------------------------------- benchmarks/bench_gpu.py

@pytest.mark.slow
def test_bench_gpu_quick_runs_and_agrees(device, tmp_path):
    """The GPU benchmark's smoke size runs on this device: creditrl's statistics are float32-
    accurate on bf16 logits, its advantages agree with verl's, and both trainers produce
    responses of exactly --max-len tokens."""
    script = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "bench_gpu.py")
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, script, "--quick", "--device", device.type, "--json", str(out)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    numbers = json.loads(out.read_text())
    ours = [r for r in numbers["token_stats"] if r["method"] == "creditrl"]
    assert ours and all(max(r["rel_err"]) < 1e-5 for r in ours), ours
    diffs = [r["diff"] for r in numbers["estimators"] if r["diff"] is not None]
    assert ("not importable" in numbers["env"]["verl"]) or (diffs and max(diffs) <= 1e-5), numbers["estimators"]
    for name, r in numbers["trainer"].items():
        assert "error" not in r, (name, r)
        assert r["mean_len"] == 8 and r["steps_per_s"] > 0, (name, r)

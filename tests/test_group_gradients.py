"""creditrl.runtime.group_gradients: every group's exact gradient under every estimator against a
per-response loop, the sketch and parameter-subset options, and exact per-token gradient norms."""
from __future__ import annotations

import math
import random

import pytest
import torch

from creditrl import compute_advantages
from creditrl.core.gradients import CountSketch
from creditrl.runtime.group_gradients import group_gradients, per_token_grad_sq_norms, select_parameters

ESTIMATORS = {"reinforce": ("reinforce", {}), "rloo": ("rloo", {}), "dr_grpo": ("dr_grpo", {}), "otb": ("otb", {}),
              "otb+loo": ("otb", {"leave_one_out": True}), "maxpo": ("maxpo", {"k": 2})}


@pytest.fixture(scope="module")
def tiny_rollouts():
    """A random (not warm-started) tiny policy and one rollout batch: 2 groups x 3 responses."""
    from creditrl.runtime.models.tiny import TinyModelConfig, char_tokenizer, tiny_model
    from creditrl.runtime.rollout import generate_rollouts
    from creditrl.tasks import get_task

    torch.manual_seed(0)
    task = get_task("multiplication", digits=1)
    tokenizer = char_tokenizer(task.alphabet())
    model = tiny_model(tokenizer, TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64))
    model.eval()
    problems = [task.sample(random.Random(i)) for i in (1, 2)]  # different prompt lengths -> left padding
    batch = generate_rollouts(model, tokenizer, task, problems, group_size=3, max_new_tokens=6,
                              generator=torch.Generator().manual_seed(0))
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])  # non-degenerate groups
    return model, select_parameters(model), batch


def row_logp(model, batch, row):
    """Response log-probs and energies of one row from its own unpadded forward."""
    keep = batch.attention_mask[row] > 0
    ids = batch.input_ids[row][keep][None]
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1].double()
    logp = torch.log_softmax(logits, -1)
    resp = batch.response_mask[row][keep][1:] > 0
    pi = logp.exp()[resp]
    onehot = torch.nn.functional.one_hot(ids[0, 1:][resp], logits.shape[-1]).double()
    return logp.gather(-1, ids[0, 1:, None])[:, 0][resp], (onehot - pi).square().sum(-1)


def flat(grads, params):
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)])


def test_group_gradients_match_a_per_response_loop(tiny_rollouts):
    model, params, batch = tiny_rollouts
    got = group_gradients(model, batch, ESTIMATORS, temperature=1.0)
    plain = group_gradients(model, batch, ESTIMATORS, temperature=1.0, shared_prompts=False)
    torch.testing.assert_close(plain.grads, got.grads, atol=1e-6, rtol=1e-5)
    mask = batch.response_mask[:, batch.prompt_len:] > 0
    energy = torch.zeros(mask.shape)
    for r in range(6):
        energy[r][mask[r]] = row_logp(model, batch, r)[1].detach().float()
    torch.testing.assert_close(got.response_energy, energy.double().sum(1), rtol=1e-5, atol=1e-7)
    for e, (name, options) in enumerate(ESTIMATORS.values()):
        adv = compute_advantages(name, rewards=batch.rewards, mask=mask, group=batch.group, energy=energy, **options)
        for g in range(2):
            total = 0
            for r in range(3 * g, 3 * g + 3):   # (1/N) Σ_t A_t log π(y_t) of each response on its own
                logp, _ = row_logp(model, batch, r)
                grads = torch.autograd.grad((adv[r][mask[r]].double() * logp).sum() / 3, params, allow_unused=True)
                total = total + flat(grads, params)
            torch.testing.assert_close(got.grads[g, e].double(), total.double(), atol=1e-5, rtol=1e-4, msg=name)
    assert got.labels == tuple(ESTIMATORS)
    torch.testing.assert_close(got.grads[:, 2], got.grads[:, 1] * 2 / 3, atol=1e-7, rtol=1e-6)  # dr_grpo = (N−1)/N·rloo


def test_group_gradients_sketch_and_subset(tiny_rollouts):
    model, params, batch = tiny_rollouts
    names = {k: ESTIMATORS[k] for k in ("rloo", "otb")}
    full = group_gradients(model, batch, names, temperature=1.0)
    sketch = CountSketch([p.shape for p in params], dim=64, seed=3)
    sketched = group_gradients(model, batch, names, temperature=1.0, sketch=sketch)
    sizes = [p.numel() for p in params]
    for g in range(2):
        for e in range(2):
            pieces = [x.view(p.shape) for x, p in zip(full.grads[g, e].split(sizes), params)]
            torch.testing.assert_close(sketched.grads[g, e], sketch(pieces), atol=1e-6, rtol=1e-5)
    head = select_parameters(model, ["model.norm."])
    subset = group_gradients(model, batch, names, temperature=1.0, params=head)
    names_in_order = [n for n, p in model.named_parameters() if p.requires_grad]
    offset = sum(p.numel() for p in params[:names_in_order.index("model.norm.weight")])
    torch.testing.assert_close(subset.grads, full.grads[:, :, offset:offset + head[0].numel()], atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="prefixes: expected a prefix of at least one trainable parameter name"):
        select_parameters(model, ["nope."])


def test_per_token_grad_norms_match_loop(tiny_rollouts):
    model, params, batch = tiny_rollouts
    for row in (0, 4):
        got, seq = per_token_grad_sq_norms(model, params, batch, row, 1.0)
        logp, _ = row_logp(model, batch, row)
        cols = torch.nonzero(batch.response_mask[row, batch.prompt_len:] > 0).flatten().tolist()
        total = 0
        for t, lp in zip(cols, logp):
            f = flat(torch.autograd.grad(lp, params, retain_graph=True, allow_unused=True), params)
            assert math.isclose(got[t].item(), f.pow(2).sum().item(), rel_tol=1e-4)
            total = total + f
        assert math.isclose(seq.item(), total.pow(2).sum().item(), rel_tol=1e-4)

"""Batched sampling with a KV cache: G responses per prompt, behaviour log-probs, tool turns.

One decoding loop serves every task. Each prompt is prefilled once and its KV cache expanded
to its G rows; each step then feeds one token per live row (one forward through the cache;
finished rows leave the batch and the cache, so they cost nothing). Rows whose response just
ended with the task's ``tool_stop`` (e.g. ``</calc>``) get the environment's output
(``<out>42</out>``) queued as *forced* tokens, which are fed over the next steps with mask 0
and log-prob 0, so single- and multi-turn tasks share one batched loop with no per-row forward.

Layout: prompts are left-padded to a common length P, responses follow from column P and
are right-padded, so every response starts at column P and ``position_ids`` =
cumsum(attention_mask) - 1 matches what the cache saw during generation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from creditrl.tasks.base import Problem, Task


@dataclass
class RolloutBatch:
    """B = len(problems) * group_size responses; L = prompt_len + response columns.

    input_ids:      [B,L] long, left-padded prompt then right-padded response
    attention_mask: [B,L] long
    position_ids:   [B,L] long, cumsum(attention_mask) - 1 (0 on left padding)
    response_mask:  [B,L] float, 1 on sampled response tokens (trained on), 0 on prompt,
                    padding and tool-output tokens
    rollout_logp:   [B,L] float32, behaviour log-prob of each sampled token (0 elsewhere)
    rewards:        [B] float32;  correct: [B] bool (reward >= 1)
    group:          [B] long, index of the prompt each response answers
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    response_mask: Tensor
    rollout_logp: Tensor
    rewards: Tensor
    group: Tensor
    correct: Tensor
    response_texts: list[str]
    problems: list[Problem]
    prompt_len: int

    @property
    def num_tokens(self) -> int:
        """Sampled (trained-on) tokens in the batch."""
        return int(self.response_mask.sum())


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """[B,L] positions counting only attended tokens, so left padding does not shift them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def encode_prompts(tokenizer, prompts: list[str]) -> tuple[Tensor, Tensor]:
    """Left-padded ``(input_ids, attention_mask)`` [N,P] with the tokenizer's special tokens.
    An empty prompt becomes the single BOS (else EOS) token, so every row has a position to
    predict its first response token from."""
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    enc = [tokenizer(p)["input_ids"] or [start] for p in prompts]
    width = max(len(e) for e in enc)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(e)) + list(e) for e in enc], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc], dtype=torch.long)
    return ids, mask


def sample_next(logits: Tensor, *, temperature: float, top_p: float,
                generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Sample one token per row from softmax(logits / temperature) truncated to the top-p
    nucleus; return ``(tokens [N], logp [N])`` under that (renormalised) behaviour policy.
    ``temperature == 0`` is greedy (logp 0)."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1), torch.zeros(logits.shape[0])
    logp = torch.log_softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        # keep a token if the mass before it is < top_p (the top token always survives)
        drop = (sorted_logp.exp().cumsum(-1) - sorted_logp.exp()) >= top_p
        sorted_logp = sorted_logp.masked_fill(drop, float("-inf"))
        logp = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_logp)
        logp = torch.log_softmax(logp, dim=-1)
    token = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


def _tail_matches(generated: Tensor, length: Tensor, pattern: Tensor) -> Tensor:
    """[N] bool: the last ``len(pattern)`` tokens of each row's generated prefix equal pattern."""
    m = pattern.numel()
    if generated.shape[1] < m:
        return torch.zeros(generated.shape[0], dtype=torch.bool)
    cols = (length[:, None] - m + torch.arange(m)).clamp(min=0)
    return (generated.gather(1, cols) == pattern).all(-1) & (length >= m)


def select_cache_rows(cache, rows: Tensor):
    """The KV cache restricted/expanded to batch ``rows`` (indices may repeat): HF ``Cache``
    objects in place, legacy tuple/tensor caches by indexing every tensor's first dim."""
    if hasattr(cache, "batch_select_indices"):
        cache.batch_select_indices(rows)
        return cache
    return torch.utils._pytree.tree_map(lambda x: x[rows] if isinstance(x, Tensor) else x, cache)


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], *, group_size: int = 1, temperature: float = 1.0,
             top_p: float = 1.0, max_new_tokens: int = 16, generator: torch.Generator | None = None,
             task: Task | None = None, max_tool_tokens: int = 16) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """Decode ``group_size`` responses per prompt (rows i*G .. i*G+G-1 answer prompt i). Returns
    ``(input_ids, attention_mask, response_mask, rollout_logp, prompt_len)`` as in RolloutBatch.

    Each prompt is prefilled once and its KV cache expanded G times (the G responses share it),
    and finished rows leave the decode batch, so a decode step costs only the live rows."""
    device = next(model.parameters()).device
    prompt_ids, prompt_attn = encode_prompts(tokenizer, prompts)
    prompt_len = prompt_ids.shape[1]
    expand = torch.arange(len(prompts)).repeat_interleave(group_size)
    n = len(expand)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    tool_calls = int(getattr(task, "max_tool_calls", 0) or 0)
    stop_ids = (torch.tensor(tokenizer(task.tool_stop, add_special_tokens=False)["input_ids"], dtype=torch.long)
                if tool_calls and task.tool_stop else None)
    max_steps = max_new_tokens + tool_calls * max_tool_tokens

    tokens = torch.full((n, max_steps), pad, dtype=torch.long)
    sampled = torch.zeros(n, max_steps)                      # 1 where the policy chose the token
    logps = torch.zeros(n, max_steps)
    fed = torch.zeros(n, dtype=torch.long)                   # response tokens fed = attended columns
    n_sampled = torch.zeros(n, dtype=torch.long)
    n_calls = torch.zeros(n, dtype=torch.long)
    forced = torch.full((n, max_tool_tokens), pad, dtype=torch.long)  # queued tool-output tokens
    forced_len = torch.zeros(n, dtype=torch.long)
    forced_pos = torch.zeros(n, dtype=torch.long)

    ids, attn = prompt_ids[expand], prompt_attn[expand]
    attn_dev, next_pos = attn.to(device), attn.sum(-1)
    steps = 0
    # inference mode inside only: what leaves it is built below from ordinary tensors, so the
    # training forward can save it for backward
    with torch.inference_mode():
        out = model(input_ids=prompt_ids.to(device), attention_mask=prompt_attn.to(device),
                    position_ids=position_ids_from_mask(prompt_attn).to(device), use_cache=True, logits_to_keep=1)
        cache = select_cache_rows(out.past_key_values, expand.to(device))
        logits = out.logits[:, -1].cpu()[expand]
        live = torch.arange(n)                                   # rows still decoding, in cache order
        for t in range(max_steps):
            token, logp = sample_next(logits, temperature=temperature, top_p=top_p, generator=generator)
            pos = forced_pos[live]
            is_forced = pos < forced_len[live]
            token = torch.where(is_forced, forced[live, pos.clamp(max=max_tool_tokens - 1)], token)
            chosen = ~is_forced
            tokens[live, t] = token
            sampled[live, t] = chosen.float()
            logps[live, t] = torch.where(chosen, logp, torch.zeros_like(logp))
            fed[live] += 1
            forced_pos[live] = pos + is_forced.long()
            n_sampled[live] += chosen.long()
            steps = t + 1
            ended = (chosen & (token == eos)) | (n_sampled[live] >= max_new_tokens)
            keep = ~ended | (forced_pos[live] < forced_len[live])  # queued tool tokens still get fed
            if stop_ids is not None:
                candidates = torch.zeros(n, dtype=torch.bool).index_fill_(0, live[chosen & keep], True)
                _queue_tool_outputs(tokenizer, task, tokens[:, :t + 1], candidates, stop_ids, n_calls, tool_calls,
                                    forced, forced_len, forced_pos)
                keep |= forced_pos[live] < forced_len[live]
            if not bool(keep.all()):
                if not bool(keep.any()):
                    break
                kept = torch.nonzero(keep).flatten()
                live = live[kept]
                cache = select_cache_rows(cache, kept.to(device))
            # every column a live row has been fed is attended: only the prompt's left padding is masked
            step_attn = torch.cat([attn_dev[live.to(device)],
                                   torch.ones(len(live), t + 1, dtype=torch.long, device=device)], dim=1)
            out = model(input_ids=tokens[live, t:t + 1].to(device), attention_mask=step_attn,
                        position_ids=(next_pos[live] + t)[:, None].to(device), past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1].cpu()

    input_ids = torch.cat([ids, tokens[:, :steps]], dim=1)
    attention_mask = torch.cat([attn, (torch.arange(steps) < fed[:, None]).long()], dim=1)
    rollout_logp = torch.cat([torch.zeros(n, prompt_len), logps[:, :steps]], dim=1)
    response_mask = torch.cat([torch.zeros(n, prompt_len), sampled[:, :steps]], dim=1)
    return input_ids, attention_mask, response_mask, rollout_logp, prompt_len


def _queue_tool_outputs(tokenizer, task, generated: Tensor, candidates: Tensor,
                        stop_ids: Tensor, n_calls: Tensor, max_calls: int, forced: Tensor,
                        forced_len: Tensor, forced_pos: Tensor) -> None:
    """Rows that just wrote ``task.tool_stop`` get the tool output queued (mask 0 tokens).
    Only the rows that triggered a call are decoded: tool calls are events, not tokens."""
    length = torch.full((generated.shape[0],), generated.shape[1], dtype=torch.long)
    hit = candidates & _tail_matches(generated, length, stop_ids) & (n_calls < max_calls)
    for b in torch.nonzero(hit).flatten().tolist():
        text = tokenizer.decode(generated[b], skip_special_tokens=True)
        output = task.tool_output(text)
        n_calls[b] += 1
        if not output:
            continue
        out_ids = tokenizer(output, add_special_tokens=False)["input_ids"][:forced.shape[1]]
        forced[b, :len(out_ids)] = torch.tensor(out_ids, dtype=torch.long)
        forced_len[b], forced_pos[b] = len(out_ids), 0


def generate_rollouts(model, tokenizer, task: Task, problems: list[Problem], *, group_size: int,
                      temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 16,
                      generator: torch.Generator | None = None, max_tool_tokens: int = 16) -> RolloutBatch:
    """Sample ``group_size`` responses for each problem and score them with ``task.reward``.

    Responses of problem i are rows i*G .. i*G+G-1 (``group[b] = b // G``)."""
    if group_size < 1:
        raise ValueError(f"group_size: expected a positive int, got {group_size!r}")
    if not problems:
        raise ValueError("problems: expected at least one problem, got an empty list")
    was_training = model.training
    model.eval()
    try:
        input_ids, attention_mask, response_mask, rollout_logp, prompt_len = generate(
            model, tokenizer, [p.prompt for p in problems], group_size=group_size, temperature=temperature,
            top_p=top_p, max_new_tokens=max_new_tokens, generator=generator, task=task,
            max_tool_tokens=max_tool_tokens)
    finally:
        model.train(was_training)
    texts = decode_responses(tokenizer, input_ids[:, prompt_len:], attention_mask[:, prompt_len:])
    flat = [p for p in problems for _ in range(group_size)]
    rewards = torch.tensor([float(task.reward(p, r)) for p, r in zip(flat, texts)], dtype=torch.float32)
    return RolloutBatch(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask),
        response_mask=response_mask, rollout_logp=rollout_logp, rewards=rewards,
        group=torch.arange(len(problems)).repeat_interleave(group_size), correct=rewards >= 1.0,
        response_texts=texts, problems=flat, prompt_len=prompt_len)


def decode_responses(tokenizer, response_ids: Tensor, response_attn: Tensor) -> list[str]:
    """Response texts without padding/EOS (tool outputs included: the reward sees them)."""
    return tokenizer.batch_decode([row[m.bool()].tolist() for row, m in zip(response_ids, response_attn)],
                                  skip_special_tokens=True)

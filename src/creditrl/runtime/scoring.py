"""Scoring responses with the model: per-token statistics of the response tokens of a batch.

Only the response columns are scored: prompts are left-padded to a common width P, so the
logits of the last R+1 positions (``logits_to_keep``) predict every response token and the
prompt's logits are never computed. For a RolloutBatch (G rows per prompt) each prompt even
runs once, its KV cache shared by its G rows, and rows are fed in buckets of similar length so
right padding is mostly skipped (``shared_prompt_stats``: same values, ~1/3 less compute).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from creditrl.core.token_stats import TokenStats, token_stats


def response_stats(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, response_mask: Tensor,
                   prompt_len: int, *, temperature: float, chunk_size: int | None = None, group: Tensor | None = None):
    """TokenStats of the response tokens (columns ``prompt_len:``, where ``response_mask``), each [B, R].

    Differentiable in ``model``'s parameters; logits are kept in the model's dtype and
    reduced chunk-wise by ``token_stats`` (never a [B,R,V] float32 copy). With ``group`` [B]
    (rows of one group share their prompt columns, as in a RolloutBatch) the same values are
    computed by ``shared_prompt_stats`` without repeating prompts or scoring right padding."""
    kwargs = {} if chunk_size is None else {"chunk_size": chunk_size}
    tokens, mask = input_ids[:, prompt_len:], response_mask[:, prompt_len:]
    if group is not None and prompt_len > 0 and tokens.shape[1] > 1 and _plain_kv_cache(model):
        return shared_prompt_stats(model, input_ids, attention_mask, position_ids, response_mask, prompt_len,
                                   group, temperature=temperature, **kwargs)
    response_len = input_ids.shape[1] - prompt_len
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=response_len + 1, use_cache=False)
    return token_stats(out.logits[:, :-1], tokens, mask, temperature=temperature, **kwargs)


def _plain_kv_cache(model) -> bool:
    """True when the model's cache is one full-attention DynamicLayer per layer (prefix sharing is exact)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_decoder") or getattr(model, "is_gradient_checkpointing", False):
        return False  # not an HF model, or one whose training forward drops the cache
    from transformers.cache_utils import DynamicCache, DynamicLayer   # where an HF model is in hand

    cache = DynamicCache(config=config)
    return len(cache.layers) > 0 and all(type(layer) is DynamicLayer for layer in cache.layers)


def length_buckets(lengths: Tensor, overhead: int = 32, max_buckets: int = 4) -> list[Tensor]:
    """Split rows into at most ``max_buckets`` groups of similar length: of the equal-count cuts of
    the sorted lengths into 1..max_buckets parts, the one with the least Σ rows·max_len (tokens a
    forward per bucket computes, padding included) + overhead·buckets (a forward's fixed cost, in
    tokens). Returns each bucket's row indices, shortest first, longest row last."""
    order = lengths.argsort(stable=True)
    ordered = lengths[order].tolist()      # one copy of [B] to the host: the choice is host arithmetic
    n = len(ordered)
    best_k, best_cost = 1, None
    for k in range(1, min(max_buckets, n) + 1):
        sizes = [n // k + (i < n % k) for i in range(k)]                  # as tensor_split(k) cuts
        ends = [sum(sizes[:i + 1]) for i in range(k)]
        cost = sum(size * ordered[end - 1] for size, end in zip(sizes, ends)) + overhead * k
        if best_cost is None or cost < best_cost:
            best_k, best_cost = k, cost
    return list(order.tensor_split(best_k)) if n else [order]


def shared_prompt_stats(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor,
                        response_mask: Tensor, prompt_len: int, group: Tensor, *, temperature: float, **kwargs):
    """``response_stats`` computed once per prompt: each group's prompt runs through the model
    once (with grad) and its KV cache is shared by the group's rows, which then feed only their
    response tokens, in ``length_buckets`` so right padding is (mostly) not computed.

    Equal to the plain forward up to float rounding: attention is causal, so the prompt's
    keys/values do not depend on the response, and a row's padded tail only follows its tokens.
    The logits at the prompt's last column predict each row's first response token."""
    p, (size, width) = prompt_len, input_ids.shape
    tokens, mask = input_ids[:, p:], response_mask[:, p:]
    _, inverse = torch.unique(group, return_inverse=True)
    first_row = torch.full((int(inverse.max()) + 1,), size, device=group.device).scatter_reduce_(
        0, inverse, torch.arange(size, device=group.device), "amin")
    prompt = torch.stack([input_ids[:, :p], attention_mask[:, :p].to(input_ids.dtype)])
    differ = (prompt != prompt[:, first_row[inverse]]).any(-1).any(0)
    if bool(differ.any()):
        raise ValueError(f"group: expected rows of one group to share their first {p} (prompt) columns, "
                         f"got different prompts in rows {torch.nonzero(differ).flatten().tolist()[:10]}")
    prefix = model(input_ids=input_ids[first_row, :p], attention_mask=attention_mask[first_row, :p],
                   position_ids=position_ids[first_row, :p], use_cache=True, logits_to_keep=1)
    kv = [(layer.keys, layer.values) for layer in prefix.past_key_values.layers]
    head = token_stats(prefix.logits[inverse], tokens[:, :1], mask[:, :1], temperature=temperature, **kwargs)
    names = [f.name for f in dataclasses.fields(TokenStats)]

    # a row's length: up to its last attended or trained-on response column
    valid = (attention_mask[:, p:] != 0) | (mask != 0)
    lengths = (valid * torch.arange(1, width - p + 1, device=valid.device)).amax(-1).clamp(min=1)
    pieces, order = [], []
    for rows in length_buckets(lengths):
        w = int(lengths[rows[-1]])                           # tokens 1..w-1 need inputs 0..w-2
        if w > 1:
            cache = type(prefix.past_key_values)(ddp_cache_data=[(k[inverse[rows]], v[inverse[rows]]) for k, v in kv])
            out = model(input_ids=tokens[rows, :w - 1], attention_mask=attention_mask[rows, :p + w - 1],
                        position_ids=position_ids[rows, p:p + w - 1], past_key_values=cache, use_cache=True)
            stats = token_stats(out.logits, tokens[rows, 1:w], mask[rows, 1:w], temperature=temperature, **kwargs)
            pieces.append({f: torch.nn.functional.pad(getattr(stats, f), (0, width - p - w)) for f in names})
        else:
            pieces.append(dict.fromkeys(names, head.logp.new_zeros(len(rows), width - p - 1)))
        order.append(rows)
    back = torch.cat(order).argsort()
    return TokenStats(**{f: torch.cat([getattr(head, f), torch.cat([x[f] for x in pieces])[back]], dim=1)
                         for f in names})

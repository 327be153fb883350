"""Scoring responses with the model: per-token statistics of the response tokens of a batch.

Only the response columns are scored: prompts are left-padded to a common width P, so in the plain
forward the logits of the last R+1 positions (``logits_to_keep``) predict every response token and
the prompt's logits are never computed. For a RolloutBatch (G rows per prompt) ``packed_prompt_stats``
computes the same values in one forward over packs: a prompt followed by the response tokens of
some of its rows, with a 4D attention mask that lets each response see its prompt and its own
earlier tokens. No prompt runs once per row, no padding is computed, and each weight gets one
gradient product (separate forwards for the prompt and for buckets of rows each wrote and summed a
full-size weight gradient: on SmolLM2 on a CPU, 2.0-2.2 s against 1.3-1.4 s per forward+backward
of 16 rows).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from creditrl.core.token_stats import TokenStats, token_stats
from creditrl.utils.validate import as_mask


def response_stats(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, response_mask: Tensor,
                   prompt_len: int, *, temperature: float, chunk_size: int | None = None, group: Tensor | None = None):
    """TokenStats of the response tokens (columns ``prompt_len:``, where ``response_mask``), each [B, R].

    Differentiable in ``model``'s parameters; logits are kept in the model's dtype and
    reduced chunk-wise by ``token_stats`` (never a [B,R,V] float32 copy). With ``group`` [B]
    (rows of one group share their prompt columns, as in a RolloutBatch) the same values are
    computed by ``packed_prompt_stats`` without repeating prompts or scoring right padding."""
    kwargs = {} if chunk_size is None else {"chunk_size": chunk_size}
    tokens, mask = input_ids[:, prompt_len:], response_mask[:, prompt_len:]
    if group is not None and 0 < prompt_len < input_ids.shape[1] and input_ids.shape[0] > 0 and _packable(model):
        return packed_prompt_stats(model, input_ids, attention_mask, position_ids, response_mask, prompt_len,
                                   group, temperature=temperature, **kwargs)
    response_len = input_ids.shape[1] - prompt_len
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                logits_to_keep=response_len + 1, use_cache=False)
    return token_stats(out.logits[:, :-1], tokens, mask, temperature=temperature, **kwargs)


# Response tokens per pack. A pack's attention costs O(length²) (a dense mask), its linear layers
# O(length): at 1,024 tokens attention stays below the linear layers' cost for SmolLM2-sized models
# and larger (both grow with the width, the linear layers with its square).
PACK_TOKENS = 1024
PROMPT, PAD = -1, -2       # segment ids of a pack's prompt and of its padding (rows are 0..B-1)


def _packable(model) -> bool:
    """True for an HF model whose every layer attends fully (one DynamicLayer per layer in its
    cache), whose attention takes a 4D mask as given (sdpa, eager) and whose positions come from
    ``position_ids`` (not ALiBi): packing is then exact."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_decoder"):
        return False  # not an HF model
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False  # flash-attention kernels take no custom mask
    if getattr(config, "alibi", False) or getattr(config, "model_type", None) in ("bloom", "mpt"):
        return False  # ALiBi biases are built from a 2D mask
    from transformers.cache_utils import DynamicCache, DynamicLayer   # where an HF model is in hand

    cache = DynamicCache(config=config)
    return len(cache.layers) > 0 and all(type(layer) is DynamicLayer for layer in cache.layers)


@dataclass(frozen=True)
class Packs:
    """K packs of length L, right-aligned: [padding | a prompt's attended tokens | response inputs].

    ``input_ids``, ``position_ids`` [K, L]; ``allowed`` [K, 1, L, L] bool (query attends key);
    ``row_pack`` [B] each row's pack; ``head_slot`` [K] the slot of each pack's last prompt token
    (its logits predict the first response token of the pack's rows); ``rows``, ``cols``,
    ``slots`` [N]: response input ``cols`` (0-based response column) of row ``rows`` sits at
    ``slots`` in pack ``row_pack[rows]``, and its logits predict column ``cols + 1``."""
    input_ids: Tensor
    position_ids: Tensor
    allowed: Tensor
    row_pack: Tensor
    head_slot: Tensor
    rows: Tensor
    cols: Tensor
    slots: Tensor


def _groups(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, prompt_len: int,
            group: Tensor) -> tuple[Tensor, Tensor]:
    """(each row's group index [B], each group's first row [G]); rows of a group whose prompt
    columns differ are a ValueError naming them."""
    size, p = input_ids.shape[0], prompt_len
    distinct, inverse = torch.unique(group, return_inverse=True)
    first_row = _least(inverse, torch.arange(size, device=group.device), len(distinct))
    attended = attention_mask[:, :p].to(input_ids.dtype)
    prompt = torch.stack([input_ids[:, :p], attended, position_ids[:, :p].to(input_ids.dtype) * attended])
    differ = (prompt != prompt[:, first_row[inverse]]).any(-1).any(0)
    if bool(differ.any()):
        raise ValueError(f"group: expected rows of one group to share their first {p} (prompt) columns (ids, "
                         f"attention mask, positions of attended columns), got different prompts in rows "
                         f"{torch.nonzero(differ).flatten().tolist()[:10]}")
    return inverse, first_row


def _least(key: Tensor, x: Tensor, n: int) -> Tensor:
    """[n]: the least ``x`` of each ``key`` in 0..n-1."""
    return x.new_zeros(n).scatter_reduce_(0, key, x, "amin", include_self=False)


def _assign(n_in: Tensor, most: int, inverse: Tensor, n_groups: int, pack_tokens: int) -> tuple[Tensor, Tensor, Tensor]:
    """Each row's pack [B], each pack's group [K] and each row's first response slot after its
    pack's prompt [B], for rows feeding ``n_in`` [B] (<= ``most``) response inputs: a group's rows in order,
    a new pack where a row starts at or past the next multiple of ``pack_tokens`` inputs of its group."""
    size = len(n_in)
    order = torch.sort(inverse, stable=True).indices              # by group, rows in order within it
    group_sorted, n_sorted = inverse[order], n_in[order]
    start = torch.cumsum(n_sorted, 0) - n_sorted
    in_group = start - _least(group_sorted, start, n_groups)[group_sorted]
    span = size * most // pack_tokens + 1                          # > any pack's index within its group
    packs, pack_sorted = torch.unique(group_sorted * span + in_group // pack_tokens, return_inverse=True)
    in_pack = start - _least(pack_sorted, start, len(packs))[pack_sorted]
    unsort = lambda x: torch.empty_like(x).scatter_(0, order, x)   # noqa: E731
    return unsort(pack_sorted), packs // span, unsort(in_pack)


def pack_mask(seg: Tensor, col: Tensor, key: Tensor) -> Tensor:
    """[K, 1, L, L] bool, query attends key, from each slot's segment ``seg`` [K, L] (a row, PROMPT or
    PAD), column ``col`` and whether it is attended (``key``): a response token sees the pack's
    prompt and its row's columns up to its own; a prompt token the prompt's columns up to its own.
    A query with no key (padding, a prompt with no attended column) sees itself alone: no row of
    -inf, and nothing of other rows (the plain forward leaves it undefined: sdpa gives it zero
    attention, eager spreads it over the row)."""
    allowed = seg[:, :, None] == seg[:, None, :]                  # in place: the mask and one K·L² temporary
    allowed &= col[:, None, :] <= col[:, :, None]
    allowed |= (seg[:, None, :] == PROMPT) & (seg[:, :, None] != PROMPT)
    allowed &= key[:, None, :]
    allowed.diagonal(dim1=1, dim2=2).logical_or_(~allowed.any(-1))
    return allowed[:, None]


def pack_rows(input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, response_mask: Tensor,
              prompt_len: int, group: Tensor, pack_tokens: int) -> Packs:
    """Lay out [B, W] rows (prompt columns ``:prompt_len`` shared within each ``group``) as Packs.

    A row feeds its response tokens up to its last attended or trained-on column, less the last
    (which is only predicted). A group's rows go, in order, into packs of about ``pack_tokens``
    response inputs (``_assign``; a longer row gets its own). The prompt keeps its attended
    columns and always its last one. Each token attends exactly the keys it sees in the plain
    forward (``pack_mask``), at its own position."""
    p, width, dev = prompt_len, input_ids.shape[1], input_ids.device
    inverse, first_row = _groups(input_ids, attention_mask, position_ids, p, group)
    attn = attention_mask != 0
    valid = attn[:, p:] | (response_mask[:, p:] != 0)
    n_in = (valid * torch.arange(1, width - p + 1, device=dev)).amax(-1).clamp(min=1) - 1
    row_pack, pack_group, in_pack = _assign(n_in, width - p, inverse, len(first_row), pack_tokens)
    keep_prompt = attn[first_row, :p]
    keep_prompt[:, -1] = True
    prompt_count = keep_prompt.sum(-1)[pack_group]                                  # [K]
    length = prompt_count + torch.zeros_like(prompt_count).index_add_(0, row_pack, n_in)
    shape = (len(pack_group), int(length.max()))
    offset = shape[1] - length                                                      # right-aligned
    ids, pos = input_ids.new_zeros(shape), position_ids.new_zeros(shape)
    seg, col = torch.full(shape, PAD, device=dev), torch.zeros(shape, dtype=torch.long, device=dev)
    key = torch.zeros(shape, dtype=torch.bool, device=dev)

    kept = keep_prompt[pack_group]                                                  # [K, P]
    k, c = torch.nonzero(kept, as_tuple=True)
    slot, src = offset[k] + torch.cumsum(kept, 1)[k, c] - 1, first_row[pack_group[k]]
    ids[k, slot], pos[k, slot], seg[k, slot] = input_ids[src, c], position_ids[src, c], PROMPT
    col[k, slot], key[k, slot] = c, attn[src, c]

    rows, cols = torch.nonzero(torch.arange(width - p, device=dev) < n_in[:, None], as_tuple=True)
    k, slot = row_pack[rows], (offset + prompt_count)[row_pack[rows]] + in_pack[rows] + cols
    ids[k, slot], pos[k, slot], seg[k, slot] = input_ids[rows, p + cols], position_ids[rows, p + cols], rows
    col[k, slot], key[k, slot] = p + cols, attn[rows, p + cols]
    return Packs(ids, pos, pack_mask(seg, col, key), row_pack, offset + prompt_count - 1, rows, cols, slot)


def packed_prompt_stats(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None,
                        response_mask: Tensor, prompt_len: int, group: Tensor, *, temperature: float,
                        pack_tokens: int | None = None, **kwargs) -> TokenStats:
    """``response_stats`` in one forward over ``pack_rows``' packs: each group's prompt runs once
    per pack, shared by the pack's rows, and only their response tokens follow it
    (``pack_tokens``: response inputs per pack, default ``PACK_TOKENS``).

    Equal to the plain forward up to float rounding: every token attends the same keys at the same
    positions (the mask), and its logits are the same function of them."""
    p, (size, width) = prompt_len, input_ids.shape
    tokens, mask = input_ids[:, p:], as_mask("mask", response_mask[:, p:])   # the plain path's rule and name
    if position_ids is None:                                      # as the plain forward: 0..W-1
        position_ids = torch.arange(width, device=input_ids.device).expand(size, width)
    packs = pack_rows(input_ids, attention_mask, position_ids, response_mask, p, group,
                      PACK_TOKENS if pack_tokens is None else pack_tokens)
    allowed = packs.allowed
    if model.config._attn_implementation == "eager":           # eager adds the mask to its scores
        allowed = torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, torch.finfo().min)
    keep = int((packs.input_ids.shape[1] - packs.head_slot).max())   # from the first head slot on
    base = packs.input_ids.shape[1] - keep
    logits = model(input_ids=packs.input_ids, attention_mask=allowed, position_ids=packs.position_ids,
                   use_cache=False, logits_to_keep=keep).logits                      # [K, keep, V]
    head = token_stats(logits[packs.row_pack, packs.head_slot[packs.row_pack] - base][:, None], tokens[:, :1],
                       mask[:, :1], temperature=temperature, **kwargs)
    k, slot = packs.row_pack[packs.rows], packs.slots - base
    targets = torch.zeros(logits.shape[:2], dtype=tokens.dtype, device=tokens.device).index_put_(
        (k, slot), tokens[packs.rows, packs.cols + 1])
    trained = torch.zeros(logits.shape[:2], dtype=torch.bool, device=mask.device).index_put_(
        (k, slot), mask[packs.rows, packs.cols + 1])
    rest = token_stats(logits, targets, trained, temperature=temperature, **kwargs)

    def place(first: Tensor, packed: Tensor) -> Tensor:
        later = packed.new_zeros(size, width - p - 1).index_put((packs.rows, packs.cols), packed[k, slot])
        return torch.cat([first, later], dim=1)
    return TokenStats(**{f.name: place(getattr(head, f.name), getattr(rest, f.name))
                         for f in dataclasses.fields(TokenStats)})

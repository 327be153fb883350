"""The one sampler: batched decoding with a KV cache, G responses per prompt, behaviour
log-probs, stop tokens and strings, tool turns. Training rollouts, evaluation and the
``builtin:tiny`` warm start all decode through ``generate``.

Each prompt is prefilled once and its KV cache expanded to its G rows; each step then feeds
one token per live row (one forward through the cache; finished rows leave the batch and the
cache, so they cost nothing). Rows whose response text just ended with the task's ``tool_stop``
(e.g. ``</calc>``, or ``</calc>.`` where one token wrote ">.") get the environment's output
(``<out>42</out>``) queued as *forced*
tokens, fed over the next steps with mask 0 and log-prob 0, so single- and multi-turn tasks
share one batched loop with no per-row forward.

A row ends (``stopped``) at any token of ``stop_token_ids`` (the tokenizer's EOS and every id
of the model's ``generation_config.eos_token_id``) or once its text contains one of
``stop_strings``; the token that ends it is the policy's action and is trained on (a stop string
that a tool's output writes ends the row inside that output, the rest dropped: the last trained
token is then the policy's call). A row that
reaches ``max_new_tokens`` sampled tokens first is *clipped* (``stopped`` False).

Sampling runs on the model's device: only one uniform number per row comes from the (CPU,
checkpointed) generator, and the token is drawn by inverse CDF, so runs are reproducible on
any device and no [N,V] logits cross to the host. Per decoding step the sampled tokens and
their log-probs ([live rows] each) come back to the host, two copies and the step's one host
sync: the stop, tool and bookkeeping logic runs there (tests/test_device.py counts them).

On a CPU with float32 weights the linear layers multiply by weights packed once per call
(``creditrl.runtime.packed``): a decoding step's few rows otherwise pay the weights' reordering
inside every product.

Layout: prompts are left-padded to a common length P, responses follow from column P and are
right-padded, so every response starts at column P and ``position_ids`` = cumsum(attention_mask)
- 1 matches what the cache saw during generation.
"""
from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from creditrl.runtime.packed import packed_linears


@dataclass
class Generation:
    """N = prompts x group_size rows; L = prompt_len + response columns.

    input_ids, attention_mask: [N,L] long; response_mask: [N,L] float, 1 on sampled tokens;
    rollout_logp: [N,L] float32 behaviour log-prob of sampled tokens (0 elsewhere);
    stopped: [N] bool, the row ended at a stop token/string (False: clipped at max_new_tokens);
    tool_calls: [N] long, the tool calls the task answered with an output; None for a task without a
    tool (no ``max_tool_calls`` or ``tool_stop``)."""

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    rollout_logp: Tensor
    stopped: Tensor
    prompt_len: int
    tool_calls: Tensor | None


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """[B,L] positions counting only attended tokens, so left padding does not shift them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def stop_token_ids(model, tokenizer) -> list[int]:
    """Ids that end a response: the tokenizer's EOS and every ``generation_config.eos_token_id``
    (an int or a list; e.g. ``<|im_end|>`` for chat models whose tokenizer names another EOS)."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    config = getattr(model, "generation_config", None)
    extra = getattr(config, "eos_token_id", None)
    for i in [extra] if isinstance(extra, int) else list(extra or []):
        if int(i) not in ids:
            ids.append(int(i))
    if not ids:
        raise ValueError("tokenizer: expected an eos_token_id or a generation_config.eos_token_id to end "
                         "responses, got neither")
    return ids


def check_stop_strings(stop_strings) -> tuple[str, ...]:
    """``stop_strings`` as a tuple of non-empty strings, or a ValueError naming the bad one (an
    empty string matches at position 0 of every text)."""
    strings = tuple(stop_strings)
    for i, s in enumerate(strings):
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop_strings[{i}]: expected a non-empty string, got {s!r} (an empty stop string would "
                             f"cut every response to nothing)")
    return strings


def cut_at_stop(text: str, stop_strings) -> str:
    """``text`` up to and including the earliest stop string (unchanged when none occurs)."""
    ends = [i + len(s) for s in stop_strings if (i := text.find(s)) >= 0]
    return text[:min(ends)] if ends else text


def pad_prompts(prompt_ids: list[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    """Left-padded ``(input_ids, attention_mask)`` [N,P] of token-id prompts."""
    width = max(len(e) for e in prompt_ids)
    ids = torch.tensor([[pad] * (width - len(e)) + list(e) for e in prompt_ids], dtype=torch.long)
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in prompt_ids], dtype=torch.long)
    return ids, mask


def sample_next(logits: Tensor, *, temperature: float, top_p: float,
                generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Sample one token per row from softmax(logits / temperature) truncated to the top-p
    nucleus; return ``(tokens [N], logp [N])`` on ``logits``' device under that (renormalised)
    behaviour policy. ``temperature == 0`` is greedy (logp 0). The draw is an inverse CDF of
    one uniform per row from ``generator`` (CPU): zero-probability tokens are never drawn."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(-1), logits.new_zeros(logits.shape[0])
    logp = torch.log_softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_logp, order = logp.sort(dim=-1, descending=True)
        # keep a token if the mass before it is < top_p (the top token always survives)
        drop = (sorted_logp.exp().cumsum(-1) - sorted_logp.exp()) >= top_p
        sorted_logp = sorted_logp.masked_fill(drop, float("-inf"))
        logp = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_logp)
        logp = torch.log_softmax(logp, dim=-1)
    u = 1.0 - torch.rand(logits.shape[0], generator=generator, dtype=torch.float64)   # (0, 1]
    token = inverse_cdf(logp.exp(), u.to(logits.device))
    return token, logp.gather(-1, token[:, None]).squeeze(-1)


CDF_BLOCK = 1024


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """[N] the first token of each row of ``probs`` [N,V] (>= 0) whose cumulative probability reaches
    ``u`` [N] in (0, 1] times the row's total: a token of probability 0 is never drawn.

    Sums are float64 (a float32 running sum near 1 moves in steps of 6e-8, so rarer tokens could
    never be drawn), taken in two levels so no [N,V] float64 CDF is made (623 MB at N = 512 and
    Qwen's 152k vocabulary): the sums of blocks of ``CDF_BLOCK`` tokens pick each row's block, and a
    cumulative sum inside that block the token."""
    rows, vocab = probs.shape
    full = vocab - vocab % CDF_BLOCK
    sums = probs[:, :full].reshape(rows, -1, CDF_BLOCK).sum(-1, dtype=torch.float64)
    if full < vocab:
        sums = torch.cat([sums, probs[:, full:].sum(-1, keepdim=True, dtype=torch.float64)], 1)
    block_cdf = sums.cumsum(-1)
    target = u * block_cdf[:, -1]
    block = torch.searchsorted(block_cdf, target[:, None]).squeeze(-1).clamp_(max=sums.shape[1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    columns = block[:, None] * CDF_BLOCK + torch.arange(CDF_BLOCK, device=probs.device)
    inside = probs.gather(1, columns.clamp(max=vocab - 1)) * (columns < vocab)
    inner = inside.cumsum(-1, dtype=torch.float64)
    # the block's two sums round differently: never past its last token of nonzero probability
    rest = torch.minimum(target - before, inner[:, -1])
    return (block * CDF_BLOCK + torch.searchsorted(inner, rest[:, None]).squeeze(-1)).clamp_(max=vocab - 1)


def select_cache_rows(cache, rows: Tensor):
    """The KV cache restricted/expanded to batch ``rows`` (indices may repeat): HF ``Cache``
    objects in place, legacy tuple/tensor caches by indexing every tensor's first dim."""
    if hasattr(cache, "batch_select_indices"):
        cache.batch_select_indices(rows)
        return cache
    return torch.utils._pytree.tree_map(lambda x: x[rows] if isinstance(x, Tensor) else x, cache)


def _text_stops(tokenizer, generated: Tensor, rows: Tensor, t: int, stop_strings, window: int) -> Tensor:
    """[len(rows)] bool: the row's text ending at column t now contains a stop string. Only its
    tail is decoded (``_tail_texts``): an occurrence that ended earlier was caught at its own step."""
    if not len(rows):
        return torch.zeros(0, dtype=torch.bool)
    tails = _tail_texts(tokenizer, generated, rows, t, window)
    return torch.tensor([any(s in text for s in stop_strings) for text in tails], dtype=torch.bool)


def _tail_texts(tokenizer, generated: Tensor, rows: Tensor, t: int, window: int) -> list[str]:
    """The last ``window`` characters or more of each of ``rows``' text up to column t: its last
    ``window`` tokens (each writes >= 1 character; one batched decode), more for the rare row whose
    special tokens decode to nothing in there."""
    def decode(which: list[int], width: int) -> list[str]:
        return tokenizer.batch_decode(generated[rows[which], max(0, t + 1 - width):t + 1].tolist(),
                                      skip_special_tokens=True)

    if not len(rows):
        return []
    texts, width = decode(list(range(len(rows))), window), window
    short = [i for i, text in enumerate(texts) if len(text) < window]
    while short and width < t + 1:
        width *= 2
        for i, text in zip(short, decode(short, width)):
            texts[i] = text
        short = [i for i in short if len(texts[i]) < window]
    return texts


@dataclass
class _Decode:
    """Bookkeeping of one batched decode, a row per response (CPU tensors): the tokens written,
    which the policy chose (1) or the environment forced (0), their log-probs, the columns fed,
    sampled-token and tool-call counts (the calls made, against the budget, and those the task
    answered with an output), whether each row stopped, and queued tool-output tokens."""
    tokens: Tensor
    sampled: Tensor
    logps: Tensor
    fed: Tensor
    n_sampled: Tensor
    n_calls: Tensor
    n_answered: Tensor
    stopped: Tensor
    forced: Tensor
    forced_len: Tensor
    forced_pos: Tensor

    @classmethod
    def empty(cls, n: int, max_steps: int, max_tool_tokens: int, pad: int) -> "_Decode":
        zeros = lambda: torch.zeros(n, dtype=torch.long)  # noqa: E731
        return cls(torch.full((n, max_steps), pad, dtype=torch.long), torch.zeros(n, max_steps),
                   torch.zeros(n, max_steps), zeros(), zeros(), zeros(), zeros(), torch.zeros(n, dtype=torch.bool),
                   torch.full((n, max_tool_tokens), pad, dtype=torch.long), zeros(), zeros())

    def write(self, live: Tensor, t: int, token: Tensor, logp: Tensor) -> tuple[Tensor, Tensor]:
        """Write column ``t`` of the ``live`` rows: a queued tool-output token where one is
        pending, else the sampled ``token``. Returns (the tokens written, chosen by the policy)."""
        pos = self.forced_pos[live]
        is_forced = pos < self.forced_len[live]
        token = torch.where(is_forced, self.forced[live, pos.clamp(max=self.forced.shape[1] - 1)], token)
        chosen = ~is_forced
        self.tokens[live, t] = token
        self.sampled[live, t] = chosen.float()
        self.logps[live, t] = torch.where(chosen, logp, torch.zeros_like(logp))
        self.fed[live] += 1
        self.forced_pos[live] = pos + is_forced.long()
        self.n_sampled[live] += chosen.long()
        return token, chosen

    def pending(self, live: Tensor) -> Tensor:
        """[len(live)] bool: queued tool-output tokens still to feed."""
        return self.forced_pos[live] < self.forced_len[live]

    def result(self, ids: Tensor, attn: Tensor, steps: int, tool: bool) -> Generation:
        n, prompt_len = ids.shape
        input_ids = torch.cat([ids, self.tokens[:, :steps]], dim=1)
        attention_mask = torch.cat([attn, (torch.arange(steps) < self.fed[:, None]).long()], dim=1)
        rollout_logp = torch.cat([torch.zeros(n, prompt_len), self.logps[:, :steps]], dim=1)
        response_mask = torch.cat([torch.zeros(n, prompt_len), self.sampled[:, :steps]], dim=1)
        return Generation(input_ids, attention_mask, response_mask, rollout_logp, self.stopped, prompt_len,
                          self.n_answered.clone() if tool else None)


@dataclass(frozen=True)
class _Stops:
    """When a row ends: a stop token, a stop string, or ``max_new`` sampled tokens; and the tool
    calls it may make (text ending with ``task.tool_stop``, at most ``calls``)."""
    ids: Tensor
    strings: tuple[str, ...]
    window: int
    max_new: int
    tool_stop: str | None
    calls: int
    tool_end_ids: Tensor | None = None   # the ids whose text can end tool_stop (None: any)


def _stops(model, tokenizer, task, stop_strings, max_new_tokens: int) -> _Stops:
    strings = check_stop_strings(stop_strings)
    calls = int(getattr(task, "max_tool_calls", 0) or 0)
    tool_stop = task.tool_stop if calls and task.tool_stop else None
    # every token writes >= 1 character, so this many tokens hold any stop string or tool_stop
    window = max((len(s) for s in (*strings, tool_stop or "")), default=0) + 1
    return _Stops(torch.tensor(stop_token_ids(model, tokenizer), dtype=torch.long), strings, window,
                  max_new_tokens, tool_stop, calls,
                  _ids_writing(tokenizer, tool_stop[-1]) if tool_stop and tool_stop[-1].isascii() else None)


_WRITING_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _ids_writing(tokenizer, char: str) -> Tensor:
    """[K] the token ids whose text holds ``char`` (special tokens' included), found once per
    tokenizer (0.4 s over SmolLM2's 49,152): only a row whose last token is one of them can have just
    written a tool call, so only those rows' tails are decoded at a step."""
    try:
        table = _WRITING_IDS.setdefault(tokenizer, {})
    except TypeError:              # a tokenizer that cannot be a weak dict key: found again each call
        table = {}
    if char not in table:
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        table[char] = torch.tensor([i for i, text in enumerate(texts) if char in text], dtype=torch.long)
    return table[char]


def call_end(text: str, last_token_text: str, tool_stop: str) -> int | None:
    """Where the tool call ``text`` just closed ends (the index after its ``tool_stop``), or None: the
    text ends with ``tool_stop``, or its last token wrote the end of ``tool_stop`` and a few characters
    more, as one merged BPE token (SmolLM2 writes "</calc>." as 'calc', '>.'). Not where those
    characters open the next tag ('><' of "</calc><calc>"): an output there would split the tag."""
    end = text.rfind(tool_stop)
    if end < 0:
        return None
    end += len(tool_stop)
    extra = text[end:]
    return end if not extra or (len(extra) < len(last_token_text) and tool_stop[0] not in extra) else None


def _continuing(state: _Decode, stops: _Stops, tokenizer, task, live: Tensor, t: int, token: Tensor,
                chosen: Tensor) -> Tensor:
    """[len(live)] bool: the rows that go on decoding after column ``t`` (marks the stopped ones;
    queues tool outputs of rows that just called a tool)."""
    ends = chosen & torch.isin(token, stops.ids)
    if stops.strings:
        # a tool's output that writes a stop string ends the row there, the rest of it dropped: the
        # reward's text is cut at it, and no token sampled after it is trained as the stop
        ends |= _text_stops(tokenizer, state.tokens, live, t, stops.strings, stops.window)
        state.forced_len[live[ends]] = state.forced_pos[live[ends]]
    state.stopped[live] |= ends
    keep = ~(ends | (state.n_sampled[live] >= stops.max_new)) | state.pending(live)  # queued tokens still fed
    if stops.tool_stop is not None:
        # a call is the text ending with tool_stop, as task.tool_output reads it: a BPE tokenizer writes
        # "</calc>" with more than one token sequence (SmolLM2: "Ġ</" after a space), so ids cannot tell
        can_end = chosen & keep
        if stops.tool_end_ids is not None:
            can_end &= torch.isin(token, stops.tool_end_ids)
        rows = live[can_end]
        rows = rows[state.n_calls[rows] < stops.calls]
        tails = _tail_texts(tokenizer, state.tokens, rows, t, stops.window)
        last = tokenizer.batch_decode(state.tokens[rows, t:t + 1].tolist(), skip_special_tokens=True)
        calling = [int(b) for b, text, written in zip(rows, tails, last)
                   if call_end(text, written, stops.tool_stop) is not None]
        _queue_tool_outputs(tokenizer, task, state, calling, t)
        keep |= state.pending(live)
    return keep


@torch.no_grad()
def generate(model, tokenizer, prompt_ids: list[list[int]], *, group_size: int = 1, temperature: float = 1.0,
             top_p: float = 1.0, max_new_tokens: int = 16, generator: torch.Generator | None = None,
             task=None, max_tool_tokens: int = 24, stop_strings: tuple[str, ...] | list[str] = (),
             packed_weights: bool = True) -> Generation:
    """Decode ``group_size`` responses per prompt (rows i*G .. i*G+G-1 answer prompt i) from
    token-id prompts (``tasks.chat.render_prompt``); see the module docstring. The sampled token
    of every live row comes to the host once per step (stop strings, tool calls and bookkeeping
    need it): one small device-to-host copy per decoding step, never the logits.
    ``packed_weights``: on a CPU, linear layers use weights packed once for the call
    (``creditrl.runtime.packed``)."""
    device = next(model.parameters()).device
    prompt_tokens, prompt_attn = pad_prompts(prompt_ids, tokenizer.pad_token_id)
    expand = torch.arange(len(prompt_ids)).repeat_interleave(group_size)
    stops = _stops(model, tokenizer, task, stop_strings, max_new_tokens)
    state = _Decode.empty(len(expand), max_new_tokens + stops.calls * max_tool_tokens, max_tool_tokens,
                          tokenizer.pad_token_id)
    ids, attn = prompt_tokens[expand], prompt_attn[expand]
    attn_dev, next_pos = attn.to(device), attn.sum(-1)
    steps = 0
    # inference mode inside only: what leaves it is built from ordinary tensors, so the training
    # forward can save it for backward
    with torch.inference_mode(), packed_linears(model, len(expand), packed_weights):
        out = model(input_ids=prompt_tokens.to(device), attention_mask=prompt_attn.to(device),
                    position_ids=position_ids_from_mask(prompt_attn).to(device), use_cache=True, logits_to_keep=1)
        cache = select_cache_rows(out.past_key_values, expand.to(device))
        logits = out.logits[:, -1][expand.to(device)]
        live = torch.arange(len(expand))                           # rows still decoding, in cache order
        for t in range(state.tokens.shape[1]):
            token, logp = (x.cpu() for x in sample_next(logits, temperature=temperature, top_p=top_p,
                                                         generator=generator))
            token, chosen = state.write(live, t, token, logp)
            steps = t + 1
            keep = _continuing(state, stops, tokenizer, task, live, t, token, chosen)
            if not bool(keep.all()):
                if not bool(keep.any()):
                    break
                kept = torch.nonzero(keep).flatten()
                live, cache = live[kept], select_cache_rows(cache, kept.to(device))
            # every column a live row has been fed is attended: only the prompt's left padding is masked
            step_attn = torch.cat([attn_dev[live.to(device)],
                                   torch.ones(len(live), t + 1, dtype=torch.long, device=device)], dim=1)
            out = model(input_ids=state.tokens[live, t:t + 1].to(device), attention_mask=step_attn,
                        position_ids=(next_pos[live] + t)[:, None].to(device), past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1]
    return state.result(ids, attn, steps, tool=stops.tool_stop is not None)


def _queue_tool_outputs(tokenizer, task, state: _Decode, rows: list[int], t: int) -> None:
    """``rows`` just wrote ``task.tool_stop``: each gets its tool output queued (mask 0 tokens).
    Only the rows that made a call are decoded whole: tool calls are events, not tokens. An
    output longer than ``max_tool_tokens`` is cut, with a warning (the policy then reads, and the
    reward scores, a reply without its end)."""
    cap = state.forced.shape[1]
    for b in rows:
        text = tokenizer.decode(state.tokens[b, :t + 1], skip_special_tokens=True)
        # the call as the task reads it, up to its tool_stop: a merged token's extra characters ("." of
        # "</calc>.") stay in the response, before the output
        output = task.tool_output(text[:text.rfind(task.tool_stop) + len(task.tool_stop)])
        state.n_calls[b] += 1
        if not output:
            continue
        state.n_answered[b] += 1
        out_ids = tokenizer(output, add_special_tokens=False)["input_ids"]
        if len(out_ids) > cap:
            # one message per cap (Python shows it once): the policy and the reward see the cut text
            warnings.warn(f"tool outputs longer than max_tool_tokens={cap} tokens are cut, so the policy reads and "
                          f"the reward scores a reply without its end: raise rollout.max_tool_tokens",
                          RuntimeWarning, stacklevel=2)
            out_ids = out_ids[:cap]
        state.forced[b, :len(out_ids)] = torch.tensor(out_ids, dtype=torch.long)
        state.forced_len[b], state.forced_pos[b] = len(out_ids), 0


def decode_responses(tokenizer, response_ids: Tensor, response_attn: Tensor, stop_strings=()) -> list[str]:
    """Response texts without padding/EOS, cut right after a stop string (tool outputs
    included: the reward sees them)."""
    stop_strings = check_stop_strings(stop_strings)
    texts = tokenizer.batch_decode([row[m.bool()].tolist() for row, m in zip(response_ids, response_attn)],
                                   skip_special_tokens=True)
    return [cut_at_stop(t, stop_strings) for t in texts] if stop_strings else texts

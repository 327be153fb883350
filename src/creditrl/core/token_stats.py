"""Per-token statistics of the sampling distribution, computed from logits in chunks.

For pi_t = softmax(logits[b,t] / temperature) and the sampled token y_t:

    logp    = log pi_t(y_t)
    entropy = H(pi_t) = -sum_v pi_t(v) log pi_t(v)
    sum_p2  = sum_v pi_t(v)^2
    energy  = ||e_{y_t} - pi_t||^2 = 1 - 2 pi_t(y_t) + sum_p2      (OTB paper eq. 7), clamped >= 0

The energy is evaluated as (1 - pi(y))^2 + sum_{v != y} pi(v)^2 with 1 - pi(y) = sum_{v != y} pi(v),
both sums taken over the other tokens directly: the same quantity without the cancellation of
1 - 2 pi + sum pi^2, which in float32 floors at ~1e-7 for near-certain tokens (the proxy must
still rank them).

Memory: only valid tokens are processed, ``chunk_size`` rows of the flattened [B*T, V] logits at
a time, upcast to float32 inside the chunk, so the extra memory is O(chunk_size * V) float32 in
the forward pass. The backward pass (a custom autograd Function) recomputes pi chunk by chunk
from the saved logits and per-token log-normaliser: it allocates the logits' gradient (same
dtype as the logits, as any backward must) plus O(chunk_size * V) float32 scratch, never a
float32 [B,T,V] copy.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from creditrl.utils.validate import NonFiniteError, as_mask, bad_rows, check_range, check_tensor

# Default chunk, in float32 elements of scratch per temporary, by device type: 4M (16 MiB) on a CPU
# (its one-thread forward was timed there); 64M (256 MiB) on other devices, where every chunk pays its
# own kernel launches: on an H200 16 MiB chunks ran 3.5x slower than 256 MiB ones (docs/performance.md,
# the GPU chunk sweep; CUDA measured, MPS and others not).
DEFAULT_CHUNK_ELEMENTS = {"cpu": 1 << 22, "accelerator": 1 << 26}


def default_chunk_size(vocab: int, device: torch.device) -> int:
    """Tokens per chunk when ``token_stats`` is given no ``chunk_size``."""
    elements = DEFAULT_CHUNK_ELEMENTS["cpu" if device.type == "cpu" else "accelerator"]
    return max(1, elements // max(vocab, 1))


@dataclass(frozen=True)
class TokenStats:
    """[B,T] float32 statistics, 0 where mask == 0. ``logp`` and ``entropy`` carry gradients."""

    logp: Tensor
    entropy: Tensor
    sum_p2: Tensor
    energy: Tensor

    @classmethod
    def cat(cls, parts: list["TokenStats"]) -> "TokenStats":
        """Row-wise concatenation of statistics of the same width."""
        return cls(*(torch.cat([getattr(x, f.name) for x in parts]) for f in dataclasses.fields(cls)))

    def detach(self) -> "TokenStats":
        """The same statistics as data (no gradient), float32."""
        return TokenStats(*(getattr(self, f.name).detach().float() for f in dataclasses.fields(self)))


def _chunk_forward(rows: Tensor, targets: Tensor, temperature: float,
                   scratch: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, ...]:
    """rows [n, V] any float dtype -> (logp, entropy, sum_p2, energy, log_normaliser) float32 [n].

    With z the tempered logits, m = max z, e = exp(z - m), s = sum e:
    log pi(y) = z_y - m - log s,  H = log s - sum e (z - m) / s,  sum pi^2 = sum e^2 / s^2,
    energy = (r / s)^2 + q / s^2 with r = sum_{v != y} e, q = sum_{v != y} e^2, summed with e_y
    zeroed (no cancellation for pi(y) -> 1). z - m is clamped at the float32 minimum first, so
    -inf logits (a masked vocabulary, e = 0) add 0 log 0 = 0 without a check or a host sync.
    Every sum over V is an elementwise product then ``sum`` (pairwise on the CPU, a tree on
    CUDA): a float32 dot product (bmm) accumulates sequentially on the CPU, loses ~1e-4
    relative at V = 152k, and is slower there. ``scratch``: two float32 buffers of at least
    rows.shape reused across chunks (fresh chunk-sized buffers per chunk cost page faults).
    """
    shifted, e = (None, None) if scratch is None else (buf[: rows.shape[0]] for buf in scratch)
    # max is exact in any dtype; subtracting a float32 max upcasts in the same pass (no separate copy)
    m = rows.amax(-1, keepdim=True).to(torch.float32)
    shifted = torch.sub(rows, m, out=shifted)
    if temperature != 1.0:
        shifted.div_(temperature)
        m = m / temperature
    e = torch.exp(shifted, out=e)
    s = e.sum(-1)
    log_s = s.log()
    logp = shifted.gather(1, targets[:, None]).squeeze(1) - log_s
    shifted.clamp_(min=torch.finfo(torch.float32).min)                     # 0 * -inf would be NaN
    entropy = log_s - shifted.mul_(e).sum(-1) / s                           # shifted is scratch from here on
    e_y = e.gather(1, targets[:, None]).squeeze(1)
    e.scatter_(1, targets[:, None], 0.0)
    others = torch.mul(e, e, out=shifted).sum(-1) / (s * s)                # sum_{v != y} pi^2
    not_y = e.sum(-1) / s                                                   # 1 - pi(y)
    return logp, entropy, others + (e_y / s).square(), not_y.square() + others, m.squeeze(1) + log_s


def _chunk_backward(rows: Tensor, targets: Tensor, log_norm: Tensor, entropy: Tensor,
                    grad_logp: Tensor, grad_entropy: Tensor, temperature: float,
                    scratch: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """d/dlogits of sum(g_logp * logp + g_H * H) for one chunk, float32 [n, V]:
    dlogp/dz = e_y - pi,  dH/dz = -pi (log pi + H),  dz/dlogits = 1 / temperature; log pi is
    clamped at the float32 minimum (-inf logits: pi = 0, and so is their gradient)."""
    log_pi, pi = (None, None) if scratch is None else (buf[: rows.shape[0]] for buf in scratch)
    log_pi = torch.sub(rows, (log_norm * temperature)[:, None], out=log_pi)  # upcasts to float32
    if temperature != 1.0:
        log_pi.div_(temperature)
    pi = torch.exp(log_pi, out=pi)
    log_pi.clamp_(min=torch.finfo(torch.float32).min)
    grad = log_pi.add_(entropy[:, None]).mul_(pi).mul_(-grad_entropy[:, None])
    grad.addcmul_(pi, grad_logp[:, None], value=-1.0)
    grad[torch.arange(rows.shape[0], device=rows.device), targets] += grad_logp
    return grad.div_(temperature) if temperature != 1.0 else grad


def _scratch(flat_logits: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """Two float32 [rows, V] buffers reused by every chunk of one call."""
    return tuple(flat_logits.new_empty((rows, flat_logits.shape[1]), dtype=torch.float32) for _ in range(2))


def _chunks(index: Tensor, chunk: int) -> list[tuple[slice, Tensor | slice]]:
    """(positions in ``index``, rows of the flat logits) per chunk; rows are a plain slice (a view,
    no copy) when the chunk's valid tokens are contiguous, as with a full mask."""
    n = index.numel()
    starts = list(range(0, n, chunk))
    if not starts:
        return []
    ends = [min(s + chunk, n) for s in starts]
    bounds = torch.stack([index[torch.tensor(starts, device=index.device)],
                          index[torch.tensor(ends, device=index.device) - 1]])
    firsts, lasts = bounds.tolist()                        # the one host copy (a sync on CUDA) per call
    return [(slice(s, e), slice(f, f + e - s) if last - f + 1 == e - s else index[s:e])
            for s, e, f, last in zip(starts, ends, firsts, lasts)]


class _TokenStatsFn(torch.autograd.Function):
    """Flat valid-token statistics with a chunked, recomputing backward."""

    @staticmethod
    def forward(ctx, flat_logits: Tensor, index: Tensor, targets: Tensor, temperature: float, chunk: int,
                steps: int):
        n = index.numel()
        outs = [flat_logits.new_zeros(n, dtype=torch.float32) for _ in range(5)]
        scratch = _scratch(flat_logits, min(chunk, n))
        for rows, source in _chunks(index, chunk):
            results = _chunk_forward(flat_logits[source], targets[rows], temperature, scratch)
            for out, res in zip(outs, results):
                out[rows] = res
        logp, entropy, sum_p2, energy, log_norm = outs
        bad = ~torch.isfinite(log_norm)                       # NaN / +inf logits (or a row all -inf)
        if bool(bad.any()):
            rows = sorted({int(p) // max(steps, 1) for p in index[bad][:1000].tolist()})
            raise NonFiniteError(f"logits: {int(bad.sum())} valid position(s) have NaN or +inf logits (or all -inf), "
                                 f"e.g. rows {rows[:10]}")
        ctx.save_for_backward(flat_logits, index, targets, log_norm, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(sum_p2, energy)
        return logp, entropy, sum_p2, energy

    @staticmethod
    def backward(ctx, grad_logp: Tensor, grad_entropy: Tensor, _grad_sum_p2: Tensor, _grad_energy: Tensor):
        flat_logits, index, targets, log_norm, entropy = ctx.saved_tensors
        grad_logp = torch.zeros_like(entropy) if grad_logp is None else grad_logp.float()
        grad_entropy = torch.zeros_like(entropy) if grad_entropy is None else grad_entropy.float()
        grad = torch.zeros_like(flat_logits)
        scratch = _scratch(flat_logits, min(ctx.chunk, index.numel()))
        for rows, source in _chunks(index, ctx.chunk):
            grad[source] = _chunk_backward(flat_logits[source], targets[rows], log_norm[rows], entropy[rows],
                                           grad_logp[rows], grad_entropy[rows], ctx.temperature,
                                           scratch).to(grad.dtype)
        return grad, None, None, None, None, None


def token_stats(logits: Tensor, tokens: Tensor, mask: Tensor | None = None, *, temperature: float = 1.0,
                chunk_size: int | None = None) -> TokenStats:
    """logp, entropy, sum_p2 and energy (module docstring) of every valid token, [B,T] float32.

    logits: [B,T,V] any float dtype, aligned so logits[b,t] produced tokens[b,t]; tokens: [B,T]
    int; mask: [B,T] bool/0-1 (default: all valid; tokens at masked positions are ignored).
    -inf logits are legal (a masked vocabulary: 0 log 0 = 0, finite gradients); NaN or +inf
    logits at a valid position raise NonFiniteError naming the rows.
    chunk_size: tokens per chunk (default ``default_chunk_size``: 4M elements / V on a CPU, 64M on a
    GPU). Accurate to ~1e-6 relative of a
    float64 reference for float32 logits; bf16/fp16 logits are upcast chunk by chunk.
    """
    check_tensor("logits", logits, ndim=3, floating=True)
    num, steps, vocab = logits.shape
    check_tensor("tokens", tokens, shape=[num, steps], integer=True)
    if mask is None:
        mask = torch.ones(num, steps, dtype=torch.bool, device=logits.device)
    else:
        mask = as_mask("mask", mask, tokens.shape)     # the one mask rule: bool or 0/1
    check_range("temperature", temperature, 0.0, None, low_inclusive=False)
    if chunk_size is None:
        chunk_size = default_chunk_size(vocab, logits.device)
    elif isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected an int >= 1 or None, got {chunk_size!r}")
    out_of_vocab = mask & ((tokens < 0) | (tokens >= vocab))
    if bool(out_of_vocab.any()):
        raise ValueError(f"tokens: expected ids in [0, {vocab}) on valid positions, got "
                         f"{int(tokens[out_of_vocab][0])} in rows {bad_rows(out_of_vocab)}")

    index = torch.nonzero(mask.flatten()).flatten()
    targets = tokens.flatten()[index].long()
    logp, entropy, sum_p2, energy = _TokenStatsFn.apply(logits.reshape(num * steps, vocab), index, targets,
                                                        float(temperature), chunk_size, steps)

    def scatter(x: Tensor) -> Tensor:
        return x.new_zeros(num * steps).index_put((index,), x).reshape(num, steps)

    return TokenStats(logp=scatter(logp), entropy=scatter(entropy), sum_p2=scatter(sum_p2),
                      energy=scatter(energy))

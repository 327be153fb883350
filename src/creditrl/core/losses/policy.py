"""The policy loss: one autograd composition of the registered loss terms.

Per token (valid tokens; r_t = π_θ/π_old, A_t the advantage), the default composition:
    keep       κ = valid ∧ ¬STAPO-silenced (``stapo``) ∧ ¬dropped, ρ̄ = the weight (``rollout_correction``)
    ratio      A_t ← max(A_t, adv_clamp);  z ← M·z (ε-trace) or τ = M(1 + σ(log π − 1)) (ε-weight)  (``trace``)
    surrogate  ℓ_t = max(−A_t r_t, −A_t clip(r_t, 1−ε_low, 1+ε_high)), min(·, −A_t c) where A_t < 0,
               times ρ̄·τ                                                                       (``clip``)
    penalty    ℓ_t += β·KL_t(π_θ‖π_ref), k1/k2/k3                                                (``kl``)
    aggregate  L = agg_loss(ℓ, κ): denominators count kept tokens only (STAPO eq. 1)         (``aggregation``)
and the terms one chooses: at "keep" ``mask_truncated``, ``top_entropy``; at "ratio" ``gspo``
(the sequence-level ratio); at "surrogate" one of ``cispo``, ``sapo``, ``geo_mean``, ``dppo_tv``,
``dppo_kl``, ``clip_cov``, ``kl_cov`` in place of ``clip``; at "penalty" ``entropy_bonus``; at
"aggregate" ``delta_l_norm`` in place of ``aggregation`` (``terms.EXCLUSIVE_STAGES``). Each
term is a function of a ``LossState`` with its own options dataclass (``terms.py``), in the
module of its math. Between "keep" and "ratio" the composition detaches log π on the dropped
tokens (they keep their place and value in a trace but pass no gradient) and sets
z = log π_θ − log π_old. Autograd differentiates the whole; only ``logp`` receives gradient
(advantages and the old / reference / rollout log-probs and entropies are data, as in every RL
trainer), and the entropy too while an entropy bonus is on.

Numerics: float32, or the widest float dtype among the inputs; bf16 inputs are upcast and the
gradient comes back in ``logp``'s dtype. Log-ratios are clamped to ±20 before exp (as verl
does): the gradient is 0 where a clamp binds. Masked entries never reach the result, even NaN
(every input is zeroed off the mask first). Log-probs above 0 by more than ``LOGP_TOLERANCE``
(1e-3, ``creditrl.utils.validate``) on the mask's tokens are refused, naming the input. Metrics are
copied to the host once.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from creditrl.core.losses import aggregation as _aggregation, clip as _clip, kl as _kl  # noqa: F401 (registers)
from creditrl.core.losses import rollout_correction as _rollout_correction, stapo as _stapo  # noqa: F401
from creditrl.core.losses import traces as _traces  # noqa: F401 (registers the trace term)
from creditrl.core.losses import truncation as _truncation, entropy as _entropy, gspo as _gspo  # noqa: F401
from creditrl.core.losses import cispo as _cispo, sapo as _sapo, gmpo as _gmpo, dppo as _dppo  # noqa: F401
from creditrl.core.losses import covariance as _covariance, delta_l as _delta_l  # noqa: F401
from creditrl.core.losses.diagnostics import kl_estimate
from creditrl.core.losses.terms import EXCLUSIVE_STAGES, STAGES, LossState, LossTerm, apply_term, get_loss_term
from creditrl.core.losses.terms import builtin_loss_terms, list_loss_terms, resolve_loss_terms
from creditrl.utils.imports import plugin_name
from creditrl.utils.validate import LOGP_TOLERANCE, NonFiniteError, as_mask, check_finite, check_same_shape
from creditrl.utils.validate import check_tensor
from creditrl.utils.validate import token_advantages

# terms whose gradient at r = 1 (π_θ = π_old) is the clip surrogate's, A·∇log π (tests/test_surrogates.py):
# in an on-policy single pass they train exactly as the default loss
ON_POLICY_AS_CLIP = ("gspo", "cispo", "sapo", "dppo_tv", "dppo_kl", "kl_cov")

LOG_PROBS = ("logp", "old_logp", "ref_logp", "rollout_logp")   # each <= 0, within LOGP_TOLERANCE
# what every loss measures; a term's own metrics appear only where it measured them (``__call__``)
METRIC_KEYS = ("approx_kl", "adv_abs_mean", "kept_frac", "agg_count")

__all__ = ["METRIC_KEYS", "ON_POLICY_AS_CLIP", "LossMetrics", "PolicyLoss"]


class LossMetrics(dict):
    """A loss's metrics, name -> float, and ``counts``: name -> how many items (tokens, responses)
    a metric is the mean over, for those a term gave as (total, count) (``LossState.with_metrics``).
    Gradient accumulation weights a micro-batch's metric by its count, the others by ``agg_count``."""

    def __init__(self, values=(), counts: dict[str, float] | None = None):
        super().__init__(values)
        self.counts = counts or {}


class PolicyLoss:
    """The policy loss of a set of terms: ``PolicyLoss(terms)(logp, old_logp, advantages, mask, ...)``.

    ``terms``: term name or ``"package.module:function"`` -> options (an instance, a mapping of
    its fields, or None for the defaults), or the list form ``[{"path": ..., **options}]``
    (``resolve_loss_terms``). Flat terms that are not given take their default options; the
    other terms are on only when given. Options are checked here, once.
    """

    def __init__(self, terms: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None):
        chosen = resolve_loss_terms(terms)
        for name in list_loss_terms():
            term = get_loss_term(name)
            if term.flat and name not in chosen:
                chosen[name] = term.make_options()
        self.chosen: dict[str, Any] = chosen
        pairs = [(get_loss_term(name), options) for name, options in chosen.items()]
        self.flat = {term.name: options for term, options in pairs if term.flat}
        replaced = _replaced_flat_terms(pairs)
        order = {name: i for i, name in enumerate(list_loss_terms())}    # stage, then registration
        self.terms: tuple[tuple[LossTerm, Any], ...] = tuple(
            sorted((pair for pair in pairs if pair[0].name not in replaced), key=lambda pair: order[pair[0].name]))
        self.needs_entropy = any("entropy" in term.needs for term, _ in self.terms)
        self.entropy_grad = any("entropy" in term.differentiates for term, _ in self.terms)
        self.needs_truncated = any("truncated" in term.needs for term, _ in self.terms)

    def with_options(self, name: str, options: Any) -> PolicyLoss:
        """The same loss with term ``name``'s options replaced (a trainer's controller, e.g. the
        adaptive entropy coefficient, changes them between optimizer steps)."""
        if name not in self.chosen:
            raise ValueError(f"name: loss term {name!r} is not part of this loss; its terms are {list(self.chosen)}")
        return PolicyLoss({**self.chosen, name: get_loss_term(name).make_options(options)})

    def options_of(self, name: str) -> Any:
        """The options of term ``name`` in this loss, or None when it is not chosen."""
        return self.chosen.get(name)

    def to_config(self) -> dict[str, Any]:
        """This loss in ``creditrl train``'s nested spelling (``creditrl.core.losses.compose``): every
        built-in term (flat fields at the top, each section with ``enabled``), the user's terms by
        import path under ``terms``; ``compose(loss.to_config())`` rebuilds it."""
        out: dict[str, Any] = {}
        builtin = builtin_loss_terms()
        for term in builtin:
            options = self.chosen.get(term.name)
            values = dataclasses.asdict(options if options is not None else term.make_options())
            out.update(values) if term.flat else out.update({term.name: {"enabled": options is not None, **values}})
        names = {term.name for term in builtin}
        out["terms"] = [{"path": f"{get_loss_term(name).fn.__module__}:{get_loss_term(name).fn.__qualname__}",
                         **dataclasses.asdict(options)} for name, options in self.chosen.items() if name not in names]
        return out

    def __repr__(self) -> str:
        return f"PolicyLoss({', '.join(f'{term.name}={options!r}' for term, options in self.terms)})"

    def __eq__(self, other: object) -> bool:
        """The same terms with equal options: however it was spelled (``compose``'s three forms)."""
        if not isinstance(other, PolicyLoss):
            return NotImplemented
        return [(t.name, t.fn, o) for t, o in self.terms] == [(t.name, t.fn, o) for t, o in other.terms]

    def __hash__(self) -> int:           # equal losses have equal options, hence equal reprs
        return hash(repr(self))

    def __call__(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                 ref_logp: Tensor | None = None, rollout_logp: Tensor | None = None,
                 entropy: Tensor | None = None, truncated: Tensor | None = None,
                 weights: Tensor | None = None) -> tuple[Tensor, LossMetrics]:
        """logp: [B,T] current log π_θ(y_t) (with grad); old_logp, ref_logp, rollout_logp: [B,T]
        log-probs of the policy of the ratios' denominator, the frozen reference and the
        sampler; advantages: [B] or [B,T]; mask: [B,T] valid response tokens; entropy: [B,T]
        current-policy entropy (STAPO, top_entropy; with its gradient for entropy_bonus);
        truncated: [B] bool, responses cut at the token cap (mask_truncated); weights: [B,T] >= 0,
        data weights of the surrogate (verl's ``rollout_is_weights``, TRL's vLLM importance
        sampling ratio), multiplied with those of the terms (TIS, traces) and detached.

        Returns (scalar loss, metrics); the gradient reaches ``logp`` only, and ``entropy`` under
        an entropy bonus (an empty batch, B = 0 or T = 0, gives loss 0 with zero gradients and
        ``METRIC_KEYS`` 0.0). Metrics (``LossMetrics``: with the count each mean is over) are Python
        floats. Every loss gives ``METRIC_KEYS``: approx_kl (k3, KL(π_old‖π_θ)), adv_abs_mean over
        valid tokens, kept_frac as a fraction of valid tokens, agg_count, the aggregation's
        denominator (what gradient accumulation weights micro-batches by). The others appear only
        where something measured them, never as a stand-in 0.0: clip_frac_low/_high over kept
        tokens (the clipping surrogates), clip_frac_dual (the dual clip on); ref_kl (chosen
        estimator, with ``ref_logp``); mismatch_kl (k3, KL(π_rollout‖π_old)) and ppl_gap (OTB eq.
        68, old vs rollout), with ``rollout_logp``; is_masked_frac (a rollout correction that drops
        tokens); spurious_ratio (STAPO on); each chosen term's own (``cov_selected_frac``,
        ``high_entropy_frac``, ``bonus_entropy``, ..., a user term's).
        """
        logp_in = check_tensor("logp", logp, ndim=2, floating=True)
        valid = as_mask("mask", mask, logp_in.shape)
        given = {"logp": logp_in, "old_logp": old_logp, "rollout_logp": rollout_logp, "ref_logp": ref_logp,
                 "entropy": entropy if self.needs_entropy else None, "weights": weights}
        self._check_needs({**given, "truncated": truncated})
        if entropy is not None and not self.needs_entropy:     # unread: its shape and dtype still checked
            check_same_shape("logp", logp_in, "entropy", check_tensor("entropy", entropy, floating=True))
        rows_cut = as_mask("truncated", truncated, logp_in.shape[:1]) if truncated is not None else None
        rows_cut = rows_cut if self.needs_truncated else None
        dtype = _common_dtype(*given.values(), advantages)
        live = ("logp", "entropy") if self.entropy_grad else ("logp",)
        data = {name: None if x is None else _as_float(name, x, logp_in, dtype, name in live)
                for name, x in given.items()}
        if logp_in.numel() == 0:      # B = 0 or T = 0: loss 0, still attached (zero gradients), metrics 0
            token_advantages(advantages, logp_in)                           # validated all the same
            return logp_in.sum() * 0.0, LossMetrics(dict.fromkeys(METRIC_KEYS, 0.0))
        initial, token_adv, highest = _initial_state(data, advantages, valid)
        if data["entropy"] is not None:          # how far below 0 it goes, read with the metrics
            highest["entropy"] = -torch.where(valid, data["entropy"].detach(), 0.0).amin()   # masked garbage ignored
        initial = dataclasses.replace(initial, truncated=rows_cut, flat=self.flat, weight=_data_weights(initial, data))
        state, _ = self._compose(initial)
        return _finish(state, {**given, "advantages": token_adv}, highest,
                       locate=lambda: self._compose(initial, locate=True)[1])

    def _compose(self, state: LossState, locate: bool = False) -> tuple[LossState, str | None]:
        """The terms applied in their stages' order. ``locate`` (only once a result came out non-finite
        from finite inputs): run without gradient and stop at the first term whose output holds NaN/inf,
        returning its description."""
        for stage in STAGES:
            if stage == "ratio":
                state = _surrogate_inputs(state)
            for term, options in self.terms:
                if term.stage == stage:
                    if not locate:
                        state = apply_term(term, options, state)
                        continue
                    with torch.no_grad():
                        state = apply_term(term, options, state)
                    bad = _non_finite_fields(state)
                    if bad:
                        return state, (f"loss term {term.name!r} ({plugin_name(term.fn)}, {_describe(options)}) "
                                       f"produced NaN/inf in {', '.join(bad)}")
        return state, None

    def _check_needs(self, given: dict[str, Tensor | None]) -> None:
        for term, options in self.terms:
            missing = [name for name in term.needs if given.get(name) is None]
            if missing and term.active(options):
                shape = "[B]" if missing[0] == "truncated" else "[B,T]"
                raise ValueError(f"{missing[0]}: expected a {shape} tensor when loss term {term.name!r} is on "
                                 f"({_describe(options)}), got None")


def _replaced_flat_terms(pairs: list[tuple[LossTerm, Any]]) -> set[str]:
    """Flat terms replaced by a chosen term of their ``EXCLUSIVE_STAGES`` stage; two chosen terms
    of one such stage are refused, naming both."""
    replaced = set()
    for stage in EXCLUSIVE_STAGES:
        mine = [term.name for term, _ in pairs if term.stage == stage and not term.flat]
        if len(mine) > 1:
            raise ValueError(f"terms: loss terms {mine[0]!r} and {mine[1]!r} are both {stage} terms and cannot "
                             f"combine (each computes the loss's whole {stage}); choose one")
        if mine:
            replaced |= {term.name for term, _ in pairs if term.stage == stage and term.flat}
    return replaced


def _describe(options: Any) -> str:
    return ", ".join(f"{f.name}={getattr(options, f.name)!r}" for f in dataclasses.fields(options)) or "defaults"


def _common_dtype(*tensors) -> torch.dtype:
    """Mixed float dtypes are computed in the widest one (never below float32)."""
    dtype = torch.float32
    for x in tensors:
        if isinstance(x, Tensor) and x.is_floating_point():
            dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def _as_float(name: str, x: object, like: Tensor, dtype: torch.dtype, live: bool) -> Tensor:
    """Shape-checked [B,T] input in ``dtype``; detached unless ``live`` (``logp``, and the entropy
    of an entropy bonus). NaN is checked lazily: see ``_explain_non_finite``."""
    x = check_tensor(name, x, floating=True)
    check_same_shape("logp", like, name, x)
    return x.to(dtype) if live else x.detach().to(dtype)


@torch.no_grad()
def _advantages(advantages: Tensor, like: Tensor, valid: Tensor, valid_f: Tensor,
                row_tokens: Tensor) -> tuple[Tensor, Tensor]:
    """(advantages [B,1] or [B,T] in ``like``'s dtype, 0 where nothing is valid; the validated
    [B,T] view for error messages)."""
    token_adv = token_advantages(advantages, like)
    if advantages.dim() == 1:                                             # [B,1]: no [B,T] passes
        return torch.where(row_tokens > 0, advantages.detach().to(like.dtype), 0.0)[:, None], token_adv
    return zero_off_mask(advantages.detach().to(like.dtype), valid, valid_f), token_adv


def _initial_state(data: dict[str, Tensor | None], advantages: Tensor, valid: Tensor
                   ) -> tuple[LossState, Tensor, dict[str, Tensor]]:
    """The state every term starts from: inputs zeroed off the mask, keep = valid, the
    metrics every loss reports (``adv_abs_mean``) and the defaults of the others (0); the
    log-prob inputs' largest valid values still to be read (``_zeroed_log_probs``)."""
    logp = data["logp"]
    valid_f = valid.to(logp.dtype)
    row_tokens = valid_f.sum(dim=1)
    n_tokens = row_tokens.sum()
    adv, token_adv = _advantages(advantages, logp, valid, valid_f, row_tokens)
    with torch.no_grad():
        adv_abs_sum = (adv.abs() * (row_tokens[:, None] if adv.shape[1] == 1 else valid_f)).sum()
    zeroed, highest = _zeroed_log_probs(data, valid, valid_f)
    zeroed.update({name: None if x is None else zero_off_mask(x, valid, valid_f)
                   for name, x in data.items() if name not in LOG_PROBS})
    state = LossState(logp=zeroed["logp"], old_logp=zeroed["old_logp"], advantages=adv, valid=valid,
                      valid_f=valid_f, keep=valid, row_tokens=row_tokens, n_valid=n_tokens.clamp(min=1),
                      ref_logp=zeroed["ref_logp"], rollout_logp=zeroed["rollout_logp"], entropy=zeroed["entropy"],
                      metrics={})
    return state.with_metrics(adv_abs_mean=(adv_abs_sum, n_tokens)), token_adv, highest


def _zeroed_log_probs(data: dict[str, Tensor | None], valid: Tensor, valid_f: Tensor
                      ) -> tuple[dict[str, Tensor | None], dict[str, Tensor]]:
    """The log-prob inputs zeroed off the mask, and those whose largest valid value must still be
    compared with ``LOGP_TOLERANCE`` (0-d tensors, read with the metrics in ``_finish``: no host sync
    of their own). On CPU one ``aminmax`` per input (one pass, one read, as the finiteness check of
    ``zero_off_mask`` costs) settles both the finiteness and, in the usual case, the bound; an input
    above the bound is checked on its valid tokens at once (before any work)."""
    zeroed, highest = {}, {}
    for name in LOG_PROBS:
        x = data[name]
        if x is None:
            zeroed[name] = None
            continue
        if x.device.type == "cpu":
            low, high = torch.aminmax(x.detach())
            if bool(torch.isfinite(low) & (high <= LOGP_TOLERANCE)):      # the usual case: one read
                zeroed[name] = x * valid_f
                continue
            finite = bool(torch.isfinite(low) & torch.isfinite(high))      # rare: above the bound, or NaN/inf
            zeroed[name] = x * valid_f if finite else torch.where(valid, x, 0.0)
            _check_log_probs(name, float(zeroed[name].detach().amax()))
            if not finite:
                _check_no_minus_inf(name, zeroed[name].detach())
        else:                                  # a where, and the bounds read later with the metrics
            zeroed[name] = torch.where(valid, x, 0.0)
            lowest, highest[name] = torch.aminmax(zeroed[name].detach())  # one pass for both bounds
            highest[f"-{name}"] = -lowest                               # -inf read as +inf: refused
    return zeroed, highest


def _check_log_probs(name: str, highest: float) -> None:
    """Refuse log-probabilities above 0 beyond rounding, +inf included (NaN passes here:
    ``_explain_non_finite`` names it, and a trainer skips such a step). ``-name``: the negated
    lowest value of an input whose -inf is refused (``_check_no_minus_inf``)."""
    if name.startswith("-"):
        if highest == math.inf:
            _refuse_minus_inf(name[1:])
        return
    if name == "entropy":        # an entropy is >= 0; below it (beyond rounding) STAPO would silence tokens on it
        if highest > LOGP_TOLERANCE:
            raise ValueError(f"entropy: expected token entropies >= 0 (up to {LOGP_TOLERANCE:g} of rounding) on the "
                             f"mask's tokens, got values down to {-highest:.4g}")
        return
    if highest > LOGP_TOLERANCE:
        raise ValueError(f"{name}: expected log-probabilities <= 0 (up to {LOGP_TOLERANCE:g} of rounding) on the "
                         f"mask's tokens, got values up to {highest:.4g} (logits or probabilities passed as "
                         f"log-probs?)")


def _check_no_minus_inf(name: str, x: Tensor) -> None:
    """Log-probs of sampled tokens: a probability of 0 (-inf) is not a distribution that sampled them (a
    ratio or KL of it is infinite, and clipping hides it); in ``logp``, the current policy's, the token would
    silently get no gradient (``token_stats`` never gives -inf: it clamps -inf logits)."""
    if bool(torch.isneginf(x).any()):
        _refuse_minus_inf(name)


def _refuse_minus_inf(name: str) -> None:
    raise ValueError(f"{name}: expected finite log-probabilities on the mask's tokens (the policy behind it "
                     f"sampled them, so their probability is > 0), got -inf (a masked or -inf logit?)")


def _data_weights(state: LossState, data: dict[str, Tensor | None]) -> Tensor | None:
    """The caller's surrogate weights, 0 off the mask; a negative one would flip a token's sign."""
    weights = data["weights"]
    if weights is None:
        return None
    weights = zero_off_mask(weights, state.valid, state.valid_f)
    if bool((weights < 0).any()):
        raise ValueError(f"weights: expected data weights >= 0 on the response tokens, got {int((weights < 0).sum())} "
                         f"negative, e.g. {weights[weights < 0][:4].tolist()}")
    return weights


def zero_off_mask(x: Tensor, valid: Tensor, valid_f: Tensor) -> Tensor:
    """x with 0 off ``valid`` (differentiable), inf/NaN padding included. On CPU, where a ``where``
    costs ~7x a multiply, a multiply by ``valid_f`` once a sum shows x is finite (the usual case);
    elsewhere a ``where`` (cheap there, while the check would wait for the device)."""
    if x.device.type == "cpu" and bool(torch.isfinite(x.detach().sum())):
        return x * valid_f
    return torch.where(valid, x, 0.0)


def gradient_where(keep: Tensor, x: Tensor) -> Tensor:
    """x, with gradient only where ``keep`` (x finite): x.detach() + (x − x.detach())·keep, the
    value of x exactly, ~5x cheaper on CPU than ``torch.where(keep, x, x.detach())``."""
    frozen = x.detach()
    return (x - frozen).mul_(keep.to(x.dtype)).add_(frozen)


def _surrogate_inputs(state: LossState) -> LossState:
    """After the "keep" stage: log π detached on dropped tokens, z = log π_θ − log π_old, and
    approx_kl = mean over valid tokens of k3(z), an estimate of KL(π_old‖π_θ)."""
    logp = state.logp if state.keep is state.valid else gradient_where(state.keep, state.logp)
    log_ratio = logp - state.old_logp
    with torch.no_grad():
        approx_kl = kl_estimate(log_ratio.detach(), "k3").sum(), state.n_tokens
    return dataclasses.replace(state, logp=logp, log_ratio=log_ratio).with_metrics(approx_kl=approx_kl)


def _finish(state: LossState, inputs: dict[str, Tensor | None], highest: dict[str, Tensor], locate
            ) -> tuple[Tensor, LossMetrics]:
    """(loss, metrics as floats): one device→host copy, which also brings the log-prob inputs'
    largest valid values still to be checked; a non-finite result names its input, or else the
    term that produced it (``locate()``)."""
    with torch.no_grad():
        state = state.with_metrics(kept_frac=(state.keep.sum(), state.n_tokens))
        metrics, counts = state.metrics, state.metric_counts
        values = [*metrics.values(), *counts.values(), state.loss.detach(), *highest.values()]
        floats = torch.stack([torch.as_tensor(v, device=state.valid.device).to(torch.float64).reshape(())
                              for v in values]).tolist()
    read = len(metrics) + len(counts)
    result = LossMetrics(zip(metrics, floats), counts=dict(zip(counts, floats[len(metrics):read])))
    for name, value in zip(highest, floats[read + 1:]):
        _check_log_probs(name, value)
    if not all(math.isfinite(v) for v in floats):
        _explain_non_finite(inputs, state.valid, result, locate)
    return state.loss, result


def _explain_non_finite(inputs: dict[str, Tensor | None], valid: Tensor, metrics: dict, locate) -> None:
    """Called only when the loss or a metric came out non-finite: name the culprit input, or else the
    first loss term whose output is not finite."""
    for name, x in inputs.items():
        if x is not None:
            check_finite(name, torch.where(valid, x.detach(), 0.0))
    culprit = locate()
    if culprit:
        err = NonFiniteError(f"policy_loss: {culprit} from finite inputs; metrics {metrics}")
        err.term = culprit                # what a trainer reports when it stops (it skips such steps)
        raise err
    raise NonFiniteError(f"policy_loss: non-finite result from finite inputs (values too large?): {metrics}")


def _non_finite_fields(state: LossState) -> list[str]:
    """The state's tensors (0 off the mask by contract) and metrics holding NaN/inf."""
    tensors = {name: getattr(state, name) for name in ("log_ratio", "weight", "advantages", "token_loss", "loss")}
    tensors.update({f"metrics[{k!r}]": v for k, v in state.metrics.items()})
    return [name for name, x in tensors.items()
            if isinstance(x, Tensor) and x.is_floating_point() and not bool(torch.isfinite(x).all())]

"""``compute_advantages``: validate once, build an ``AdvantageBatch``, run a registered estimator.

Output contract for every estimator (built-in or registered by a third party): float32 [B,T]
on the input device, exactly 0 where ``mask == 0``; a sequence-level [B] result is broadcast
to the response's valid tokens.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import torch
from torch import Tensor

from creditrl.utils.imports import PluginError, is_builtin, plugin_name
from creditrl.utils.validate import (ENERGY_TOLERANCE, FLOAT32_MAX, INF_FLOAT32_BITS, FusedChecks, bad_rows,
                                    check_finite, check_range, check_mask, check_mask_dtype, check_tensor, float32_bits,
                                    integer_mask_copy, integer_mask_verdict, mask_stats, mask_verdict,
                                    non_negative_range_and_rule)

# The fused passes compile on their first use in a process (seconds: 5.9 s on the dev CPU with a warm
# inductor cache, 15 s cold, where nothing else had compiled) and save ~1.5 ms a call at 4M elements:
# below 2^20 elements (~0.5 ms of rule) a float32 mask is checked eagerly, so interactive and test-sized
# calls never compile
FUSED_RULE_MIN_ELEMENTS = 1 << 20
from creditrl.core.estimators.registry import (AdvantageBatch, EstimatorSpec, KRange, get_estimator, list_estimators,
                                               register_estimator)
from creditrl.core.estimators.steps import returns_to_go
from creditrl.core.groups import GroupIndex

__all__ = ["compute_advantages", "list_estimators", "register_estimator", "AdvantageBatch", "EstimatorSpec", "KRange",
           "build_batch", "with_energy", "prepare", "estimate", "estimator_output", "estimator_result", "returns_to_go",
           "check_group_size", "check_total"]


def _real(name: str, x: Tensor) -> Tensor:
    if x.is_complex():
        raise TypeError(f"{name}: expected a real (float, int or bool) tensor, got dtype {x.dtype}")
    return x


def _token_tensor(name: str, x: object, mask: Tensor) -> Tensor:
    """A [B,T] non-negative float input (energy, is_weights) as float32 (checked by ``build_batch``)."""
    check_tensor(name, x, shape=list(mask.shape), floating=True)
    return x.to(torch.float32)


def _non_negative_stats(x: Tensor) -> Tensor:
    """min, max of the float32 bit patterns of ``x``: in [0, INF_FLOAT32_BITS) iff every value is
    finite and >= +0.0 (``float32_bits``). One integer pass, no copy."""
    return torch.stack(torch.aminmax(float32_bits(x))) if x.numel() else torch.zeros(2, dtype=torch.int32)


def _valid_non_negative(name: str, x: Tensor, mask: Tensor, original: torch.dtype) -> Tensor:
    """``x`` checked on the valid tokens only, with 0 on masked ones: finite and >= 0 (values
    below -ENERGY_TOLERANCE * eps(``original``) raise, as they are not rounding; the rest are
    clamped at 0). The exact path, taken when the one-pass test fails."""
    tolerance = ENERGY_TOLERANCE * torch.finfo(original).eps
    x = torch.where(mask.bool(), x, 0.0)
    check_finite(name, x)
    low = float(x.min())
    if low < -tolerance:
        raise ValueError(f"{name}: expected values >= 0, got {low:.3g} in rows {bad_rows(x < -tolerance)}")
    return x.clamp_(min=0)


def _exact_totals(totals: Tensor, token_rewards: Tensor | None) -> Tensor:
    """[B] float32 rewards R whose float32 sum was not finite: raises naming the rows with NaN/inf
    (in ``token_rewards`` [B,T] where given, else in ``totals``); else returns R as it is where every
    row's R is finite (only their sum overflowed), and otherwise the token rewards summed again in
    float64 (a float32 overflow of a row's finite values)."""
    check_finite("rewards", totals if token_rewards is None else token_rewards)
    if token_rewards is None or bool(torch.isfinite(totals).all()):
        return totals
    totals = token_rewards.to(torch.float64).sum(1)
    if not bool(torch.isfinite(totals.float()).all()):
        raise ValueError("rewards: row sums exceed the float32 range in rows "
                         f"{bad_rows(~torch.isfinite(totals.float()))}")
    return totals.float()


def _check_device(device: torch.device, **tensors: Tensor | None) -> None:
    for name, x in tensors.items():
        if x is not None and check_tensor(name, x).device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (the mask's device), got {x.device}")


def _components(components: Tensor | None, weights: object, num: int,
                device: torch.device) -> tuple[Tensor | None, Tensor | None]:
    """Reward components [B,K] (NaN = no reward from that term; ±inf refused) and their weights
    [K] (finite; ones when None) as float64."""
    if components is None:
        if weights is not None:
            raise ValueError("component_weights: given without components; pass components [B,K] too")
        return None, None
    check_tensor("components", components, ndim=2)
    _real("components", components)
    check_tensor("components", components, shape=[num, None])
    _check_device(device, components=components)
    components = components.to(torch.float64)
    infinite = torch.isinf(components)
    if bool(infinite.any()):
        raise ValueError(f"components: expected finite values or NaN (no reward from that term), got inf in rows "
                         f"{bad_rows(infinite)}")
    count = components.shape[1]
    try:
        weights = torch.ones(count, dtype=torch.float64, device=device) if weights is None else \
            torch.as_tensor(weights, dtype=torch.float64, device=device)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"component_weights: expected {count} real numbers (a sequence or a tensor), got "
                         f"{weights!r}") from None
    check_tensor("component_weights", weights, shape=[count])
    check_finite("component_weights", weights)
    return components, weights


def build_batch(*, rewards: Tensor, mask: Tensor, group: Tensor, energy: Tensor | None = None,
                is_weights: Tensor | None = None, gamma: float = 1.0, components: Tensor | None = None,
                component_weights: object = None, defer_mask_check: bool = False) -> AdvantageBatch:
    """Validate raw inputs and build the ``AdvantageBatch`` every estimator consumes.

    rewards [B] (outcome) or [B,T] (per token; a reward on a masked token counts at the row's nearest
    preceding valid token, and in the row total R); mask [B,T]; group [B] int ids; energy, is_weights [B,T]
    floats (is_weights multiply energies by rho_bar^2, OTB App. D eq. 58-60); components [B,K] each reward
    term's values (NaN where a term gave none) with component_weights [K] (sequence or tensor; ones by
    default). Returns-to-go (computed only if an estimator reads them) use ``gamma`` over valid tokens;
    [B] rewards with ``gamma`` < 1 are discounted from each row's last valid token, where the outcome
    arrives (G_t = γ^(L-1-t)·R, as token rewards with R on that token give). Inputs are read detached.

    Shapes, dtypes and devices are checked first. Every value check is then one reduction pass per tensor,
    all read back in one host read (``FusedChecks``): the mask's 0/1 rule (``mask_stats``; an integer mask
    is replaced by its float32 copy, checked on the copy's bits, ``integer_mask_copy``; a float32 mask of
    >= ``FUSED_RULE_MIN_ELEMENTS`` on a CPU in another pass over it: with energies, the energies' check,
    ``non_negative_range_and_rule``; without, and with ``defer_mask_check`` (built-in estimators, whose
    every use of the mask is tested), its first use, in a second read: see ``AdvantageBatch``), finite
    rewards (a non-finite value makes its row's sum R and the sum of R non-finite: token rewards cost the
    one sum R needs), energies and IS weights finite and >= 0 (one integer min/max pass). Only a failing
    test takes an exact, slower pass, to name the rows or to accept what the fast test cannot tell (masked
    garbage, -0.0, rounding just below 0, a float32 overflow of the row sums).
    """
    mask = check_tensor("mask", mask, ndim=2)
    check_mask_dtype("mask", mask)
    num, steps_t = mask.shape
    check_tensor("rewards", rewards, ndim=(1, 2))
    mask, rewards, energy, is_weights, components = _as_data(mask, rewards, energy, is_weights, components)
    _real("rewards", rewards)
    check_tensor("rewards", rewards, shape=[num, steps_t] if rewards.dim() == 2 else [num])
    check_tensor("group", group, shape=[num], integer=True)
    _check_device(mask.device, rewards=rewards, group=group, energy=energy, is_weights=is_weights)
    check_range("gamma", gamma, 0.0, 1.0)
    components, component_weights = _components(components, component_weights, num, mask.device)
    token_rewards = rewards.to(torch.float32) if rewards.dim() == 2 else None
    seq_rewards = rewards.to(torch.float32) if token_rewards is None else token_rewards.sum(1)
    checks = FusedChecks()
    # On a CPU a large float32 mask's rule runs inside another pass over it: with energies, the energies'
    # check (one compiled read of both); without, it waits for the mask's first use (AdvantageBatch.given_mask),
    # where a broadcast runs it in the pass it writes. Not on a GPU: there the pass costs microseconds, and a
    # second host read a sync
    large = mask.device.type == "cpu" and mask.dtype == torch.float32 and mask.numel() >= FUSED_RULE_MIN_ELEMENTS
    energy_of, rule = _queue_energy_checks(checks, mask, energy, is_weights, with_mask_rule=large and energy is not None)
    given = mask
    pending = defer_mask_check and large and energy is None and is_weights is None
    mask = _queue_mask_check(checks, given, rule, pending)
    finite = checks.add(seq_rewards.sum(), lambda values: math.isfinite(values[0]))
    results = checks.run()                       # the one host read; a bad mask raises here
    if not results[finite]:      # a NaN/inf, or a float32 overflow of finite rewards: the exact pass decides
        if pending:                              # a bad mask's error before the rewards', as when checked here
            check_mask("mask", mask)
            pending = False
        seq_rewards = _exact_totals(seq_rewards, token_rewards)
    return AdvantageBatch(rewards=seq_rewards, input_mask=mask, groups=GroupIndex.from_ids(group),
                          raw_energy=energy_of(results, mask), token_rewards=token_rewards, gamma=float(gamma),
                          components=components, component_weights=component_weights, mask_copy=mask is not given,
                          mask_pending=pending)


def _as_data(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """Advantages are data (no gradient flows through a baseline, as in verl and TRL): inputs that carry
    gradients are read detached."""
    return tuple(x.detach() if isinstance(x, Tensor) else x for x in tensors)


def _queue_mask_check(checks: FusedChecks, mask: Tensor, rule: Tensor | None, pending: bool) -> Tensor:
    """Queue the mask's 0/1 check: its statistics from ``rule`` (the energies' pass) where given, none
    while ``pending`` (``AdvantageBatch.given_mask``), else its own pass. Returns the mask the
    estimators read: an integer mask's float32 copy (checked in one pass over it), else the mask."""
    if mask.dtype != torch.bool and not mask.is_floating_point():   # verl passes int64
        copy, stats = integer_mask_copy(mask)
        verdict = functools.partial(integer_mask_verdict, "mask", mask)
    else:
        copy, stats = mask, rule if rule is not None else None if pending else mask_stats(mask)
        verdict = functools.partial(mask_verdict, "mask", mask)
    if stats is not None:
        checks.add(stats, verdict)
    return copy


def with_energy(batch: AdvantageBatch, energy: Tensor, is_weights: Tensor | None = None, *,
                checked: bool = False) -> AdvantageBatch:
    """``batch`` with energies [B,T] (times is_weights² when given), checked as ``build_batch`` checks
    them (one pass each, one host read): for callers that derive the energies once the mask is
    checked (verl's plug-in tests the actor's stats against the mask's float32 copy). ``checked``:
    ``energy`` is float32 and already known finite and >= 0 on every token, masked ones too (as
    ``checked_energy_from_logp`` returns it), so its pass is skipped; ``is_weights`` are still checked."""
    mask = batch.given_mask
    _check_device(mask.device, energy=energy, is_weights=is_weights)
    if checked and energy.dtype != torch.float32:     # its shape is checked below, as an unchecked one's
        raise ValueError(f"energy: with checked=True expected float32 energies (checked by the caller), "
                         f"got {energy.dtype}")
    checks = FusedChecks()
    energy_of, _ = _queue_energy_checks(checks, mask, energy, is_weights, trusted=("energy",) if checked else ())
    out = dataclasses.replace(batch, raw_energy=energy_of(checks.run(), mask))
    # views already derived from the mask (e.g. ``valid``) carry over; only ``energy`` depends on the energies
    out.__dict__.update({key: value for key, value in batch.__dict__.items() if key != "energy" and
                         isinstance(getattr(type(batch), key, None), functools.cached_property)})
    return out


def _queue_energy_checks(checks: FusedChecks, mask: Tensor, energy: Tensor | None, is_weights: Tensor | None,
                         with_mask_rule: bool = False, trusted: tuple[str, ...] = ()
                         ) -> tuple[Callable[[list, Tensor], Tensor | None], Tensor | None]:
    """Queue the checks of energy and is_weights [B,T] (finite and >= 0: one integer min/max pass
    each, shapes checked now; none for the names in ``trusted``, checked by the caller); returns
    ``energy_of(results, mask)``, the checked float32 energies (times is_weights², None without
    energies) once ``checks`` have run, and, ``with_mask_rule`` (a float32 mask, energies given),
    the mask's 0/1 statistics from the energy's pass (``non_negative_range_and_rule``; the caller
    queues their verdict), else None."""
    inputs = {name: _token_tensor(name, x, mask) for name, x in (("energy", energy), ("is_weights", is_weights))
              if x is not None}
    originals = {"energy": getattr(energy, "dtype", None), "is_weights": getattr(is_weights, "dtype", None)}
    good, rule = {}, None
    for name, x in inputs.items():
        if name in trusted:
            continue
        if name == "energy" and with_mask_rule:
            stats = non_negative_range_and_rule(x, mask)
            good[name], rule = checks.add(stats[:2], lambda v: v[0] >= 0 and v[1] < math.inf), stats[2:]
        else:
            good[name] = checks.add(_non_negative_stats(x), lambda v: v[0] >= 0 and v[1] < INF_FLOAT32_BITS)

    def energy_of(results: list, checked_mask: Tensor) -> Tensor | None:
        checked = {name: x if name in trusted or results[good[name]] else
                   _valid_non_negative(name, x, checked_mask, originals[name])
                   for name, x in inputs.items()}
        out = checked.get("energy")
        if out is not None and "is_weights" in checked:  # masked tokens are zeroed where an estimator reads them
            out = out * checked["is_weights"].square()
        return out
    return energy_of, rule


def compute_advantages(name: str, *, rewards: Tensor, mask: Tensor, group: Tensor,
                       energy: Tensor | None = None, is_weights: Tensor | None = None,
                       components: Tensor | None = None, component_weights: object = None, **options) -> Tensor:
    """Advantages [B,T] float32 from the estimator ``name`` (see ``list_estimators()``).

    rewards: [B] outcome reward, or [B,T] token rewards (returns-to-go with option ``gamma``,
    default 1; a [B] reward arrives at the row's last valid token, G_t = γ^(L-1-t)·R), read as
    float32 (a float64 reward is rounded: differences below float32's spacing at the rewards'
    magnitude, e.g. 1 around 1e8, are lost; the group statistics then run in float64).
    Sequence-level estimators use each row's total R = sum_t r_t; for token-level returns a reward
    on a masked token counts at the row's nearest preceding valid token.
    mask: [B,T] bool/0-1. group: [B] int ids (any order, any sizes). energy: [B,T] w_t from
    ``token_stats`` (needed by ``ogb``, ``otb``, ``otb_isolated``); is_weights: [B,T] truncated
    IS weights rho_bar_t, which weight those energies (w = rho_bar^2 w): the other estimators
    ignore both (their shape and values are still checked). components: [B,K] each reward term's
    own values (NaN where a term gave none) and component_weights [K] their weights in the total
    (ones by default), read by ``gdpo`` (which needs rewards = their weighted sum,
    ``check_total``); others ignore them (their shape and values are still checked). Estimator
    options (``k``, ``eps``, ``normalize``) are keywords.
    Output: float32 [B,T] on the mask's device, exactly 0 where mask == 0, without autograd history
    (advantages are data: inputs that carry gradients are read detached).
    An empty batch (B = 0 or T = 0) gives float32 zeros [B,T].

    Statistics are over the rows passed. A row with no valid token gets advantages 0; its reward
    still enters its group's statistics where the baseline is a plain statistic of the group's
    rewards (grpo, dr_grpo, rloo, maxrl, the max@K estimators, gdpo, shrinkage,
    reinforce_plus_plus_baseline's centring), as TRL and verl compute them (a truncated completion
    masked out of the loss is still scored), and weighs 0 where rows are weighted by valid tokens or
    energy (opo, ogb, otb, otb_isolated, the REINFORCE++ whitening). Leave rows out of the call to
    leave them out of the statistics, e.g. groups filtered by dynamic sampling (CreditGRPOTrainer
    and the trainer do): a batch-level statistic (grpo's ``scale="batch"``, shrinkage, gdpo) reads
    every row given.
    """
    out, batch = _estimator_output(name, True, rewards=rewards, mask=mask, group=group, energy=energy,
                                   is_weights=is_weights, components=components, component_weights=component_weights,
                                   **options)
    return batch.on_tokens(out, last_use=True)       # checks a deferred mask in the pass it writes


def estimator_output(name: str, *, rewards: Tensor, mask: Tensor, group: Tensor,
                     energy: Tensor | None = None, is_weights: Tensor | None = None,
                     components: Tensor | None = None, component_weights: object = None,
                     **options) -> tuple[Tensor, AdvantageBatch]:
    """``compute_advantages`` before the broadcast: the estimator's checked result (``estimator_result``:
    [B] for a sequence-level one, else [B,T]) and the batch it ran on, for callers that use the
    per-row values (e.g. a plug-in's metrics from [B] values and ``batch.lengths``)."""
    return _estimator_output(name, False, rewards=rewards, mask=mask, group=group, energy=energy,
                             is_weights=is_weights, components=components, component_weights=component_weights,
                             **options)


def _estimator_output(name: str, defer_mask_check: bool, *, rewards: Tensor, mask: Tensor, group: Tensor,
                      energy: Tensor | None = None, is_weights: Tensor | None = None,
                      components: Tensor | None = None, component_weights: object = None,
                      **options) -> tuple[Tensor, AdvantageBatch]:
    """``estimator_output``; with ``defer_mask_check`` (the caller broadcasts the result with
    ``batch.on_tokens``), a built-in estimator's float32 mask may be checked in that pass."""
    spec = get_estimator(name)
    options = spec.resolve_options(options)          # before any work: unknown or mistyped options
    batch = prepare(name, rewards=rewards, mask=mask, group=group, energy=energy, is_weights=is_weights,
                    gamma=options.pop("gamma", 1.0), components=components, component_weights=component_weights,
                    defer_mask_check=defer_mask_check and is_builtin(spec.fn))
    if batch.components is not None and spec.reward_components:
        batch.mask_error_first(check_total, batch, spec.name)
    options.pop("gamma", None)                        # already in the batch
    return _result(name, spec, batch, options), batch



def check_total(batch: AdvantageBatch, name: str = "gdpo") -> None:
    """Raise ValueError unless each row's reward R is the weighted sum of its components: R_i =
    Σ_k w_k C_ik over the terms that gave a reward (NaN = none; the reward pipeline's and TRL's
    nansum), within float32 rounding. Rows where no term gave a reward are not compared (their R
    is a stand-in: 0 in ``creditrl train``, the group mean in TRL's plug-in), nor rows whose sum
    float32 cannot hold.

    The tolerance is the rounding of that sum in float32: K products and K - 1 additions, each
    within u = eps32/2 of the exact value relative to Σ_k |w_k C_ik| (Higham §4.2), so (K + 1)·eps32
    of it (plus (K + 1)·2^-149, float32's absolute rounding floor among subnormals); token rewards
    [B,T] add their own float32 row sum, T·eps32·Σ_t |r_t|. The sum is taken in float64, whose
    rounding is 2^29 times smaller.

    ``compute_advantages`` checks it for an estimator ``name`` that reads the components and not R
    (``reward_components``: gdpo; a wrong R would be ignored silently); verl's plug-in calls ``prepare``/``estimate`` without it, because verl's own
    gdpo reads ``algorithm.gdpo_reward_keys`` as the components and the score need not be their sum."""
    components, weights = batch.components, batch.component_weights
    terms = components * weights                                     # [B,K] float64, NaN = no reward
    given = ~torch.isnan(terms)
    total = torch.where(given, terms, 0.0).sum(1)
    scale = torch.where(given, terms.abs(), 0.0).sum(1)
    # and each rounding's absolute floor in float32's subnormal range, half its spacing 2^-149
    tolerance = (components.shape[1] + 1) * (torch.finfo(torch.float32).eps * scale + 2.0 ** -149)
    if batch.token_rewards is not None:
        tolerance = tolerance + batch.token_rewards.shape[1] * torch.finfo(torch.float32).eps * \
            batch.token_rewards.abs().to(torch.float64).sum(1)
    compared = given.any(1) & (total.abs() <= FLOAT32_MAX)
    off = compared & ((batch.rewards.to(torch.float64) - total).abs() > tolerance)
    if bool(off.any()):
        row = int(torch.nonzero(off)[0, 0])
        raise ValueError(
            f"rewards: expected each row's reward to be the weighted sum of its components (Σ_k w_k C_k over the "
            f"terms that gave a reward; {name} reads components, not rewards), but {int(off.sum())} row(s) differ, "
            f"e.g. row {row}: rewards {float(batch.rewards[row]):.9g}, components·weights {float(total[row]):.9g}; "
            f"pass rewards=nansum(components * component_weights)")


def prepare(name: str, *, rewards: Tensor, mask: Tensor, group: Tensor, energy: Tensor | None = None,
            is_weights: Tensor | None = None, gamma: float = 1.0, components: Tensor | None = None,
            component_weights: object = None, defer_mask_check: bool = False) -> AdvantageBatch:
    """``build_batch`` after checking that estimator ``name`` gets the energies it needs."""
    if get_estimator(name).needs_energy and energy is None:
        raise ValueError(f"energy: estimator {name!r} needs per-token energies [B,T] "
                         "(creditrl.token_stats(...).energy), got None")
    return build_batch(rewards=rewards, mask=mask, group=group, energy=energy, is_weights=is_weights,
                       gamma=gamma, components=components, component_weights=component_weights,
                       defer_mask_check=defer_mask_check)


def estimate(name: str, batch: AdvantageBatch, **options) -> Tensor:
    """Run estimator ``name`` on a built batch and apply the output contract (``compute_advantages``)."""
    return batch.on_tokens(estimator_result(name, batch, **options))


def estimator_result(name: str, batch: AdvantageBatch, **options) -> Tensor:
    """Estimator ``name``'s own result on a built batch, checked: float32 [B], finite (one value
    per row, before the broadcast), or float32 [B,T], finite on valid tokens and exactly 0 where
    mask == 0. An empty batch gives float32 zeros [B,T]."""
    spec = get_estimator(name)
    options = spec.resolve_options(options)
    options.pop("gamma", None)                    # already in the batch
    return _result(name, spec, batch, options)


def _result(name: str, spec: EstimatorSpec, batch: AdvantageBatch, options: dict) -> Tensor:
    """``estimator_result`` with ``options`` resolved (``gamma`` taken out)."""
    shape = batch.input_mask.shape                # not given_mask: its check may wait for the broadcast
    if batch.input_mask.numel() == 0:             # B = 0 or T = 0: no token has an advantage
        return torch.zeros(shape, dtype=torch.float32, device=batch.input_mask.device)
    return batch.mask_error_first(_checked_result, name, spec, batch, options)


def _checked_result(name: str, spec: EstimatorSpec, batch: AdvantageBatch, options: dict) -> Tensor:
    """``estimator_result`` on a non-empty batch, with ``options`` resolved."""
    shape = batch.input_mask.shape
    if spec.k_range is not None:
        spec.k_range.check(spec.name, batch.groups, options["k"])
    try:
        out = spec.fn(batch, **options)
    except ValueError:                            # bad input, named by the estimator (the library's contract)
        raise
    except Exception as err:
        if is_builtin(spec.fn):
            raise
        raise PluginError(f"estimator {name!r} ({plugin_name(spec.fn)}) raised {type(err).__name__}: {err}") from err
    if not isinstance(out, Tensor) or tuple(out.shape) not in {tuple(shape[:1]), tuple(shape)}:
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"estimator {name!r} returned {got}; expected shape [B] or [B,T] = "
                         f"{list(shape)}")
    out = out.to(device=batch.input_mask.device, dtype=torch.float32)
    # One reduction pass for every estimator, masked_output ones included: a NaN/inf makes the
    # sum non-finite. Only a failing test takes the exact pass (a float32 overflow of a sum of
    # finite values, or non-finite values on masked tokens, which are replaced by 0).
    if not math.isfinite(out.sum().item()):
        return _finite_on_valid_tokens(name, out, batch)
    if out.dim() == 1 or spec.masked_output:
        return out                                # [B], or [B,T] already exactly 0 on masked tokens
    return out * batch.valid                      # exactly 0 on masked tokens


def _finite_on_valid_tokens(name: str, out: Tensor, batch: AdvantageBatch) -> Tensor:
    """The exact check of an estimator's float32 output [B] or [B,T]: raise naming the rows with a
    NaN/inf advantage on a valid token (any row of a [B] result); return ``out`` with 0 on masked
    tokens otherwise."""
    bad = ~torch.isfinite(out)
    if out.dim() == 2:
        bad &= batch.mask
    if bool(bad.any()):
        # every input was checked finite: a built-in's NaN/inf is a float32 overflow of its sums
        cause = (" from finite inputs: a sum beyond float32's range (about 3.4e38); rescale the rewards or energies"
                 if is_builtin(get_estimator(name).fn) else "")
        raise ValueError(f"estimator {name!r} returned non-finite advantages in rows {bad_rows(bad)}{cause}")
    return torch.where(batch.mask, out, 0.0) if out.dim() == 2 else out


def check_group_size(name: str, options: dict, group_size: int, key: str = "group_size") -> bool:
    """Raise ValueError (naming ``key``) unless estimator ``name`` with ``options`` accepts groups of
    ``group_size`` responses: its declared K range first, then one dummy group of that size, so any
    option/size combination it rejects fails before training instead of at the first batch. Returns
    whether groups of one get a nonzero advantage (False: such groups learn nothing), probed on two
    singleton groups with different rewards, so a batch-level estimator (``reinforce_plus_plus``)
    that compares responses across prompts counts as learning."""
    spec = get_estimator(name)
    k = options.get("k")
    if spec.k_range is not None and isinstance(k, int) and not isinstance(k, bool) and \
            not spec.k_range.allows(k, group_size):
        raise ValueError(f"k: {spec.name} needs {spec.k_range.text(key)} (={group_size}), got k={k}")
    try:
        compute_advantages(name, rewards=(torch.arange(group_size) % 2).float(), mask=torch.ones(group_size, 2),
                           group=torch.zeros(group_size, dtype=torch.long), energy=torch.ones(group_size, 2),
                           **options)
        alone = compute_advantages(name, rewards=torch.tensor([0.0, 1.0]), mask=torch.ones(2, 2),
                                   group=torch.arange(2), energy=torch.ones(2, 2), **options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{key}={group_size} with estimator {name!r} and options {options}: {err}") from None
    return bool(alone.abs().sum() > 0)

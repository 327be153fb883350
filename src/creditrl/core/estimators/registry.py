"""The estimator registry and ``compute_advantages``, the one entry point to all estimators.

An estimator is a pure function ``fn(batch: AdvantageBatch, **options) -> Tensor`` returning
either a sequence-level advantage [B] (broadcast to the response's valid tokens) or a
token-level advantage [B, T]. ``compute_advantages`` validates the raw inputs once, builds
the ``AdvantageBatch`` and applies the output contract (float32, exactly 0 where mask == 0),
so estimators contain only their formula. Third parties add one with ``@register_estimator``.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Protocol

import torch
from torch import Tensor

from creditrl.core.estimators.steps import StepIndex, outcome_returns, returns_to_go, rewards_off_last_token
from creditrl.core.groups import GroupIndex
from creditrl.utils.fused import fused
from creditrl.utils.imports import import_submodules, is_builtin, plugin_name, registered_entry
from creditrl.utils.options import OptionSpec, build, doc_summary, options_of
from creditrl.utils.validate import (bool_row_counts, check_mask, float_mask, mask_verdict,
                                    row_sums_with_rule, times_mask_with_rule)


def _times_mask_pair(first: Tensor, second: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    return first[:, None] * mask, second[:, None] * mask


_times_mask_pair_fused = fused(_times_mask_pair)


@dataclass(frozen=True)
class AdvantageBatch:
    """Validated estimator inputs on the input device. Derived views are computed on first use,
    so a sequence-level estimator never pays for returns-to-go or the compacted step view.

    rewards:       [B]    float32 sequence reward R (Σ_t r_t over every token for token rewards)
    input_mask:    [B,T]  the mask as the caller gave it (bool or floats), or an integer mask's checked
                          float32 copy (then ``mask_copy`` is True: creditrl's own tensor). Read
                          ``given_mask`` instead: while ``mask_pending``, a float32 mask's 0/1 rule has
                          not run yet
    groups:        GroupIndex of the group ids
    raw_energy:    [B,T]  float32 ŵ_t (×ρ̄_t² when is_weights were given, OTB App. D eq. 58-60),
                          finite and >= 0, but not necessarily 0 on masked tokens (no copy of
                          the caller's tensor); None when not given
    token_rewards: [B,T]  float32 per-token rewards as given; None for [B] rewards (whose returns-to-go, with
                          gamma < 1, discount R from each row's last valid token)
    gamma:         discount of the returns-to-go
    components:    [B,K]  float64 reward components (one column per reward term, e.g. each of
                          ``task.options.rewards``; NaN where a term gave no reward), or None
    component_weights: [K] float64 each component's weight in the total reward (ones if not given)
    For a built-in estimator, a float32 mask of >= 2^20 elements on a CPU without energies is checked
    on first use (``mask_pending``; ``build_batch(defer_mask_check=True)`` decides): ``given_mask`` and
    every view derived from it run the 0/1 rule first, but two run it inside their own pass, the
    broadcast of a [B] result (``times_mask_with_rule``, without autograd; all a sequence-level
    estimator does with the mask) and ``lengths`` (``row_sums_with_rule``): 0.45 ms over that pass,
    where the rule alone takes 1.9 ms, at B = 1,024, T = 4,096 on the 2-core dev CPU. The rule's error
    comes before any advantage is returned, from whichever view comes first, and before another
    input's error found on the way (``check_pending_mask``), as when the mask is checked up front.
    Derived: ``given_mask`` the checked mask; ``valid`` [B,T] float32 1/0; ``lengths`` [B] int64 valid
    tokens per response; ``mask_bytes`` [B,T] uint8 0/1 (a bool mask only); ``mask`` [B,T] bool;
    ``energy`` [B,T] the energies with 0 where mask == 0;
    ``steps`` (StepIndex); ``returns`` [B,T] float32 returns-to-go
    G_t over valid steps (R on every valid token for [B] rewards with gamma = 1), 0 where mask == 0; a reward on
    a masked token counts at the row's nearest preceding valid token.
    """

    rewards: Tensor
    input_mask: Tensor
    groups: GroupIndex
    raw_energy: Tensor | None
    token_rewards: Tensor | None
    gamma: float = 1.0
    components: Tensor | None = None
    component_weights: Tensor | None = None
    mask_copy: bool = False
    mask_pending: bool = False

    @property
    def token_level(self) -> bool:
        return self.token_rewards is not None

    @cached_property
    def given_mask(self) -> Tensor:
        """The mask, its 0/1 rule run (here, one pass and a host read, where it is still pending)."""
        if self.mask_pending:
            check_mask("mask", self.input_mask)
        return self.input_mask

    @property
    def rule_pending(self) -> bool:
        """True while the mask's 0/1 rule has not run: a pass over ``input_mask`` may run it, then hand
        its statistics to ``accept_mask_stats`` (``times_mask_with_rule``'s, ``mask_stats``')."""
        return self.mask_pending and "given_mask" not in self.__dict__

    def check_pending_mask(self) -> None:
        """Run a pending mask's 0/1 rule now (one pass; raises on a bad mask). Called before another
        input's error is raised, so a bad mask's error comes first whether or not its check waited."""
        if self.rule_pending:
            self.given_mask

    def mask_error_first(self, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)``; where it raises, a pending mask's own error comes first (the one
        ``build_batch`` gives when it checks the mask up front): only the error path pays for the pass."""
        try:
            return fn(*args, **kwargs)
        except Exception as err:      # noqa: BLE001 (any failure: the bad mask is the first thing to report)
            failure = err
        self.check_pending_mask()
        raise failure

    def accept_mask_stats(self, stats: Tensor) -> None:
        """Read a pending mask's 0/1 statistics, computed in another pass over it: raise on a bad
        mask, else mark it checked (``given_mask`` then skips the rule)."""
        mask_verdict("mask", self.input_mask, stats.tolist())
        self.__dict__["given_mask"] = self.input_mask

    @cached_property
    def mask_bytes(self) -> Tensor:
        """A bool mask's bytes as uint8 0/1 [B,T] (``float_mask``'s clamp, which a bool viewed from
        other bytes needs): ``valid`` converts them and ``lengths`` counts them, one clamp for both."""
        return self.given_mask.view(torch.uint8).clamp(max=1)

    def _float_copy(self) -> Tensor:
        mask = self.given_mask
        return self.mask_bytes.to(torch.float32) if mask.dtype == torch.bool else float_mask(mask)

    @cached_property
    def valid(self) -> Tensor:
        return self._float_copy()

    @cached_property
    def lengths(self) -> Tensor:
        if self.rule_pending:                           # the sums and the rule from one read
            sums, stats = row_sums_with_rule(self.input_mask)
            self.accept_mask_stats(stats)
            return sums.long()
        mask = self.given_mask
        if mask.dtype == torch.bool:                    # an integer pass over the [B,T] bytes (SWAR)
            return bool_row_counts(self.mask_bytes.view(torch.bool))
        # float32/64 rows sum 0/1 exactly (no converted copy); 16-bit floats would round the count
        # (bf16: 4,099 ones sum to 4,096)
        exact = mask.dtype in (torch.float32, torch.float64)
        return (mask if exact else self.valid).sum(1).long()

    @cached_property
    def mask(self) -> Tensor:
        return self.given_mask.bool()

    @cached_property
    def energy(self) -> Tensor | None:
        return None if self.raw_energy is None else self.raw_energy * self.valid

    @cached_property
    def steps(self) -> StepIndex:
        lengths = self.lengths                           # first: it checks a pending mask in its own pass
        return StepIndex.from_mask(self.given_mask, self.valid, lengths)

    def broadcast(self, per_row: Tensor) -> Tensor:
        """[B] float32 -> [B,T] float32: the value on each row's valid tokens, exactly 0 elsewhere:
        finite values times the float32 mask (as given, or ``valid``: a bool mask's copy costs what
        a float32 times bool product costs, and leaves ``valid`` and ``lengths`` cheap; ``where``
        branches per token, 8x slower on a holey mask on a CPU). A float32 mask still to be checked
        is checked in the same pass."""
        if self.rule_pending and not (per_row.requires_grad or self.input_mask.requires_grad):
            out, stats = times_mask_with_rule(per_row, self.input_mask)   # compiled: no autograd graph
            self.accept_mask_stats(stats)
            return out
        mask = self.given_mask
        return per_row[:, None] * (mask if mask.dtype == torch.float32 else self.valid)

    @property
    def mask_is_callers_float32(self) -> bool:
        """Whether products read the caller's own float32 mask (not creditrl's float32 copy of it)."""
        return self.input_mask.dtype == torch.float32 and not self.mask_copy

    def broadcast_pair(self, first: Tensor, second: Tensor) -> tuple[Tensor, Tensor]:
        """Two [B] float32 -> ``broadcast`` of each, [B,T] float32 twice. Where the mask is the caller's
        float32 tensor (``mask_is_callers_float32``), already checked, both products come from one
        compiled read of it (a verl estimator's advantages and returns): at B = 1,024 on the 2-core
        dev CPU 2.9 against 3.4 ms at T = 4,096, 10.2 against 13.4 at T = 16,384."""
        if (self.rule_pending or not self.mask_is_callers_float32
                or first.requires_grad or second.requires_grad or self.input_mask.requires_grad):
            return self.broadcast(first), self.broadcast(second)
        return _times_mask_pair_fused(first.detach().contiguous(), second.detach().contiguous(),
                                      self.input_mask.detach().contiguous())

    def on_tokens(self, out: Tensor, *, last_use: bool = False) -> Tensor:
        """An estimator's checked result [B] or [B,T] -> the advantages [B,T] (``broadcast`` a [B] one).

        ``last_use``: the caller reads nothing from this batch afterwards (nor from a batch that
        shares its views, ``with_energy``'s), so a [B] result may be multiplied into the batch's own
        float32 copy of the mask (a bool, integer, 16- or 64-bit float mask's), which then holds
        the advantages, as do views derived from it (``valid``, ``steps``): the same values as
        ``broadcast``, without allocating and writing a second [B,T] tensor (on a CPU about 1 ms of
        2-3 at B = 1,024, T = 4,096). A float32 mask is the caller's tensor and is never written."""
        if out.dim() != 1:
            if self.rule_pending:        # a [B,T] result that never read the mask: checked before it leaves
                self.given_mask
            return out
        if not last_use or self.mask_is_callers_float32:
            return self.broadcast(out)
        own = self.given_mask if self.mask_copy else self.__dict__.pop("valid", None)
        return (self._float_copy() if own is None else own).mul_(out[:, None])

    @cached_property
    def constant_returns(self) -> bool:
        """True when every valid token's return-to-go is its row's R: gamma = 1 with [B] rewards, or token
        rewards that sit only on each row's last valid token with gamma = 1 (the usual outcome
        reward as verl passes it). Estimators then skip the returns-to-go (one pass over the token
        rewards and the mask, ``rewards_off_last_token``)."""
        if self.gamma != 1.0:
            return False
        if self.token_rewards is None:
            return True
        if self.rule_pending:
            self.lengths                                 # a pending mask's rule, inside the sums' pass
        mask = self.given_mask
        return not rewards_off_last_token(self.token_rewards, self.mask_bytes if mask.dtype == torch.bool else mask)

    @cached_property
    def returns(self) -> Tensor:
        if self.constant_returns:
            return self.broadcast(self.rewards)
        if self.token_rewards is None:      # a [B] outcome arrives at the row's last valid token
            return outcome_returns(self.rewards, self.steps, self.gamma)
        return returns_to_go(self.token_rewards, self.steps, self.gamma, self.rewards)


class Estimator(Protocol):
    def __call__(self, batch: AdvantageBatch, **options) -> Tensor: ...


@dataclass(frozen=True)
class KRange:
    """The K of a max@K estimator, for a group of N responses: ``low <= K <= N - below``."""
    low: int
    below: int = 0

    def text(self, n: str = "N") -> str:
        return f"{self.low} <= k {'<' if self.below == 1 else '<='} {n}" + (
            f" - {self.below}" if self.below > 1 else "")

    def allows(self, k: int, group_size: int) -> bool:
        return self.low <= k <= group_size - self.below

    def check(self, name: str, groups: GroupIndex, k: int) -> None:
        """Raise if no group size allows ``k`` (below the range's low end), else naming the first group
        (singletons aside: they get 0) whose size N rules out ``k``."""
        if k < self.low:
            raise ValueError(f"{name}: k={k} is out of range for any group; expected {self.text()}")
        sizes = groups.sizes
        # k beyond int64 (10**20) cannot be compared as a tensor; it exceeds every size all the same
        bad = (min(k, torch.iinfo(torch.int64).max) > sizes - self.below) & (sizes > 1)
        if bool(bad.any()):
            first = int(torch.nonzero(bad)[0, 0])
            raise ValueError(f"{name}: k={k} is out of range for group id {groups.ids[first].item()} "
                             f"(N={int(sizes[first])}, K={k}); expected {self.text()} ({int(bad.sum())} "
                             f"group(s) affected)")


@dataclass(frozen=True)
class EstimatorSpec:
    """A registered estimator and the facts every front end reads from it (declared once, in
    ``register_estimator``): whether it needs energies, its K range (max@K estimators), whether
    it uses token-level returns (and so takes ``gamma``); ``leave_one_out`` is whether its
    signature declares that option."""
    name: str
    fn: Callable[..., Tensor]
    needs_energy: bool = False
    doc: str = ""
    masked_output: bool = False  # a [B,T] result is already finite and exactly 0 where mask == 0
    k_range: KRange | None = None
    token_level: bool = False
    reward_components: bool = False
    batch_level: bool = False
    batch_level_when: tuple[tuple[str, object], ...] = ()   # options that make it batch-level (grpo's scale)

    def uses_batch(self, options: dict | None = None) -> bool:
        """Whether its advantages with ``options`` (defaults filled in) read statistics of the whole
        batch: always for ``batch_level``, else when every option of ``batch_level_when`` takes its
        value (``grpo`` with ``scale="batch"``). A caller that splits a step's batch into groups (the
        gradient measurements, ``creditrl.runtime.group_gradients``) must compute these over the step."""
        if self.batch_level:
            return True
        if not self.batch_level_when:
            return False
        given = {**(self.options or {}), **(options or {})}
        return all(given.get(key) == value for key, value in self.batch_level_when)

    @cached_property
    def option_specs(self) -> list[OptionSpec] | None:
        """The options this estimator takes, declared once by ``fn``'s keyword parameters after
        the batch (help from ``Annotated[type, "help"]``), plus ``gamma`` for a token-level one
        (the returns-to-go discount). None when ``fn`` takes ``**options``."""
        specs = options_of(self.fn, skip=1)
        if specs is None:
            return None
        return [GAMMA, *specs] if self.token_level else specs

    @property
    def options(self) -> dict[str, object] | None:
        """``option_specs`` as name -> default (``inspect.Parameter.empty`` = required)."""
        specs = self.option_specs
        return None if specs is None else {s.name: s.default for s in specs}

    @property
    def leave_one_out(self) -> bool:
        """Whether it has a ``leave_one_out`` form (the option is declared)."""
        return "leave_one_out" in (self.options or {})

    def facts(self) -> list[str]:
        """The declared facts in words (``creditrl estimators``, docs/config.md)."""
        return [text for flag, text in (
            (self.needs_energy, "needs the energies ŵ_t"),
            (self.k_range is not None, f"k: {self.k_range.text() if self.k_range else ''} (N the group size)"),
            (self.token_level, "token-level returns G_t (token rewards, gamma)"),
            (self.reward_components, "reads the reward components [B,K] (task.options.rewards; the total reward "
                                     "when there are none)"),
            (self.batch_level, "batch-level: its statistics span the batch, so an advantage depends on the other "
                               "prompts' responses"),
            (bool(self.batch_level_when), "batch-level with " + ", ".join(
                f"{key}={value!r}" for key, value in self.batch_level_when) + ": its statistics then span the batch"),
            (self.leave_one_out, "has a leave_one_out form")) if flag]

    def resolve_options(self, options: dict, where: str | None = None, strict: bool = True) -> dict:
        """``options`` checked against the declaration and typed (a bool option takes a bool, not
        ``"false"``), defaults filled in; OptionError naming ``where`` (default: the estimator).
        ``strict=False`` for YAML values (a float may come as the string "1e-5")."""
        specs = self.option_specs
        if specs is None:
            return dict(options)
        hint = "" if self.token_level or "gamma" not in options else (
            f" (gamma discounts token-level returns; {self.name} uses the total reward R)")
        return build(where or self.name, specs, options, hint, strict)


GAMMA = OptionSpec("gamma", float, 1.0, "Discount of the returns-to-go over valid tokens (an outcome reward arrives "
                                         "at the last valid token).")

NAME = re.compile(r"[A-Za-z0-9_.-]+")     # an estimator name: no spaces (a CLI value, a YAML scalar)
_REGISTRY: dict[str, EstimatorSpec] = {}
BUILTINS = "creditrl.core.estimators"


def _check_registration(name, k_range, batch_level_when, **flags) -> None:
    """``register_estimator``'s own arguments, checked before anything is registered."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"name: expected a non-empty estimator name of letters, digits, '_', '-' or '.' "
                         f"(no spaces), got {name!r}")
    if k_range is not None and not isinstance(k_range, KRange):
        raise TypeError(f"k_range: expected a creditrl.KRange (e.g. KRange(1, below=1) for 1 <= k <= N - 1) or "
                        f"None, got {type(k_range).__name__} {k_range!r}")
    batch_level = flags["batch_level"]
    if batch_level_when is not None and (batch_level or not isinstance(batch_level_when, dict)
                                         or not all(isinstance(k, str) for k in batch_level_when)):
        raise TypeError(f"batch_level_when: expected a dict option name -> value (and batch_level=False), got "
                        f"{batch_level_when!r} with batch_level={batch_level!r}")
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{flag}: expected a bool (True or False), got {type(value).__name__} {value!r}")


def register_estimator(name: str, *, needs_energy: bool = False, k_range: KRange | None = None,
                       token_level: bool = False, reward_components: bool = False, batch_level: bool = False,
                       batch_level_when: dict[str, object] | None = None, masked_output: bool = False,
                       overwrite: bool = False):
    """Decorator: register ``fn(batch: AdvantageBatch, **options) -> [B] | [B,T]`` under ``name``.

    The facts every front end reads, declared here once:
    ``needs_energy``: ``compute_advantages`` requires the ``energy`` argument;
    ``k_range``: a max@K estimator's ``KRange`` (``fn`` takes ``k``; checked per group before it runs);
    ``token_level``: it reads the returns-to-go G_t (so token rewards and ``gamma`` matter);
    ``reward_components``: it reads ``batch.components`` [B,K], each reward term's own values (the
    trainer and the TRL/verl plug-ins pass them; ``compute_advantages(components=...)`` from Python);
    ``batch_level``: its statistics span the whole batch (a whitening, a batch std, the across-prompt
    mean), so one group's advantages depend on the other groups;
    ``batch_level_when``: option -> value under which it is batch-level (``grpo``: ``{"scale": "batch"}``);
    ``masked_output``: a [B,T] result is finite and exactly 0 where mask == 0, so
    ``compute_advantages`` skips its checking pass (the built-in token-level estimators; tested).
    ``fn`` must not write into the batch's tensors: ``rewards``, ``input_mask``, ``raw_energy`` and
    ``token_rewards`` may be the caller's own (no copies are made for speed), so an in-place edit
    would change the user's inputs.
    Re-registering a name raises unless ``overwrite=True`` (or it is the same function).
    The arguments are checked here, before anything is registered: ``name`` a non-empty string of
    letters, digits, ``_``, ``-`` and ``.``; ``k_range`` a ``KRange`` or None; the flags real bools.
    """
    _check_registration(name, k_range, batch_level_when, needs_energy=needs_energy, token_level=token_level,
                        reward_components=reward_components, batch_level=batch_level, masked_output=masked_output,
                        overwrite=overwrite)

    def decorator(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
        try:
            inspect.signature(fn).bind_partial(None)
        except (TypeError, ValueError):
            raise TypeError(f"estimator {name!r}: {plugin_name(fn)} must take the batch as its first argument, "
                            f"fn(batch, **options)") from None
        if not is_builtin(fn):           # the built-ins first, so a name clash is met here, not at their first use
            import_submodules(BUILTINS)
        old = _REGISTRY.get(name)
        if old is not None and not overwrite and old.fn is not fn and (
                getattr(old.fn, "__qualname__", None), getattr(old.fn, "__module__", None)) != (
                getattr(fn, "__qualname__", None), getattr(fn, "__module__", None)):
            raise ValueError(f"estimator {name!r} is already registered to {old.fn!r}; pass overwrite=True")
        spec = EstimatorSpec(name, fn, needs_energy, doc_summary(fn.__doc__), masked_output, k_range, token_level,
                             reward_components, batch_level, tuple((batch_level_when or {}).items()))
        unknown = [key for key, _ in spec.batch_level_when if key not in (spec.options or {})]
        if unknown and spec.options is not None:
            raise ValueError(f"estimator {name!r}: batch_level_when names options it does not declare: {unknown}")
        takes_k = "k" in (spec.options or {})
        if (k_range is not None) != takes_k and spec.options is not None:
            raise ValueError(f"estimator {name!r}: k_range is declared for estimators that take a `k` option, and "
                             f"only for them (k_range={k_range}, takes k: {takes_k})")
        _REGISTRY[name] = spec
        return fn

    return decorator


def list_estimators() -> list[str]:
    """Names of all registered estimators, sorted."""
    import_submodules(BUILTINS)
    return sorted(_REGISTRY)


def get_estimator(name: str) -> EstimatorSpec:
    """The spec of a registered estimator, by name or by the import path ``"pkg.module:function"``
    of a function registered with ``register_estimator`` (importing the module registers it)."""
    import_submodules(BUILTINS)
    if name in _REGISTRY:                       # the common case, without building the error text
        return _REGISTRY[name]
    return registered_entry(
        _REGISTRY, name, what="estimator",
        unknown=f"name: unknown estimator {name!r}; valid estimators are {list_estimators()} or an import path "
                "'package.module:function'",
        unregistered="decorate it with @creditrl.register_estimator('my_name') so its options and needs are declared")

"""Reward functions in the field's conventions, summed with weights as TRL does, each call time-limited.

A checker is a built-in name (``exact``, ``numeric``, ``math``: ``tasks/checkers.py``), a
``package.module:function`` import path or, from Python, the function itself (run in-process, no
time limit) in one of three conventions, told from its signature
(``convention`` forces one):

- ``creditrl``: ``fn(prompt, response, answer) -> float``, one completion per call;
- ``trl``: ``fn(prompts, completions, **columns) -> list[float | None]``, the whole batch in one
  call, with every other dataset column as a keyword argument holding one value per completion
  (only the columns the function names, unless it takes ``**kwargs``); a conversational prompt's
  completions are ``[{"role": "assistant", "content": text}]``, as TRL passes them. TRL's
  ``completion_ids``, ``trainer_state``, ``log_extra`` and ``log_metric`` are not passed;
- ``verl``: ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``, one
  completion per call, with the row's ``data_source`` and ``extra_info`` columns.

A checker returns a number, None (no reward, TRL's convention) or a dict (verl's ``{"score": ...,
"acc": ...}``: its ``score`` is the reward, its other numeric keys are logged as ``reward/<key>``).
Several reward terms (the checker with weight 1, plus ``rewards: [{checker, weight}]``) are summed
as TRL's ``sum_then_normalize`` does: Σ_i w_i r_i over the terms that gave a reward, NaN when none
did. Each term's own reward is logged as ``reward/<name>`` when there are several (``term_keys``:
the function's name, its full ``module.function`` name where two terms share one), and kept as a
reward component (``Scores.components``: name, weight, values) for estimators that normalise each
term on its own (``gdpo``).

DAPO's soft overlong punishment (Yu et al. 2025, eq. 13) is ``overlong_penalty``: applied by the
rollout to the token lengths, after the task's reward, as its own component ``overlong``.

Import-path checkers and ``math`` run in a child process (``creditrl.utils.bounded``): each
per-completion call within ``timeout`` seconds, a TRL call within ``timeout`` x its batch size,
from any thread. A late call is killed, counted as an invalid reward and as a timeout
(``reward_timeouts``), with one warning. ``timeout=None`` runs them in-process without a limit.
Invalid rewards (None, NaN, inf, a number beyond float32's range such as 1e39, a wrong type, a raise,
a timeout) are NaN here; the rollout counts
them as 0 and logs ``reward_invalid_frac``. A checker's raise never stops a run (one warning per
checker); a TRL function returning the wrong number of rewards does (a bug in it, as in TRL).
"""
from __future__ import annotations

import functools
import inspect
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from creditrl.tasks.base import Problem
from creditrl.tasks.checkers import BUILTIN_CHECKERS, check_exact, check_math, check_numeric
from creditrl.utils.bounded import Outcome, TimeLimitedCalls
from creditrl.utils.imports import is_import_path, load_object

CONVENTIONS = ("auto", "creditrl", "trl", "verl")
TRL_ARGS = ("prompts", "completions")
VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
DEFAULT_TIMEOUT = 10.0   # seconds per completion: a checker takes milliseconds; math-verify stops at 5 s
_MATH_PATH = "creditrl.tasks.checkers:check_math"


@dataclass(frozen=True)
class RewardComponent:
    """One reward term's own values (NaN where it gave none) and its weight in the total."""
    name: str
    weight: float
    values: list[float]


@dataclass
class Scores:
    """Per completion: ``rewards`` (NaN = invalid), ``extras`` (logged values by name, NaN where a
    completion has none) and ``timed_out`` (a call over its time limit); ``components``: each
    reward term when there are several (empty for a single reward, which is its own component);
    ``correct``: the answer checker's verdict (``verdict``), None where it is ``rewards`` >= 1."""
    rewards: list[float]
    extras: dict[str, list[float]] = field(default_factory=dict)
    timed_out: list[bool] = field(default_factory=list)
    components: list[RewardComponent] = field(default_factory=list)
    correct: list[bool] | None = None


def verdict(scores: Scores) -> list[bool]:
    """Whether each completion is correct by one checker's ``scores``: its ``acc`` where it returned
    verl's dict with one (verl's accuracy), else its reward >= 1; never where the reward is invalid (NaN)."""
    acc = scores.extras.get("acc") or [math.nan] * len(scores.rewards)
    return [not math.isnan(r) and (r if math.isnan(a) else a) >= 1.0 for r, a in zip(scores.rewards, acc)]


def overlong_penalty(lengths: Sequence[int], limit: int, buffer: int, factor: float) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13) per response of
    ``lengths`` sampled tokens, ``limit`` = the most a response may sample:

        0 for L <= limit - buffer,   -factor * (L - (limit - buffer)) / buffer beyond (down to -factor at L = limit),

    verl's DAPO reward manager (``overlong_buffer_cfg``: ``len`` = buffer, ``penalty_factor`` = factor)
    and, with factor 1, TRL's ``get_soft_overlong_punishment(limit, buffer)``."""
    start = limit - buffer
    return [min(-(length - start) / buffer * factor, 0.0) for length in lengths]


def columns_of(problem: Problem) -> dict[str, Any]:
    """The dataset columns of a problem's row other than its prompt (``meta["columns"]``)."""
    return problem.meta.get("columns", {})


def ground_truth(problem: Problem) -> Any:
    """The answer as the data holds it (a list, a number, ...); ``problem.answer`` is its text."""
    return problem.meta.get("ground_truth", problem.answer)


FLOAT32_MAX = 3.4028234663852886e38   # rewards are float32 tensors: a larger finite number would become inf


def _number(value: Any) -> float | None:
    if value is None or isinstance(value, (str, bytes, dict, list, tuple)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _callable_name(fn: Callable) -> str:
    """A function's name in messages and logs (``reward/<name>``)."""
    return getattr(fn, "__name__", type(fn).__name__)


def detect_convention(signature: inspect.Signature, checker: str, what: str) -> str:
    """``verl`` if the function names ``solution_str`` (or ``data_source`` and ``ground_truth``),
    ``trl`` if it names ``prompts`` or ``completions``, ``creditrl`` if it takes 3 positional arguments."""
    names = set(signature.parameters)
    if "solution_str" in names or {"data_source", "ground_truth"} <= names:
        return "verl"
    if names & set(TRL_ARGS):
        return "trl"
    try:
        signature.bind(None, None, None)
        return "creditrl"
    except TypeError:
        raise ValueError(f"{what}: cannot tell the convention of {checker!r} from its signature {signature}; "
                         f"expected fn(prompt, response, answer), a TRL reward function fn(prompts, completions, "
                         f"**kwargs) or verl's compute_score(data_source, solution_str, ground_truth, extra_info), "
                         f"or set task.options.checker_convention to one of {list(CONVENTIONS[1:])}") from None


def _keyword_names(signature: inspect.Signature) -> tuple[set[str], set[str], bool]:
    """(names passable by keyword, those without a default, whether it takes ``**kwargs``)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = signature.parameters.values()
    names = {p.name for p in params if p.kind in kinds}
    required = {p.name for p in params if p.kind in kinds and p.default is inspect.Parameter.empty}
    required |= {p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is p.empty}
    return names, required, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class RewardFunction:
    """One checker, resolved and its signature checked against the data's ``columns`` before any
    work; ``score(problems, responses)`` gives its ``Scores``."""

    def __init__(self, checker: str, *, convention: str = "auto", tolerance: float = 0.0,
                 timeout: float | None = DEFAULT_TIMEOUT, columns: Sequence[str] = (),
                 what: str = "task.options.checker"):
        if not isinstance(checker, str) and not callable(checker):
            raise ValueError(f"{what}: expected a checker name, 'package.module:function' or a function, "
                             f"got {checker!r}")
        if convention not in CONVENTIONS:
            raise ValueError(f"task.options.checker_convention: expected one of {list(CONVENTIONS)}, got {convention!r}")
        if timeout is not None and (isinstance(timeout, bool) or _number(timeout) is None or not 0 < timeout < math.inf):
            raise ValueError(f"task.options.checker_timeout: expected a positive number of seconds or null, "
                             f"got {timeout!r}")
        self.name = checker if isinstance(checker, str) else _callable_name(checker)
        # a built-in checker reads the answer as text (``Problem.answer``)
        self.builtin = checker if isinstance(checker, str) and checker in BUILTIN_CHECKERS else None
        self.what, self.timeout = what, timeout
        self.path, self.fn = (None, checker) if callable(checker) else self._resolve(checker, tolerance)
        if isinstance(checker, str) and checker in BUILTIN_CHECKERS:
            if convention not in ("auto", "creditrl"):
                raise ValueError(f"task.options.checker_convention: the built-in checker {checker!r} takes "
                                 f"(prompt, response, answer) ('creditrl'), got {convention!r}")
            self.convention = "creditrl"
        else:
            signature = inspect.signature(self.fn)
            self.convention = detect_convention(signature, checker, what) if convention == "auto" else convention
            self.accepts, self.passes_all = self._check_signature(signature, set(columns))
        self.columns = sorted(columns)
        self._runner = TimeLimitedCalls() if self.path and timeout else None
        self._warned: set[str] = set()

    def _resolve(self, checker: str, tolerance: float) -> tuple[str | None, Callable]:
        """(import path run in the child process or None, the function)."""
        if checker == "exact":
            return None, check_exact
        if checker == "numeric":
            return None, functools.partial(check_numeric, tolerance=tolerance)
        if checker == "math":
            return _MATH_PATH, check_math
        if not is_import_path(checker):
            raise ValueError(f"{self.what}: unknown value {checker!r}; valid values are {list(BUILTIN_CHECKERS)} "
                             f"or 'package.module:function'")
        fn = load_object(checker, what=self.what)
        if not callable(fn):
            raise ValueError(f"{self.what}: {checker!r} is a {type(fn).__name__}, not a function")
        return checker, fn

    def _check_signature(self, signature: inspect.Signature, columns: set[str]) -> tuple[set[str], bool]:
        """Refuse a function this convention cannot call, naming what it lacks or requires."""
        names, required, var_kw = _keyword_names(signature)
        if self.convention == "creditrl":
            try:
                signature.bind(None, None, None)
            except TypeError:
                raise ValueError(f"{self.what}: {self.name!r} must take (prompt, response, answer) in creditrl's "
                                 f"convention, but its signature is {signature}") from None
            return names, var_kw
        known = set(VERL_ARGS) if self.convention == "verl" else set(TRL_ARGS) | columns
        missing = sorted(required - known)
        if missing:
            extra = f"; the data's columns are {sorted(columns)}" if self.convention == "trl" else ""
            raise ValueError(f"{self.what}: {self.name!r} ({self.convention} convention) requires {missing}, which "
                             f"{'are not passed' if self.convention == 'verl' else 'the data does not have'}{extra}")
        if self.convention == "verl" and not var_kw and "solution_str" not in names:
            raise ValueError(f"{self.what}: {self.name!r} (verl convention) must take solution_str; its signature "
                             f"is {signature}")
        return names, var_kw

    def _call(self, args: tuple, kwargs: dict, timeout: float | None) -> Outcome:
        if self._runner is not None:
            return self._runner.call(self.path, args, kwargs, timeout=timeout)
        try:
            return Outcome("ok", self.fn(*args, **kwargs))
        except Exception as err:  # noqa: BLE001 - a checker's bug on some output must not kill training
            return Outcome("error", f"raised {type(err).__name__}: {err}")

    def _warn(self, kind: str, text: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(f"checker {self.name!r} {text}", stacklevel=4)

    def _passed(self, kwargs: dict) -> dict:
        return kwargs if self.passes_all else {k: v for k, v in kwargs.items() if k in self.accepts}

    def score(self, problems: Sequence[Problem], responses: Sequence[str]) -> Scores:
        if self.convention == "trl":
            outcomes = self._score_batch(problems, responses)
        else:
            outcomes = [self._call(*self._arguments(p, r), self.timeout) for p, r in zip(problems, responses)]
        return self._collect(outcomes)

    def _arguments(self, problem: Problem, response: str) -> tuple[tuple, dict]:
        if self.convention == "creditrl":
            return (problem.prompt, response, problem.answer), {}
        columns = columns_of(problem)
        return (), self._passed({"data_source": columns.get("data_source"), "solution_str": response,
                                 "ground_truth": ground_truth(problem), "extra_info": columns.get("extra_info")})

    def _score_batch(self, problems: Sequence[Problem], responses: Sequence[str]) -> list[Outcome]:
        completions = [[{"role": "assistant", "content": r}] if isinstance(p.prompt, list) else r
                       for p, r in zip(problems, responses)]
        kwargs = {name: [columns_of(p).get(name) for p in problems] for name in self.columns}
        kwargs = self._passed({**kwargs, "prompts": [p.prompt for p in problems], "completions": completions})
        timeout = None if self.timeout is None else self.timeout * len(problems)
        outcome = self._call((), kwargs, timeout)
        if outcome.status != "ok":
            return [outcome] * len(problems)
        values = outcome.value
        if hasattr(values, "tolist") and getattr(values, "ndim", 0) == 1:   # a tensor or array, as TRL takes
            values = values.tolist()
        if not isinstance(values, (list, tuple)) or len(values) != len(problems):
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
            raise ValueError(f"{self.what}: the TRL reward function {self.name!r} returned {got} for "
                             f"{len(problems)} completions; expected one float or None per completion")
        return [Outcome("ok", v) for v in values]

    def _collect(self, outcomes: list[Outcome]) -> Scores:
        rewards, timed_out, rows = [], [], []
        for outcome in outcomes:
            reward, extras = math.nan, {}
            if outcome.status == "timeout":
                limit = f"{self.timeout:g} s" + (" per completion" if self.convention == "trl" else "")
                self._warn("timeout", f"took longer than task.options.checker_timeout={limit}; the call was "
                                      f"stopped and counted as an invalid reward (reward 0, logged as reward_timeouts)")
            elif outcome.status == "error":
                self._warn("error", f"{outcome.value}; counting reward 0 (logged as reward_invalid_frac)")
            else:
                reward, extras, problem = self._value(outcome.value)
                if problem:
                    self._warn("type", f"{problem}; counting reward 0 (logged as reward_invalid_frac)")
            rewards.append(reward)
            timed_out.append(outcome.status == "timeout")
            rows.append(extras)
        keys = list(dict.fromkeys(k for row in rows for k in row))
        return Scores(rewards, {k: [row.get(k, math.nan) for row in rows] for k in keys}, timed_out)

    @staticmethod
    def _value(value: Any) -> tuple[float, dict[str, float], str | None]:
        """(reward, logged extras, what was wrong or None) from one returned value."""
        extras: dict[str, float] = {}
        if isinstance(value, dict):
            extras = {str(k): _number(v) for k, v in value.items() if k != "score" and _number(v) is not None}
            if "score" not in value:
                return math.nan, extras, f"returned a dict without a 'score' key (keys: {sorted(value)[:10]})"
            value = value["score"]
        if value is None:
            return math.nan, extras, None
        number = _number(value)
        if number is None:
            return math.nan, extras, f"returned a {type(value).__name__}, not a number"
        if math.isinf(number) or abs(number) > FLOAT32_MAX:   # (a finite one would be inf as a float32 reward)
            # invalid like NaN: as a term it gives no reward, so the others' still count
            return math.nan, extras, f"returned {number!r}, not a finite float32 reward (|reward| <= {FLOAT32_MAX:.3g})"
        return number, extras, None

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()


def reward_terms(checker: str, rewards: Any, *, convention: str = "auto", tolerance: float = 0.0,
                 timeout: float | None = DEFAULT_TIMEOUT, columns: Sequence[str] = ()) -> list[tuple[RewardFunction, float]]:
    """The checker (weight 1) and each ``{checker, weight[, convention]}`` of ``rewards``, resolved."""
    if not isinstance(rewards, (list, tuple)):
        raise ValueError(f"task.options.rewards: expected a list of {{checker, weight}} mappings, got {rewards!r}")
    common = dict(tolerance=tolerance, timeout=timeout, columns=columns)
    terms = [(RewardFunction(checker, convention=convention, **common), 1.0)]
    for i, term in enumerate(rewards):
        where = f"task.options.rewards[{i}]"
        if not isinstance(term, dict) or "checker" not in term or set(term) - {"checker", "weight", "convention"}:
            raise ValueError(f"{where}: expected a mapping with 'checker' and optional 'weight', 'convention', "
                             f"got {term!r}")
        weight = term.get("weight", 1.0)
        if isinstance(weight, bool) or _number(weight) is None or not math.isfinite(weight):
            raise ValueError(f"{where}.weight: expected a finite number, got {weight!r}")
        terms.append((RewardFunction(term["checker"], convention=term.get("convention", "auto"),
                                     what=f"{where}.checker", **common), float(weight)))
    return terms


def score_terms(terms: list[tuple[RewardFunction, float]], problems: Sequence[Problem],
                responses: Sequence[str]) -> Scores:
    """The weighted sum of the terms' rewards (TRL's nansum; NaN where no term gave one), correct
    where the first term, the answer checker, says so (``verdict``): a format bonus or a length
    penalty changes the reward, not what counts as right."""
    parts = [(fn, weight, fn.score(problems, responses)) for fn, weight in terms]
    correct = verdict(parts[0][2])
    if len(parts) == 1:   # one term: its reward times its weight (NaN stays NaN: invalid)
        fn, weight, scores = parts[0]
        return Scores([weight * r for r in scores.rewards], scores.extras, scores.timed_out, correct=correct)
    n = len(responses)
    total, extras = [], {}
    for i in range(n):
        given = [w * s.rewards[i] for _, w, s in parts if not math.isnan(s.rewards[i])]
        total.append(math.fsum(given) if given else math.nan)
    components = []
    for (fn, weight, s), name in zip(parts, term_keys([fn for fn, _ in terms])):
        extras[name] = s.rewards
        extras.update({f"{name}/{k}": v for k, v in s.extras.items()})
        components.append(RewardComponent(name, weight, s.rewards))
    timed_out = [any(s.timed_out[i] for _, _, s in parts) for i in range(n)]
    return Scores(total, extras, timed_out, components, correct)


def term_keys(functions: Sequence[RewardFunction]) -> list[str]:
    """Each reward term's metric key (``reward/<key>``), unique: its function's name, or where two
    terms share it (two verl ``compute_score`` from different modules) its full ``module.function``
    name, then ``_2``, ``_3``... for the same function given twice."""
    short = [fn.name.rsplit(":", 1)[-1] for fn in functions]
    keys: list[str] = []
    for fn, name in zip(functions, short):
        if short.count(name) > 1 and is_import_path(fn.name):
            name = fn.name.replace(":", ".")
        elif short.count(name) > 1 and fn.name not in BUILTIN_CHECKERS:   # a function given from Python
            name = f"{getattr(fn.fn, '__module__', '')}.{getattr(fn.fn, '__qualname__', name)}"
        key, n = name, 1
        while key in keys:
            n += 1
            key = f"{name}_{n}"
        keys.append(key)
    return keys


def score_responses(task, problems: Sequence[Problem], responses: Sequence[str]) -> Scores:
    """A task's ``Scores`` for a batch: its batched ``score`` when it has one (file and
    reasoning-gym tasks), else its ``reward`` per response (the built-in generators)."""
    if hasattr(task, "score"):
        return task.score(list(problems), list(responses))
    return Scores([_task_reward(task, p, r) for p, r in zip(problems, responses)], {}, [False] * len(responses))


def _task_reward(task, problem: Problem, response: str) -> float:
    """``task.reward`` as a checker's value is read (``RewardFunction._value``): None, a non-number,
    a non-finite number or a raise is an invalid reward (NaN), with a warning naming the task (a
    user's task class must not stop a run on odd model output, nor fail without saying where)."""
    name = getattr(task, "name", type(task).__name__)
    try:
        value = task.reward(problem, response)
    except Exception as err:  # noqa: BLE001 - as for a checker: a bug on some output must not kill training
        warnings.warn(f"task {name!r}: reward() raised {type(err).__name__}; counting reward 0 (logged as "
                      f"reward_invalid_frac)", stacklevel=3)
        return math.nan
    reward, _, problem_text = RewardFunction._value(value)
    if problem_text:
        warnings.warn(f"task {name!r}: reward() {problem_text.split(',')[0]}; counting reward 0 (logged as "
                      f"reward_invalid_frac)", stacklevel=3)
    return reward

"""The task interface the trainer, eval and experiments rely on.

A task is a seeded procedural problem source with an exact reward check:
- ``sample(rng)`` draws one training problem from the endless stream;
- ``test_set()`` returns the fixed held-out problems (same list every call);
- ``reward(problem, response)`` scores a full decoded response text (never raises);
- multi-turn tasks (``max_tool_calls > 0``) also implement ``tool_stop`` (the string that
  ends a tool call, e.g. ``"</calc>"``) and ``tool_output(response_so_far)`` returning the
  text the environment appends (e.g. ``"<out>42</out>"``), whose tokens get mask 0.
- ``sft_target(problem)`` is a correct response used to warm-start ``builtin:tiny``.
- ``chat_template`` / ``system_prompt`` say how prompts are rendered (``tasks/chat.py``).

A prompt is a string or a list of chat messages (TRL's conventions). Built-in tasks come in
two formats: ``compact`` (``"16+40="``, exact match; what ``builtin:tiny`` is warm-started on)
and ``natural`` (a chat message such as "What is 16 + 40? Reply with just the number.", whose
checker extracts the answer from free text; for pretrained instruct models).
"""
from __future__ import annotations

import random
import warnings
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from creditrl.utils.validate import check_int
from creditrl.tasks.chat import check_chat_template
from creditrl.tasks.checkers import last_number


FORMATS = ("auto", "compact", "natural")
SAMPLE_TRIES = 10_000


def last_integer(text: str) -> str | None:
    """The last number written in ``text`` (``checkers.last_number``: "1,234" with valid thousands
    separators is 1234, "56.0" is 56, a U+2212 minus a minus) as an integer's text, None when it is
    not an integer ("56.5") or there is none."""
    value = last_number(text)
    return None if value is None or value.denominator != 1 else str(value.numerator)


@dataclass(frozen=True)
class Problem:
    prompt: str | list[dict[str, str]]
    answer: str
    meta: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


@runtime_checkable
class Task(Protocol):
    name: str
    max_tool_calls: int  # 0 for single-turn tasks
    tool_stop: str | None

    def sample(self, rng: random.Random) -> Problem: ...

    def test_set(self) -> list[Problem]: ...

    def reward(self, problem: Problem, response: str) -> float: ...

    def tool_output(self, response_so_far: str) -> str | None: ...

    def sft_target(self, problem: Problem) -> str: ...

    def alphabet(self) -> str:
        """Every character prompts and responses of this task can contain (char tokenizer)."""
        ...


class ProceduralTask:
    """Shared machinery of the built-in generators: a seeded endless training stream that
    never repeats a held-out prompt, and a fixed, duplicate-free test set drawn from its own
    seed. Subclasses set ``name`` and implement ``generate`` (a compact problem),
    ``compact_reward``, ``compact_target``, ``natural_prompt``, ``natural_reward``,
    ``natural_target`` and ``alphabet``; ``options`` holds the constructor arguments (they key
    the model cache). ``format="auto"`` is resolved by ``get_task(..., chat_model=...)``;
    left unresolved it means ``compact``."""

    name: str = ""
    max_tool_calls: int = 0
    tool_stop: str | None = None

    def __init__(self, *, seed: int = 0, test_size: int = 200, format: str = "auto", chat_template="auto",
                 system_prompt: str | None = None, **options: Any):
        check_int("seed", seed)
        if isinstance(test_size, bool) or not isinstance(test_size, int) or test_size < 1:
            raise ValueError(f"test_size: expected a positive int, got {test_size!r}")
        if format not in FORMATS:
            raise ValueError(f"format: expected one of {list(FORMATS)}, got {format!r}")
        check_chat_template(chat_template)
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError(f"system_prompt: expected a string or null, got {system_prompt!r}")
        self.seed, self.test_size = seed, test_size
        self.format = "natural" if format == "natural" else "compact"
        self.chat_template, self.system_prompt = chat_template, system_prompt
        presentation = {"format": self.format, "chat_template": chat_template, "system_prompt": system_prompt}
        defaults = {"format": "compact", "chat_template": "auto", "system_prompt": None}
        # only non-defaults enter the options, so the builtin:tiny cache key of a compact task is unchanged
        self.options = {"seed": seed, "test_size": test_size, **options,
                        **{k: v for k, v in presentation.items() if v != defaults[k]}}
        self._test: list[Problem] | None = None
        self._test_prompts: frozenset[str] = frozenset()

    def generate(self, rng: random.Random) -> Problem:
        raise NotImplementedError

    def _present(self, problem: Problem) -> Problem:
        """The problem in this task's format (``meta["compact"]`` keeps the compact prompt)."""
        if self.format == "compact":
            return problem
        return Problem([{"role": "user", "content": self.natural_prompt(problem)}], problem.answer,
                       {**problem.meta, "compact": problem.prompt})

    def reward(self, problem: Problem, response: str) -> float:
        if not isinstance(response, str):
            return 0.0
        natural = isinstance(problem.prompt, list)
        return float((self.natural_reward if natural else self.compact_reward)(problem, response))

    def sft_target(self, problem: Problem) -> str:
        return (self.natural_target if isinstance(problem.prompt, list) else self.compact_target)(problem)

    def natural_reward(self, problem: Problem, response: str) -> float:
        """Default natural checker: the last integer of the response equals the answer exactly."""
        return float(last_integer(response) == problem.answer)

    def space_size(self) -> int | None:
        """Number of distinct problems when small (the test set then takes at most half)."""
        return None

    def test_set(self) -> list[Problem]:
        if self._test is None:
            rng = random.Random(f"creditrl-test-{self.name}-{self.seed}")
            size = self.test_size
            if self.space_size() is not None:
                size = min(size, max(1, self.space_size() // 2))
            problems: dict[str, Problem] = {}
            misses = 0
            while len(problems) < size and misses < 1000:
                p = self.generate(rng)
                misses = misses + 1 if p.prompt in problems else 0
                problems.setdefault(p.prompt, p)
            if misses >= 1000:   # the space is (nearly) all drawn: hold out half, train on the rest
                found = len(problems)
                problems = dict(list(problems.items())[:max(1, found // 2)])
                warnings.warn(f"{self!r}: these options make only about {found} distinct problems, fewer than "
                              f"test_size={self.test_size} asks to hold out with some left to train on; holding out "
                              f"{len(problems)}", stacklevel=2)
            self._test = [self._present(p) for p in problems.values()]
            self._test_prompts = frozenset(problems)
        return list(self._test)

    def sample(self, rng: random.Random) -> Problem:
        self.test_set()
        # held-out prompts are never trained on: draw until a training one comes. Where the held-out set
        # holds most of the draws' probability (a test_size just under the space) that takes many draws,
        # yet with 5% left for training 10,000 misses in a row have probability 0.95^10000 ~ 1e-223
        for _ in range(SAMPLE_TRIES):
            p = self.generate(rng)
            if p.prompt not in self._test_prompts:
                return self._present(p)
        raise ValueError(f"{self!r}: {SAMPLE_TRIES} draws in a row gave only held-out problems: the options leave "
                         f"(almost) nothing to train on; lower test_size (now {self.test_size}) or widen the problem "
                         f"space")

    def tool_output(self, response_so_far: str) -> str | None:
        return None

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this task's data (keys the warm-started model cache)."""
        return {"name": self.name, **self.options}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({args})"

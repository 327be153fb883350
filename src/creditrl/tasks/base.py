"""The task interface the trainer, eval and experiments rely on.

A task is a seeded procedural problem source with an exact reward check:
- ``sample(rng)`` draws one training problem from the endless stream;
- ``test_set()`` returns the fixed held-out problems (same list every call);
- ``reward(problem, response)`` scores a full decoded response text (never raises);
- multi-turn tasks (``max_tool_calls > 0``) also implement ``tool_stop`` (the string that
  ends a tool call, e.g. ``"</calc>"``) and ``tool_output(response_so_far)`` returning the
  text the environment appends (e.g. ``"<out>42</out>"``), whose tokens get mask 0.
- ``sft_target(problem)`` is a correct response used to warm-start ``builtin:tiny``.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Problem:
    prompt: str
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
    seed. Subclasses set ``name`` and implement ``generate``, ``reward``, ``sft_target`` and
    ``alphabet``; ``options`` holds the constructor arguments (they key the model cache)."""

    name: str = ""
    max_tool_calls: int = 0
    tool_stop: str | None = None

    def __init__(self, *, seed: int = 0, test_size: int = 200, **options: Any):
        if not isinstance(test_size, int) or test_size < 1:
            raise ValueError(f"test_size: expected a positive int, got {test_size!r}")
        self.seed, self.test_size = seed, test_size
        self.options = {"seed": seed, "test_size": test_size, **options}
        self._test: list[Problem] | None = None
        self._test_prompts: frozenset[str] = frozenset()

    def generate(self, rng: random.Random) -> Problem:
        raise NotImplementedError

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
            self._test = list(problems.values())
            self._test_prompts = frozenset(problems)
        return list(self._test)

    def sample(self, rng: random.Random) -> Problem:
        self.test_set()
        for _ in range(100):  # held-out prompts are never trained on
            p = self.generate(rng)
            if p.prompt not in self._test_prompts:
                return p
        return p

    def tool_output(self, response_so_far: str) -> str | None:
        return None

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this task's data (keys the warm-started model cache)."""
        return {"name": self.name, **self.options}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({args})"

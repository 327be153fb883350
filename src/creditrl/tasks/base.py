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

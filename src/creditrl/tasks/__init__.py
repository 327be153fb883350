"""Built-in verifiable tasks and the registry the trainer and CLI use.

``get_task(name, **options)`` builds one; ``list_tasks()`` names them. Every task has a
seeded endless training stream (``sample(rng)``), a fixed held-out ``test_set()``, an exact
``reward`` that never raises on model output, ``sft_target`` and ``alphabet`` (see base.py).
"""
from __future__ import annotations

import inspect

from creditrl.tasks.arithmetic import Addition, Multiplication
from creditrl.tasks.base import Problem, ProceduralTask, Task
from creditrl.tasks.calculator import Calculator
from creditrl.tasks.countdown import Countdown
from creditrl.tasks.jsonl import JsonlTask
from creditrl.tasks.safe_math import safe_eval

TASKS = {cls.name: cls for cls in (Addition, Multiplication, Countdown, Calculator, JsonlTask)}


def list_tasks() -> list[str]:
    return list(TASKS)


def task_options(name: str) -> dict[str, object]:
    """Option names of a task and their defaults (``inspect.Parameter.empty`` if required)."""
    cls = _lookup(name)
    params = inspect.signature(cls.__init__).parameters
    return {k: p.default for k, p in params.items() if k != "self"}


def _lookup(name: str):
    if name not in TASKS:
        raise ValueError(f"task: unknown task {name!r}; valid tasks are {list_tasks()}")
    return TASKS[name]


def get_task(name: str, *, chat_model: bool = False, **options) -> Task:
    """Build the task ``name``; unknown options raise naming them and the valid ones.

    A built-in task's ``format="auto"`` (the default) becomes ``natural`` for a ``chat_model``
    (one whose tokenizer has a chat template, ``creditrl.runtime.models.is_chat_model``) and
    ``compact`` otherwise (``builtin:tiny`` and the models trained from it)."""
    cls = _lookup(name)
    valid = task_options(name)
    if "format" in valid and options.get("format", "auto") == "auto":
        options = {**options, "format": "natural" if chat_model else "compact"}
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"task {name!r}: unknown option(s) {unknown}; valid options are {sorted(valid)}")
    missing = [k for k, v in valid.items() if v is inspect.Parameter.empty and k not in options]
    if missing:
        raise ValueError(f"task {name!r}: missing required option(s) {missing}")
    return cls(**options)


__all__ = ["Addition", "Calculator", "Countdown", "JsonlTask", "Multiplication", "Problem", "ProceduralTask",
           "Task", "get_task", "list_tasks", "safe_eval", "task_options"]

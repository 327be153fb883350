"""Built-in verifiable tasks and the registry the trainer and CLI use.

``get_task(name, **options)`` builds one; ``list_tasks()`` names them. Every task has a
seeded endless training stream (``sample(rng)``), a fixed held-out ``test_set()``, an exact
``reward`` that never raises on model output, ``sft_target`` and ``alphabet`` (see base.py).
A user's own task is named by import path: ``task.name=package.module:function`` (a factory
returning a Task) or ``package.module:Class``, called with ``task.options`` as keyword arguments.
"""
from __future__ import annotations

import inspect

from creditrl.tasks.arithmetic import Addition, Multiplication
from creditrl.tasks.base import Problem, ProceduralTask, Task
from creditrl.tasks.calculator import Calculator
from creditrl.tasks.countdown import Countdown
from creditrl.tasks.jsonl import JsonlTask
from creditrl.tasks.reasoning_gym import ReasoningGymTask
from creditrl.tasks.safe_math import safe_eval
from creditrl.utils.imports import is_import_path, load_object

TASKS = {cls.name: cls for cls in (Addition, Multiplication, Countdown, Calculator, JsonlTask, ReasoningGymTask)}
TASK_NEEDS = ("name", "max_tool_calls", "tool_stop", "sample()", "test_set()", "reward()")   # score() may stand for reward()


def list_tasks() -> list[str]:
    return list(TASKS)


def task_options(name: str) -> dict[str, object]:
    """Option names of a task and their defaults (``inspect.Parameter.empty`` if required);
    None for a user's factory that takes ``**kwargs`` (any option is passed on)."""
    factory = _lookup(name)
    params = inspect.signature(factory.__init__ if isinstance(factory, type) else factory).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return {k: p.default for k, p in params.items() if k != "self" and p.kind not in (p.VAR_POSITIONAL,)}


def _lookup(name: str):
    if is_import_path(name):
        factory = load_object(name, what="task.name")
        if not callable(factory):
            raise ValueError(f"task.name: {name!r} is a {type(factory).__name__}; expected a Task class or a "
                             f"function returning a Task")
        return factory
    if name not in TASKS:
        raise ValueError(f"task: unknown task {name!r}; valid tasks are {list_tasks()} or a user's task as "
                         f"'package.module:function'")
    return TASKS[name]


def _check_task(task, name: str):
    """A user's factory must return something with the Task interface (``creditrl.tasks.base.Task``;
    ``sft_target`` and ``alphabet`` only for ``builtin:tiny``); errors name what is missing."""
    def has(need: str) -> bool:
        if need == "reward()" and callable(getattr(task, "score", None)):
            return True
        return callable(getattr(task, need[:-2], None)) if need.endswith("()") else hasattr(task, need)

    missing = [need for need in TASK_NEEDS if not has(need)]
    if getattr(task, "max_tool_calls", 0) and not callable(getattr(task, "tool_output", None)):
        missing.append("tool_output()")
    if missing:
        raise ValueError(f"task.name: {name!r} returned a {type(task).__name__} without {missing}; a task has "
                         f"{list(TASK_NEEDS)} (creditrl.tasks.base.Task)")
    return task


def get_task(name: str, *, chat_model: bool = False, **options) -> Task:
    """Build the task ``name``; unknown options raise naming them and the valid ones.

    A built-in task's ``format="auto"`` (the default) becomes ``natural`` for a ``chat_model``
    (one whose tokenizer has a chat template, ``creditrl.runtime.models.is_chat_model``) and
    ``compact`` otherwise (``builtin:tiny`` and the models trained from it)."""
    factory = _lookup(name)
    valid = task_options(name)
    if valid is None:
        return _check_task(factory(**options), name)
    if "format" in valid and options.get("format", "auto") == "auto":
        options = {**options, "format": "natural" if chat_model else "compact"}
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"task {name!r}: unknown option(s) {unknown}; valid options are {sorted(valid)}")
    missing = [k for k, v in valid.items() if v is inspect.Parameter.empty and k not in options]
    if missing:
        raise ValueError(f"task {name!r}: missing required option(s) {missing}")
    task = factory(**options)
    return task if name in TASKS else _check_task(task, name)


__all__ = ["Addition", "Calculator", "Countdown", "JsonlTask", "Multiplication", "Problem", "ProceduralTask",
           "ReasoningGymTask", "Task", "get_task", "list_tasks", "safe_eval", "task_options"]

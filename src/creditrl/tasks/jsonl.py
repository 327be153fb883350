"""The user's own data: a local JSONL or Parquet file with prompt/answer columns.

A ``prompt`` is a string (standard) or a list of ``{"role", "content"}`` messages
(conversational), TRL's conventions; ``chat_template`` / ``system_prompt`` decide how it is
rendered (``tasks/chat.py``). An ``answer`` is a string or a number. Bad rows are reported
before training with the file name and up to 10 row numbers.

JSON lines are read row by row with one clear error per problem (file and line); Parquet via
``datasets``. Rows are split into train/test deterministically by
``seed``. Checkers: ``exact`` (string equality up to surrounding whitespace), ``numeric``
(the last number of the response equals the answer: exactly by default, within the absolute
``tolerance`` when one is set; "1,234" counts as 1234 only with separators every 3 digits, so
"1,2,3" is read as 3), ``math`` (math-verify parse + verify of the last ``MATH_TAIL_CHARS``
characters, for LaTeX/boxed answers; quiet, 5 s timeout) or ``"pkg.module:function"`` called as
``fn(prompt, response, answer) -> float``. A checker never raises on model output: errors inside
a user function are reported once as a warning and give NaN, which the rollout counts as reward
0 and logs as ``reward_invalid_frac``.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import logging
import math
import random
import re
import threading
import warnings
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Callable

from creditrl.utils.validate import check_range
from creditrl.tasks.base import Problem
from creditrl.tasks.chat import check_chat_template, check_prompt

CHECKERS = ("exact", "numeric", "math")
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_NUMBER = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")
MATH_TAIL_CHARS = 2000   # math-verify reads this tail of a response: where the final answer is


def check_exact(prompt: str, response: str, answer: str) -> float:
    return float(response.strip() == answer.strip())


def _last_number(text: str) -> Decimal | None:
    """The last number written in ``text``, exactly (thousands separators in valid places only)."""
    found = _NUMBER.findall(text)
    try:
        value = Decimal(found[-1].replace(",", "")) if found else None
    except InvalidOperation:
        return None
    return value if value is not None and value.is_finite() else None


def make_numeric(tolerance: float) -> Callable[[str, str, str], float]:
    def check_numeric(prompt: str, response: str, answer: str) -> float:
        got, want = _last_number(response), _last_number(answer)
        if got is None or want is None:
            return 0.0
        return float(got == want if tolerance == 0 else abs(got - want) <= Decimal(repr(tolerance)))
    return check_numeric


def check_math(prompt: str, response: str, answer: str) -> float:
    """math-verify: parse both sides (LaTeX, ``\\boxed{}``, plain expressions) and compare."""
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only works on the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = answer if "$" in answer or "\\boxed" in answer else f"${answer}$"
    quiet = logging.getLogger("math_verify")
    level, quiet.level = quiet.level, logging.CRITICAL   # it logs the whole response on a timeout
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return float(verify(parse(gold, parsing_timeout=timeout),
                                parse(response[-MATH_TAIL_CHARS:], parsing_timeout=timeout), timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - malformed model output is reward 0, never a crash
        return 0.0
    finally:
        quiet.level = level


def resolve_checker(checker: str, tolerance: float) -> Callable[[str, str, str], float]:
    """A checker name or ``"pkg.module:function"`` -> ``fn(prompt, response, answer)``."""
    if not isinstance(checker, str):
        raise TypeError(f"checker: expected a str, got {type(checker).__name__}")
    if checker == "exact":
        return check_exact
    if checker == "numeric":
        return make_numeric(tolerance)
    if checker == "math":
        return check_math
    if ":" not in checker:
        raise ValueError(f"checker: unknown value {checker!r}; valid values are {list(CHECKERS)} "
                         "or 'package.module:function'")
    module_name, _, attr = checker.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"checker: cannot import {checker!r} ({err})") from err
    if not callable(fn):
        raise TypeError(f"checker: {checker!r} is not callable")
    return fn


MAX_LINE_BYTES = 1 << 20   # one JSONL row (1 MiB): larger lines are refused, never read whole


def read_json_rows(file: Path) -> dict[str, list]:
    """Columns of a JSON-lines file (or a JSON array of objects), read with one clear error per
    problem: empty file, a line over ``MAX_LINE_BYTES``, invalid UTF-8, malformed JSON or a
    row that is not an object, each naming the file and the line."""
    rows: list[dict] = []
    with open(file, "rb") as fh:
        head = fh.read(1 << 16).lstrip()
        fh.seek(0)
        if head.startswith(b"["):                     # a JSON array of objects
            if file.stat().st_size > 64 * MAX_LINE_BYTES:
                raise ValueError(f"path: {file.name} is a JSON array over {64 * MAX_LINE_BYTES >> 20} MiB; use JSON lines")
            try:
                data = json.loads(fh.read().decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as err:
                raise ValueError(f"path: {file.name}: not a valid JSON array ({err})") from None
            rows = data if isinstance(data, list) else []
            lines = range(1, len(rows) + 1)
        else:
            lines = []
            number = 0
            while True:
                raw = fh.readline(MAX_LINE_BYTES + 1)
                if not raw:
                    break
                number += 1
                if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                    raise ValueError(f"path: {file.name} line {number} is longer than {MAX_LINE_BYTES >> 20} MiB "
                                     f"(the limit for one row)")
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    raise ValueError(f"path: {file.name} line {number} is not valid UTF-8 ({err.reason} at byte "
                                     f"{err.start})") from None
                if not text.strip():
                    continue
                try:
                    rows.append(json.loads(text))
                except ValueError as err:
                    raise ValueError(f"path: {file.name} line {number}: malformed JSON ({err})") from None
                lines.append(number)
    if not rows:
        raise ValueError(f"path: {file.name} has no rows; expected one JSON object per line with prompt and answer")
    bad = [str(n) for n, row in zip(lines, rows) if not isinstance(row, dict)]
    if bad:
        raise ValueError(f"path: {file.name}: line(s) {', '.join(bad[:10])} are not JSON objects")
    keys = list(dict.fromkeys(k for row in rows for k in row))
    return {k: [row.get(k) for row in rows] for k in keys}


def read_parquet(file: Path) -> dict[str, list]:
    """Columns of a Parquet file (via ``datasets``), with a clear error when it cannot be read."""
    import datasets

    try:
        data = datasets.load_dataset("parquet", data_files=str(file), split="train")
    except Exception as err:  # noqa: BLE001 - a dependency's error type, reported with the file
        raise ValueError(f"path: {file.name}: cannot read it as Parquet ({type(err).__name__}: {err})") from None
    if len(data) == 0:
        raise ValueError(f"path: {file.name} has no rows")
    return {k: data[k] for k in data.column_names}


def rows_to_problems(file_name: str, prompts: list, answers: list) -> list[Problem]:
    """Problems from the prompt/answer columns; one error listing the bad rows (1-based)."""
    problems, bad = [], []
    for row, (prompt, answer) in enumerate(zip(prompts, answers), start=1):
        try:
            prompt = check_prompt(prompt, "prompt")
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise ValueError(f"answer: expected a string or a number, got {str(answer)[:40]!r}")
            problems.append(Problem(prompt, answer if isinstance(answer, str) else repr(answer)))
        except ValueError as err:
            bad.append(f"row {row}: {err}")
    if bad:
        raise ValueError(f"path: {file_name} has {len(bad)} invalid row(s); " + "; ".join(bad[:10]))
    return problems


class JsonlTask:
    """Prompt/answer pairs from a local file; ``sample`` draws from the train split."""

    name = "jsonl"
    max_tool_calls = 0
    tool_stop = None

    def __init__(self, path: str, checker: str = "exact", prompt_key: str = "prompt",
                 answer_key: str = "answer", test_fraction: float = 0.1, tolerance: float = 0.0,
                 *, seed: int = 0, test_size: int | None = None, chat_template="auto",
                 system_prompt: str | None = None, truncate_prompts: bool = False):
        file = Path(path).expanduser()
        if not file.is_file():
            raise FileNotFoundError(f"path: no such file {str(file)!r} (expected a local .jsonl/.json/.parquet file)")
        fmt = FORMATS.get(file.suffix.lower())
        if fmt is None:
            raise ValueError(f"path: expected a file ending in {sorted(FORMATS)}, got {file.name!r}")
        check_range("test_fraction", test_fraction, 0, 1, low_inclusive=False, high_inclusive=False)
        check_range("tolerance", tolerance, 0)
        check_chat_template(chat_template)
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError(f"system_prompt: expected a string or null, got {system_prompt!r}")
        self._check = resolve_checker(checker, tolerance)
        if not isinstance(truncate_prompts, bool):
            raise ValueError(f"truncate_prompts: expected true or false, got {truncate_prompts!r}")
        self.chat_template, self.system_prompt = chat_template, system_prompt
        self.truncate_prompts = truncate_prompts
        self.max_prompt_tokens: int | None = None   # set by the trainer when prompts must be truncated
        self.options = {"path": str(file), "checker": checker, "prompt_key": prompt_key, "answer_key": answer_key,
                        "test_fraction": test_fraction, "tolerance": tolerance, "seed": seed, "test_size": test_size,
                        "chat_template": chat_template, "system_prompt": system_prompt,
                        "truncate_prompts": truncate_prompts}
        self._digest = hashlib.sha256(file.read_bytes()).hexdigest()

        columns = read_parquet(file) if fmt == "parquet" else read_json_rows(file)
        for arg, key in (("prompt_key", prompt_key), ("answer_key", answer_key)):
            if key not in columns:
                raise ValueError(f"{arg}: column {key!r} not in {file.name}; columns are {list(columns)}")
        problems = rows_to_problems(file.name, columns[prompt_key], columns[answer_key])
        if len(problems) < 2:
            raise ValueError(f"path: expected at least 2 rows to split into train/test, got {len(problems)}")
        order = list(range(len(problems)))
        random.Random(seed).shuffle(order)
        n_test = min(len(problems) - 1, max(1, round(test_fraction * len(problems))))
        if test_size is not None:
            n_test = min(n_test, test_size)
        self._test = [problems[i] for i in order[:n_test]]
        self._train = [problems[i] for i in order[n_test:]]
        self._warned = False

    def sample(self, rng: random.Random) -> Problem:
        return rng.choice(self._train)

    def test_set(self) -> list[Problem]:
        return list(self._test)

    def train_set(self) -> list[Problem]:
        return list(self._train)

    def reward(self, problem: Problem, response: str) -> float:
        if not isinstance(response, str):
            return 0.0
        try:
            value = float(self._check(problem.prompt, response, problem.answer))
        except Exception as err:  # noqa: BLE001 - a user checker bug must not kill training
            value = math.nan
            if not self._warned:
                warnings.warn(f"checker {self.options['checker']!r} raised {err!r}; counting reward 0", stacklevel=2)
                self._warned = True
        return value   # NaN/inf (or a checker error) is counted as 0 and logged by the rollout

    def tool_output(self, response_so_far: str) -> str | None:
        return None

    def sft_target(self, problem: Problem) -> str:
        return problem.answer

    def alphabet(self) -> str:
        texts = [m["content"] for p in self._train + self._test
                 for m in (p.prompt if isinstance(p.prompt, list) else [{"content": p.prompt}])]
        return "".join(sorted(set("".join(texts + [p.answer for p in self._train + self._test]))))

    def fingerprint(self) -> dict[str, Any]:
        return {"name": self.name, **self.options, "data_sha256": self._digest}

    def __repr__(self) -> str:
        return f"JsonlTask({self.options['path']!r}, checker={self.options['checker']!r})"

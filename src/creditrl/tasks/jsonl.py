"""The user's own data: a local JSONL or Parquet file, TRL's or verl's layout read as is.

A ``prompt`` is a string (standard) or a list of ``{"role", "content"}`` messages
(conversational), TRL's conventions; ``chat_template`` / ``system_prompt`` decide how it is
rendered (``tasks/chat.py``). An ``answer`` is a string or a number, or for a checker of your
own in TRL's or verl's form any JSON value, passed to it as the data holds it (a list of accepted
answers, Search-R1's ``{"target": [...]}``). Checkers in creditrl's form read the answer as text: the
built-ins need a non-empty one, ``numeric`` one number. Bad rows are reported before training with the file
name and up to 10 row numbers.

Columns are addressed by name or, inside nested columns, by a dotted key
(``answer_key=reward_model.ground_truth``). A file in verl's RL layout (``prompt`` as messages,
``reward_model: {style, ground_truth}``, ``data_source``, ``extra_info``) is recognised without
options: with no ``answer`` column and ``answer_key`` unset, the answer is
``reward_model.ground_truth``. Every column but the prompt stays with its row
(``Problem.meta["columns"]``): TRL-style checkers receive them as keyword arguments, verl-style
ones the ``data_source`` and ``extra_info``; ``data_source`` also names the row's dataset
(per-dataset accuracy when there are several).

JSON lines are read row by row with one clear error per problem (file and line); Parquet via
``datasets``. Rows are split into train/test deterministically by ``seed``, by distinct prompt:
rows that repeat a prompt all go to the same side (with a warning giving their count), so the
held-out set never holds a prompt trained on. Checkers, reward terms and their time limit:
``tasks/rewards.py``.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import warnings
from pathlib import Path
from typing import Any

from creditrl.utils.validate import check_int, check_range
from creditrl.tasks.base import Problem
from creditrl.tasks.chat import check_chat_template, check_prompt
from creditrl.tasks.checkers import answer_number
from creditrl.tasks.rewards import DEFAULT_TIMEOUT, Scores, reward_terms, score_terms

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
VERL_ANSWER_KEY = "reward_model.ground_truth"


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
    """Columns of a Parquet file (via ``datasets``), with a clear error when it cannot be read or
    has no rows (its footer gives the row count without reading the data)."""
    import datasets
    import pyarrow.parquet

    try:
        rows = pyarrow.parquet.ParquetFile(file).metadata.num_rows
        data = datasets.load_dataset("parquet", data_files=str(file), split="train") if rows else None
    except Exception as err:  # noqa: BLE001 - a dependency's error type, reported with the file
        raise ValueError(f"path: {file.name}: cannot read it as Parquet ({type(err).__name__}: {err})") from None
    if data is None or len(data) == 0:
        raise ValueError(f"path: {file.name} has no rows; expected a Parquet file with prompt and answer columns")
    return {k: data[k] for k in data.column_names}


def column_values(columns: dict[str, list], key: str, arg: str, file_name: str) -> list:
    """The values of column ``key``, or of a field inside a nested column by dotted key
    (``reward_model.ground_truth``); a missing one is an error naming ``arg`` and the row."""
    if key in columns:
        return columns[key]
    head, _, rest = key.partition(".")
    if not rest or head not in columns:
        raise ValueError(f"{arg}: column {key!r} not in {file_name}; columns are {list(columns)}")
    values = []
    for row, value in enumerate(columns[head], start=1):
        for part in rest.split("."):
            if not isinstance(value, dict) or part not in value:
                raise ValueError(f"{arg}: row {row} of {file_name} has no {key!r} (its {head!r} is "
                                 f"{str(columns[head][row - 1])[:80]!r})")
            value = value[part]
        values.append(value)
    return values


def rows_to_problems(file_name: str, prompts: list, answers: list, rows: list[dict] | None = None) -> list[Problem]:
    """Problems from the prompt/answer columns (``rows``: each row's other columns, kept in
    ``meta["columns"]``); one error listing the bad rows (1-based)."""
    problems, bad = [], []
    for row, (prompt, answer) in enumerate(zip(prompts, answers), start=1):
        try:
            prompt = check_prompt(prompt, "prompt")
            if answer is None:          # a JSON line without the key reads as null too
                raise ValueError("answer: missing (the row has no answer, or it is null); expected a string, a "
                                 "number, a list or a mapping")
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float, list, dict)):
                raise ValueError(f"answer: expected a string, a number, a list or a mapping, got {str(answer)[:40]!r}")
            if isinstance(answer, float) and not math.isfinite(answer):
                raise ValueError(f"answer: expected a finite number, got {answer!r}")
            columns = rows[row - 1] if rows else {}
            meta = {"columns": columns, "ground_truth": answer}
            if isinstance(columns.get("data_source"), str):
                meta["dataset"] = columns["data_source"]
            problems.append(Problem(prompt, answer_text(answer), meta))
        except ValueError as err:
            bad.append(f"row {row}: {err}")
    if bad:
        raise ValueError(f"path: {file_name} has {len(bad)} invalid row(s); " + "; ".join(bad[:10]))
    return problems


def answer_text(answer: str | int | float | list | dict) -> str:
    """``Problem.answer``: a string as it is, a number as written ("42" for 42.0, a float column's
    integers), a list or mapping as JSON."""
    if isinstance(answer, str):
        return answer
    if isinstance(answer, float):
        return str(int(answer)) if answer.is_integer() else repr(answer)
    return str(answer) if isinstance(answer, int) else json.dumps(answer)


def check_answers(file_name: str, problems: list[Problem], terms: list) -> None:
    """Refuse, naming the rows, the answers a checker among ``terms`` cannot read: a list or mapping
    where a checker takes the answer as text (the built-ins, and functions in creditrl's form
    ``fn(prompt, response, answer)``, which would get its JSON); for the built-ins an empty text
    (``exact`` would reward an empty completion, ``numeric`` and ``math`` nothing), and for
    ``numeric`` a text stating no single number (``answer_number``)."""
    builtin = {fn.builtin for fn, _ in terms if fn.builtin}
    text = sorted({fn.name for fn, _ in terms if fn.convention == "creditrl"})
    if not text:
        return
    bad = []
    for row, problem in enumerate(problems, start=1):
        raw = problem.meta["ground_truth"]
        if isinstance(raw, (list, dict)):
            bad.append(f"row {row}: a {type(raw).__name__}")
        elif builtin and not problem.answer.strip():
            bad.append(f"row {row}: an empty answer")
        elif "numeric" in builtin and answer_number(problem.answer) is None:
            bad.append(f"row {row}: {problem.answer[:40]!r} states no single number")
    if bad:
        raise ValueError(f"path: {file_name} has {len(bad)} answer(s) the checker(s) {text} cannot read "
                         f"({'; '.join(bad[:10])}); these read the answer as text: fix the rows, or score them with "
                         f"a function of your own in TRL's or verl's form (task.options.checker=package.module:"
                         f"function), which gets the answer as the data holds it")


def read_problems(file: Path, prompt_key: str, answer_key: str | None) -> list[Problem]:
    """Every row of ``file`` as a Problem; ``answer_key=None`` is ``answer``, or verl's
    ``reward_model.ground_truth`` in a file without an ``answer`` column."""
    columns = read_parquet(file) if FORMATS[file.suffix.lower()] == "parquet" else read_json_rows(file)
    if answer_key is None:
        answer_key = VERL_ANSWER_KEY if "answer" not in columns and "reward_model" in columns else "answer"
    prompts = column_values(columns, prompt_key, "prompt_key", file.name)
    answers = column_values(columns, answer_key, "answer_key", file.name)
    others = [k for k in columns if k != prompt_key]
    rows = [{k: columns[k][i] for k in others} for i in range(len(prompts))]
    return rows_to_problems(file.name, prompts, answers, rows)


def split_by_prompt(problems: list[Problem], file_name: str, test_fraction: float, test_size: int | None,
                    seed: int) -> tuple[list[Problem], list[Problem]]:
    """(train, test): the distinct prompts shuffled by ``seed``, ``test_fraction`` of them (at most
    ``test_size``, at least 1, never all) held out with every row that repeats them. Without repeats
    this is a split of the rows; repeats are counted in a warning."""
    rows: dict[str, list[Problem]] = {}
    for p in problems:
        rows.setdefault(json.dumps(p.prompt, sort_keys=True), []).append(p)
    prompts = list(rows.values())
    if len(prompts) < 2:
        raise ValueError(f"path: expected at least 2 distinct prompts to split into train/test, got {len(prompts)} "
                         f"in {len(problems)} row(s)")
    if len(prompts) < len(problems):
        warnings.warn(f"{file_name}: {len(problems) - len(prompts)} of {len(problems)} rows repeat the prompt of "
                      f"another row; the train/held-out split is by distinct prompt ({len(prompts)}), so no prompt is "
                      f"both trained on and held out", stacklevel=3)
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    n_test = min(len(prompts) - 1, max(1, round(test_fraction * len(prompts))))
    if test_size is not None:
        n_test = min(n_test, test_size)
    return ([p for i in order[n_test:] for p in prompts[i]], [p for i in order[:n_test] for p in prompts[i]])


class JsonlTask:
    """Prompt/answer pairs from a local file; ``sample`` draws from the train split. Options of
    the reward (``checker``, ``checker_convention``, ``checker_timeout``, ``rewards``,
    ``tolerance``): ``tasks/rewards.py``."""

    name = "jsonl"
    max_tool_calls = 0
    tool_stop = None

    def __init__(self, path: str, checker: str = "exact", prompt_key: str = "prompt",
                 answer_key: str | None = None, test_fraction: float = 0.1, tolerance: float = 0.0,
                 *, seed: int = 0, test_size: int | None = None, chat_template="auto",
                 system_prompt: str | None = None, truncate_prompts: bool = False, checker_convention: str = "auto",
                 checker_timeout: float | None = DEFAULT_TIMEOUT, rewards: list | None = None):
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"path: expected the path of a local .jsonl/.json/.parquet file (a string; quote a "
                             f"name YAML reads as a number), got {path!r}")
        file = Path(path).expanduser()
        if file.is_dir():
            raise ValueError(f"path: expected a local .jsonl/.json/.parquet file, got the directory {str(file)!r}")
        if not file.is_file():
            raise FileNotFoundError(f"path: no such file {str(file)!r} (expected a local .jsonl/.json/.parquet file)")
        if file.suffix.lower() not in FORMATS:
            raise ValueError(f"path: expected a file ending in {sorted(FORMATS)}, got {file.name!r}")
        check_int("seed", seed)
        check_range("test_fraction", test_fraction, 0, 1, low_inclusive=False, high_inclusive=False)
        if test_size is not None and (isinstance(test_size, bool) or not isinstance(test_size, int) or test_size < 1):
            raise ValueError(f"test_size: expected a positive int (held-out prompts) or null, got {test_size!r}")
        check_range("tolerance", tolerance, 0)
        check_chat_template(chat_template)
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError(f"system_prompt: expected a string or null, got {system_prompt!r}")
        if not isinstance(truncate_prompts, bool):
            raise ValueError(f"truncate_prompts: expected true or false, got {truncate_prompts!r}")
        self.chat_template, self.system_prompt = chat_template, system_prompt
        self.truncate_prompts = truncate_prompts
        self.max_prompt_tokens: int | None = None   # set by the trainer when prompts must be truncated
        self.options = {"path": str(file), "checker": checker, "prompt_key": prompt_key, "answer_key": answer_key,
                        "test_fraction": test_fraction, "tolerance": tolerance, "seed": seed, "test_size": test_size,
                        "chat_template": chat_template, "system_prompt": system_prompt,
                        "truncate_prompts": truncate_prompts, "checker_convention": checker_convention,
                        "checker_timeout": checker_timeout, "rewards": rewards or []}
        self._digest = hashlib.sha256(file.read_bytes()).hexdigest()
        problems = read_problems(file, prompt_key, answer_key)
        columns = list(dict.fromkeys(k for p in problems for k in p.meta["columns"]))
        self.dataset_names = sorted({p.meta["dataset"] for p in problems if "dataset" in p.meta})   # data_source
        self._terms = reward_terms(checker, rewards or [], convention=checker_convention, tolerance=tolerance,
                                   timeout=checker_timeout, columns=columns)
        check_answers(file.name, problems, self._terms)
        self._train, self._test = split_by_prompt(problems, file.name, test_fraction, test_size, seed)

    def sample(self, rng: random.Random) -> Problem:
        return rng.choice(self._train)

    def test_set(self) -> list[Problem]:
        return list(self._test)

    def train_set(self) -> list[Problem]:
        return list(self._train)

    def score(self, problems: list[Problem], responses: list[str]) -> Scores:
        """The rewards of a batch of responses (NaN where invalid; see ``tasks/rewards.py``)."""
        return score_terms(self._terms, problems, responses)

    def reward(self, problem: Problem, response: str) -> float:
        if not isinstance(response, str):
            return 0.0
        return self.score([problem], [response]).rewards[0]   # NaN/inf is counted as 0 and logged by the rollout

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

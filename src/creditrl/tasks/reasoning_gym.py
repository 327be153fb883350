"""reasoning-gym's procedural datasets as a task (``task.name=reasoning_gym``; extra ``creditrl[reasoning-gym]``).

Options:

- ``dataset``: a reasoning-gym dataset name (``basic_arithmetic``), or a weighted mix: a list of
  ``{name, weight, config}`` (reasoning-gym's own ``composite`` dataset);
- ``config``: the single dataset's options, passed to ``reasoning_gym.create_dataset`` (a mix
  gives each dataset its own ``config``);
- ``seed``, ``test_size``: reasoning-gym seeds item i of a dataset with ``seed + i`` (a mix's
  j-th dataset with ``seed + j + 1 + i``). The held-out problems are items 0..test_size-1 of
  the dataset seeded ``seed``; training problems are drawn from the one seeded ``seed + test_size
  + len(mix) + 1``, so the two never share a generator seed, and a training question equal to a
  held-out one is skipped as well;
- ``system_prompt``: the answer-format instruction: a key of ``reasoning_gym.utils.SYSTEM_PROMPTS``
  (default ``default``: think, then the answer inside ``<answer></answer>``) or your own text;
- ``format``: ``natural`` (a chat message with the instruction as the system prompt, rendered
  with the tokenizer's chat template) or ``compact`` (one plain-text prompt: instruction,
  question), ``auto`` picks by the model as for the built-in tasks; ``chat_template`` as elsewhere;
- ``prefill``: text the answer starts with (e.g. ``<answer>``): the assistant message the prompt
  ends with, continued by the model (TRL's convention; appended to a compact prompt); the
  scored text is the prefill followed by the completion;
- ``checker_timeout``: the time limit of one scoring call (``tasks/rewards.py``).

The reward is reasoning-gym's own: the dataset's ``score_answer`` on ``extract_answer(response)``
(the last ``<answer>…</answer>``), in [0, 1] (some datasets give partial credit; a response counts
as correct at 1). Each problem keeps its dataset name and difficulty (``Problem.meta``, written to
completions.jsonl); a mix logs accuracy per dataset. Scoring goes through ``compute_score``, a
verl-style reward function that also serves verl (``extra_info`` carries the entry).
"""
from __future__ import annotations

import functools
import json
import random
from typing import Any

from creditrl.utils.validate import check_int
from creditrl.tasks.base import FORMATS, Problem
from creditrl.tasks.chat import check_chat_template
from creditrl.tasks.rewards import DEFAULT_TIMEOUT, RewardFunction, Scores

EXTRA = "reasoning-gym"
TRAIN_SIZE = 1_000_000     # training items are drawn from this many generator seeds
_SCORER = "creditrl.tasks.reasoning_gym:compute_score"


def import_reasoning_gym():
    """The ``reasoning_gym`` module, or an ImportError naming the extra that installs it."""
    try:
        import reasoning_gym
    except ImportError as err:
        raise ImportError(f"task.name=reasoning_gym needs the reasoning-gym package: pip install "
                          f"'creditrl[{EXTRA}]' (or pip install reasoning-gym); {err}") from None
    return reasoning_gym


def _normalize_mix(dataset: Any, config: Any) -> list[dict]:
    """``dataset`` (a name, or a list of ``{name, weight, config}``) as a checked list of specs."""
    if isinstance(dataset, str):
        if config is not None and not isinstance(config, dict):
            raise ValueError(f"config: expected a mapping of {dataset!r}'s options, got {config!r}")
        return [{"name": dataset, "weight": 1.0, "config": _check_config("config", config or {})}]
    if not isinstance(dataset, list) or not dataset:
        raise ValueError(f"dataset: expected a reasoning-gym dataset name or a non-empty list of "
                         f"{{name, weight, config}}, got {dataset!r}")
    if config:
        raise ValueError("config: a mix gives each dataset its own config (dataset: [{name, weight, config}]); "
                         f"got a top-level config {config!r}")
    specs = []
    for i, spec in enumerate(dataset):
        if not isinstance(spec, dict) or "name" not in spec or set(spec) - {"name", "weight", "config"}:
            raise ValueError(f"dataset[{i}]: expected a mapping with 'name' and optional 'weight', 'config', got {spec!r}")
        weight = spec.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"dataset[{i}].weight: expected a positive number, got {weight!r}")
        if not isinstance(spec.get("config") or {}, dict):
            raise ValueError(f"dataset[{i}].config: expected a mapping, got {spec['config']!r}")
        config = _check_config(f"dataset[{i}].config", spec.get("config") or {})
        specs.append({"name": spec["name"], "weight": float(weight), "config": config})
    names = [s["name"] for s in specs]
    if len(set(names)) < len(names):
        raise ValueError(f"dataset: each dataset may appear once in a mix, got {names}")
    return specs


def _check_config(where: str, config: dict) -> dict:
    """A copy of a dataset's options; ``seed`` and ``size`` are creditrl's to set (see the module doc)."""
    taken = sorted({"seed", "size"} & set(config))
    if taken:
        raise ValueError(f"{where}: {taken} are set by creditrl from task.options.seed and task.options.test_size "
                         f"(held-out and training problems come from disjoint seeds); remove them")
    return dict(config)


def build_dataset(specs: list[dict], seed: int, size: int):
    """The reasoning-gym dataset of ``specs`` (one dataset, or a ``composite`` for a mix)."""
    rg = import_reasoning_gym()
    from reasoning_gym.composite import DatasetSpec
    from reasoning_gym.factory import DATASETS

    for i, spec in enumerate(specs):
        if spec["name"] not in DATASETS:
            where = "dataset" if len(specs) == 1 else f"dataset[{i}].name"
            raise ValueError(f"{where}: unknown reasoning-gym dataset {spec['name']!r}; known datasets: "
                             f"{sorted(k for k in DATASETS if k != 'composite')}")
    try:
        if len(specs) == 1:
            return rg.create_dataset(specs[0]["name"], **{**specs[0]["config"], "seed": seed, "size": size})
        mix = [DatasetSpec(s["name"], s["weight"], s["config"]) for s in specs]
        return rg.create_dataset("composite", datasets=mix, seed=seed, size=size)
    except (TypeError, ValueError, AssertionError) as err:
        raise ValueError(f"config: reasoning-gym refused {[{s['name']: s['config']} for s in specs]}: "
                         f"{type(err).__name__}: {err}") from None


@functools.lru_cache(maxsize=16)
def _scoring_dataset(spec_json: str):
    return build_dataset(json.loads(spec_json), seed=0, size=1)


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict) -> float:
    """verl-style reward: reasoning-gym's ``score_answer`` of the answer extracted from
    ``solution_str``; ``extra_info`` holds the ``entry`` and the dataset ``spec`` (JSON)."""
    from reasoning_gym.utils import extract_answer

    dataset = _scoring_dataset(extra_info["spec"])
    return float(dataset.score_answer(extract_answer(solution_str), extra_info["entry"]))


class ReasoningGymTask:
    """A reasoning-gym dataset or mix: endless seeded training stream, fixed held-out set."""

    name = "reasoning_gym"
    max_tool_calls = 0
    tool_stop = None

    def __init__(self, dataset: Any, config: dict | None = None, *, seed: int = 0, test_size: int = 200,
                 system_prompt: str | None = "default", format: str = "auto", chat_template="auto",
                 prefill: str | None = None, checker_timeout: float | None = DEFAULT_TIMEOUT):
        rg = import_reasoning_gym()
        from reasoning_gym.utils import SYSTEM_PROMPTS

        check_int("seed", seed, 0)
        if isinstance(test_size, bool) or not isinstance(test_size, int) or test_size < 1:
            raise ValueError(f"test_size: expected a positive int, got {test_size!r}")
        if format not in FORMATS:
            raise ValueError(f"format: expected one of {list(FORMATS)}, got {format!r}")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError(f"system_prompt: expected a key of {sorted(SYSTEM_PROMPTS)}, your own text or null, "
                             f"got {system_prompt!r}")
        if isinstance(system_prompt, str) and system_prompt not in SYSTEM_PROMPTS and system_prompt.isascii() \
                and system_prompt.isidentifier():
            # one bare word is a mistyped key, not an instruction: sent as text, the model never learns the format
            raise ValueError(f"system_prompt: {system_prompt!r} is not a key of reasoning-gym's SYSTEM_PROMPTS "
                             f"{sorted(SYSTEM_PROMPTS)}; expected one of them, your own text (more than one word) or null")
        check_chat_template(chat_template)
        if prefill is not None and (not isinstance(prefill, str) or not prefill):
            raise ValueError(f"prefill: expected a non-empty string or null, got {prefill!r}")
        self.prefill = prefill or ""
        self.specs = _normalize_mix(dataset, config)
        self.dataset_names = [s["name"] for s in self.specs]
        self.instruction = SYSTEM_PROMPTS.get(system_prompt, system_prompt)
        self.format = "natural" if format == "natural" else "compact"
        self.chat_template = chat_template
        self.system_prompt = self.instruction if self.format == "natural" else None
        self.options = {"dataset": dataset, "config": config, "seed": seed, "test_size": test_size,
                        "system_prompt": system_prompt, "format": self.format, "chat_template": chat_template,
                        "prefill": prefill, "checker_timeout": checker_timeout, "reasoning_gym": getattr(rg, "__version__", None)}
        self._spec_json = json.dumps(self.specs, sort_keys=True)
        self._test_data = build_dataset(self.specs, seed, test_size)
        self._train_data = build_dataset(self.specs, seed + test_size + len(self.specs) + 1, TRAIN_SIZE)
        self._test = [self._problem(self._test_data[i]) for i in range(test_size)]
        self._test_questions = frozenset(p.meta["question"] for p in self._test)
        self._reward = RewardFunction(_SCORER, convention="verl", timeout=checker_timeout,
                                      what="task.name=reasoning_gym scoring")

    def _problem(self, entry: dict) -> Problem:
        question = entry["question"]
        if self.format == "natural":
            prompt: Any = [{"role": "user", "content": question}]
            prompt += [{"role": "assistant", "content": self.prefill}] if self.prefill else []
        else:
            prompt = (f"{self.instruction}\n\n{question}\n" if self.instruction else f"{question}\n") + self.prefill
        metadata = entry.get("metadata", {})
        name = metadata.get("source_dataset", self.dataset_names[0])
        answer = "" if entry.get("answer") is None else str(entry["answer"])
        meta = {"dataset": name, "question": question, "ground_truth": entry.get("answer"),
                "columns": {"data_source": name, "extra_info": {"entry": entry, "spec": self._spec_json}}}
        if "difficulty" in metadata:
            meta["difficulty"] = metadata["difficulty"]
        return Problem(prompt, answer, meta)

    def sample(self, rng: random.Random) -> Problem:
        for _ in range(100):   # held-out questions are never trained on
            problem = self._problem(self._train_data[rng.randrange(TRAIN_SIZE)])
            if problem.meta["question"] not in self._test_questions:
                return problem
        raise ValueError(f"task.options.test_size: 100 draws from the training items all hit the {len(self._test)} "
                         "held-out questions (the dataset has too few distinct questions for this held-out set); "
                         "lower task.options.test_size or widen task.options.config")

    def test_set(self) -> list[Problem]:
        return list(self._test)

    def score(self, problems: list[Problem], responses: list[str]) -> Scores:
        return self._reward.score(problems, [self.prefill + r for r in responses])

    def reward(self, problem: Problem, response: str) -> float:
        if not isinstance(response, str):
            return 0.0
        return self.score([problem], [response]).rewards[0]

    def tool_output(self, response_so_far: str) -> str | None:
        return None

    def sft_target(self, problem: Problem) -> str:
        return f"<answer>{problem.answer}</answer>".removeprefix(self.prefill)

    def alphabet(self) -> str:
        rng = random.Random(0)
        problems = self._test + [self.sample(rng) for _ in range(500)]
        texts = [m["content"] for p in problems for m in (p.prompt if isinstance(p.prompt, list) else
                                                          [{"content": p.prompt}])]
        return "".join(sorted(set("".join(texts + [self.sft_target(p) for p in problems] + [self.instruction or ""]))))

    def fingerprint(self) -> dict[str, Any]:
        return {"name": self.name, **self.options}

    def __repr__(self) -> str:
        return f"ReasoningGymTask({self.options['dataset']!r}, config={self.options['config']!r})"

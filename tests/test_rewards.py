"""Reward functions in TRL's and verl's conventions, weighted terms, time limits, verl's parquet layout."""
from __future__ import annotations

import math
import sys
import threading
import time

import pytest

from creditrl.tasks import get_task
from creditrl.tasks.base import Problem
from creditrl.tasks.rewards import RewardFunction, score_terms

USER_REWARDS = '''
import time

CALLS = []

def trl_reward(prompts, completions, difficulty, source, **kwargs):
    """TRL style: batched, dataset columns as keyword arguments."""
    out = []
    for prompt, completion, level, src, answer in zip(prompts, completions, difficulty, source, kwargs["answer"]):
        text = completion[0]["content"] if isinstance(completion, list) else completion
        out.append(None if src == "skip" else float(answer in text) + 0.01 * level)
    return out

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl style: one completion per call; a dict return logs its other keys."""
    return {"score": float(ground_truth in solution_str), "acc": ground_truth in solution_str,
            "source_len": len(data_source), "note": "text is not logged"}

def creditrl_style(prompt, response, answer):
    return 0.5 if answer in response else 0.0

def length_penalty(completions, **kwargs):
    return [-len(c if isinstance(c, str) else c[0]["content"]) / 100 for c in completions]

def sleepy(prompt, response, answer):
    if response == "hang":
        time.sleep(60)
    return 1.0

def wrong_length(prompts, completions, **kwargs):
    return [1.0]

def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}

def ambiguous(a, b):
    return 1.0

def needs_column(prompts, completions, solution, **kwargs):
    return [0.0] * len(prompts)

def unbounded(prompt, response, answer):
    return {"+": float("inf"), "-": -float("inf")}.get(response, 0.0)

def any_of(data_source, solution_str, ground_truth, extra_info=None):
    """verl style, several accepted answers (a list) or Search-R1's {"target": [...]}"""
    accepted = ground_truth["target"] if isinstance(ground_truth, dict) else ground_truth
    return float(solution_str.strip() in accepted)

def bonus(completions, **kwargs):
    return [1.0] * len(completions)

def graded(data_source, solution_str, ground_truth, extra_info=None):
    """verl's DAPO style: a shaped score, the verdict in ``acc``."""
    right = ground_truth == solution_str
    return {"score": 0.25 if right else -1.0, "acc": right}
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield "user_rewards"
    sys.modules.pop("user_rewards", None)


def _jsonl(path, rows):
    import json
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [{"prompt": f"q{i}", "answer": str(i), "difficulty": i % 3, "source": "skip" if i == 5 else "gen"}
        for i in range(12)]


# Rewards are float64 sums of a few weighted terms (math.fsum): exact to a rounding, inside pytest.approx's
# default 1e-6 relative used below.


def test_trl_reward_function_gets_dataset_columns(tmp_path, user_module):
    task = get_task("jsonl", path=_jsonl(tmp_path / "d.jsonl", ROWS), checker="user_rewards:trl_reward",
                    test_fraction=0.5)
    fn = task._terms[0][0]
    assert fn.convention == "trl"
    problems = task.train_set() + task.test_set()
    by_prompt = {p.prompt: p for p in problems}
    batch = [by_prompt["q4"], by_prompt["q5"], by_prompt["q7"]]
    scores = task.score(batch, ["it is 4", "it is 5", "no idea"])
    assert scores.rewards[0] == pytest.approx(1.0 + 0.01 * 1)     # difficulty 4 % 3 = 1 reached it
    assert math.isnan(scores.rewards[1])                           # None: no reward (TRL), counted invalid
    assert scores.rewards[2] == pytest.approx(0.01 * 1)


def test_trl_reward_sees_conversational_completions(tmp_path, user_module):
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i), "difficulty": 0, "source": "gen"}
            for i in range(4)]
    task = get_task("jsonl", path=_jsonl(tmp_path / "c.jsonl", rows), checker="user_rewards:trl_reward")
    p = task.train_set()[0]
    assert task.score([p], [f"so {p.answer}"]).rewards == [1.0]


def test_verl_compute_score_gets_data_source_and_logs_dict_keys(tmp_path, user_module):
    rows = [{"prompt": f"q{i}", "answer": str(i), "data_source": "openai/gsm8k" if i % 2 else "math"}
            for i in range(6)]
    task = get_task("jsonl", path=_jsonl(tmp_path / "v.jsonl", rows), checker="user_rewards:compute_score")
    assert task._terms[0][0].convention == "verl"
    problems = sorted(task.train_set() + task.test_set(), key=lambda p: p.prompt)
    scores = task.score(problems[:2], ["0", "wrong"])
    assert scores.rewards == [1.0, 0.0]
    assert scores.extras["acc"] == [1.0, 0.0]
    assert scores.extras["source_len"] == [len("math"), len("openai/gsm8k")]   # data_source reached it
    assert "note" not in scores.extras
    assert problems[1].meta["dataset"] == "openai/gsm8k"


def test_convention_detection_and_forcing(tmp_path, user_module):
    columns = ["answer", "difficulty", "source"]
    assert RewardFunction("user_rewards:creditrl_style").convention == "creditrl"
    assert RewardFunction("user_rewards:length_penalty", columns=columns).convention == "trl"
    assert RewardFunction("user_rewards:compute_score").convention == "verl"
    with pytest.raises(ValueError, match=r"cannot tell the convention of 'user_rewards:ambiguous'.*checker_convention"):
        RewardFunction("user_rewards:ambiguous")
    with pytest.raises(ValueError, match=r"must take \(prompt, response, answer\)"):
        RewardFunction("user_rewards:ambiguous", convention="creditrl")
    with pytest.raises(ValueError, match=r"requires \['solution'\], which the data does not have; the data's "
                                         r"columns are \['answer', 'difficulty', 'source'\]"):
        RewardFunction("user_rewards:needs_column", columns=columns)
    with pytest.raises(ValueError, match=r"checker_convention: expected one of"):
        RewardFunction("user_rewards:creditrl_style", convention="openai")
    with pytest.raises(ValueError, match=r"built-in checker 'exact' takes"):
        RewardFunction("exact", convention="trl")


def test_weighted_terms_sum_as_trl_does(tmp_path, user_module):
    task = get_task("jsonl", path=_jsonl(tmp_path / "d.jsonl", ROWS), checker="user_rewards:trl_reward",
                    rewards=[{"checker": "user_rewards:length_penalty", "weight": 0.5},
                             {"checker": "exact", "weight": 2.0}])
    by_prompt = {p.prompt: p for p in task.train_set() + task.test_set()}
    batch = [by_prompt["q3"], by_prompt["q5"]]
    responses = ["3", "it is 5"]
    scores = task.score(batch, responses)
    # row 0: trl 1 + 0.01*0, length -0.01, exact 1   -> 1 + 0.5 * -0.01 + 2 * 1
    assert scores.rewards[0] == pytest.approx(1.0 + 0.5 * -0.01 + 2.0)
    # row 1: trl None (skipped, TRL's nansum), length -0.07, exact 0
    assert scores.rewards[1] == pytest.approx(0.5 * -0.07)
    assert math.isnan(scores.extras["trl_reward"][1]) and scores.extras["exact"] == [1.0, 0.0]
    # each term stays a component (gdpo normalises them one by one), with its weight
    assert [(c.name, c.weight) for c in scores.components] == [("trl_reward", 1.0), ("length_penalty", 0.5),
                                                              ("exact", 2.0)]
    assert scores.components[2].values == [1.0, 0.0] and math.isnan(scores.components[0].values[1])
    with pytest.raises(ValueError, match=r"rewards\[0\].weight: expected a finite number"):
        get_task("jsonl", path=_jsonl(tmp_path / "d.jsonl", ROWS), rewards=[{"checker": "exact", "weight": "x"}])


def test_correct_is_the_answer_checkers_verdict_not_the_total(tmp_path, user_module):
    """accuracy (and so greedy_acc, pass@k, dynamic sampling's ``accuracy``) is the first term's own
    verdict: a length penalty does not make a right answer wrong, a format bonus does not make a
    wrong one right, and verl's ``acc`` decides where the checker returns one."""
    import torch
    from creditrl.runtime.rollout import score_rollouts

    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    problem = Problem("q3", "3")
    responses = ["3", "it is 4", "a long right answer? no: 3"]
    for extra, weight in (("user_rewards:length_penalty", 0.5), ("user_rewards:bonus", 1.0)):
        task = get_task("jsonl", path=path, rewards=[{"checker": extra, "weight": weight}])
        scores = task.score([problem] * 3, responses)
        checker = scores.components[0].values
        assert checker == [1.0, 0.0, 0.0] and scores.correct == [True, False, False]
        assert (scores.rewards[0] < 1.0) == (weight == 0.5) and (scores.rewards[1] >= 1.0) == (weight == 1.0)
        rollout = score_rollouts(scores, torch.tensor([1, 7, 26]), 64, (8, 1.0))   # the overlong penalty does not count either
        assert rollout["correct"].tolist() == [True, False, False]
    task = get_task("jsonl", path=path, checker="user_rewards:graded")
    scores = task.score([problem] * 2, ["3", "4"])
    assert scores.rewards == [0.25, -1.0] and scores.correct == [True, False]
    # an invalid reward is never correct, whatever else the checker says
    fn = RewardFunction("user_rewards:no_score")
    with pytest.warns(UserWarning, match="without a 'score' key"):
        assert score_terms([(fn, 1.0)], [problem], ["3"]).correct == [False]


def test_an_infinite_term_is_invalid_and_the_others_still_count(tmp_path, user_module):
    """±inf is an invalid reward, as NaN is: as one term of several it gives no reward, so the
    checker's 1 still counts; +inf and -inf in one row do not stop the step (math.fsum raises on them)."""
    task = get_task("jsonl", path=_jsonl(tmp_path / "d.jsonl", ROWS), checker="user_rewards:unbounded",
                    rewards=[{"checker": "user_rewards:unbounded", "weight": 1.0},
                             {"checker": "exact", "weight": 1.0}])
    with pytest.warns(UserWarning, match="not a finite float32 reward"):
        scores = task.score([Problem("q0", "0")] * 2, ["+", "-"])
    assert scores.rewards == [0.0, 0.0] and all(math.isnan(c) for c in scores.components[0].values)
    scores = task.score([Problem("q0", "+")], ["+"])      # warned once per checker, above
    assert scores.rewards == [1.0] and scores.correct == [False]


def test_a_list_or_mapping_answer_reaches_a_checker_of_ones_own_as_the_data_holds_it(tmp_path, user_module):
    rows = [{"prompt": "2+2?", "answer": ["four", "4"]}, {"prompt": "3+3?", "answer": {"target": ["six", "6"]}},
            {"prompt": "1+1?", "answer": "2"}]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    task = get_task("jsonl", path=path, checker="user_rewards:any_of")
    by_prompt = {p.prompt: p for p in task.train_set() + task.test_set()}
    assert task.score([by_prompt["2+2?"]] * 2, ["four", "five"]).rewards == [1.0, 0.0]
    assert task.score([by_prompt["3+3?"]], ["6"]).rewards == [1.0]
    assert by_prompt["2+2?"].answer == '["four", "4"]'          # its text, for logs and sft targets
    with pytest.raises(ValueError, match=r"2 answer\(s\) the checker\(s\) \['exact'\] cannot read "
                                         r"\(row 1: a list; row 2: a dict\)"):
        get_task("jsonl", path=path)
    # creditrl's own form reads the answer as text too: it would get the list's JSON, where "our" is in '["four", ..]'
    with pytest.raises(ValueError, match=r"the checker\(s\) \['user_rewards:creditrl_style'\] cannot read .* TRL's or "
                                         r"verl's form"):
        get_task("jsonl", path=path, checker="user_rewards:creditrl_style")


def test_all_terms_missing_is_invalid():
    fn = RewardFunction("exact")
    scores = score_terms([(fn, 1.0), (fn, 1.0)], [Problem("q", "1")], ["1"])
    assert scores.rewards == [2.0]


def test_bad_returns_are_invalid_with_one_warning(tmp_path, user_module):
    task = get_task("jsonl", path=_jsonl(tmp_path / "d.jsonl", ROWS), checker="user_rewards:no_score")
    with pytest.warns(UserWarning, match=r"returned a dict without a 'score' key"):
        assert math.isnan(task.reward(Problem("q", "1"), "1"))
    wrong = get_task("jsonl", path=_jsonl(tmp_path / "d.jsonl", ROWS), checker="user_rewards:wrong_length")
    with pytest.raises(ValueError, match=r"returned 1 values for 2 completions"):
        wrong.score([Problem("q", "1")] * 2, ["1", "2"])


def test_checker_timeout_off_the_main_thread(tmp_path, user_module):
    task = get_task("jsonl", path=_jsonl(tmp_path / "d.jsonl", ROWS), checker="user_rewards:sleepy",
                    checker_timeout=1.0)
    problems = [Problem("q", "1")] * 3
    results = {}

    def worker():
        with pytest.warns(UserWarning, match=r"took longer than task.options.checker_timeout=1 s"):
            results["scores"] = task.score(problems, ["ok", "hang", "ok"])

    thread = threading.Thread(target=worker)
    start = time.perf_counter()
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    assert time.perf_counter() - start < 20          # not the checker's 60 s
    scores = results["scores"]
    assert scores.rewards[0] == 1.0 and math.isnan(scores.rewards[1]) and scores.rewards[2] == 1.0   # restarted
    assert scores.timed_out == [False, True, False]


def test_math_checker_bounded_off_the_main_thread(tmp_path):
    path = _jsonl(tmp_path / "m.jsonl", [{"prompt": "a", "answer": "42"}, {"prompt": "b", "answer": "2"}])
    task = get_task("jsonl", path=path, checker="math")
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", task.reward(Problem("a", "42"), "$\\boxed{42}$")))
    thread.start()
    thread.join(60)
    assert out["r"] == 1.0


def test_rollout_counts_timeouts(tmp_path, user_module):
    import torch

    from creditrl.runtime.rollout import RolloutBatch, rollout_metrics

    batch = RolloutBatch(*(torch.zeros(1),) * 8, response_texts=[], problems=[], prompt_len=0, stopped=torch.ones(2),
                         prompt_texts=[], reward_timeouts=torch.tensor([True, False]),
                         reward_extras={"acc": torch.tensor([1.0, math.nan])})
    assert rollout_metrics(batch, task=None) == {"reward_timeouts": 1, "reward/acc": 1.0}


# ----------------------------------------------------------------------------- verl's parquet layout

def verl_rows(n: int = 8) -> list[dict]:
    """Rows as verl's data preprocessing scripts write them (examples/data_preprocess/gsm8k.py)."""
    return [{"data_source": "openai/gsm8k" if i % 2 else "lighteval/MATH",
             "prompt": [{"role": "user", "content": f"What is {i} + {i}? Let's think step by step."}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]


def test_verl_parquet_read_without_options(tmp_path, user_module):
    import datasets

    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(verl_rows()).to_parquet(str(path))
    task = get_task("jsonl", path=str(path), checker="user_rewards:compute_score", test_fraction=0.25)
    problems = sorted(task.train_set() + task.test_set(), key=lambda p: p.answer)
    p = next(q for q in problems if q.answer == "6")
    assert p.prompt == [{"role": "user", "content": "What is 3 + 3? Let's think step by step."}]
    assert p.meta["dataset"] == "openai/gsm8k" and p.meta["columns"]["extra_info"] == {"split": "train", "index": 3}
    scores = task.score([p], ["so the answer is 6"])
    assert scores.rewards == [1.0] and scores.extras["source_len"] == [len("openai/gsm8k")]
    assert task.dataset_names == ["lighteval/MATH", "openai/gsm8k"]
    explicit = get_task("jsonl", path=str(path), answer_key="reward_model.ground_truth", test_fraction=0.25)
    assert [q.answer for q in explicit.test_set()] == [q.answer for q in task.test_set()]
    with pytest.raises(ValueError, match=r"answer_key: row 1 of train.parquet has no 'reward_model.answer'"):
        get_task("jsonl", path=str(path), answer_key="reward_model.answer")


def test_verl_extra_columns_reach_trl_checkers(tmp_path, user_module):
    import datasets

    (tmp_path / "cols.py").write_text(
        "def reward(prompts, completions, data_source, reward_model, extra_info, ability, **kw):\n"
        "    return [float(r['ground_truth'] in c[0]['content']) + e['index'] / 100\n"
        "            for c, r, e in zip(completions, reward_model, extra_info)]\n")
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(verl_rows()).to_parquet(str(path))
    task = get_task("jsonl", path=str(path), checker="cols:reward")
    p = next(q for q in task.train_set() + task.test_set() if q.answer == "4")
    assert task.score([p], ["4"]).rewards == [pytest.approx(1.02)]
    sys.modules.pop("cols", None)


def test_start_and_import_time_do_not_count_against_the_limit(tmp_path, monkeypatch):
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(2)\n\n"
                                             "def score(prompt, response, answer):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = RewardFunction("slow_import:score", timeout=0.5)
    assert fn.score([Problem("q", "1")] * 2, ["1", "2"]).rewards == [1.0, 1.0]
    sys.modules.pop("slow_import", None)


def test_a_training_script_without_a_main_guard(tmp_path):
    """The checker process is a fresh interpreter: it never re-runs the caller's ``__main__``
    (multiprocessing's spawn would, and fail on a script without ``if __name__ == "__main__":``)."""
    import os
    import subprocess

    data = _jsonl(tmp_path / "m.jsonl", [{"prompt": "a", "answer": "42"}, {"prompt": "b", "answer": "2"}])
    script = tmp_path / "script.py"
    script.write_text("from creditrl.tasks import get_task\nfrom creditrl.tasks.base import Problem\n"
                      f"task = get_task('jsonl', path={data!r}, checker='math')\n"
                      "print('REWARD', task.reward(Problem('a', '42'), 'so $\\\\boxed{42}$'))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert out.stdout.count("REWARD 1.0") == 1, out.stderr[-2000:]


@pytest.mark.slow
def test_verl_dataset_and_verls_own_compute_score_unchanged(tmp_path):
    """The README's example: a parquet file in verl's layout scored by verl's own
    ``default_compute_score`` (which dispatches on ``data_source``), neither changed."""
    pytest.importorskip("verl")
    import datasets

    path = tmp_path / "gsm8k.parquet"
    datasets.Dataset.from_list([{**row, "data_source": "openai/gsm8k"} for row in verl_rows()]).to_parquet(str(path))
    task = get_task("jsonl", path=str(path), checker="verl.utils.reward_score:default_compute_score")
    assert task._terms[0][0].convention == "verl"
    p = next(q for q in task.train_set() + task.test_set() if q.answer == "8")
    assert task.score([p, p], ["4 + 4 = 8\n#### 8", "#### 9"]).rewards == [1.0, 0.0]


def test_terms_sharing_a_function_name_get_distinct_metrics(tmp_path, monkeypatch):
    """Case 9: two verl compute_score from different modules logged one reward/compute_score (the second's
    0.25) while the reward was 1.25. Each term's metric key is unique: the full module.function name where
    two share a name, and _2, _3 for the same function twice; the weighted sum is unchanged."""
    for module, value in (("score_a", 1.0), ("score_b", 0.25)):
        (tmp_path / f"{module}.py").write_text(
            f"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return {value}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    task = get_task("jsonl", path=_jsonl(tmp_path / "d.jsonl", ROWS), checker="score_a:compute_score",
                    rewards=[{"checker": "score_b:compute_score"}, {"checker": "exact"}, {"checker": "exact"}],
                    checker_timeout=None)
    scores = task.score([task.train_set()[0]], ["wrong"])
    assert scores.rewards == [1.25]
    assert scores.extras == {"score_a.compute_score": [1.0], "score_b.compute_score": [0.25], "exact": [0.0],
                             "exact_2": [0.0]}
    for module in ("score_a", "score_b"):
        sys.modules.pop(module, None)


def test_checkers_returning_tensors_in_every_convention(tmp_path, monkeypatch):
    """Case 15: a checker in a child process that returned a torch.Tensor crashed with
    'AuthenticationError: digest sent was rejected' (multiprocessing's pickler sends tensors as
    shared-memory handles). A 0-d tensor is a number, a TRL function's 1-D tensor its list of rewards."""
    (tmp_path / "tensor_rewards.py").write_text(
        "import torch\n"
        "def creditrl_style(prompt, response, answer):\n    return torch.tensor(0.5)\n"
        "def trl_style(prompts, completions, **kwargs):\n    return torch.full((len(prompts),), 0.25)\n"
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return {'score': torch.tensor(1.0), 'acc': torch.tensor(1.0)}\n"
        "def many(prompt, response, answer):\n    return torch.ones(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    problems = [Problem("q1", "1"), Problem("q2", "2")]
    for name, want in (("creditrl_style", 0.5), ("trl_style", 0.25), ("compute_score", 1.0)):
        fn = RewardFunction(f"tensor_rewards:{name}")            # a child process (the default time limit)
        scores = fn.score(problems, ["1", "x"])
        fn.close()
        assert scores.rewards == [want, want], name
    fn = RewardFunction("tensor_rewards:many")
    with pytest.warns(UserWarning, match="returned a Tensor, not a number"):
        assert all(math.isnan(r) for r in fn.score(problems, ["1", "x"]).rewards)
    fn.close()
    sys.modules.pop("tensor_rewards", None)

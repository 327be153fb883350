"""reasoning-gym as a task source: one dataset, a mix of two, scores, metadata, the trainer end to end."""
from __future__ import annotations

import json
import random
import sys

import pytest

rg = pytest.importorskip("reasoning_gym")

from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer  # noqa: E402

from creditrl.config import load_config  # noqa: E402
from creditrl.tasks import get_task  # noqa: E402
from creditrl.trainer import train  # noqa: E402

ARITHMETIC = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
LEGS = {"min_animals": 1, "max_animals": 2}
MIX = [{"name": "basic_arithmetic", "weight": 1, "config": ARITHMETIC},
       {"name": "leg_counting", "weight": 2, "config": LEGS}]


def test_mix_of_two_datasets_scores_with_reasoning_gym():
    task = get_task("reasoning_gym", dataset=MIX, test_size=40, seed=3)
    test = task.test_set()
    assert task.dataset_names == ["basic_arithmetic", "leg_counting"]
    assert {p.meta["dataset"] for p in test} == {"basic_arithmetic", "leg_counting"}
    assert all("difficulty" in p.meta for p in test)
    assert [p.meta["question"] for p in get_task("reasoning_gym", dataset=MIX, test_size=40, seed=3).test_set()] \
        == [p.meta["question"] for p in test]                                      # fixed held-out set
    rng = random.Random(0)
    train_questions = {task.sample(rng).meta["question"] for _ in range(300)}
    assert not train_questions & {p.meta["question"] for p in test}              # disjoint
    reference = {s["name"]: rg.create_dataset(s["name"], **s["config"]) for s in MIX}
    responses = []
    for i, p in enumerate(test):
        wrong = str(int(p.answer) + 1)
        responses += [f"think... <answer>{p.answer}</answer>", f"<answer>{wrong}</answer>", p.answer]
    scores = task.score([p for p in test for _ in range(3)], responses)
    expected = [reference[p.meta["dataset"]].score_answer(extract_answer(r), p.meta["columns"]["extra_info"]["entry"])
                for p, r in zip([p for p in test for _ in range(3)], responses)]
    assert scores.rewards == expected
    assert expected[0::3] == [1.0] * len(test) and set(expected[1::3]) == {0.0} and set(expected[2::3]) == {0.0}


def test_prompts_state_the_answer_format():
    chat = get_task("reasoning_gym", chat_model=True, dataset="basic_arithmetic", config=ARITHMETIC, test_size=4)
    p = chat.test_set()[0]
    assert p.prompt == [{"role": "user", "content": p.meta["question"]}]
    assert chat.system_prompt == SYSTEM_PROMPTS["default"] and "<answer>" in chat.system_prompt
    plain = get_task("reasoning_gym", dataset="basic_arithmetic", config=ARITHMETIC, test_size=4, system_prompt="direct")
    q = plain.test_set()[0]
    assert q.prompt == f"{SYSTEM_PROMPTS['direct']}\n\n{q.meta['question']}\n" and plain.system_prompt is None
    with pytest.raises(ValueError, match=r"system_prompt: 'defualt' is not a key of reasoning-gym's SYSTEM_PROMPTS"):
        get_task("reasoning_gym", dataset="basic_arithmetic", test_size=4, system_prompt="defualt")
    # one word of a script without spaces is text, not a mistyped key
    assert get_task("reasoning_gym", dataset="basic_arithmetic", test_size=4,
                    system_prompt="请用答案标签回答").instruction == "请用答案标签回答"
    own = get_task("reasoning_gym", dataset="basic_arithmetic", test_size=4, system_prompt="Reply as <answer>N</answer>.")
    assert own.test_set()[0].prompt.startswith("Reply as <answer>N</answer>.\n\n")


def test_prefill_starts_the_answer_and_is_scored_with_it(tiny_chat_model_dir):
    from transformers import AutoTokenizer

    from creditrl.tasks.chat import render_task_prompts

    task = get_task("reasoning_gym", chat_model=True, dataset="basic_arithmetic", config=ARITHMETIC, test_size=4,
                    system_prompt="direct", prefill="<answer>")
    p = task.test_set()[0]
    assert p.prompt[-1] == {"role": "assistant", "content": "<answer>"}
    assert task.reward(p, f"{p.answer}</answer>") == 1.0 and task.reward(p, "nothing</answer>") == 0.0
    assert task.sft_target(p) == f"{p.answer}</answer>"
    (ids,) = render_task_prompts(AutoTokenizer.from_pretrained(tiny_chat_model_dir), task, [p.prompt])
    assert AutoTokenizer.from_pretrained(tiny_chat_model_dir).decode(ids).endswith(
        f"{p.meta['question']}<|im_end|>\n<|im_start|>assistant\n<answer>")
    compact = get_task("reasoning_gym", dataset="basic_arithmetic", config=ARITHMETIC, test_size=4,
                       system_prompt=None, prefill="<answer>")
    q = compact.test_set()[0]
    assert q.prompt == f"{q.meta['question']}\n<answer>"


@pytest.mark.parametrize("options, message", [
    (dict(dataset="no_such_set"), r"dataset: unknown reasoning-gym dataset 'no_such_set'; known datasets: \["),
    (dict(dataset=[{"name": "gcd"}, {"name": "gcd"}]), r"each dataset may appear once in a mix"),
    (dict(dataset=[{"name": "gcd", "weight": 0}]), r"dataset\[0\].weight: expected a positive number, got 0"),
    (dict(dataset="gcd", config={"seed": 1}), r"config: \['seed'\] are set by creditrl"),
    (dict(dataset=MIX, config={"x": 1}), r"config: a mix gives each dataset its own config"),
    (dict(dataset="gcd", config={"min_numbers": 5, "max_numbers": 2}), r"config: reasoning-gym refused"),
    (dict(dataset="gcd", config={"no_such_option": 1}), r"config: reasoning-gym refused .*no_such_option"),
])
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        get_task("reasoning_gym", test_size=4, **options)


def test_missing_extra_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(ImportError, match=r"pip install 'creditrl\[reasoning-gym\]'"):
        get_task("reasoning_gym", dataset="gcd")


def test_trainer_logs_datasets_difficulty_and_per_dataset_accuracy(tiny_chat_model_dir, tmp_path):
    mix = json.dumps(MIX)
    cfg = load_config(None, [f"model.name={tiny_chat_model_dir}", "task.name=reasoning_gym",
                             f"task.options.dataset={mix}", "task.options.system_prompt=direct",
                             "task.options.test_size=8", "rollout.group_size=2", "rollout.prompts_per_step=6",
                             "rollout.max_new_tokens=6", "train.steps=2", "train.eval_every=0", "train.save_every=0",
                             "train.eval_samples=2", "logging.report_to=[jsonl]", "logging.plots=false",
                             "logging.progress=false", "logging.completions=12", f"train.output_dir={tmp_path}",
                             "train.run_name=rg", "algorithm.estimator=grpo", "train.threads=1"])
    run = train(cfg)
    records = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert {r["dataset"] for r in records} == {"basic_arithmetic", "leg_counting"}
    assert all("difficulty" in r and 0.0 <= r["reward"] <= 1.0 for r in records)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(k.startswith("accuracy/") for m in metrics for k in m)
    assert all(m["reward_timeouts"] == 0 for m in metrics)
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert {"greedy_acc/basic_arithmetic", "greedy_acc/leg_counting"} <= set(evals[-1])
    summary = json.loads((run / "summary.json").read_text())
    assert {"greedy_acc/basic_arithmetic", "greedy_acc/leg_counting"} <= set(summary["end"])


def test_a_held_out_set_holding_every_question_is_refused_not_leaked():
    """1-digit a+b has 100 distinct questions: a held-out set of 300 draws holds (nearly) all of them,
    so training draws would be held-out questions; sampling says so instead of training on them."""
    config = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
              "allow_parentheses": False, "allow_negation": False}
    task = get_task("reasoning_gym", dataset="basic_arithmetic", config=config, test_size=600, seed=0)
    held_out = {p.meta["question"] for p in task.test_set()}
    rng = random.Random(0)
    drawn = []
    with pytest.raises(ValueError, match="task.options.test_size: 100 draws from the training items all hit"):
        for _ in range(50):
            drawn.append(task.sample(rng).meta["question"])
    assert not set(drawn) & held_out

"""Exact resume: a run SIGKILLed mid-training and resumed with ``creditrl train --resume``
logs the same per-step metrics as an uninterrupted run (deterministic CPU mode)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from creditrl.config import load_config
from creditrl.runtime.models import load_policy
from creditrl.tasks import get_task
from creditrl.trainer.checkpoint import list_checkpoints, load_latest, save_checkpoint
from creditrl.trainer.logging import truncate_jsonl

TIMING = {"tokens_per_s", "time_rollout", "time_update", "time_eval"}
TINY_RUN = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
            "model.warm_start.max_steps=400", "model.warm_start.eval_every=25", "model.warm_start.eval_size=32",
            "model.warm_start.target_accuracy=0.3", "model.warm_start.lr=3e-3", "task.options.digits=1",
            "train.eval_problems=8", "train.eval_samples=4", "train.pass_k=[1,4]", "logging.progress=false",
            "train.threads=1", "train.steps=14", "train.save_every=3", "train.eval_every=5",
            "loss.stapo.enabled=true", "loss.rollout_correction=tis", "optim.epochs=2", "optim.minibatch_size=32",
            # the adaptive entropy controller's state (β, last entropy) must survive the resume too
            "loss.entropy_bonus.enabled=true", "loss.entropy_bonus.adaptive=true", "loss.entropy_bonus.target=5.0",
            "loss.entropy_bonus.coef=0.01"]


def records(path):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING} for line in path.read_text().splitlines()]


def train_cmd(*args):
    return [sys.executable, "-m", "creditrl.cli", "train", "--no-progress", *args]


@pytest.mark.slow
@pytest.mark.parametrize("variant", [[], ["model.lora.enabled=true", "model.lora.r=4", "optim.lr=1e-3"]],
                         ids=["full", "lora"])
def test_resume_after_sigkill_matches_uninterrupted_run(tmp_path_factory, variant):
    base = tmp_path_factory.getbasetemp()
    out = tmp_path_factory.mktemp("resume")
    common = TINY_RUN + variant + [f"model.cache_dir={base / 'tiny-cache'}", f"train.output_dir={out}"]
    cfg = load_config(None, common)  # warm-start once here so both subprocesses load the cache
    load_policy(cfg.model.name, get_task(cfg.task.name, **cfg.task.options), model_cfg=cfg.model.tiny,
                warm_start=cfg.model.warm_start, cache_dir=cfg.model.cache_dir, seed=cfg.train.seed, progress=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    full = subprocess.run(train_cmd(*common, "train.run_name=full"), env=env, capture_output=True, text=True,
                          timeout=300)
    assert full.returncode == 0, full.stderr[-2000:]

    run = out / "killed"
    proc = subprocess.Popen(train_cmd(*common, "train.run_name=killed"), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:  # kill once step 4 is logged (checkpoint at 3)
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 4:
            break
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (run / "summary.json").exists(), "the run finished before it could be killed"
    killed_at = len(metrics.read_text().splitlines())
    assert killed_at < 14 and list_checkpoints(run)

    resumed = subprocess.run(train_cmd("--resume", str(run)), env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = records(out / "full" / "metrics.jsonl"), records(metrics)
    assert [r["step"] for r in b] == list(range(1, 15))
    assert a == b  # exact equality of every non-timing metric, every step
    assert records(out / "full" / "eval.jsonl") == records(run / "eval.jsonl")
    assert any(r["grad_norm"] > 0 for r in a)  # the comparison is not vacuous

    # Killed before the first checkpoint (step 2, checkpoint due at 3): resume restarts from step 0.
    early = out / "early"
    early.mkdir()
    (early / "config.yaml").write_text((out / "full" / "config.yaml").read_text())
    for name in ("metrics.jsonl", "eval.jsonl"):
        lines = (out / "full" / name).read_text().splitlines(keepends=True)
        (early / name).write_text("".join(line for line in lines if json.loads(line)["step"] <= 2))
    resumed = subprocess.run(train_cmd("--resume", str(early)), env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert records(early / "metrics.jsonl") == a
    assert records(early / "eval.jsonl") == records(out / "full" / "eval.jsonl")


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    import torch
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, {"w": torch.full((2,), float(step), dtype=torch.bfloat16)}, {"x": step},
                        keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000003", "step_000004"]
    (tmp_path / "checkpoints" / ".tmp-step_000005-abc").mkdir()   # a crash mid-write
    weights, state = load_latest(tmp_path)
    assert state["x"] == 4 and state["step"] == 4
    assert weights["w"].dtype == torch.bfloat16 and weights["w"].tolist() == [4.0, 4.0]   # the model's dtype
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_latest(tmp_path / "elsewhere")


def test_trainable_state_round_trip_and_mismatch():
    import torch
    from creditrl.trainer.checkpoint import load_trainable_state, trainable_state
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].requires_grad_(False)
    state = trainable_state(model)
    assert set(state) == {"1.weight", "1.bias"}
    other = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    other[0].requires_grad_(False)
    load_trainable_state(other, state)
    assert torch.equal(other[1].weight, model[1].weight)
    with pytest.raises(ValueError, match="trainable parameters"):
        load_trainable_state(other, {"1.weight": state["1.weight"]})


def test_truncate_jsonl_drops_later_steps_and_torn_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)) + '{"step": 6, "x"')
    truncate_jsonl(path, 3)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]

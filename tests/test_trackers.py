"""logging.report_to: each tracker's stored data read back (TensorBoard, trackio, wandb), missing extras named."""
from __future__ import annotations

import json
import sqlite3
import struct
import sys

import pytest

from creditrl.config import ConfigError, config_from_dict, config_to_dict, load_config
from creditrl.trainer import train
from creditrl.trainer.trackers import check_trackers

pytest.importorskip("tensorboard")
pytest.importorskip("trackio")
pytest.importorskip("wandb")


@pytest.fixture(scope="module")
def run(tiny_chat_model_dir, tmp_path_factory, monkeypatch_module):
    out = tmp_path_factory.mktemp("runs")
    monkeypatch_module.delenv("WANDB_MODE", raising=False)
    cfg = load_config(None, [f"model.name={tiny_chat_model_dir}", "task.name=addition", "rollout.group_size=2",
                             "rollout.prompts_per_step=2", "rollout.max_new_tokens=4", "train.steps=2",
                             "train.eval_every=1", "train.save_every=0", "train.eval_problems=4",
                             "train.eval_samples=2", "logging.report_to=[jsonl, tensorboard, trackio, wandb]",
                             "logging.progress=false", "logging.completions=2", f"train.output_dir={out}",
                             "train.run_name=tracked", "algorithm.estimator=grpo", "train.threads=1"])
    return train(cfg), cfg


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


# The trackers store scalars as float32 (TensorBoard, wandb's history as JSON of them): within eps32/2 = 6e-8
# relative of metrics.jsonl's float64, inside pytest.approx's default 1e-6 used below.


def jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tensorboard_stored_metrics_config_tables_plots(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, cfg = run
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    metrics = jsonl(run_dir / "metrics.jsonl")
    stored = [(e.step, e.value) for e in acc.Scalars("metrics/reward_mean")]
    assert stored == [(m["step"], pytest.approx(m["reward_mean"])) for m in metrics]
    assert [e.step for e in acc.Scalars("eval/greedy_acc")] == [e["step"] for e in jsonl(run_dir / "eval.jsonl")]
    config_text = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "report_to" in config_text and "tracked" in config_text
    table = acc.Tensors("completions/train/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert table.startswith("| prompt | completion | reward | advantage | length | stopped |")
    assert {"plots/train", "plots/eval"} <= set(acc.Tags()["images"])


def test_trackio_stored_metrics_config_tables_plots(run):
    run_dir, cfg = run
    db = sqlite3.connect(run_dir / "trackio" / "creditrl.db")
    rows = [(step, json.loads(blob)) for step, blob in db.execute("select step, metrics from metrics order by id")]
    metrics = jsonl(run_dir / "metrics.jsonl")
    scalars = {step: m["metrics/reward_mean"] for step, m in rows if "metrics/reward_mean" in m}
    assert scalars == {m["step"]: pytest.approx(m["reward_mean"]) for m in metrics}
    tables = [m["completions/train"] for _, m in rows if "completions/train" in m]
    assert tables and tables[0]["_type"] == "trackio.table"
    first = next(r for r in jsonl(run_dir / "completions.jsonl") if r["kind"] == "train")
    assert tables[0]["_value"][0]["completion"] == first["completion"]
    images = {k: v for _, m in rows for k, v in m.items() if k.startswith("plots/")}
    assert set(images) == {"plots/train", "plots/eval"}
    assert all((run_dir / "trackio" / "media" / v["file_path"]).is_file() for v in images.values())
    (config,) = [json.loads(c) for (c,) in db.execute("select config from configs")]
    assert config["logging"]["report_to"] == ["jsonl", "tensorboard", "trackio", "wandb"]
    assert config["train"]["run_name"] == "tracked"


def wandb_records(path):
    """The records of a wandb transaction log (LevelDB log format: 32 KiB blocks of
    [crc32 u32, length u16, type u8] chunks; type 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, records, pending, pos = path.read_bytes(), [], b"", 7   # 7-byte file header ':W&B' + magic + version
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_wandb_stored_offline_metrics_config_tables_plots(run):
    run_dir, cfg = run
    (log,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(log)
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    metrics = jsonl(run_dir / "metrics.jsonl")
    scalars = {h["_step"]: h["metrics/reward_mean"] for h in history if "metrics/reward_mean" in h}
    assert scalars == {m["step"]: pytest.approx(m["reward_mean"]) for m in metrics}
    assert any(h.get("completions/train/_type") == "table-file" for h in history)
    table_path = next(h["completions/train/path"] for h in history if "completions/train/path" in h)
    table = json.loads((log.parent / "files" / table_path).read_text())
    assert table["columns"][:3] == ["prompt", "completion", "reward"]
    plots = [h["plots/train/path"] for h in history if "plots/train/path" in h]
    assert plots and (log.parent / "files" / plots[0]).is_file()
    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {i.key: json.loads(i.value_json) for i in run_record.config.update}
    assert config["train"]["run_name"] == "tracked"


@pytest.mark.parametrize("tracker", ["tensorboard", "trackio", "wandb"])
def test_missing_tracker_is_named_before_work(tracker, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, tracker, None)
    with pytest.raises(ImportError, match=rf"'{tracker}' needs the {tracker} package.*pip install 'creditrl\[{tracker}\]'"):
        check_trackers(["jsonl", tracker])
    cfg = load_config(None, [f"logging.report_to=[{tracker}]", f"train.output_dir={tmp_path}", "train.run_name=x"])
    import creditrl.trainer.loop as loop

    monkeypatch.setattr(loop, "load_configured_policy", lambda *a, **k: pytest.fail("model loaded"))
    with pytest.raises(ImportError, match=rf"creditrl\[{tracker}\]"):
        train(cfg)


def test_report_to_choices_and_old_tensorboard_key():
    assert check_trackers(["jsonl", "jsonl"]) == []
    with pytest.raises(ConfigError, match=r"logging.report_to\[1\]: unknown value 'mlflow'; valid values are"):
        load_config(None, ["logging.report_to=[jsonl, mlflow]"])
    assert load_config(None, ["logging.tensorboard=false"]).logging.report_to == ["jsonl"]
    assert load_config(None, ["logging.tensorboard=true"]).logging.report_to == ["jsonl", "tensorboard"]
    old = config_to_dict(load_config())
    old["logging"] = {"tensorboard": True, "progress": True, "plots": True, "completions": 4}   # an earlier run's file
    assert config_from_dict(old).logging.report_to == ["jsonl", "tensorboard"]
    with pytest.raises(ConfigError, match="logging.tensorboard: expected true or false"):
        load_config(None, ["logging.tensorboard=maybe"])


@pytest.mark.slow
def test_trackers_hold_the_metrics_history_after_a_kill_and_resume(tiny_chat_model_dir, tmp_path, monkeypatch):
    """SIGKILL mid-run, then --resume: each tracker's history equals metrics.jsonl, step for step
    (before: trackio lost the killed process's steps, TensorBoard and wandb held some twice)."""
    import os
    import signal
    import subprocess
    import time

    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_SERVICE", raising=False)   # each run its own wandb service, as for a user
    args = [f"model.name={tiny_chat_model_dir}", "task.name=addition", "rollout.group_size=2",
            "rollout.prompts_per_step=2", "rollout.max_new_tokens=4", "train.steps=12", "train.eval_every=0",
            "train.save_every=2", "train.eval_problems=2", "train.eval_samples=2", "logging.plots=false",
            "logging.report_to=[jsonl, tensorboard, trackio, wandb]", "logging.completions=1",
            f"train.output_dir={tmp_path}", "train.run_name=r", "algorithm.estimator=grpo", "train.threads=1"]
    cli = [sys.executable, "-m", "creditrl.cli", "train", "--no-progress"]
    proc = subprocess.Popen([*cli, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics_file = tmp_path / "r" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 3) and time.time() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    resumed = subprocess.run([*cli, "--resume", str(tmp_path / "r")], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run_dir = tmp_path / "r"
    expected = [m["step"] for m in jsonl(metrics_file)]
    assert expected == list(range(1, 13))

    tensorboard = [e.step for f in sorted((run_dir / "tensorboard").glob("events*")) for e in EventFileLoader(str(f)).Load()
                   if e.summary.value and e.summary.value[0].tag == "metrics/reward_mean"]
    assert tensorboard == expected
    db = sqlite3.connect(run_dir / "trackio" / "creditrl.db")
    trackio = [step for step, blob in db.execute("select step, metrics from metrics order by id")
               if "metrics/reward_mean" in json.loads(blob)]
    assert trackio == expected
    (log,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in wandb_records(log) if r.WhichOneof("record_type") == "history"]
    assert [h["_step"] for h in history if "metrics/reward_mean" in h] == expected


def test_a_tracker_that_fails_to_start_leaves_no_run_directory(tiny_chat_model_dir, tmp_path, monkeypatch):
    """Case 20: a tracker that imports but fails when the run starts (wandb without a login, a full disk)
    left a run directory holding only config.yaml, which blocked a re-run. A run that fails before
    logging anything leaves nothing behind (and an --overwrite of an old run leaves it cleared, not
    half-written); the error names the tracker."""
    import creditrl.trainer.logging as run_logging

    class Broken:
        folder, replays = "tensorboard", True

        def __init__(self, *args):
            raise OSError("disk full")

    monkeypatch.setitem(run_logging.TRACKER_CLASSES, "tensorboard", Broken)
    cfg = load_config(None, [f"model.name={tiny_chat_model_dir}", "task.name=addition", "rollout.group_size=2",
                             "rollout.prompts_per_step=1", "rollout.max_new_tokens=4", "train.steps=1",
                             "train.eval_problems=2", "train.save_every=0", "logging.report_to=[tensorboard]",
                             "logging.plots=false", f"train.output_dir={tmp_path}", "train.run_name=x"])
    with pytest.raises(OSError, match=r"logging.report_to: tracker 'tensorboard' could not start: OSError: disk full"):
        train(cfg, progress=False)
    assert not (tmp_path / "x").exists()
    monkeypatch.undo()
    monkeypatch.setitem(run_logging.TRACKER_CLASSES, "tensorboard", run_logging.TRACKER_CLASSES["tensorboard"])
    assert (train(cfg, progress=False) / "metrics.jsonl").is_file()      # the re-run is not blocked

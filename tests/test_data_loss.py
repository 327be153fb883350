"""Data loss: ``--overwrite`` deletes a run only once the new one is certain to start, never a
directory outside ``train.output_dir`` or one that is not a creditrl run, and a resumed run's
trackers hold the same history as its metrics.jsonl. Each test fails on the behaviour before."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from creditrl.cli import main
from creditrl.config import ConfigError, load_config
from creditrl.utils.rundir import LOCK_FILE, mark_run, occupant, run_kind

TINY = ["model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.intermediate_size=64",
        "model.warm_start.max_steps=50", "model.warm_start.eval_every=25", "model.warm_start.eval_size=8",
        "task.options.digits=1", "train.eval_problems=4", "train.eval_samples=2", "logging.progress=false",
        "train.threads=1", "train.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
        "algorithm.estimator=grpo", "train.save_every=1", "logging.plots=false"]


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> SHA-256)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_occupant_tells_what_holds_a_run_directory(tmp_path):
    """The one classification behind --overwrite and compare's replacement check."""
    assert occupant(tmp_path / "absent") is None
    (tmp_path / "file").write_text("x")
    assert occupant(tmp_path / "file") == "file"
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / LOCK_FILE).write_text("1")
    assert occupant(locked) is None                     # empty but for a lock: free
    (locked / "config.yaml").write_text("train: {}\n")
    assert occupant(locked) == "folder"                 # a config.yaml alone is any project's
    for kind in ("train", "diagnose"):
        mark_run(locked, kind)
        assert occupant(locked) == kind
    (locked / ".creditrl-run").write_text('{"kind": "evil"}')
    assert occupant(locked) == "folder"


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    args = ["train", "--no-progress", *TINY, f"model.cache_dir={root / 'cache'}", f"train.output_dir={root}",
            "train.run_name=done"]
    assert main(args) == 0
    return root, args


@pytest.mark.parametrize("bad", [["task.name=jsonl", "task.options.path=/nonexistent/data.jsonl"],
                                 ["algorithm.estimator=nope"], ["algorithm.estimator=otb", "algorithm.options.k=3"],
                                 ["rollout.group_size=1"], ["model.name=/nonexistent/model"]],
                         ids=["missing-file", "unknown-estimator", "k-on-otb", "group-of-one", "missing-model"])
def test_overwrite_with_a_bad_input_keeps_the_finished_run(finished_run, bad, capsys):
    root, args = finished_run
    before = snapshot(root / "done")
    assert "final/manifest.json" in before and "metrics.jsonl" in before
    assert main([*args, *bad, "--overwrite"]) == 2
    assert "error:" in capsys.readouterr().err
    assert snapshot(root / "done") == before


def test_overwrite_replaces_a_run_once_it_can_start(finished_run):
    root, args = finished_run
    other = root / "again"
    assert main([*args[:-1], "train.run_name=again"]) == 0
    (other / "stale.txt").write_text("from the first run")
    assert main([*args[:-1], "train.run_name=again", "--overwrite"]) == 0
    assert not (other / "stale.txt").exists()
    assert [json.loads(x)["step"] for x in (other / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert run_kind(other) == "train"


@pytest.mark.parametrize("name", ["..", ".", "a/b", "/tmp", "..\\x"])
@pytest.mark.parametrize("key", ["train.run_name", "diagnose.run_name"])
def test_a_run_name_is_one_plain_component(name, key):
    with pytest.raises(ConfigError, match=rf"{key}: expected one plain directory name"):
        load_config(None, [f"{key}={name}"])


@pytest.mark.parametrize("command,key", [("train", "train.run_name"), ("diagnose", "diagnose.run_name")])
@pytest.mark.parametrize("name", ["..", "."])
def test_overwrite_never_deletes_the_output_dir_or_its_parent(tmp_path, command, key, name, capsys):
    out = tmp_path / "parent" / "runs"
    (out / "kept-run").mkdir(parents=True)
    (out / "kept-run" / "config.yaml").write_text("x: 1\n")
    (tmp_path / "parent" / "precious.txt").write_text("keep me")
    before = snapshot(tmp_path)
    assert main([command, "--no-progress", *TINY, f"train.output_dir={out}", f"{key}={name}", "--overwrite"]) == 2
    assert key in capsys.readouterr().err
    assert snapshot(tmp_path) == before


def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path, capsys):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work")
    assert main(["train", "--no-progress", *TINY, f"train.output_dir={tmp_path}", "train.run_name=notes",
                 "--overwrite"]) == 2
    assert "is not a creditrl run directory" in capsys.readouterr().err
    assert (folder / "thesis.tex").read_text() == "years of work"


def test_an_existing_folder_that_is_no_run_is_named_so_without_overwrite(tmp_path, capsys):
    """Without --overwrite too: the error does not offer --resume or --overwrite, which both refuse it."""
    (tmp_path / "mydata").mkdir()
    (tmp_path / "mydata" / "notes.txt").write_text("mine")
    assert main(["train", "--no-progress", *TINY, f"train.output_dir={tmp_path}", "train.run_name=mydata"]) == 2
    err = capsys.readouterr().err
    assert "is not a creditrl run directory" in err and "neither --resume nor --overwrite" in err
    assert "creditrl train --resume" not in err


@pytest.mark.parametrize("inside", ["final", "data.jsonl"])
def test_overwrite_refuses_to_delete_what_the_run_reads(finished_run, inside, capsys):
    """A run trained from an earlier run's final/ (or reading its data from the run directory) with
    --overwrite of that same run would delete its own input: refused before any work."""
    root, args = finished_run
    source = root / "done"
    before = snapshot(source)
    if inside == "final":
        reads = [f"model.name={source / 'final'}"]
    else:
        (source / "data.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n' * 8)
        before = snapshot(source)
        reads = ["task.name=jsonl", f"task.options.path={source / 'data.jsonl'}", "task.options.checker=numeric"]
    assert main([*args, *reads, "--overwrite"]) == 2
    err = capsys.readouterr().err
    key = "model.name" if inside == "final" else "task.options.path"
    assert f"--overwrite refuses to delete {str(source)!r}: this run reads {key}" in err
    assert snapshot(source) == before


def test_inputs_inside_resolves_links_and_skips_non_paths(tmp_path):
    from creditrl.utils.rundir import inputs_inside

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (tmp_path / "link").symlink_to(run / "final")
    (tmp_path / "outside").mkdir()
    inputs = {"a": str(tmp_path / "link"), "b": "builtin:tiny", "c": str(tmp_path / "outside"), "d": 3,
              "e": None, "f": str(run), "g": str(tmp_path / "run2")}
    assert inputs_inside(run, inputs) == [("a", str(tmp_path / "link")), ("f", str(run))]


@pytest.mark.parametrize("bad", [["algorithm.estimator=nope"], ["diagnose.estimators=[nope]"],
                                 ["task.name=jsonl", "task.options.path=/nonexistent/data.jsonl"]],
                         ids=["unknown-estimator", "unknown-diagnosed", "missing-file"])
def test_diagnose_overwrite_with_a_bad_input_keeps_the_report(tmp_path, bad, capsys):
    run = tmp_path / "d"
    run.mkdir()
    for name, text in (("diagnose.md", "# report"), ("diagnose.json", "{}")):
        (run / name).write_text(text)
    mark_run(run, "diagnose")
    before = snapshot(run)
    assert main(["diagnose", "--no-progress", *TINY, *bad, f"train.output_dir={tmp_path}", "diagnose.run_name=d",
                 "--overwrite"]) == 2
    assert "error:" in capsys.readouterr().err
    assert snapshot(run) == before


@pytest.mark.parametrize("files", [{"config.yaml": "foo: 1\n", "important.txt": "keep"},
                                   {"metrics.jsonl": "", "sub/thesis.tex": "years of work"},
                                   {"diagnose.md": "# my notes", "diagnose.json": "{}"}],
                         ids=["config-yaml", "metrics-jsonl", "diagnose-files"])
@pytest.mark.parametrize("command,key", [("train", "train.run_name"), ("diagnose", "diagnose.run_name")])
def test_overwrite_refuses_a_folder_that_only_looks_like_a_run(tmp_path, files, command, key, capsys):
    """A config.yaml, a metrics.jsonl or a diagnose.md is any project's file: only the marker every
    creditrl run writes first lets --overwrite delete a directory."""
    folder = tmp_path / "project"
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    before = snapshot(folder)
    assert main([command, "--no-progress", *TINY, f"train.output_dir={tmp_path}", f"{key}=project",
                 "--overwrite"]) == 2
    assert "is not a creditrl run directory" in capsys.readouterr().err
    assert snapshot(folder) == before


def test_overwrite_refuses_a_run_of_the_other_kind(finished_run, tmp_path, capsys):
    """A diagnose report never replaces a trained run (its final model), nor a training run a report."""
    root, args = finished_run
    before = snapshot(root / "done")
    assert run_kind(root / "done") == "train"
    assert main(["diagnose", "--no-progress", *TINY, f"train.output_dir={root}", "diagnose.run_name=done",
                 "--overwrite"]) == 2
    assert "it is a creditrl train run, and this diagnose run replaces only a diagnose run" in capsys.readouterr().err
    assert snapshot(root / "done") == before
    report = tmp_path / "report"
    report.mkdir()
    (report / "diagnose.md").write_text("# report")
    mark_run(report, "diagnose")
    before = snapshot(report)
    assert main(["train", "--no-progress", *TINY, f"train.output_dir={tmp_path}", "train.run_name=report",
                 "--overwrite"]) == 2
    assert "it is a creditrl diagnose run, and this train run replaces only a train run" in capsys.readouterr().err
    assert snapshot(report) == before


def test_output_dir_with_a_tilde_is_under_home(tmp_path, monkeypatch):
    """Case (audit): train.output_dir=~/runs made a directory named '~' in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--no-progress", *TINY, "train.steps=1", f"model.cache_dir={tmp_path / 'cache'}",
                 "train.output_dir=~/runs", "train.run_name=r"]) == 0
    assert run_kind(tmp_path / "home" / "runs" / "r") == "train" and not (tmp_path / "~").exists()


@pytest.mark.parametrize("command", ["train", "diagnose", "compare"])
def test_a_second_config_file_is_refused(tmp_path, command, capsys):
    """argparse kept the last --config silently, dropping every key of the first."""
    first, second = tmp_path / "a.yaml", tmp_path / "b.yaml"
    first.write_text("train:\n  steps: 1\n")
    second.write_text("optim:\n  lr: 1.0e-5\n")
    with pytest.raises(SystemExit) as exit_:
        main([command, "--config", str(first), "--config", str(second), f"train.output_dir={tmp_path}"])
    assert exit_.value.code == 2
    assert f"--config: given twice ({str(first)!r} and {str(second)!r})" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.yaml", "b.yaml"]


@pytest.mark.parametrize("kind", ["missing", "a file"])
def test_resume_of_something_that_is_no_directory_names_it_and_leaves_nothing(tmp_path, kind, capsys):
    target = tmp_path / "run"
    if kind == "a file":
        target.write_text("notes")
    assert main(["train", "--resume", str(target)]) == 2
    assert f"resume: {str(target)!r} is {kind}; expected a creditrl run directory" in capsys.readouterr().err
    assert target.exists() == (kind == "a file") and (kind == "missing" or target.read_text() == "notes")


def test_the_writability_probe_leaves_no_folder_behind(tmp_path):
    from creditrl.utils.rundir import RunDirError, check_writable

    check_writable(tmp_path / "a" / "b")
    assert not (tmp_path / "a").exists()
    (tmp_path / "kept").mkdir()
    check_writable(tmp_path / "kept")
    assert (tmp_path / "kept").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunDirError, match=r"--out: cannot write in"):
        check_writable(tmp_path / "file" / "sub", "--out")


def test_a_run_inside_another_run_is_refused_and_never_deleted_with_it(tmp_path):
    """A run made inside another run's directory would go with that run's --overwrite (the audit lost a
    finished run so): it is refused where it would be created, and a run directory that already holds one
    (made before this check) is not overwritten."""
    from creditrl.utils.rundir import RunDirError, check_new_run
    outer = tmp_path / "base"
    outer.mkdir()
    mark_run(outer, "train")
    with pytest.raises(RunDirError, match=r"lies inside the creditrl run .*base'; choose a train.output_dir outside"):
        check_new_run(outer / "sub")
    nested = outer / "sub"
    nested.mkdir()
    mark_run(nested, "train")
    (nested / "final").mkdir()
    with pytest.raises(RunDirError, match=r"--overwrite refuses to delete .*base'.*holds another creditrl run, .*sub'"):
        check_new_run(outer, overwrite=True)
    assert (nested / "final").is_dir()
    check_new_run(tmp_path / "beside")                      # a sibling is fine


def test_overwrite_refuses_a_run_reached_through_a_symbolic_link(tmp_path):
    from creditrl.utils.rundir import RunDirError, check_new_run
    real = tmp_path / "real"
    real.mkdir()
    mark_run(real, "train")
    (real / "config.yaml").write_text("train: {}\n")
    (tmp_path / "out").mkdir()
    link = tmp_path / "out" / "link"
    link.symlink_to(real)
    with pytest.raises(RunDirError, match=r"is a symbolic link \(to .*real'\)"):
        check_new_run(link, overwrite=True)
    assert (real / "config.yaml").is_file()


def test_resume_of_a_finished_run_whose_newest_checkpoint_is_older_is_refused(finished_run, tmp_path):
    """final/ and the summary at 2/2 steps, the newest checkpoint at step 1 (as after an edit with
    train.save_every=0): resuming would train step 2 again and replace final/; refused as finished."""
    import shutil

    from creditrl.trainer.loop import Trainer
    root, _ = finished_run
    run = tmp_path / "done"
    shutil.copytree(root / "done", run)
    checkpoints = sorted((run / "checkpoints").iterdir())
    assert checkpoints[-1].name == "step_000002"
    shutil.rmtree(checkpoints[-1])
    before = snapshot(run)
    with pytest.raises(ValueError, match=r"already finished \(2/2 steps, final/ complete\)"):
        Trainer.resume(run)
    assert snapshot(run) == before


def test_a_finished_run_in_the_way_is_named_finished_not_offered_a_resume_that_refuses(finished_run, capsys):
    _, args = finished_run
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "it finished: to train on, raise train.steps in its config.yaml and run `creditrl train --resume" in err
    assert "continue it with" not in err


def test_the_write_probe_survives_another_runs_probe_removing_the_new_folder(tmp_path, monkeypatch):
    """Two runs starting at once in a new train.output_dir (compare --jobs 2): one run's probe removes
    the folder it created between the other's mkdir and write. The probe tries again."""
    from pathlib import Path
    from creditrl.utils.rundir import check_writable
    real, calls = Path.write_text, []

    def racing(self, *a, **k):
        calls.append(self)
        if len(calls) == 1:
            self.parent.rmdir()                     # the other run's cleanup, just after our mkdir
            raise FileNotFoundError(2, "No such file or directory")
        return real(self, *a, **k)
    monkeypatch.setattr(Path, "write_text", racing)
    check_writable(tmp_path / "runs" / "runs")
    assert len(calls) == 2 and not (tmp_path / "runs").exists()

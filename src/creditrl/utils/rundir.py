"""Run directories that cannot be corrupted by accident.

- A new run refuses an existing, non-empty directory unless ``overwrite``; continuing one is
  ``--resume``'s job. ``overwrite`` deletes only a creditrl run directory of the same kind, known
  by the marker every run writes first (``mark_run``: a ``config.yaml`` alone is any project's),
  and only once the new run has checked its whole config and loaded its model (``check_new_run``
  then ``clear_run``).
- The directory must be writable, checked before any model is loaded.
- ``RunLock``: one writer at a time. ``.lock`` holds the owner's PID; a lock whose process is
  gone (a killed run) is taken over, a live one is an error naming the PID.
Every rewrite of a log or config goes through ``creditrl.utils.io.atomic_write_text`` (temporary
file + ``os.replace``; a failed write removes its temporary file and names the path).
"""
from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

LOCK_FILE = ".lock"


class RunDirError(ValueError):
    """A run directory that cannot be used as asked; the message says what to do instead."""


def missing_folders(path: Path) -> list[Path]:
    """``path`` and its parents that do not exist yet, deepest first: what creating ``path`` makes."""
    return [p for p in (Path(path), *Path(path).parents) if not p.exists()]


def remove_empty_folders(folders: list[Path]) -> None:
    """Remove ``folders`` (deepest first, as ``missing_folders`` lists them) while they are empty:
    the first that is not (another process wrote in it) stays, with its parents."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def check_writable(folder: Path, arg: str = "train.output_dir") -> None:
    """Prove a file can be written in ``folder`` (errors name ``arg``), creating it for the probe and
    removing again the folders the probe created: a run refused afterwards leaves none behind."""
    folder = Path(folder)
    missing = missing_folders(folder)
    try:
        for attempt in range(3):
            folder.mkdir(parents=True, exist_ok=True)
            probe = folder / f".write-test-{os.getpid()}"
            try:
                probe.write_text("ok")
                break
            except FileNotFoundError:
                # another run's probe removed the folder it had created between our mkdir and write
                # (two runs starting at once in a new train.output_dir, e.g. compare --jobs 2)
                if attempt == 2:
                    raise
        probe.unlink()
    except OSError as err:
        raise RunDirError(f"{arg}: cannot write in {str(folder)!r} ({err.strerror or err}); "
                          f"choose a writable {arg}") from None
    finally:
        remove_empty_folders(missing)


RUN_MARKER = ".creditrl-run"       # {"kind": "train" | "diagnose"}: the first file of every run directory
RUN_KINDS = ("train", "diagnose")


def mark_run(run_dir: Path, kind: str) -> None:
    """Mark ``run_dir`` as a creditrl run of ``kind`` (one of ``RUN_KINDS``): what ``--overwrite``
    may delete."""
    if kind not in RUN_KINDS:
        raise ValueError(f"kind: expected one of {list(RUN_KINDS)}, got {kind!r}")
    (Path(run_dir) / RUN_MARKER).write_text(json.dumps({"kind": kind}) + "\n")


def run_kind(run_dir: Path) -> str | None:
    """The kind ``mark_run`` wrote into ``run_dir``; None for a directory without a readable marker."""
    try:
        kind = json.loads((Path(run_dir) / RUN_MARKER).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if kind in RUN_KINDS else None


def occupant(run_dir: Path) -> str | None:
    """What holds ``run_dir``: None (nothing, or an empty directory but for its lock), ``"file"`` (not
    a directory), ``"folder"`` (a directory that is no creditrl run) or the run's kind (``RUN_KINDS``)."""
    if run_dir.exists() and not run_dir.is_dir():
        return "file"
    if not run_dir.is_dir() or not any(p.name != LOCK_FILE for p in run_dir.iterdir()):
        return None
    return run_kind(run_dir) or "folder"


def check_new_run(run_dir: Path, *, overwrite: bool = False, key: str = "train.run_name",
                  resume_hint: bool = True, kind: str = "train", inputs: Mapping[str, object] | None = None) -> None:
    """Checks for a new run of ``kind`` in ``run_dir``, before any work and without deleting
    anything: an existing, non-empty directory is refused unless ``overwrite``; a directory that is
    not a creditrl run of the same kind (``occupant``) is refused either way, so a mistyped
    ``output_dir``/``run_name`` can never delete someone's folder, nor a diagnose report a trained
    model. ``inputs``: the run's input paths by config key (``model.name``, a data file); ``overwrite``
    is refused where one lies inside ``run_dir`` (a model trained from an earlier run's ``final/``
    would be deleted by the run that reads it), where ``run_dir`` holds another run, or is a symbolic
    link; a run inside another run's directory is refused (that run's --overwrite would delete it).
    Errors name ``key``; ``resume_hint`` mentions ``creditrl train --resume``. Deleting is
    ``clear_run``'s job, once the new run is certain to start."""
    found = occupant(run_dir)
    if found == "file":
        raise RunDirError(f"{key}: {str(run_dir)!r} exists and is not a directory; choose another {key}")
    host = enclosing_run(run_dir)
    if host is not None:     # its --overwrite would delete this run with everything else in it
        raise RunDirError(f"{key}: {str(run_dir)!r} lies inside the creditrl run {str(host)!r}; choose a "
                          f"train.output_dir outside every run directory")
    if found is not None and run_dir.is_symlink():
        raise RunDirError(f"{key}: {str(run_dir)!r} is a symbolic link (to {str(run_dir.resolve())!r}): neither "
                          f"--resume nor --overwrite takes a run through a link; use the run's own path")
    if found is None:
        check_writable(run_dir.parent if not run_dir.exists() else run_dir,
                       "train.output_dir" if not run_dir.exists() else key)
        return
    if found == "folder":
        raise RunDirError(f"{key}: {str(run_dir)!r} already exists and is not a creditrl run directory (it has no "
                          f"{RUN_MARKER} marker, which every run writes first; a run made before creditrl wrote "
                          f"one has none: delete it yourself if it is one), so neither --resume nor --overwrite "
                          f"takes it; choose another {key}")
    if found != kind:
        if overwrite:
            raise RunDirError(f"{key}: --overwrite refuses to delete {str(run_dir)!r}: it is a creditrl {found} run, "
                              f"and this {kind} run replaces only a {kind} run; choose another {key}")
        raise RunDirError(f"{key}: {str(run_dir)!r} already exists: it is a creditrl {found} run, which this {kind} "
                          f"run can neither continue nor replace; choose another {key}")
    if not overwrite:
        finished = (Path(run_dir) / "final").is_dir() and (Path(run_dir) / "summary.json").is_file()
        resume = "" if not resume_hint else (
            f"it finished: to train on, raise train.steps in its config.yaml and run `creditrl train --resume "
            f"{run_dir}`, or " if finished else f"continue it with `creditrl train --resume {run_dir}` or ")
        raise RunDirError(f"{key}: the run directory {str(run_dir)!r} already exists; {resume}start it again "
                          f"with --overwrite (which deletes it){'' if resume_hint else ' or choose another ' + key}")
    nested = next((m.parent for m in Path(run_dir).rglob(RUN_MARKER) if m.parent != Path(run_dir)), None)
    if nested is not None:
        raise RunDirError(f"{key}: --overwrite refuses to delete {str(run_dir)!r}: it holds another creditrl run, "
                          f"{str(nested)!r}; move that run out first, or choose another {key}")
    inside = inputs_inside(run_dir, inputs or {})
    if inside:
        named = ", ".join(f"{k} {str(v)!r}" for k, v in inside)
        raise RunDirError(f"{key}: --overwrite refuses to delete {str(run_dir)!r}: this run reads {named}, which "
                          f"lies inside it; copy it out of the run directory first, or choose another {key}")
    check_writable(run_dir, key)


def enclosing_run(run_dir: Path) -> Path | None:
    """The nearest folder above ``run_dir`` (symbolic links resolved) that is a creditrl run, else None."""
    return next((folder for folder in Path(run_dir).resolve().parents if run_kind(folder) is not None), None)


def inputs_inside(run_dir: Path, inputs: Mapping[str, object]) -> list[tuple[str, object]]:
    """The (key, value) of ``inputs`` naming an existing path inside ``run_dir`` (or ``run_dir`` itself),
    symbolic links resolved; values that are no path (``builtin:tiny``, numbers) are skipped."""
    root = Path(run_dir).resolve()
    found = []
    for key, value in inputs.items():
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            continue
        try:
            path = Path(value).expanduser().resolve()
            exists = path.exists()
        except (OSError, RuntimeError, ValueError):
            continue
        if exists and (path == root or root in path.parents):
            found.append((key, value))
    return found


def clear_run(run_dir: Path) -> None:
    """Delete everything in ``run_dir`` but its lock, which the caller must hold (``RunLock``): the
    ``--overwrite`` of a run whose config, task and model have all been checked and loaded."""
    lock = Path(run_dir) / LOCK_FILE
    if not (lock.is_file() and lock.read_text().strip() == str(os.getpid())):
        raise RunDirError(f"run directory {str(run_dir)!r}: clear_run needs this process to hold its lock")
    for entry in Path(run_dir).iterdir():
        if entry.name != LOCK_FILE:
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # exists, owned by someone else
        return True
    return True


class RunLock:
    """``with RunLock(run_dir):`` holds ``run_dir/.lock`` (the owner's PID) for the block."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE
        self.held = False

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    owner = int(self.path.read_text().strip() or 0)
                except (OSError, ValueError):
                    owner = 0
                if owner and owner != os.getpid() and _alive(owner):
                    raise RunDirError(f"run directory {str(self.path.parent)!r} is in use by another creditrl "
                                      f"process (PID {owner}); wait for it or stop it first") from None
                self.path.unlink(missing_ok=True)  # stale: its process is gone
                continue
            with os.fdopen(fd, "w") as fh:
                fh.write(str(os.getpid()))
            self.held = True
            return self
        raise RunDirError(f"run directory {str(self.path.parent)!r}: could not take its lock {self.path.name}")

    def __exit__(self, *exc) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

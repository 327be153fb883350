"""Atomic writes shared by the config, the run logs, checkpoints, final/ and the model cache, and
the manifest (size + SHA-256 of every file) that tells a complete directory from a damaged one."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same folder and ``os.replace``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise OSError(f"could not write {str(path)!r}: {err.strerror or err}") from err


@contextmanager
def atomic_directory(path: Path, *, replace: bool = False, complete_marker: str | None = None):
    """Yield a temporary directory beside ``path``; when the block succeeds it becomes ``path``
    in one rename, so a crash leaves only a ``.tmp-*`` directory (always removed on the way out).

    ``replace``: an existing ``path`` is deleted first (a checkpoint rewritten after a crash).
    Otherwise a ``path`` that another process completed meanwhile (it holds ``complete_marker``)
    is kept and ours is dropped; any other rename failure is raised."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".tmp-{path.name}-"))
    file_mode = plain_file_mode(tmp)
    os.chmod(tmp, file_mode | (file_mode & 0o444) >> 2)   # as a plain mkdir would make it (mkdtemp: 0700)
    try:
        yield tmp
        plain_modes(tmp, file_mode)
        if replace and path.exists():
            shutil.rmtree(path)
        try:
            os.rename(tmp, path)
        except OSError:
            if replace or complete_marker is None or not (path / complete_marker).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def plain_file_mode(folder: Path) -> int:
    """The mode a plain ``open(..., "w")`` gives a new file in ``folder``, read from a probe file:
    reading the umask by setting it would race with other threads (the umask is process-wide)."""
    probe = Path(folder) / f".mode-{uuid.uuid4().hex}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        return stat.S_IMODE(probe.stat().st_mode)
    finally:
        probe.unlink(missing_ok=True)


def plain_modes(folder: Path, mode: int | None = None) -> None:
    """Every file in ``folder`` given ``mode``, by default what a plain ``open`` would make
    (safetensors writes its files 0600, so a shared run directory's weights were private)."""
    mode = plain_file_mode(folder) if mode is None else mode
    for file in folder.rglob("*"):
        if file.is_file() and not file.is_symlink():
            os.chmod(file, mode)


MANIFEST = "manifest.json"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: Path, **extra) -> None:
    """``folder/manifest.json``: size and SHA-256 of every file in ``folder`` (written last, inside
    an ``atomic_directory``, so a complete manifest means a complete directory)."""
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(Path(folder).iterdir()) if p.is_file() and p.name != MANIFEST}
    (Path(folder) / MANIFEST).write_text(json.dumps({**extra, "files": files}, indent=1))


def read_manifest(folder: Path) -> dict | None:
    """The ``files`` entry of ``folder/manifest.json`` (None without one); ValueError when unreadable."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
        if not isinstance(files, dict):
            raise TypeError(f"files is a {type(files).__name__}")
    except (ValueError, KeyError, TypeError, OSError) as err:
        raise ValueError(f"unreadable {MANIFEST} ({err})") from None
    return files


def manifest_problem(folder: Path, required: tuple[str, ...] = ()) -> str | None:
    """What is wrong with ``folder`` against its manifest (a file missing, of another size or
    another SHA-256; no manifest at all), or None when every listed file is intact. ``required``:
    names the manifest must list."""
    try:
        files = read_manifest(folder)
    except ValueError as err:
        return str(err)
    if files is None:
        return f"no {MANIFEST}"
    for name in dict.fromkeys([*required, *files]):
        entry, file = files.get(name), Path(folder) / name
        if entry is None or not file.is_file():
            return f"{name} missing"
        if file.stat().st_size != entry["size"]:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {entry['size']}"
        if sha256_file(file) != entry["sha256"]:
            return f"{name} does not match its SHA-256"
    return None

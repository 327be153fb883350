"""Atomic writes shared by the config, the run logs, checkpoints and the model cache."""
from __future__ import annotations

import os
import shutil
import tempfile
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
    os.chmod(tmp, 0o755)
    try:
        yield tmp
        if replace and path.exists():
            shutil.rmtree(path)
        try:
            os.rename(tmp, path)
        except OSError:
            if replace or complete_marker is None or not (path / complete_marker).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

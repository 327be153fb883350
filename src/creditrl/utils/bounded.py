"""Calls with a wall-clock limit that hold from any thread: run in a child process, killed when late.

A signal-based timeout (``SIGALRM``, what math-verify uses) only works on the main thread, and a
thread cannot be stopped, so a reward function that hangs inside a worker thread (a data loader,
an async trainer, TRL's reward thread pool) would hang the run. ``TimeLimitedCalls`` keeps one
child process that imports each function by its ``package.module:function`` path once and serves
calls one at a time; a call over its limit kills the child (a fresh one starts on the next call)
and returns ``Outcome("timeout")``. Starting the child and importing the function are not part of
any call's limit: they have their own, ``LOAD_TIMEOUT`` (a busy machine can take many seconds to
import torch or sympy). A call costs a pipe round trip (~0.1 ms) plus pickling its arguments.
Like verl's ``timeout_limit``, but one process for many calls, not one per call.

The child is a fresh interpreter (``python -c``, the parent's ``sys.path``, two pipes), not a
``multiprocessing`` process: those re-import the caller's ``__main__``, which breaks a training
script written without an ``if __name__ == "__main__":`` guard, and forking a process that holds
torch's threads is unsafe. Messages are plain ``pickle`` bytes, not ``multiprocessing``'s pickler:
that one sends a torch tensor as a shared-memory handle which only a ``multiprocessing`` relative
may open (in this child it failed as ``AuthenticationError: digest sent was rejected``).
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from creditrl.utils.imports import load_object

STATUSES = ("ok", "error", "timeout")
LOAD_TIMEOUT = 300.0   # seconds to start the child and import a function (not counted in a call's limit)
_CHILD = "import sys; from creditrl.utils.bounded import serve; serve(int(sys.argv[1]), int(sys.argv[2]))"


@dataclass(frozen=True)
class Outcome:
    """``status`` is ``ok`` (``value`` = the return value), ``error`` (``value`` = what went wrong,
    worded to follow the function's name: "raised ValueError: ...", "died (...)") or ``timeout``
    (``value`` = None)."""
    status: str
    value: Any = None


def serve(read_fd: int, write_fd: int) -> None:
    """The child's loop: ``(path, None, None)`` loads a function (reply ``("ok", None)``),
    ``(path, args, kwargs)`` calls it; ``(status, value)`` out, until the pipe closes."""
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    functions: dict[str, Any] = {}
    while True:
        try:
            path, args, kwargs = pickle.loads(inbox.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            if path not in functions:
                functions[path] = load_object(path, what="checker")
            reply = ("ok", None) if args is None else ("ok", functions[path](*args, **kwargs))
        except BaseException as err:  # noqa: BLE001 - every failure of a user's function goes back as text
            reply = ("error", f"raised {type(err).__name__}: {err}")
        try:
            data = pickle.dumps(reply)
        except Exception as err:  # noqa: BLE001 - e.g. a return value that cannot be pickled
            data = pickle.dumps(("error", f"returned a value that cannot be pickled ({type(err).__name__}: {err})"))
        outbox.send_bytes(data)


class TimeLimitedCalls:
    """``call(path, args, kwargs, timeout=s)`` runs ``load_object(path)(*args, **kwargs)`` in a child
    process and returns an ``Outcome``; thread-safe (calls are serialised). ``close()`` ends the child."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._inbox = self._outbox = None
        self._loaded: set[str] = set()

    def _start(self) -> None:
        to_child, from_parent = os.pipe()[::-1]
        from_child, to_parent = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._process = subprocess.Popen([sys.executable, "-c", _CHILD, str(from_parent), str(to_parent)],
                                         pass_fds=(from_parent, to_parent), env=env, stdin=subprocess.DEVNULL)
        os.close(from_parent)
        os.close(to_parent)
        self._outbox, self._inbox = Connection(to_child, readable=False), Connection(from_child, writable=False)

    def _kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._outbox.close()
            self._inbox.close()
        self._process = self._inbox = self._outbox = None
        self._loaded = set()

    def _exchange(self, message: tuple, timeout: float) -> Outcome:
        """Send ``message`` and wait ``timeout`` s for the reply; a late reply kills the child."""
        try:
            data = pickle.dumps(message)
        except Exception as err:  # noqa: BLE001 - arguments that cannot be pickled
            return Outcome("error", f"got arguments that cannot be pickled ({err})")
        try:
            self._outbox.send_bytes(data)
        except (BrokenPipeError, EOFError, OSError):
            return self._died()
        try:
            if self._inbox.poll(timeout):
                return Outcome(*pickle.loads(self._inbox.recv_bytes()))
        except (EOFError, OSError):
            return self._died()
        self._kill()
        return Outcome("timeout")

    def _died(self) -> Outcome:
        code = self._process.poll()
        self._kill()
        return Outcome("error", f"died (its process exited with code {code})")

    def call(self, path: str, args: tuple = (), kwargs: dict | None = None, *, timeout: float) -> Outcome:
        if not timeout > 0:
            raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._kill()
                self._start()
            if path not in self._loaded:
                loaded = self._exchange((path, None, None), LOAD_TIMEOUT)
                if loaded.status != "ok":
                    reason = f"took over {LOAD_TIMEOUT:g} s" if loaded.status == "timeout" else loaded.value
                    return Outcome("error", f"could not be loaded in a child process ({reason})")
                self._loaded.add(path)
            return self._exchange((path, tuple(args), dict(kwargs or {})), timeout)

    def close(self) -> None:
        with self._lock:
            self._kill()

    def __del__(self) -> None:
        try:
            self._kill()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

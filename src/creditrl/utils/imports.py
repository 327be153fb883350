"""User plug-ins by import path: ``"package.module:attribute"`` names any importable object.

Every front end that takes a user's function (an estimator, a loss term, a checker, a task)
resolves it here, so one syntax and one error message serve them all.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
import re
import sys
import traceback
from typing import Any

from creditrl.utils.errors import CreditrlError

_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class PluginError(CreditrlError):
    """A user's plug-in (estimator, loss term) raised or returned the wrong thing; the message names
    the plug-in and what it did, its own error is chained (``__cause__``)."""


def plugin_name(fn: Any) -> str:
    """``module:function`` of a user's function, for messages."""
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def is_builtin(fn: Any) -> bool:
    """Whether ``fn`` is creditrl's own (its errors are the library's, not a plug-in's)."""
    return getattr(fn, "__module__", "").startswith("creditrl.")


def is_import_path(text: object) -> bool:
    """Whether ``text`` has the form ``package.module:attribute`` (attribute may be dotted)."""
    return isinstance(text, str) and bool(_PATH.match(text))


def load_object(path: str, *, what: str = "object") -> Any:
    """The object named by ``"package.module:attribute"``; errors name the path and the fix.

    ``what`` words the error (e.g. ``"algorithm.estimator"``). The working directory is appended
    to ``sys.path`` first (as ``python -m`` puts it first), so ``creditrl train`` finds a user's
    module next to their config without shadowing installed packages."""
    if not is_import_path(path):
        raise ValueError(f"{what}: expected an import path 'package.module:attribute', got {path!r}")
    module_name, attribute = path.split(":", 1)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise ValueError(f"{what}: cannot import module {module_name!r} of {path!r} (not found on the "
                             f"Python path; run from the directory that holds it or install it)") from None
        raise ValueError(f"{what}: importing module {module_name!r} of {path!r} raised {type(err).__name__}: "
                         f"{err}{_where(err)}") from err
    except Exception as err:  # noqa: BLE001 - whatever the user's module raises, named with the key and path
        raise ValueError(f"{what}: importing module {module_name!r} of {path!r} raised {type(err).__name__}: "
                         f"{err}{_where(err)}") from err
    value: Any = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise ValueError(f"{what}: module {module_name!r} has no attribute {attribute!r} (from {path!r})")
        value = getattr(value, part)
    return value


def _where(err: BaseException) -> str:
    """' (at file:line)' of the innermost frame of ``err``'s traceback (the user's line that raised)."""
    frames = traceback.extract_tb(err.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def registered_entry(registry: dict[str, Any], name: str, *, what: str, unknown: str, unregistered: str) -> Any:
    """The entry of ``registry`` (name -> entry with an ``fn``) named ``name``, or the one whose ``fn``
    is the function at the import path ``name`` (importing its module registers it). ``unknown`` is
    the error for a name that is neither; ``unregistered`` for a path to an undecorated function."""
    if name in registry:
        return registry[name]
    if not is_import_path(name):
        raise ValueError(unknown)
    fn = load_object(name, what=what)
    for entry in registry.values():
        if entry.fn is fn:
            return entry
    raise ValueError(f"{what} {name!r}: {fn!r} is not registered; {unregistered}")


_IMPORTED: set[str] = set()


def import_submodules(package: str) -> None:
    """Import every module of ``package`` once: registries whose entries register by decorator find
    a new module by its being in the folder, with no import list to edit."""
    if package in _IMPORTED:
        return
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__, package + "."):
        importlib.import_module(info.name)
    _IMPORTED.add(package)

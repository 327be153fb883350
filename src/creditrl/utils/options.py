"""Options declared once: typed dataclasses and function signatures as the single source of every
front end's options (config sections, ``--help``, docs/config.md, TRL fields, verl keys).

- ``opt(default, help)``: a dataclass field with its help text (``field(metadata={"help": ...})``).
- ``options_of(declaration)``: the ``OptionSpec`` list of a dataclass type or of a function's
  keyword parameters (help from ``typing.Annotated[type, "help"]``).
- ``coerce`` / ``merge`` / ``build``: YAML-ish values checked and converted against those types,
  with errors naming the dotted key and the valid keys or values (``OptionError``).
Torch-free: ``creditrl.config`` builds on it without importing the library.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import math
import types
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal, Union

REQUIRED = inspect.Parameter.empty


class OptionError(ValueError):
    """A bad option key, value or combination; the message names the dotted key."""


def opt(default: Any = dataclasses.MISSING, help: str = "", **kwargs) -> Any:  # noqa: A002 (dataclass style)
    """A dataclass field with ``help``; a mutable default (list/dict) is copied per instance."""
    if isinstance(default, (list, dict)):
        value = default
        return dataclasses.field(default_factory=lambda: copy.deepcopy(value), metadata={"help": help}, **kwargs)
    return dataclasses.field(default=default, metadata={"help": help}, **kwargs)


@dataclass(frozen=True)
class OptionSpec:
    """One declared option: ``default`` is ``REQUIRED`` when it has none."""
    name: str
    type: Any
    default: Any
    help: str = ""

    @property
    def required(self) -> bool:
        return self.default is REQUIRED


def _unannotated(tp: Any) -> tuple[Any, str]:
    if typing.get_origin(tp) is Annotated:
        base, *extra = typing.get_args(tp)
        return base, next((e for e in extra if isinstance(e, str)), "")
    return tp, ""


def options_of(declaration: Any, *, skip: int = 0) -> list[OptionSpec] | None:
    """The options a dataclass type declares (its fields), or a callable declares (its keyword
    parameters after the first ``skip``); None for a callable that takes ``**kwargs``."""
    if dataclasses.is_dataclass(declaration):
        hints = typing.get_type_hints(declaration, include_extras=True)
        out = []
        for f in dataclasses.fields(declaration):
            tp, doc = _unannotated(hints[f.name])
            if f.default is not dataclasses.MISSING:
                default = f.default
            elif f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
            else:
                default = REQUIRED
            out.append(OptionSpec(f.name, tp, default, f.metadata.get("help", doc)))
        return out
    params = list(inspect.signature(declaration).parameters.values())[skip:]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    hints = typing.get_type_hints(declaration, include_extras=True)
    out = []
    for p in params:
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
            tp, doc = _unannotated(hints.get(p.name, Any))
            out.append(OptionSpec(p.name, tp, p.default, doc))
    return out


def is_optional(tp: Any) -> tuple[bool, Any]:
    """(whether ``tp`` admits None, the type without None)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)):
            return True, args[0] if len(args) == 1 else Union[tuple(args)]
    return False, tp


def describe(tp: Any) -> str:
    """A type in words for error messages and docs: ``one of 'a', 'b' or null``, ``float``."""
    optional, inner = is_optional(_unannotated(tp)[0])
    if typing.get_origin(inner) is Literal:
        text = "one of " + ", ".join(repr(a) for a in typing.get_args(inner))
    elif typing.get_origin(inner) in (list, tuple) and typing.get_args(inner):
        text = f"list of {describe(typing.get_args(inner)[0])}"
    else:
        text = getattr(inner, "__name__", str(inner).replace("typing.", ""))
    return text + (" or null" if optional else "")


def _scalar(key: str, value: Any, inner: Any, strict: bool = False) -> Any:
    """``value`` as the scalar type ``inner`` (bool, int, float, str), or raise. ``strict`` (values
    from code, not YAML): a number is never read from a string, and an int may come as a whole float
    (in config text ``3.0`` for an int is refused: write 3)."""
    if inner is bool and isinstance(value, bool):
        return value
    if inner is int and not isinstance(value, bool):
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer() and strict:   # from code: numpy and JSON give 4.0
            return int(value)
        if isinstance(value, float):
            raise OptionError(f"{key}: expected int, got {value!r}" + (f"; write {int(value)}" if value.is_integer()
                                                                            else ""))
    if inner is float and not isinstance(value, bool):
        number = None
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str) and not strict:  # YAML 1.1 reads "1e-5" as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):
                raise OptionError(f"{key}: expected a finite number, got {value!r}")
            return number
    if inner is str and isinstance(value, str):
        return value
    if inner is str and not isinstance(value, (list, dict)):   # YAML read 007, 1.10, on or a date: quoted, as typed
        raise OptionError(f"{key}: expected a string, got {value!r} ({type(value).__name__}); quote it to keep the "
                          f"text as written: {key.rsplit('.', 1)[-1]}: \"...\" in YAML, {key}='\"...\"' on the "
                          f"command line")
    raise OptionError(f"{key}: expected {describe(inner)}, got {value!r}" + (
        f" ({type(value).__name__})" if strict else ""))


def coerce(key: str, value: Any, tp: Any, strict: bool = False) -> Any:
    """Check/convert ``value`` to type ``tp``; raise OptionError naming ``key`` (``strict``: see ``_scalar``)."""
    tp = _unannotated(tp)[0]
    optional, inner = is_optional(tp)
    if value is None:
        if optional or inner is Any:
            return None
        raise OptionError(f"{key}: expected {describe(tp)}, got null")
    origin = typing.get_origin(inner)
    if origin is Literal:
        if value not in typing.get_args(inner):
            raise OptionError(f"{key}: unknown value {value!r}; valid values are {list(typing.get_args(inner))}")
        return value
    if dataclasses.is_dataclass(inner):
        return merge(inner(), value, key)
    if origin in (list, tuple):
        value = value if isinstance(value, (list, tuple)) else [value]
        (item,) = typing.get_args(inner)[:1] or (Any,)
        for i, v in enumerate(value):   # a list of strings takes no numbers: [1] may mean a token id
            if _unannotated(item)[0] is str and not isinstance(v, str):
                raise OptionError(f"{key}[{i}]: expected a string, got {v!r} ({type(v).__name__}); quote it, e.g. "
                                  f"{key}='[\"{v}\"]'")
        items = [coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or inner is dict:
        if not isinstance(value, dict):
            raise OptionError(f"{key}: expected a mapping, got {value!r}")
        return copy.deepcopy(value)
    if inner is Any:
        return value
    return _scalar(key, value, inner, strict)


def deep_update(base: dict, update: dict) -> dict:
    """``base`` with ``update`` merged in recursively (nested mappings merge key by key)."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(out.get(key), dict) and isinstance(value, dict):
            out[key] = deep_update(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def merge(obj: Any, data: Any, prefix: str = "") -> Any:
    """A copy of dataclass instance ``obj`` with the mapping ``data`` merged in (recursively; a
    ``dict`` field merges key by key). Unknown keys and bad values raise OptionError naming the
    dotted key and the valid keys; the class's own ``__post_init__`` checks run too."""
    if data is None:
        return obj
    where = prefix or "config"
    if not isinstance(data, dict):
        raise OptionError(f"{where}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    changes = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise OptionError(f"{dotted}: unknown key; valid keys of {where} are {names}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current) and isinstance(value, dict):
            changes[key] = merge(current, value, dotted)
        elif isinstance(current, dict) and isinstance(value, dict):
            changes[key] = deep_update(current, value)
        else:
            changes[key] = coerce(dotted, value, hints[key])
    try:
        return dataclasses.replace(obj, **changes)
    except (TypeError, ValueError) as err:  # the class's own __post_init__ check
        if isinstance(err, OptionError):
            raise
        field_name, _, rest = str(err).partition(": ")
        if field_name in names:                         # the class names its field: name it in full
            raise OptionError(f"{prefix + '.' if prefix else ''}{field_name}: {rest}") from None
        raise OptionError(f"{where}: {err}") from None


def check_known(where: str, given, valid, hint: str = "") -> None:
    """The one unknown-option check: raise OptionError naming ``where``, the unknown keys of
    ``given`` and the ``valid`` ones (``hint`` is appended)."""
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise OptionError(f"{where}: unknown option(s) {unknown}; valid options are {sorted(valid)}{hint}")


def build(where: str, specs: list[OptionSpec], values: dict | None, hint: str = "", strict: bool = False) -> dict:
    """``values`` checked against ``specs``: every declared option, typed, defaults filled in.
    Unknown keys and missing required options raise OptionError naming ``where`` and the valid
    options (``hint`` follows an unknown-option error; ``strict``: values from code, see ``_scalar``)."""
    values = dict(values or {})
    valid = sorted(s.name for s in specs)
    check_known(where, values, valid, hint)
    out = {}
    for spec in specs:
        if spec.name in values:
            out[spec.name] = coerce(f"{where}.{spec.name}", values[spec.name], spec.type, strict)
        elif spec.required:
            raise OptionError(f"{where}.{spec.name}: required, e.g. {where}.{spec.name}=..."
                              f" ({describe(spec.type)}); valid options are {valid}")
        else:
            out[spec.name] = copy.deepcopy(spec.default)
    return out


def instantiate(where: str, cls: Callable, values: dict | None) -> Any:
    """``cls(**build(where, options_of(cls), values))`` with its own checks' errors naming ``where``."""
    specs = options_of(cls)
    try:
        return cls(**build(where, specs, values))
    except (TypeError, ValueError) as err:
        if isinstance(err, OptionError):
            raise
        field_name, _, rest = str(err).partition(": ")
        if field_name in {s.name for s in specs}:      # the class names its field: name it in full
            raise OptionError(f"{where}.{field_name}: {rest}") from None
        raise OptionError(f"{where}: {err}") from None


def doc_summary(doc: str | None) -> str:
    """A registered function's one-line description: its docstring's first paragraph on one line (a
    sentence may wrap), without the colon that introduces an equation below it (``creditrl
    estimators``, docs/config.md)."""
    paragraph = (doc or "").strip().split("\n\n")[0]
    return " ".join(line.strip() for line in paragraph.splitlines()).rstrip(":").rstrip()


def parse_json_field(name: str, value, kind: type):
    """``value`` itself, or the ``kind`` (dict / list) its JSON string holds (from the command line)."""
    if not isinstance(value, str):
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(f"{name}: expected a {kind.__name__} or its JSON text, got {value!r}, which is not "
                         f"valid JSON ({err})") from None
    if not isinstance(parsed, kind):
        raise ValueError(f"{name}: expected a {kind.__name__} or its JSON text, got {value!r} (a JSON "
                         f"{type(parsed).__name__})")
    return parsed

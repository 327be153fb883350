"""Loading and saving configs: defaults <- YAML file (or a packaged config's name) <- dotted
``key=value`` overrides (``merge_layers``, the one override mechanism of every command), older
layouts migrated, a run's saved config.yaml read strictly."""
from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any, Sequence

import yaml

from creditrl.config.checks import check_switches, validate
from creditrl.config.diagnose import DiagnoseConfig, validate_diagnose
from creditrl.config.schema import LEGACY_ALGORITHM_KEYS, SAMPLING_CONTROLS_OFF, Config, ConfigError
from creditrl.utils.io import atomic_write_text
from creditrl.utils.options import deep_update, is_optional, merge

def parse_override(text: str, schema: Any = None) -> dict:
    """``"a.b.c=1e-5"`` -> ``{"a": {"b": {"c": 1e-5}}}`` (the value parsed as YAML). Where ``schema`` (a
    config dataclass) declares the key a string, a value YAML would read as another scalar keeps its text
    as typed: ``train.run_name=007`` is "007", not 7 (nor ``2024-01-01`` a date, ``on`` true)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value, e.g. optim.lr=1e-5")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: expected a dotted key such as optim.lr")
    try:
        value = yaml.load(raw, Loader=UniqueKeyLoader) if raw.strip() else None
    except AmbiguousNumber as err:
        if not declares_string(schema, key):
            raise ConfigError(f"{key}: {err.problem}") from None
        value = raw.strip()
    except yaml.YAMLError:
        value = raw
    if value is not None and not isinstance(value, (str, list, dict)) and declares_string(schema, key):
        value = raw.strip()
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def declared_type(schema: Any, key: str) -> Any:
    """The annotation of dotted ``key`` in config dataclass ``schema`` (an instance; a ``Config``'s
    ``diagnose.*`` keys are a ``DiagnoseConfig``'s), or None where no dataclass field declares it."""
    node, parts = schema, key.split(".")
    if isinstance(schema, Config) and parts[0] == "diagnose":
        node, parts = DiagnoseConfig(), parts[1:]
    for part in parts[:-1]:
        node = getattr(node, part, None)
    if not parts or not dataclasses.is_dataclass(node):
        return None
    return typing.get_type_hints(type(node)).get(parts[-1])


def declares_string(schema: Any, key: str) -> bool:
    """Whether ``schema`` types dotted ``key`` as a string (or a string or null)."""
    declared = declared_type(schema, key)
    return declared is not None and is_optional(declared)[1] is str


def migrate(data: Any) -> Any:
    """Older layouts read into today's: ``algorithm.<k|eps|gamma|normalize>`` becomes
    ``algorithm.options.<...>`` (a null there meant "the estimator's default" and is dropped);
    ``logging.tensorboard: true/false`` becomes ``logging.report_to: [jsonl, tensorboard] / [jsonl]``;
    a saved run's ``diagnose`` section (config.yaml held one before `creditrl diagnose` got its own
    config; training never read it) is dropped."""
    if isinstance(data, dict) and "diagnose" in data:
        data = {k: v for k, v in data.items() if k != "diagnose"}
    if isinstance(data, dict) and isinstance(data.get("logging"), dict) and "tensorboard" in data["logging"]:
        logging = dict(data["logging"])
        flag = logging.pop("tensorboard")
        if not isinstance(flag, bool):
            raise ConfigError(f"logging.tensorboard: expected true or false (now logging.report_to), got {flag!r}")
        if "report_to" in logging:
            raise ConfigError("logging.tensorboard: set together with logging.report_to; keep only report_to")
        data = {**data, "logging": {**logging, "report_to": ["jsonl", "tensorboard"] if flag else ["jsonl"]}}
    if not isinstance(data, dict) or not isinstance(data.get("algorithm"), dict):
        return data
    algorithm = dict(data["algorithm"])
    moved = {k: algorithm.pop(k) for k in LEGACY_ALGORITHM_KEYS if k in algorithm}
    moved = {k: v for k, v in moved.items() if v is not None}
    both = sorted(set(moved) & set(algorithm.get("options") or {}))
    if both:
        raise ConfigError(f"algorithm.{both[0]}: set together with algorithm.options.{both[0]} (its current name); "
                          f"keep only algorithm.options.{both[0]}")
    if moved:
        algorithm["options"] = deep_update(algorithm.get("options") or {}, moved)
    return {**data, "algorithm": algorithm}


PACKAGED_CONFIGS = Path(__file__).parent.parent / "configs"


def packaged_configs() -> list[str]:
    """Names of the configs shipped with creditrl (``--config NAME``)."""
    return sorted(p.stem for p in PACKAGED_CONFIGS.glob("*.yaml"))


def resolve_config_path(path: str | Path) -> Path:
    """A YAML file path, or the name of a packaged config (e.g. ``smollm2-addition``)."""
    path = Path(path)
    if path.is_file():
        return path
    if path.suffix == "" and (PACKAGED_CONFIGS / f"{path.name}.yaml").is_file() and len(path.parts) == 1:
        return PACKAGED_CONFIGS / f"{path.name}.yaml"
    what = "a directory, not a YAML file" if path.is_dir() else "no such file"
    raise ConfigError(f"config file: {str(path)!r} is {what}; expected a YAML file or a packaged config "
                      f"{packaged_configs()}")


class AmbiguousNumber(yaml.constructor.ConstructorError):
    """A YAML 1.1 integer that does not mean what it reads as: ``010`` is octal 8, ``1:30`` base-60 90."""


class UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader refusing a mapping that names a key twice (plain YAML keeps the last). A merge
    key (``<<: *base``) is no second naming: its keys are defaults the mapping's own keys override."""

    def construct_yaml_int(self, node):
        text = str(node.value).replace("_", "")
        if re.fullmatch(r"[-+]?0[0-9]+", text) or ":" in text:
            value = super().construct_yaml_int(node)
            raise AmbiguousNumber(None, None, f"YAML 1.1 reads {node.value} as {value} ("
                                  f"{'base 60' if ':' in text else 'octal'}); write {value}, or the decimal you meant, "
                                  f"or quote it for text", node.start_mark)
        return super().construct_yaml_int(node)

    def flatten_mapping(self, node):
        # the mapping's own pairs, before a merge (here or where an alias merges it) adds the merged ones
        if not hasattr(node, "own_pairs"):
            node.own_pairs = list(node.value)
        super().flatten_mapping(node)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in getattr(node, "own_pairs", node.value):
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", UniqueKeyLoader.construct_yaml_int)


def read_yaml(path: str | Path) -> Any:
    """A YAML file's data; an unreadable or invalid file, or a mapping with a key given twice, is a
    ConfigError naming it."""
    try:
        return yaml.load(Path(path).read_text(), Loader=UniqueKeyLoader)
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"config file {str(path)!r}: unreadable ({err})") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r}: invalid YAML: {err}") from None


def merge_layers(cfg: Any, path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """``cfg`` (any config dataclass) <- YAML file at ``path`` <- dotted ``key=value`` overrides.

    The one override mechanism of ``creditrl train``, ``eval``, ``compare``, ``diagnose`` and
    ``experiment``: the same typed merge for the trainer's ``Config`` and for each experiment's
    config dataclass. For a ``Config`` the ``diagnose`` section (in the file or as ``diagnose.*``
    overrides) is checked as a ``DiagnoseConfig`` and set aside (``merge_with_diagnose``)."""
    if isinstance(cfg, Config):
        return merge_with_diagnose(cfg, DiagnoseConfig(), path, overrides)[0]
    if path is not None:
        cfg = merge(cfg, read_yaml(resolve_config_path(path)) or {})
    for text in overrides:
        cfg = merge(cfg, parse_override(text, cfg))
    return cfg


def merge_with_diagnose(cfg: Config, diagnose: DiagnoseConfig, path: str | Path | None = None,
                        overrides: list[str] | tuple[str, ...] = ()) -> tuple[Config, DiagnoseConfig]:
    """(``cfg``, ``diagnose``) <- YAML file <- overrides: each layer's ``diagnose`` section goes to the
    ``DiagnoseConfig`` (typed, unknown keys refused), the rest to the ``Config`` (``migrate``d)."""
    return _merge_layers(cfg, diagnose, config_layers(path, overrides, cfg))


def config_layers(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                  schema: Any = None) -> list[Any]:
    """The YAML file's data (if any), then each override as a nested mapping (``parse_override`` against
    config dataclass ``schema``): what ``merge`` applies."""
    return ([read_yaml(resolve_config_path(path)) or {}] if path is not None else []) + \
        [parse_override(text, schema) for text in overrides]


def _merge_layers(cfg: Config, diagnose: DiagnoseConfig, layers: list[Any]) -> tuple[Config, DiagnoseConfig]:
    logging = [data["logging"] for data in layers if isinstance(data, dict) and isinstance(data.get("logging"), dict)]
    given = [i for i, x in enumerate(logging) if "report_to" in x]
    if given and any("tensorboard" in x for x in logging[given[0] + 1:]):
        # each layer is migrated alone: the later legacy flag would replace the report_to set before it
        raise ConfigError("logging.tensorboard: set together with logging.report_to; keep only report_to")
    for data in layers:
        if isinstance(data, dict) and "diagnose" in data:
            section = data["diagnose"]
            if section is not None and not isinstance(section, dict):
                raise ConfigError(f"diagnose: expected a mapping of diagnose.* keys, got {section!r}")
            diagnose = merge(diagnose, section or {}, "diagnose")
            data = {k: v for k, v in data.items() if k != "diagnose"}
        cfg = merge(cfg, migrate(data))
    return cfg, diagnose


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file at ``path`` (or a packaged config's name) <- dotted ``overrides``; validated
    (a ``diagnose`` section is checked and set aside: ``load_diagnose_config`` reads it)."""
    return load_diagnose_config(path, overrides)[0]


def load_diagnose_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
                         ) -> tuple[Config, DiagnoseConfig]:
    """`creditrl diagnose`'s configs: the training ``Config`` and the ``diagnose`` section, both
    validated."""
    layers = config_layers(path, overrides, Config())
    cfg, diagnose = _merge_layers(Config(), DiagnoseConfig(), layers)
    validate(cfg)
    check_switches(layers, cfg)   # after the values' own checks: a bad value is the more useful error
    validate_diagnose(diagnose)
    return cfg, diagnose


def apply_overrides(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    """A validated copy of ``cfg`` with dotted ``key=value`` overrides applied."""
    layers = config_layers(None, overrides, cfg)
    cfg = _merge_layers(cfg, DiagnoseConfig(), layers)[0]
    validate(cfg)
    check_switches(layers, cfg)
    return cfg


def config_to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path, comments: Sequence[str] = ()) -> None:
    """``cfg`` as YAML, below ``comments`` (one ``# `` line each; records such as how
    ``train.precision`` was chosen, which the value alone cannot say)."""
    header = "".join(f"# {line}\n" for line in comments)
    atomic_write_text(path, header + yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def saved_layout(data: Any) -> Any:
    """A saved run's config (config.yaml or a checkpoint's record) in today's layout: ``migrate``, and
    a complete ``rollout`` from before the sampling controls (no ``overlong``, no ``dynamic_sampling``)
    gets both switched off, which is what that run ran with."""
    data = migrate(data)
    rollout = data.get("rollout") if isinstance(data, dict) else None
    if isinstance(rollout, dict) and "group_size" in rollout and not {"overlong", "dynamic_sampling"} & set(rollout):
        data = {**data, "rollout": {**rollout, **SAMPLING_CONTROLS_OFF}}
    return data


def read_saved_config(path: str | Path) -> dict:
    """A run's ``config.yaml`` as read (legacy layouts migrated), strictly: every key of the config
    tree must be present (a truncated, emptied or partly deleted file is an error naming the
    missing keys, never filled in with defaults)."""
    path = Path(path)
    try:
        data = saved_layout(read_yaml(path))
    except ConfigError as err:
        raise ConfigError(f"{path}: unreadable saved config ({err}); fix the file, or start a new run") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: incomplete saved config (expected a mapping of the config's sections, got "
                          f"{type(data).__name__}); it is not filled in with defaults. Restore it or start a new run")
    check_complete(path, data, config_to_dict(Config()))
    return data


def check_complete(path: str | Path, data: dict, complete: dict) -> None:
    """Raise naming the keys of ``complete`` (a full config as a dict) that ``data`` lacks."""
    missing = missing_keys(data, complete)
    if missing:
        shown = ", ".join(missing[:12]) + (f" and {len(missing) - 12} more" if len(missing) > 12 else "")
        raise ConfigError(f"{path}: incomplete saved config (missing {shown}); it is not filled in with "
                          f"defaults. Restore it or start a new run")


def load_saved_config(path: str | Path) -> Config:
    """A run's ``config.yaml`` (``read_saved_config``: complete or refused) as a validated Config."""
    return config_from_dict(read_saved_config(path))


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """``{"optim.lr": 1e-5, "loss.stapo.enabled": False, ...}``: the leaves of nested mappings by
    dotted key (lists and scalars are leaves; an empty mapping has none)."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def missing_keys(data: dict, complete: dict) -> list[str]:
    """The dotted keys of ``complete`` that ``data`` lacks."""
    return sorted(set(flatten(complete)) - set(flatten(data)))


def config_from_dict(data: dict) -> Config:
    """Rebuild a Config from ``config_to_dict`` output (e.g. a run's config.yaml)."""
    cfg = merge(Config(), migrate(data))
    validate(cfg)
    return cfg


def flat_items(obj: Any, prefix: str = "") -> list[tuple[str, Any, str]]:
    """``[("model.name", "builtin:tiny", help), ...]`` for every leaf key of a config dataclass."""
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            out.extend(flat_items(value, key + "."))
        else:
            out.append((key, value, f.metadata.get("help", "")))
    return out

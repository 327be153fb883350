"""The experiment protocol as a typed interface, and the registry ``creditrl experiment`` reads."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from creditrl_research.rules import Verdict

PRESET_NAMES = ("fast", "full")


@dataclass(frozen=True)
class Experiment:
    """One paper claim reproduced in miniature.

    presets:  preset name ("fast": < 1 min, used by the tests; "full": the published numbers) -> a
              frozen config dataclass with at least ``seed`` and ``threads`` (``num_seeds`` if it
              trains several seeds); overrides merge into it (``creditrl.config.merge_layers``).
    run:      (cfg, out_dir) -> summary dict; writes its CSVs, ``figure`` and summary.json.
    verdicts: out_dir -> its claims, decided from those files by rules fixed in code before the runs.
    report:   (out_dir, figure_path) -> its Markdown section of docs/results.md.
    validate: cfg -> None, raising a ValueError naming the field of a config ``run`` cannot use
              (checked with the config, before any output is written); None: nothing beyond the numbers.
    """

    name: str
    presets: Mapping[str, Any]
    run: Callable[[Any, Path], dict]
    verdicts: Callable[[Path], list[Verdict]]
    report: Callable[[Path, str], str]
    validate: Callable[[Any], Any] | None = None

    def __post_init__(self):
        missing = [p for p in PRESET_NAMES if p not in self.presets]
        if missing:
            raise ValueError(f"presets: experiment {self.name!r} needs presets {list(PRESET_NAMES)}, missing {missing}")
        for preset, cfg in self.presets.items():
            fields = {f.name for f in dataclasses.fields(cfg)} if dataclasses.is_dataclass(cfg) else set()
            if not {"seed", "threads"} <= fields:
                raise ValueError(f"presets: {self.name}'s {preset!r} preset must be a config dataclass with seed and "
                                 f"threads fields, got {type(cfg).__name__}")

    @property
    def figure(self) -> str:
        """The PNG ``run`` writes into its output directory (and the report copies to docs/figures/)."""
        return self.name.replace("-", "_") + ".png"


_REGISTRY: dict[str, Experiment] = {}


def register_experiment(experiment: Experiment) -> Experiment:
    """Add ``experiment`` (the report lists experiments in registration order); a name is registered once."""
    old = _REGISTRY.get(experiment.name)
    if old is not None and old.run is not experiment.run:
        raise ValueError(f"name: experiment {experiment.name!r} is already registered")
    _REGISTRY[experiment.name] = experiment
    return experiment


def experiment_names() -> list[str]:
    return list(_REGISTRY)


def get_experiment(name: str) -> Experiment:
    if name not in _REGISTRY:
        raise ValueError(f"name: unknown experiment {name!r}; valid names are {sorted(_REGISTRY)}")
    return _REGISTRY[name]

"""The one typed config tree of a creditrl run: dataclasses, loaded from YAML + dotted overrides.

``load_config(path, overrides)`` starts from the defaults below (the packaged
``configs/default.yaml`` states the same values), merges a user YAML file, then applies
``key=value`` overrides such as ``optim.lr=1e-5 algorithm.options.k=4``. Values are parsed as YAML
scalars and checked against the field types (``Literal`` choices included); unknown keys and bad
values raise ``ConfigError`` naming the dotted key and the valid keys/values.

Every option is declared once, with its help text: the fields below for the run's own settings,
and the library's declarations for what users extend. ``algorithm.options`` are the chosen
estimator's keyword parameters, ``loss`` the options of the loss terms (``creditrl.core.losses``),
``task.options`` the task's constructor parameters: those three are mappings here, checked
against their declarations when a run starts (``creditrl.recipe.resolve.resolve_config``), so
loading a config imports no library code and no torch.

The package by concern: ``schema`` (the sections), ``checks`` (``validate``), ``files`` (loading,
overrides, saving, saved configs), ``resume`` (what a resumed run may change) and ``diagnose``
(`creditrl diagnose`'s own section).
"""
from creditrl.config.schema import (DTYPES, LEGACY_ALGORITHM_KEYS, SAMPLING_CONTROLS_OFF, SIGNALS, TEMPERATURE_RANGE,
                                    TRACKERS, AlgorithmConfig, Config, ConfigError, DynamicSamplingConfig,
                                    LoggingConfig, LoraConfig, LoraSettings, ModelConfig, OptimConfig, OverlongConfig,
                                    RolloutConfig, TaskConfig, TinyModelConfig, TrainConfig, WarmStartConfig)
from creditrl.config.checks import (check_overlong, check_run_name, eval_settings, run_inputs, validate,
                                    validate_sampling_controls)
from creditrl.config.diagnose import DiagnoseConfig, validate_diagnose
from creditrl.config.files import (PACKAGED_CONFIGS, apply_overrides, check_complete, config_from_dict, config_to_dict,
                                   declared_type,
                                   flat_items, flatten, load_config, load_diagnose_config, load_saved_config,
                                   merge_layers, merge_with_diagnose, migrate, missing_keys, packaged_configs,
                                   parse_override, read_saved_config, read_yaml, resolve_config_path, save_config,
                                   saved_layout)
from creditrl.config.resume import (RESUME_CHANGEABLE, changeable_on_resume, check_location_edit, resume_changes,
                                    run_place)

__all__ = [
    "DTYPES", "LEGACY_ALGORITHM_KEYS", "SAMPLING_CONTROLS_OFF", "SIGNALS", "TEMPERATURE_RANGE", "TRACKERS",
    "AlgorithmConfig", "Config", "ConfigError", "DynamicSamplingConfig", "LoggingConfig", "LoraConfig", "LoraSettings",
    "ModelConfig", "OptimConfig", "OverlongConfig", "RolloutConfig", "TaskConfig", "TinyModelConfig", "TrainConfig",
    "WarmStartConfig", "check_overlong", "check_run_name", "eval_settings", "run_inputs", "validate",
    "validate_sampling_controls",
    "DiagnoseConfig", "validate_diagnose", "PACKAGED_CONFIGS", "apply_overrides", "check_complete", "config_from_dict",
    "config_to_dict", "flat_items", "flatten", "load_config", "load_diagnose_config", "load_saved_config",
    "declared_type", "merge_layers", "merge_with_diagnose", "migrate", "missing_keys", "packaged_configs",
    "parse_override",
    "read_saved_config", "read_yaml", "resolve_config_path", "save_config", "saved_layout", "RESUME_CHANGEABLE",
    "changeable_on_resume", "check_location_edit", "resume_changes", "run_place",
]

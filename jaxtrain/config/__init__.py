"""Typed configuration: a tree of dataclasses (:mod:`.tree`), loaded from YAML and overridden by dotted
``key=value`` pairs (:mod:`.load`), validated once, up front (:mod:`.validate`).

Also here: the operations sections (:mod:`.ops`: dist, check, observe), the data section's checks
(:mod:`.data_checks`), typed YAML reading (:mod:`.schema`), checks of given paths and addresses (:mod:`.locations`)
and the hardware files (:mod:`.hardware`). Nothing in this package imports JAX: it must be usable before the runtime
is configured. It imports only ``jaxtrain.errors``, ``jaxtrain.rundir`` (the run directory's file names) and the
device-free ``jaxtrain.parallel.dims``.
"""

from jaxtrain.config.load import dump_yaml, load_config, to_dict
from jaxtrain.config.tree import (
    FLASH_HEAD_DIMS,
    AxisSizes,
    CheckpointConfig,
    Config,
    DataConfig,
    MeshConfig,
    ModelConfig,
    MoEConfig,
    RopeScalingConfig,
    RunConfig,
    RuntimeConfig,
    TrainConfig,
    all_keys,
    default_rules,
    kernel_head_dim,
    unknown_config_key,
)
from jaxtrain.config.validate import config_warnings, validate
from jaxtrain.errors import ConfigError

__all__ = ["FLASH_HEAD_DIMS", "AxisSizes", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "MeshConfig",
           "ModelConfig", "MoEConfig", "RopeScalingConfig", "RunConfig", "RuntimeConfig", "TrainConfig", "all_keys",
           "config_warnings", "default_rules", "dump_yaml", "kernel_head_dim", "load_config", "to_dict",
           "unknown_config_key", "validate"]

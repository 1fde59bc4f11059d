"""Typed configs: one class per component, stage and pipeline configs, YAML loading with overrides."""

from infir2_rl.algo.config import AlgorithmConfig
from infir2_rl.config.components import (
    CheckpointConfig,
    DataConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    PlacementConfig,
    RolloutConfig,
    TrainerConfig,
    WeightSyncConfig,
)
from infir2_rl.config.loader import (
    ConfigError,
    apply_overrides,
    dump_config,
    is_pipeline_file,
    load_pipeline_config,
    load_pipeline_stages,
    load_stage_config,
    parse_stage_config,
)
from infir2_rl.config.stage import (
    PipelineConfig,
    PipelineStage,
    RlStageConfig,
    SftStageConfig,
    validate_paths,
)

__all__ = [
    "AlgorithmConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "MetricsConfig",
    "ModelConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "PipelineStage",
    "PlacementConfig",
    "RlStageConfig",
    "RolloutConfig",
    "SftStageConfig",
    "TrainerConfig",
    "WeightSyncConfig",
    "apply_overrides",
    "dump_config",
    "is_pipeline_file",
    "load_pipeline_config",
    "load_pipeline_stages",
    "load_stage_config",
    "parse_stage_config",
    "validate_paths",
]

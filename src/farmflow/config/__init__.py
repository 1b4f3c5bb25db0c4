"""One pydantic tree configures a whole farm; presets are named instances of it.

Every field carries a description (the Prefect UI renders them as form help) and every
model forbids unknown fields, so a typo is an error that names the field instead of a
setting silently ignored. `load_config(preset, overrides)` is the one entry point used by
the CLI, the flows and the tests; it turns any validation problem into one `ConfigError`.

The package is a leaf (pydantic and the standard library only), one module per concern:
`data`, `model`, `methods` (SFT, sampling, reward model, each method's section), `registry`
(`METHODS`, the one table of methods), `annotators` (with the paper's API pools in `pools`),
`evaluation`, `execution` (store, checkpoints, where stages run), `farm` (the whole tree),
`presets`, `overrides` (`load_config`), and `credentials` (settings never carry secrets).
What a config's fields alone do not pin down for a stage key (a model folder's contents, a judge's resolved
endpoint and prompt version) is computed next to the code it describes: `farmflow.modelcache` and
`farmflow.annotators`.
"""

from farmflow.config.annotators import (
    AnnotatorConfig,
    ApiAnnotatorConfig,
    HFJudgeConfig,
    ModelPrice,
    OracleAnnotatorConfig,
)
from farmflow.config.base import ConfigError, Section
from farmflow.config.credentials import CredentialsInValue, refuse_credentials
from farmflow.config.data import FARM_SPLIT_FILES, DataConfig
from farmflow.config.evaluation import EvaluationConfig
from farmflow.config.execution import GPU_STAGES, CheckpointConfig, ExecutionConfig, StoreConfig
from farmflow.config.farm import FarmConfig
from farmflow.config.methods import (
    BestOfNConfig,
    DPOConfig,
    ExpertIterationConfig,
    PPOConfig,
    QuarkConfig,
    RewardBackboneConfig,
    RewardConditioningConfig,
    RewardConfig,
    SampleConfig,
    SFTConfig,
)
from farmflow.config.model import LoraConfig, ModelConfig
from farmflow.config.overrides import describe_validation_error, load_config, validate_config
from farmflow.config.pools import ANNOTATOR_PRESETS
from farmflow.config.presets import PRESETS, SHARED_DATA, preset
from farmflow.config.registry import FLOW_NAMES, METHODS, Method, methods_table

__all__ = [
    "ANNOTATOR_PRESETS",
    "AnnotatorConfig",
    "ApiAnnotatorConfig",
    "BestOfNConfig",
    "CheckpointConfig",
    "ConfigError",
    "CredentialsInValue",
    "DPOConfig",
    "DataConfig",
    "EvaluationConfig",
    "ExecutionConfig",
    "ExpertIterationConfig",
    "FARM_SPLIT_FILES",
    "FLOW_NAMES",
    "FarmConfig",
    "GPU_STAGES",
    "HFJudgeConfig",
    "LoraConfig",
    "METHODS",
    "ModelConfig",
    "Method",
    "ModelPrice",
    "OracleAnnotatorConfig",
    "PPOConfig",
    "PRESETS",
    "QuarkConfig",
    "RewardBackboneConfig",
    "RewardConditioningConfig",
    "RewardConfig",
    "SFTConfig",
    "SHARED_DATA",
    "SampleConfig",
    "Section",
    "StoreConfig",
    "describe_validation_error",
    "load_config",
    "methods_table",
    "preset",
    "refuse_credentials",
    "validate_config",
]

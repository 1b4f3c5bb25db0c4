"""Where artifacts live and where stages run: the store, checkpoints, local or distributed execution.

None of this is part of a stage key: the same artifacts come out wherever and however the stages run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qsl, urlencode

from pydantic import Field, field_validator, model_validator

from farmflow.config.base import Section
from farmflow.config.credentials import refuse_credentials
from farmflow.config.registry import METHODS


class StoreConfig(Section):
    """Where artifacts live. The S3 fields are folded into `location`, the one string tasks receive."""

    uri: str = Field(
        default_factory=lambda: os.environ.get("FARMFLOW_STORE", str(Path(".farmflow/store").absolute())),
        description=(
            "Artifact store location: a local folder or file:// URI (default ./.farmflow/store or $FARMFLOW_STORE), or "
            "s3://bucket/prefix for S3/MinIO (non-secret options may also be given as ?endpoint_url=...&profile=...)."
        ),
    )
    endpoint_url: str | None = Field(
        None,
        description="s3:// only: S3-compatible endpoint, e.g. MinIO's http://host:9000 (default $AWS_ENDPOINT_URL_S3 / "
        "$AWS_ENDPOINT_URL, else AWS).",
    )
    region: str | None = Field(
        None, description="s3:// only: AWS region (default from $AWS_DEFAULT_REGION or the profile)."
    )
    profile: str | None = Field(
        None,
        description="s3:// only: named AWS profile for credentials (default: $AWS_PROFILE, else "
        "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY and the usual AWS chain).",
    )
    credentials_block: str | None = Field(
        None,
        description="s3:// only: name of a Prefect Secret block whose value is JSON {aws_access_key_id, "
        "aws_secret_access_key[, aws_session_token]}; replaces the AWS chain.",
    )
    max_attempts: int | None = Field(
        None,
        ge=1,
        description="s3:// only: attempts per S3 request; transient errors are retried with backoff (botocore standard "
        "mode; default 5).",
    )
    cache_dir: str | None = Field(
        None,
        description="s3:// only: local cache of downloaded models and checkpoints, one copy per artifact (default "
        "$FARMFLOW_CACHE or ~/.cache/farmflow).",
    )

    @field_validator("uri", "endpoint_url")
    @classmethod
    def _no_credentials(cls, v: str | None) -> str | None:
        return refuse_credentials(v, "S3 credentials come from profile, credentials_block or the AWS environment")

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, v: str) -> str:
        scheme = v.split("://", 1)[0] if "://" in v else ""
        if scheme and scheme not in ("file", "s3"):
            raise ValueError(f"{scheme}:// stores are not supported; use a local folder, file:// or s3://bucket/prefix")
        if not v.strip():
            raise ValueError("empty; use a local folder, file:// or s3://bucket/prefix")
        return v

    @model_validator(mode="after")
    def _s3_options_need_s3(self) -> "StoreConfig":
        given = [
            name
            for name in ("endpoint_url", "region", "profile", "credentials_block", "max_attempts", "cache_dir")
            if getattr(self, name) is not None
        ]
        if given and not self.uri.startswith("s3://"):
            raise ValueError(f"{', '.join(given)} only apply to an s3:// store, not {self.uri!r}")
        return self

    @property
    def location(self) -> str:
        """The store URI with the S3 fields as query parameters (what `farmflow.storage.open_store` takes)."""
        base, _, query = self.uri.partition("?")
        fields = ("endpoint_url", "region", "profile", "credentials_block", "max_attempts", "cache_dir")
        options = dict(parse_qsl(query)) | {
            name: str(getattr(self, name)) for name in fields if getattr(self, name) is not None
        }
        return base + (f"?{urlencode(options)}" if options else "")


class CheckpointConfig(Section):
    every_steps: int = Field(
        0, ge=0, description="Checkpoint long training loops every this many optimizer steps (0: by time only)."
    )
    every_seconds: float = Field(
        300.0,
        ge=0,
        description="Checkpoint long training loops at least this often, in seconds (0: by steps only; both 0: off).",
    )


SHARED_GPU_STAGES = (
    "sft",
    "sample_pairs",
    "train_reward",
    "generate",
    "best_of_n_rescore",
    "proxy_reward",
    "reward_report",
)
"""The stages outside the methods that load a model: SFT, sampling, reward training, generation and analysis."""

GPU_STAGES = tuple(dict.fromkeys([*SHARED_GPU_STAGES, *(s for m in METHODS.values() if m.gpu for s in m.stages)]))
"""Stages that load a model on an accelerator: SFT, generation, reward and policy training (the GPU pool's work)."""


class ExecutionConfig(Section):
    """Where stages run (never part of a stage key: the same artifacts come out either way)."""

    mode: Literal["local", "distributed"] = Field(
        "local",
        description="'local': every stage in this process. 'distributed': each GPU stage (gpu_stages) runs as its own "
        "flow run of `stage_deployment` on the GPU work pool (its own process, GPU memory released afterwards) and the "
        "flow waits for it; the other stages run in the flow's own process (the CPU pool). Needs a Prefect server and "
        "`farmflow deploy`.",
    )
    max_parallel_methods: int = Field(
        2,
        ge=1,
        description="Methods (and baselines) run at once after the shared upstream stages. Local: their stages that "
        "load a model take turns (one device), while evaluation and API annotation overlap them; distributed: GPU flow "
        "runs in flight at once (bounded by the GPU pool's concurrency limit).",
    )
    cpu_pool: str = Field(
        "farmflow-cpu", description="Work pool of the flows themselves: orchestration, data, annotation, evaluation."
    )
    gpu_pool: str = Field(
        "farmflow-gpu", description="Work pool of `stage_deployment`: SFT, generation, reward and policy training."
    )
    stage_deployment: str = Field(
        "stage/gpu",
        description="Deployment ('flow/deployment') that runs one stage per flow run on the GPU pool (registered by "
        "`farmflow deploy`).",
    )
    gpu_stages: list[str] = Field(
        default_factory=lambda: list(GPU_STAGES),
        description="Stages sent to the GPU pool in distributed mode (default: every stage that loads a model).",
    )
    poll_seconds: float = Field(
        2.0, gt=0, description="Distributed: how often the flow checks on a GPU flow run it waits for."
    )
    retries: int = Field(
        2,
        ge=0,
        le=10,
        description="Retries of a stage that touches the network (API annotators, an s3:// store, a GPU flow run that "
        "crashed) on a transient error; the stage resumes from its cached inputs (and the annotations row cache).",
    )
    retry_delay_s: float = Field(
        10.0, ge=0, description="Delay before the first retry; doubles on each further retry (exponential backoff)."
    )
    heartbeat_s: int = Field(
        60,
        ge=30,
        description="Deployed flow runs (`farmflow deploy`) send a heartbeat event this often (Prefect's "
        "flows.heartbeat_frequency, at least 30 s), so a run whose machine vanished can be told from a long one "
        "(`unresponsive_after_s`).",
    )
    unresponsive_after_s: int | None = Field(
        300,
        ge=45,
        description="`farmflow deploy` registers an automation that marks a farmflow flow run Crashed when no "
        "heartbeat or final state arrived for this long (a GPU machine that vanished); the flow waiting for it then "
        "retries the stage (`retries`). More than heartbeat_s; None: no automation (such a run stays Running until "
        "marked crashed by hand).",
    )
    launcher: Literal["inline", "process", "accelerate"] = Field(
        "inline",
        description="How a GPU stage (gpu_stages) runs where it runs: 'inline' in the calling process; 'process' in a "
        "child Python process (its GPU memory is released when it ends); 'accelerate': training stages through "
        "`accelerate launch` with accelerate_config (several GPUs: DDP, FSDP or DeepSpeed; PPO and Quark: DDP only), "
        "sampling and scoring in one child process. A child writes its output folder and the calling process commits "
        "it, so the artifacts and stage keys are the same either way.",
    )
    accelerate_config: str | None = Field(
        None,
        description="launcher 'accelerate': an `accelerate launch` config file (relative paths: from the working "
        "directory), or the name of one shipped with farmflow (farmflow/configs/accelerate/): single_gpu, multi_gpu "
        "(DDP), fsdp, deepspeed_zero3. None: accelerate's defaults (`accelerate config`).",
    )
    num_processes: int | None = Field(
        None,
        ge=1,
        description="launcher 'accelerate': processes (GPUs) per training stage, passed as --num_processes (None: from "
        "the config file). Each stage's batch_size must divide evenly between them.",
    )
    report_to: Literal["none", "tensorboard", "mlflow", "wandb"] = Field(
        "none",
        description="Tracker that every training stage also reports its per-step metrics to (accelerate's tracking "
        "API; the store keeps them either way, see docs/training-metrics.md). Each stage is a run named "
        "'<stage>-<key[:12]>'. tensorboard needs tensorboardX or tensorboard, mlflow needs mlflow-skinny or mlflow "
        "(`pip install 'farmflow[trackers]'`), wandb needs wandb (WANDB_MODE=offline: no account).",
    )
    tracker_dir: str = Field(
        ".farmflow/trackers",
        description="Where trackers write (relative: from the working directory): <tracker_dir>/tensorboard/<run>/ "
        "(event files), <tracker_dir>/mlflow/mlflow.db (a local MLflow store, SQLite; MLFLOW_TRACKING_URI overrides "
        "it), "
        "<tracker_dir>/wandb/.",
    )

    @model_validator(mode="after")
    def _heartbeats_fit(self) -> "ExecutionConfig":
        if self.unresponsive_after_s is not None and self.unresponsive_after_s < self.heartbeat_s + 15:
            raise ValueError(
                f"execution.unresponsive_after_s ({self.unresponsive_after_s}) must exceed execution.heartbeat_s "
                f"({self.heartbeat_s}) by at least 15 s, or healthy runs would be marked crashed between two heartbeats"
            )
        return self

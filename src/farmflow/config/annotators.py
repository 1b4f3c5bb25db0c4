"""Annotators: the offline oracle pool, API judges on any OpenAI-compatible endpoint, the in-process hf judge.

The settings of each, and the pool-wide ones (endpoint, limits, prices, label noise). A judge's identity in the row
cache and the stage keys is computed by the annotators package from these fields (`farmflow.annotators.judges_key`).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_serializer, model_validator

from farmflow.config.base import MAX_BATCH, MAX_IN_FLIGHT, MAX_ROWS, MAX_TOKENS, Section
from farmflow.config.credentials import CredentialsInValue, refuse_credentials
from farmflow.config.pools import ANNOTATOR_PRESETS


class OracleAnnotatorConfig(Section):
    name: str = Field(description="Annotator id (appears in the preferences table).")
    sharpness: float = Field(
        20.0, gt=0, description="How strongly the annotator follows gold-reward differences (logit per unit of gold)."
    )
    length_bias: float = Field(
        0.0, description="Logit bonus for the longer output, scaled by tanh(length difference / length_scale)."
    )
    length_scale: float = Field(
        40.0,
        gt=0,
        description="Length difference (characters) at which the length bonus reaches tanh(1) = 76% of length_bias.",
    )
    list_bias: float = Field(
        0.0, description="Logit bonus for an output formatted as a list (numbered or bulleted lines)."
    )
    position_bias: float = Field(0.0, description="Logit bonus for whichever output is shown first.")


def _default_pool() -> list[OracleAnnotatorConfig]:
    # A small pool with human-like variety: some like long answers, some like lists, some
    # favor the first output shown, and they differ in how carefully they judge. The biases are
    # calibrated to AlpacaFarm's own p_sim^ann pool as AlpacaEval's annotator analysis measured
    # it: with its 25% label flips it prefers the longer output in 60% of pairs and the list in
    # 63% (humans: 64% and 61%). This pool, with the same flips, on the synthetic-tiny PREF
    # pairs: 60% and 61% (docs/synthetic-farm.md). Answers here are ~25 characters, hence the
    # 10-character length scale.
    def judge(
        name: str, sharpness: float, length: float, lists: float = 0.0, position: float = 0.0
    ) -> OracleAnnotatorConfig:
        return OracleAnnotatorConfig(
            name=name,
            sharpness=sharpness,
            length_bias=length,
            length_scale=10.0,
            list_bias=lists,
            position_bias=position,
        )

    return [
        judge("careful", 32.0, length=2.0),
        judge("verbose-lover", 20.0, length=6.0),
        judge("list-lover", 24.0, length=2.5, lists=4.0),
        judge("first-glance", 16.0, length=3.0, lists=1.0, position=0.5),
        judge("hasty", 10.0, length=4.0, lists=2.0),
    ]


class ApiAnnotatorConfig(Section):
    name: str = Field(description="Annotator id (appears in the preferences table and the annotations cache).")
    model: str = Field(description="Model name sent to the endpoint (e.g. gpt-4o-mini, a vLLM or Ollama model name).")
    prompt_format: Literal["choice", "json", "logprobs"] = Field(
        "choice",
        description="How the annotator answers: 'choice' one line '[k] (a)' per item; 'json' a JSON array with a short "
        "explanation written before a boolean per item (chain of thought); 'logprobs' one token whose "
        "log-probabilities give a fractional preference in [1, 2] (batch_size 1 only).",
    )
    style: Literal["neutral", "strict", "user"] = Field(
        "neutral",
        description="Wording of the judging guidance: a neutral rubric, a strict grader, or a busy user (the paper's "
        "pool mixed prompt personas).",
    )
    batch_size: int = Field(
        1, ge=1, le=20, description="Pairs per request, each numbered in the prompt (paper's pool: 1, 4 or 5)."
    )
    temperature: float = Field(
        1.0, ge=0, le=2, description="Sampling temperature of the judge (paper: 1.0 for the pool, 0 for p_sim^GPT-4)."
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_TOKENS,
        description="Completion token cap per request; None: enough for the format (choice 12/item, json 120/item, "
        "logprobs 1).",
    )
    logit_bias: dict[str, float] = Field(
        default_factory=dict,
        description="Token id -> bias in [-100, 100] sent as logit_bias where the endpoint supports it (ids depend on "
        "the model's tokenizer).",
    )
    base_url: str | None = Field(None, description="Endpoint of this annotator; None: the pool's base_url.")
    paper_name: str | None = Field(
        None,
        description="The AlpacaFarm annotator this one stands in for (informational, e.g. 'gpt4_1: gpt-4-0314, CoT "
        "JSON, batch 4').",
    )

    @field_validator("base_url")
    @classmethod
    def _no_credentials(cls, v: str | None) -> str | None:
        return refuse_credentials(v, "the API key comes from the pool's api_key_env or api_key_secret")

    @model_validator(mode="after")
    def _logprobs_single(self) -> "ApiAnnotatorConfig":
        if self.prompt_format == "logprobs" and self.batch_size != 1:
            raise ValueError(
                f"annotator {self.name!r}: prompt_format 'logprobs' judges one pair per request (batch_size must be 1)"
            )
        if any(not -100 <= v <= 100 for v in self.logit_bias.values()):
            raise ValueError(f"annotator {self.name!r}: logit_bias values must lie in [-100, 100]")
        return self


class ModelPrice(Section):
    prompt_usd_per_mtok: float = Field(ge=0, description="USD per million prompt (input) tokens.")
    completion_usd_per_mtok: float = Field(ge=0, description="USD per million completion (output) tokens.")


def _default_prices() -> dict[str, ModelPrice]:
    # Public list prices (USD per 1M tokens) when this table was written; check your provider's.
    table = {
        "gpt-4o": (2.5, 10.0),
        "gpt-4o-mini": (0.15, 0.6),
        "gpt-4.1": (2.0, 8.0),
        "gpt-4.1-mini": (0.4, 1.6),
        "gpt-4.1-nano": (0.1, 0.4),
    }
    return {m: ModelPrice(prompt_usd_per_mtok=p, completion_usd_per_mtok=c) for m, (p, c) in table.items()}


class HFJudgeConfig(Section):
    """An in-process LLM judge (annotation kind 'hf'): a local causal LM's next-token probabilities of (a) vs (b),
    read for both orders of the outputs and averaged, as alpaca_eval's weighted judges do. Everything that changes an
    answer (the model's files or hub id and revision, gguf_file, dtype, max_prompt_tokens, the prompt version) is the
    judge's identity in the row cache and in the stage keys; batch_size and device are not."""

    model: str = Field(
        "smollm2-135m-instruct",
        description="The judge: a model-cache name, a local folder or a Hugging Face hub id (default: "
        "SmolLM2-135M-Instruct, small enough for a CPU). A local folder is identified by its files' contents.",
    )
    revision: str | None = Field(
        None,
        description="Hub revision (commit, tag or branch) of a hub `model`; None: the newest, keyed by name only.",
    )
    gguf_file: str | None = Field(
        None,
        description="GGUF weights file inside `model` to load (transformers dequantizes it); None: the folder's "
        "safetensors/bin weights.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Weights and activations dtype (float32 on CPUs; bfloat16 halves GPU memory at a small cost in "
        "precision).",
    )
    max_prompt_tokens: int = Field(
        2048,
        ge=64,
        le=MAX_TOKENS,
        description="Longest judging prompt in tokens (also capped by the model's context); longer pairs have both "
        "outputs cut in the middle, marked in the text, and are counted in the run's `truncated` metric.",
    )
    batch_size: int = Field(
        8,
        ge=1,
        le=MAX_BATCH,
        json_schema_extra={"stage_key": False},
        description="Prompts per forward pass (left-padded; each pair is two prompts, one per order). Memory and speed "
        "only: not part of the judge's identity.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        json_schema_extra={"stage_key": False},
        description="Where the judge runs; 'auto': the GPU when there is one, else the CPU. Not part of the judge's "
        "identity.",
    )


class AnnotatorConfig(Section):
    kind: Literal["oracle", "api", "hf", "human"] = Field(
        "oracle",
        description="'oracle': offline simulated annotators that judge with the gold reward plus biases and noise "
        "(pool); 'api': LLM judges on any OpenAI-compatible endpoint (api_pool); 'hf': one local causal LM judging in "
        "this process from its next-token probabilities, both orders averaged (hf); 'human': a person's labels of the "
        "sampled pairs in the store (labeler; the preference stage only, the paper's human arm). Also accepted as a "
        "bare value: annotation=human:NAME.",
    )
    labeler: str | None = Field(
        None,
        json_schema_extra={"stage_key": False},
        description="kind 'human': whose labels (annotator human:NAME, given with `farmflow label serve` or "
        "`farmflow label import`). Keyed through the labels themselves (the human_preferences stage's key holds "
        "their digest), so new labels make new preferences.",
    )
    preset: str | None = Field(
        None,
        description="Named pool: alpacafarm-pool / p_sim_eval (the paper's 13 annotators), p_sim_ann (the same plus "
        "label noise 0.5), p_sim_gpt4 (one annotator, temperature 0). When set it fixes kind, api_pool and "
        "label_noise; the other fields (endpoint, limits, prices) still apply. Also accepted as a bare name: "
        "annotation=p_sim_ann (the same as annotation.preset=p_sim_ann).",
    )
    pool: list[OracleAnnotatorConfig] = Field(
        default_factory=_default_pool,
        min_length=1,
        description="The oracle annotator pool (kind 'oracle'); one is drawn per pair.",
    )
    api_pool: list[ApiAnnotatorConfig] = Field(
        default_factory=list, description="The API annotator pool (kind 'api'); one is drawn per pair."
    )
    hf: HFJudgeConfig = Field(
        default_factory=HFJudgeConfig,
        json_schema_extra={"stage_key": False},
        description="The local LLM judge (kind 'hf'). Keyed through the judge's identity "
        "(`farmflow.annotators.judges_key`) when kind is 'hf', so its defaults do not enter the keys of the other "
        "kinds.",
    )
    label_noise: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Probability that a label is replaced by a fair coin without asking any annotator "
        "(paper's p_sim^ann: 0.5, i.e. 25% of labels flipped and half the API cost; p_sim^eval: 0).",
    )
    seed: int = Field(
        0, ge=0, description="Seed for annotator assignment, output order, label noise and (oracle) judgement noise."
    )
    base_url: str | None = Field(
        None,
        description="OpenAI-compatible endpoint for API annotators without their own; None: $OPENAI_BASE_URL or "
        "OpenAI's.",
    )
    served_model: str | None = Field(
        None,
        min_length=1,
        description="Model name sent in every request of the API pool instead of each annotator's model, for an "
        "endpoint that serves one fixed model (transformers serve, a single-model vLLM or Ollama); each annotator "
        "keeps its prompt format, style, temperature and batch size. Part of each judge's identity in the row cache. "
        "None: each annotator's model.",
    )
    api_key_env: str = Field(
        "OPENAI_API_KEY",
        json_schema_extra={"stage_key": False},
        description="Environment variable holding the API key (never logged or stored).",
    )
    api_key_secret: str | None = Field(
        None,
        json_schema_extra={"stage_key": False},
        description="Name of a Prefect Secret block with the API key; used instead of api_key_env when set.",
    )
    max_in_flight: int = Field(
        32,
        ge=1,
        le=MAX_IN_FLIGHT,
        json_schema_extra={"stage_key": False},
        description="Requests in flight at once (per annotation call).",
    )
    requests_per_minute: float | None = Field(
        None,
        gt=0,
        json_schema_extra={"stage_key": False},
        description="Request rate limit; shared by every flow using the same rate_limit_name (None: no limit).",
    )
    rate_limit_name: str = Field(
        "farmflow-annotators",
        json_schema_extra={"stage_key": False},
        description="Name of the rate limit: a Prefect global concurrency limit (created if missing, slot decay = "
        "requests_per_minute/60) when a Prefect server is configured (PREFECT_API_URL), else a limiter shared within "
        "the process.",
    )
    timeout_s: float = Field(
        60.0,
        gt=0,
        json_schema_extra={"stage_key": False},
        description="Seconds before one HTTP request times out (the SDK then retries it).",
    )
    max_retries: int = Field(
        2,
        ge=0,
        le=10,
        json_schema_extra={"stage_key": False},
        description="SDK retries per request on 408/429/5xx/timeouts/connection errors, honoring Retry-After; "
        "other 4xx are never retried.",
    )
    chunk_size: int = Field(
        100,
        ge=1,
        le=MAX_ROWS,
        json_schema_extra={"stage_key": False},
        description="Judged pairs written to the row cache per append (at least every 10 s); each answer is also "
        "journaled on local disk as it arrives, so a killed run loses only the requests in flight.",
    )
    max_cost_usd: float | None = Field(
        None,
        gt=0,
        json_schema_extra={"stage_key": False},
        description="Spending cap of one run: each request reserves its estimated cost (prompt at 4 characters a token "
        "plus its whole token cap, at the model's price) before it is sent, so the run spends at most this much and "
        "stops within one request's cost of it; what is done is kept. None: no cap.",
    )
    prices: dict[str, ModelPrice] = Field(
        default_factory=_default_prices,
        json_schema_extra={"stage_key": False},
        description="Model name -> token prices, for cost per annotation and run totals.",
    )

    @field_validator("base_url")
    @classmethod
    def _no_credentials(cls, v: str | None) -> str | None:
        return refuse_credentials(v, "the API key comes from api_key_env or api_key_secret")

    @field_validator("api_key_env")
    @classmethod
    def _a_variable_name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):  # not the key itself: the value would be logged and stored
            raise CredentialsInValue(
                "must be the name of an environment variable (letters, digits and _), not the key itself"
            )
        return v

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, str):
            data = {"kind": "human", "labeler": data[6:]} if data.startswith("human:") else {"preset": data}
        if not isinstance(data, dict) or not data.get("preset"):
            return data
        name = data["preset"]
        if name not in ANNOTATOR_PRESETS:
            raise ValueError(f"unknown annotator preset {name!r}; known: {', '.join(sorted(ANNOTATOR_PRESETS))}")
        fixed = ANNOTATOR_PRESETS[name]
        given = data.get("api_pool") or []
        norm = lambda pool: [ApiAnnotatorConfig.model_validate(a).model_dump() for a in pool]  # noqa: E731
        if given and norm(given) != norm(fixed["api_pool"]):
            raise ValueError(f"api_pool is fixed by preset {name!r}; set preset to null to define your own pool")
        clash = sorted(k for k, v in fixed.items() if k != "api_pool" and k in data and data[k] != v)
        if clash:  # e.g. kind 'hf' with preset p_sim_ann: never silently the preset's value instead
            raise ValueError(
                f"{', '.join(clash)} is fixed by preset {name!r} "
                f"({', '.join(f'{k}={fixed[k]!r}' for k in clash)}); set preset to null to choose it"
            )
        return {**data, **{k: (list(v) if isinstance(v, list) else v) for k, v in fixed.items()}}

    @model_serializer(mode="wrap")
    def _labeler_only_when_set(self, handler: Any) -> dict[str, Any]:
        # labeler only when set: the recorded config of every other kind (compared across runs) has no such field
        data = handler(self)
        if self.labeler is None and isinstance(data, dict):
            data.pop("labeler", None)
        return data

    @model_validator(mode="after")
    def _check_api(self) -> "AnnotatorConfig":
        if self.kind == "human" and not self.labeler:
            raise ValueError("kind 'human' needs labeler (whose labels), e.g. annotation=human:alice")
        if self.kind == "api":
            if not self.api_pool:
                raise ValueError("kind 'api' needs a non-empty api_pool (or a preset)")
            names = [a.name for a in self.api_pool]
            if len(set(names)) != len(names):
                raise ValueError(f"api_pool: annotator names must be unique, got {names}")
            if self.max_cost_usd is not None:
                unpriced = sorted({self.served_model or a.model for a in self.api_pool} - set(self.prices))
                if unpriced:
                    raise ValueError(f"max_cost_usd needs a price for every model; add {unpriced} to prices")
        return self

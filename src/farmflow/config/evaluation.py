"""How outputs are judged in the evaluation, and how many replicates of an experiment a comparison runs."""

from __future__ import annotations

from pydantic import Field

from farmflow.config.annotators import AnnotatorConfig
from farmflow.config.base import Section

OPERATIONAL = {"stage_key": False}


class EvaluationConfig(Section):
    """How outputs are judged. How they are sampled (paper: temperature 0.7) is `generation`.

    The replicate fields say how often a comparison repeats the experiment, not what a stage computes: they are not
    part of any stage key (replicate r's stages have keys of their own through their shifted seeds).
    """

    annotator: AnnotatorConfig = Field(
        default_factory=AnnotatorConfig, description="Evaluation annotator (p_sim^eval: the pool without label noise)."
    )
    replicates: int = Field(
        1,
        ge=1,
        le=50,
        json_schema_extra=OPERATIONAL,
        description="Replicates of a comparison (`farmflow run compare --replicates K`): replicate r (0-based) shifts "
        "every training, sampling and annotation seed by 1000·r (the data splits and evaluation set stay); replicate 0 "
        "is the config itself. With more than 1 the leaderboard shows means, 95% intervals and paired bootstrap "
        "intervals of each method's difference to SFT.",
    )
    replicate_sft: bool = Field(
        True,
        json_schema_extra=OPERATIONAL,
        description="Replicates retrain the base model and SFT with their shifted seeds (the variance a researcher "
        "faces: every method starts from a different SFT). False: every replicate shares replicate 0's SFT model and "
        "only the stages after it vary (cheaper; the intervals then leave SFT's own variance out).",
    )
    nightly_replicates: int = Field(
        3,
        ge=1,
        le=50,
        json_schema_extra=OPERATIONAL,
        description="Replicates of the nightly comparison deployment, so its history compares intervals, not single "
        "draws.",
    )

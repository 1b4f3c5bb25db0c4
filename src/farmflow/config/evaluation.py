"""How outputs are judged in the evaluation."""

from __future__ import annotations

from pydantic import Field

from farmflow.config.annotators import AnnotatorConfig
from farmflow.config.base import Section


class EvaluationConfig(Section):
    """How outputs are judged. How they are sampled (paper: temperature 0.7) is `generation`."""

    annotator: AnnotatorConfig = Field(
        default_factory=AnnotatorConfig, description="Evaluation annotator (p_sim^eval: the pool without label noise)."
    )

"""Deployment definitions for the flows (serve them with `prefect`'s `serve(*deployments())`).

A deployment's parameters are the flows' pydantic config models, so the Prefect UI
renders the whole `FarmConfig` as a form with every field's description.
"""

from __future__ import annotations


def deployments(schedule_cron: str | None = None, timezone: str = "UTC"):
    """Runner deployments of every flow; `schedule_cron` schedules the best-of-n flow."""
    from prefect.schedules import Cron

    from farmflow.flows import best_of_n_flow

    schedules = [Cron(schedule_cron, timezone=timezone)] if schedule_cron else None
    return [best_of_n_flow.to_deployment(name="best-of-n", parameters={"preset": "synthetic-tiny"}, schedules=schedules)]

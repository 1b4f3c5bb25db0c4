"""The whole flow with API annotators through a loopback judge server (farmflow demo --annotator api-local)."""

import pytest

from farmflow.cli.annotators import local_judge
from farmflow.config import load_config
from farmflow.storage import open_store


@pytest.mark.slow
def test_flow_annotates_through_the_local_judge(prefect_harness, tmp_path, monkeypatch):
    from farmflow.flows import best_of_n_flow

    for var in ("OPENAI_API_KEY", "FARMFLOW_STORE"):  # local_judge sets them; restored after the test
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    store = str(tmp_path / "store")
    with local_judge(store, port=0) as overrides:
        cfg = load_config("synthetic-micro", overrides + [f"store.uri={store}"])
        assert cfg.annotation.kind == "api" and cfg.annotation.label_noise == 0.5 and len(cfg.annotation.api_pool) == 13
        summary = best_of_n_flow(advanced=cfg)
        ann = next(r for r in open_store(store).list() if r.stage == "annotate")
        assert ann.metrics["judged"] + ann.metrics["noised"] + ann.metrics["ties"] == ann.metrics["pairs"] == 144
        assert ann.metrics["requests"] > 0 and ann.metrics["cost_usd"] > 0 and ann.metrics["failed"] == 0
        assert {r["method"] for r in summary["leaderboard"]} >= {"sft", "untrained"}
        log = open_store(store).read_rows("annotations", "annotations")
        assert log.num_rows >= ann.metrics["judged"] and set(log.column("status").to_pylist()) == {"ok"}

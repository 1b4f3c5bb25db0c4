"""The CI-sized part of the chaos suite (`make chaos` runs all of it): the fault proxy injects what it says, and
annotation through it at 30% mixed faults loses no pair and pays no answer twice beyond those a fault destroyed."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench package beside tests/

from bench.chaos.proxy import AFTER, FAULTS, FaultProxy, TcpProxy  # noqa: E402
from bench.chaos.scenarios import pairs_file  # noqa: E402
from farmflow.annotators.server import JudgeConfig, JudgeServer  # noqa: E402
from farmflow.config import AnnotatorConfig, ApiAnnotatorConfig  # noqa: E402


def chat() -> dict:
    """A request the judge answers: one pair in the choice format."""
    from farmflow.annotators.prompts import Item, render

    item = Item(instruction="Sort: 3 1 2", input="", first="1 2 3", second="3 2 1")
    return {"model": "m", "messages": render([item], "choice"), "max_tokens": 16}


def test_the_proxy_injects_each_fault_in_turn():
    with JudgeServer(JudgeConfig()) as upstream, FaultProxy(upstream, rate=1.0, slow_s=0.2) as url:
        seen = {}
        for fault in FAULTS:
            with httpx.Client(timeout=10) as client:
                try:
                    r = client.post(f"{url}/chat/completions", json=chat())
                    seen[fault] = (r.status_code, r.headers.get("retry-after"), r.content)
                except httpx.TransportError as err:
                    seen[fault] = ("reset", None, type(err).__name__)
    assert seen["429"][:2] == (429, "1") and seen["500"][0] == 500
    assert seen["reset"][0] == seen["reset_after"][0] == "reset"
    assert seen["slow"][0] == 200 and json.loads(seen["slow"][2])["choices"]
    garbage = json.loads(seen["garbage"][2])["choices"][0]["message"]["content"]
    assert seen["garbage"][0] == 200 and "weather" in garbage
    with pytest.raises(json.JSONDecodeError):
        json.loads(seen["truncated_json"][2])
    assert seen["truncated_json"][0] == 200


def test_the_tcp_proxy_goes_down_and_comes_back():
    with JudgeServer(JudgeConfig()) as upstream:
        port = int(upstream.rsplit(":", 1)[1].split("/")[0])
        proxy = TcpProxy(port)
        with proxy as url:
            assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 200
            proxy.down()
            with pytest.raises(httpx.TransportError):
                httpx.get(f"{url}/v1/models", timeout=5)
            proxy.up()
            assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 200
    assert proxy.refused >= 1
    with socket.socket() as s:  # stopped: nothing listens there any more
        assert s.connect_ex(("127.0.0.1", int(url.rsplit(":", 1)[1]))) != 0


def test_annotation_through_30_percent_faults_loses_nothing_and_pays_nothing_twice(tmp_path, monkeypatch):
    from farmflow.annotators import annotate

    monkeypatch.setenv("OPENAI_API_KEY", "chaos")
    rows = [
        r | {"id": f"p{i}", "split": "pref", "task": None}
        for i, r in enumerate(pairs_file(tmp_path / "pairs.json", 40, seed=3))
    ]
    judge = JudgeServer(JudgeConfig())
    with judge as upstream:
        proxy = FaultProxy(upstream, rate=0.3, seed=2, slow_s=0.5)
        with proxy as url:
            cfg = AnnotatorConfig(
                kind="api", base_url=url, api_pool=[ApiAnnotatorConfig(name="j", model="gpt-4o-mini", batch_size=1)],
                label_noise=0.0, max_in_flight=4, timeout_s=10, max_retries=3, chunk_size=10,
            )  # fmt: skip
            table, totals = annotate(rows, cfg, str(tmp_path / "store"), allow_incomplete=True)
    prefs = table.column("preference").to_pylist()
    assert len(prefs) == 40  # nothing lost: each pair has an answer or is a failed row (null)
    assert sum(proxy.counts[k] for k in FAULTS) >= 8 and all(proxy.counts[k] for k in FAULTS)
    answers = judge.state.pairs.values()
    paid_twice = sum(c - 1 for c in answers if c > 1)
    assert paid_twice <= proxy.paid_lost, (paid_twice, dict(proxy.counts))  # batch_size 1: a pair per request
    assert proxy.paid_lost == sum(proxy.counts[k] for k in AFTER)
    assert sum(p is not None for p in prefs) + totals["failed"] == 40

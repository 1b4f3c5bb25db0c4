"""API annotators against a real OpenAI-compatible HTTP server on 127.0.0.1 (the loopback judge).

The `openai` client makes real HTTP calls; the server counts what it receives, so the
tests can check that nothing is asked or paid for twice.
"""

import logging
import math
import random
import socket
import threading
import time

import pyarrow as pa
import pytest

from farmflow.annotators import AnnotationError, AnnotationIncomplete, annotate, annotate_pairs, cache
from farmflow.annotators.oracle import OracleAnnotator, sigmoid
from farmflow.annotators.server import JudgeConfig, JudgeServer
from farmflow.config import AnnotatorConfig, ApiAnnotatorConfig, OracleAnnotatorConfig
from farmflow.data import gold_reward
from farmflow.data.synthetic import FAMILIES, correct_output, demonstrate, sample_task, task_to_json
from farmflow.storage import open_store
from farmflow.storage.schemas import SCHEMAS

KEY = "sk-farmflow-test-" + "s3cr3t" * 4


def make_rows(n, seed=0):
    """Synthetic pairs: a correct output and a flawed one, in alternating order."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        t = sample_task(FAMILIES[i % len(FAMILIES)], rng)
        good, bad = correct_output(t), demonstrate(t, rng, 1.0)
        if good == bad:
            bad = "no idea"
        o1, o2 = (good, bad) if i % 2 else (bad, good)
        rows.append(
            {
                "id": f"p{i}",
                "split": "pref",
                "instruction": t.instruction,
                "input": t.input,
                "output_1": o1,
                "output_2": o2,
                "task": task_to_json(t),
            }
        )
    return rows


def pool(*annotators, **kw):
    base = dict(
        kind="api",
        api_pool=list(annotators),
        label_noise=0.0,
        max_in_flight=8,
        timeout_s=10,
        max_retries=2,
        chunk_size=20,
    )
    return AnnotatorConfig(**(base | kw))


def judge(name="j", model="gpt-4o-mini", **kw):
    return ApiAnnotatorConfig(name=name, model=model, **kw)


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    srv = JudgeServer(JudgeConfig(api_key=KEY))
    with srv as url:
        srv.url = url
        yield srv


def sharp_server(monkeypatch, **kw):
    """A judge whose oracle follows gold almost surely (so answers are predictable)."""
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    return JudgeServer(JudgeConfig(api_key=KEY, pool=[OracleAnnotatorConfig(name="sharp", sharpness=500.0)], **kw))


def gold_pref(row):
    g1, g2 = gold_reward(row["task"], row["output_1"]), gold_reward(row["task"], row["output_2"])
    return 1.0 if g1 > g2 else 2.0


# ----------------------------------------------------------------------------- judgements
@pytest.mark.parametrize("fmt, batch", [("choice", 1), ("choice", 5), ("json", 4), ("logprobs", 1)])
def test_every_format_and_batch_size_un_swaps_correctly(monkeypatch, tmp_path, fmt, batch):
    rows = [
        r
        for r in make_rows(60)
        if abs(gold_reward(r["task"], r["output_1"]) - gold_reward(r["task"], r["output_2"])) >= 0.1
    ]
    with sharp_server(monkeypatch) as url:
        cfg = pool(judge(prompt_format=fmt, batch_size=batch, base_url=url))
        table, totals = annotate(rows, cfg, str(tmp_path))
    assert table.schema == SCHEMAS["preferences"]
    prefs = table.column("preference").to_pylist()
    if fmt == "logprobs":  # fractional, on the gold side of 1.5
        assert all(1.0 <= p <= 2.0 for p in prefs)
        assert [round(p) for p in prefs] == [gold_pref(r) for r in rows]
    else:
        assert prefs == [gold_pref(r) for r in rows]
    swapped = table.column("swapped").to_pylist()
    assert set(swapped) == {True, False}  # both presentation orders happened
    assert (
        totals["requests"] == math.ceil(len(rows) / batch) and totals["judged"] == len(rows) and totals["failed"] == 0
    )


def test_logprobs_preference_is_the_oracle_probability(monkeypatch, tmp_path):
    """P(b) from the server's log-probabilities, un-swapped: 1 + P(output_2 preferred)."""
    rows = make_rows(30, seed=4)
    oracle_cfg = OracleAnnotatorConfig(name="soft", sharpness=2.0, length_bias=0.7)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    with JudgeServer(JudgeConfig(pool=[oracle_cfg])) as url:
        table = annotate_pairs(rows, pool(judge(prompt_format="logprobs", base_url=url)), str(tmp_path))
    oracle = OracleAnnotator(oracle_cfg)
    for r, t in zip(rows, table.to_pylist()):
        first, second = (r["output_2"], r["output_1"]) if t["swapped"] else (r["output_1"], r["output_2"])
        p_second = sigmoid(oracle.logit_second(r, first, second))
        expected = 1 + (1 - p_second if t["swapped"] else p_second)
        assert t["preference"] == pytest.approx(expected, abs=1e-9)


def test_logit_bias_is_sent(monkeypatch, tmp_path):
    rows = make_rows(12)
    server = sharp_server(monkeypatch)
    with server as url:  # the server's token ids: 97 = "a", 98 = "b"
        cfg = pool(judge(prompt_format="logprobs", logit_bias={"97": 100, "98": -100}, base_url=url))
        table = annotate_pairs(rows, cfg, str(tmp_path))
    # everything biased to "(a)": the first output shown always wins
    assert [t["preference"] for t in table.to_pylist()] == [
        pytest.approx(2.0 if t["swapped"] else 1.0) for t in table.to_pylist()
    ]
    # the server refuses integer or empty biases (400), as transformers serve does (500): none was refused
    assert server.state.stats["status_400"] == 0 and server.state.stats["no_max_tokens"] == 0


def test_noised_label_of_a_flipped_pair_is_flipped_too(tmp_path):
    """A coin-flip label belongs to the pair, not to the order its outputs are stored in.

    The coin is drawn for the canonical order and un-flipped for the row, so a pair and its
    flipped copy never both say "output_2". label_noise=1.0: every pair is a coin, no request
    is sent.
    """
    rows = make_rows(40)
    flipped = [r | {"id": r["id"] + "-flip", "output_1": r["output_2"], "output_2": r["output_1"]} for r in rows]
    cfg = pool(judge(base_url="http://127.0.0.1:9/v1"), label_noise=1.0)
    table, totals = annotate(rows + flipped, cfg, str(tmp_path))
    out = table.to_pylist()
    assert all(r["noised"] for r in out) and totals["requests"] == 0
    assert [r["preference"] for r in out[40:]] == [3.0 - r["preference"] for r in out[:40]]
    assert {r["preference"] for r in out} == {1.0, 2.0}


def test_pool_assignment_noise_ties_and_deduplication(server, tmp_path):
    rows = make_rows(120)
    rows += [
        rows[0] | {"id": "dup"},
        rows[1] | {"id": "flip", "output_1": rows[1]["output_2"], "output_2": rows[1]["output_1"]},
    ]
    rows += [rows[2] | {"id": "tie", "output_2": rows[2]["output_1"]}]
    cfg = pool(
        judge("a", batch_size=3, base_url=server.url),
        judge("b", prompt_format="json", batch_size=2, base_url=server.url),
        judge("c", model="gpt-4o", base_url=server.url),
        label_noise=0.5,
        seed=3,
    )
    table, totals = annotate(rows, cfg, str(tmp_path))
    out = table.to_pylist()
    noised = [r for r in out if r["noised"]]
    assert 0.35 < len(noised) / len(out) < 0.65 and totals["noised"] == len(noised)
    assert out[-1]["preference"] == 1.5 and not out[-1]["noised"] and totals["ties"] == 1
    # the same pair twice, and the same pair with its outputs flipped: asked once, consistent answers
    assert out[120]["preference"] == out[0]["preference"]
    assert out[121]["preference"] == 3.0 - out[1]["preference"] and out[121]["noised"] == out[1]["noised"]
    asked = [r for r in out[:120] if not r["noised"] and r["output_1"] != r["output_2"]]
    assert server.state.stats["items_answered"] == len(asked) == totals["judged"]  # noised pairs never reach the API
    assert server.state.stats["requests"] == totals["requests"]
    assert {r["annotator"] for r in out} == {"a", "b", "c"}
    # assignment depends on instruction + input only
    by_prompt = {}
    for r in out:
        by_prompt.setdefault((r["instruction"], r["input"]), set()).add(r["annotator"])
    assert all(len(v) == 1 for v in by_prompt.values())


# ----------------------------------------------------------------------------- the row cache
def test_row_cache_never_pays_twice(server, tmp_path):
    rows = make_rows(50)
    cfg = pool(judge(batch_size=2, base_url=server.url))
    first = annotate_pairs(rows, cfg, str(tmp_path))
    n = server.state.stats["requests"]
    assert n == 25
    # rerun, rows shuffled and outputs flipped, another seed for the order shown: all from the cache
    flipped = [r | {"output_1": r["output_2"], "output_2": r["output_1"]} for r in reversed(rows)]
    again, totals = annotate(flipped, cfg.model_copy(update={"seed": 9, "max_in_flight": 3}), str(tmp_path))
    assert server.state.stats["requests"] == n and totals["cached"] == 50 and totals["requests"] == 0
    assert again.column("preference").to_pylist() == [3.0 - p for p in reversed(first.column("preference").to_pylist())]
    # the log: one row per pair, outputs canonical, preference relative to them
    log = open_store(tmp_path).read_rows("annotations", "annotations").to_pylist()
    assert len(log) == 50 and len({r["key"] for r in log}) == 50
    for r in log:
        assert (
            r["output_1"] <= r["output_2"]
            and r["status"] == "ok"
            and r["annotator_hash"]
            and r["model"] == "gpt-4o-mini"
        )
        assert (
            r["prompt_tokens"] > 0
            and r["price_usd"] > 0
            and r["latency_s"] > 0
            and r["items"] == 2
            and r["item"] in (1, 2)
        )
    # another annotator config (temperature) is another cache entry
    annotate_pairs(rows[:4], pool(judge(batch_size=2, temperature=0.5, base_url=server.url)), str(tmp_path))
    assert server.state.stats["requests"] == n + 2


def test_written_per_chunk(server, tmp_path):
    cfg = pool(judge(base_url=server.url), chunk_size=7)
    annotate_pairs(make_rows(30), cfg, str(tmp_path))
    chunks = list((tmp_path / "_rows" / "annotations").glob("*.parquet"))
    assert len(chunks) == math.ceil(30 / 7)


def test_cost_per_annotation_and_run_totals(server, tmp_path):
    rows = make_rows(20)
    cfg = pool(judge(model="gpt-4o", batch_size=4, base_url=server.url))
    _, totals = annotate(rows, cfg, str(tmp_path))
    s = server.state.stats
    assert totals["prompt_tokens"] == s["prompt_tokens"] and totals["completion_tokens"] == s["completion_tokens"]
    assert totals["cost_usd"] == pytest.approx((s["prompt_tokens"] * 2.5 + s["completion_tokens"] * 10.0) / 1e6)
    log = open_store(tmp_path).read_rows("annotations", "annotations")
    assert sum(log.column("price_usd").to_pylist()) == pytest.approx(totals["cost_usd"])


def request_estimate(row, cfg):
    """What a one-pair 'choice' request reserves: its prompt at 4 characters a token plus its whole token cap."""
    from farmflow.annotators.budget import cost, prompt_tokens_estimate
    from farmflow.annotators.prompts import Item, render

    a = cfg.api_pool[0]
    item = Item(row["instruction"], row["input"], row["output_1"], row["output_2"])
    messages = render([item], a.prompt_format, a.style)
    return cost(cfg.prices[a.model], prompt_tokens_estimate(messages), cache.max_tokens(a))


def test_max_cost_is_reserved_before_sending_and_stops_within_one_request_of_the_cap(server, tmp_path):
    """Eight requests in flight and a cap of a few requests: spending stays under the cap, less than one request short.

    Each request reserves its estimated cost before it is sent; counting cost only as replies arrive would let
    every request in flight pass the cap (a 4x overshoot at small caps)."""
    rows = make_rows(40)
    cfg = pool(judge(base_url=server.url), max_in_flight=8)
    one = max(request_estimate(r, cfg) for r in rows)
    cap = 3.5 * one
    with pytest.raises(AnnotationIncomplete, match=r"max_cost_usd=\$.* reached after \$.*: \d+ pairs not sent") as err:
        annotate(rows, cfg.model_copy(update={"max_cost_usd": cap}), str(tmp_path))
    done = open_store(tmp_path).read_rows("annotations", "annotations").to_pylist()
    spent = sum(r["price_usd"] for r in done)
    assert spent <= cap < spent + one
    assert server.state.stats["requests"] == len(done) and 3 <= len(done) < 40  # a request is sent only if it fits
    assert f"{40 - len(done)} pairs not sent" in str(err.value)
    # the cap is per run: a rerun reuses what is cached and spends up to the cap again
    table, totals = annotate(rows, cfg.model_copy(update={"max_cost_usd": cap}), str(tmp_path), allow_incomplete=True)
    assert totals["cached"] == len(done) and totals["cost_usd"] <= cap < totals["cost_usd"] + one
    assert totals["judged"] + totals["unsent"] == 40 - len(done) and totals["judged"] >= 3
    assert table.column("preference").null_count == totals["unsent"] > 0
    _, last = annotate(rows, cfg, str(tmp_path))  # no cap: finishes, pays only for the rest
    assert last["cached"] == len(done) + totals["judged"] and last["judged"] == totals["unsent"]


def test_failed_parse_is_reasked_once_then_stored_with_raw_completion(monkeypatch, tmp_path):
    rows = make_rows(10)
    with sharp_server(monkeypatch, fault_rate=1.0, faults=["garbage"]) as url:
        cfg = pool(judge(base_url=url))
        with pytest.raises(AnnotationIncomplete, match="10 of 10 pairs failed \\(parse: 10\\)"):
            annotate(rows, cfg, str(tmp_path))
    log = open_store(tmp_path).read_rows("annotations", "annotations").to_pylist()
    assert len(log) == 10
    assert all(
        r["status"] == "failed" and "after one re-ask" in r["error"] and "merits" in r["raw_completion"] for r in log
    )
    assert all(r["preference"] is None for r in log)


def test_reparse_fixes_failed_rows_without_api_calls(monkeypatch, tmp_path):
    """A completion our parser could not read is stored; after a fix, reparse turns it into a label."""
    rows = make_rows(6)
    with sharp_server(monkeypatch) as url:
        cfg = pool(judge(base_url=url))
        table = annotate_pairs(rows, cfg, str(tmp_path))
        store = open_store(tmp_path)
        good = store.read_rows("annotations", "annotations").to_pylist()
        # rewrite the log as if the parser had failed on every completion
        for p in (tmp_path / "_rows" / "annotations").glob("*.parquet"):
            p.unlink()
        store.append_rows(
            "annotations",
            pa.Table.from_pylist(
                [r | {"status": "failed", "preference": None, "error": "parse: old parser"} for r in good],
                schema=SCHEMAS["annotations"],
            ),
            "annotations",
        )
        assert cache.reparse(store) == {"failed_rows": 6, "reparsed": 6, "still_failed": 0}
        again, totals = annotate(rows, cfg, str(tmp_path))
    assert totals["requests"] == 0 and totals["cached"] == 6
    assert again.column("preference").to_pylist() == table.column("preference").to_pylist()
    assert cache.reparse(store) == {"failed_rows": 0, "reparsed": 0, "still_failed": 0}


# ----------------------------------------------------------------------------- errors and secrets
def _no_key_anywhere(caplog, *texts):
    for t in [*texts, *(r.getMessage() for r in caplog.records)]:
        assert KEY not in t


def test_bad_key_is_one_clear_error_without_retries(server, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("OPENAI_API_KEY", KEY + "-wrong")
    with pytest.raises(AnnotationError, match="API key was rejected \\(HTTP 401\\).*OPENAI_API_KEY") as err:
        annotate_pairs(make_rows(40), pool(judge(base_url=server.url)), str(tmp_path))
    assert server.state.stats["requests"] == 1  # the first request goes alone; 401 is not retried
    _no_key_anywhere(caplog, str(err.value), repr(err.value))
    assert KEY not in str(err.value.__cause__) and err.value.__cause__ is None


def test_unknown_model_is_one_clear_error(monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    srv = JudgeServer(JudgeConfig(models=["gpt-4o-mini"]))
    with srv as url:
        with pytest.raises(AnnotationError, match="HTTP 404 .* model 'no-such-model'") as err:
            annotate_pairs(make_rows(30), pool(judge(model="no-such-model", base_url=url)), str(tmp_path))
    assert srv.state.stats["requests"] == 1
    _no_key_anywhere(caplog, str(err.value))


def test_unreachable_endpoint_is_one_clear_error_no_retry_storm(monkeypatch, tmp_path, caplog):
    """A listener that drops every connection: the SDK tries max_retries + 1 times, once, not per request."""
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    accepted = []

    def drop():
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            accepted.append(1)
            conn.close()

    threading.Thread(target=drop, daemon=True).start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    start = time.perf_counter()
    with pytest.raises(AnnotationError, match=r"cannot connect to endpoint .*\(after 2 retries\)") as err:
        annotate_pairs(make_rows(50), pool(judge(base_url=url), max_in_flight=32), str(tmp_path))
    sock.close()
    assert len(accepted) == 3 and time.perf_counter() - start < 10
    _no_key_anywhere(caplog, str(err.value))
    # a closed port: same single error
    with pytest.raises(AnnotationError, match="cannot connect"):
        annotate_pairs(make_rows(5), pool(judge(base_url="http://127.0.0.1:9/v1"), max_retries=0), str(tmp_path))


def test_missing_key_is_named_and_cached_rows_need_no_key(server, tmp_path, monkeypatch):
    rows = make_rows(8)
    cfg = pool(judge(base_url=server.url))
    annotate_pairs(rows, cfg, str(tmp_path))
    monkeypatch.delenv("OPENAI_API_KEY")
    annotate_pairs(rows, cfg, str(tmp_path))  # all cached: no key needed
    with pytest.raises(AnnotationError, match="environment variable OPENAI_API_KEY is not set"):
        annotate_pairs(make_rows(9, seed=5), cfg, str(tmp_path))


def test_local_rate_limit(server, tmp_path, monkeypatch):
    """Without a Prefect API the process-wide limiter spaces requests evenly.

    The test clears PREFECT_API_URL: with the session's Prefect harness started, the run would use
    Prefect's global limit instead (a burst of one second's worth of slots), and the result would
    depend on which tests ran before it.
    """
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from farmflow.annotators import ratelimit

    cfg = pool(
        judge(base_url=server.url), requests_per_minute=1200, rate_limit_name="test-local"
    )  # one request per 50 ms
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        start = time.perf_counter()
        annotate_pairs(make_rows(21), cfg, str(tmp_path))
        seconds = time.perf_counter() - start
    assert ("test-local", 1200) in ratelimit.LIMITERS  # the local limiter did the spacing
    # 21 requests at one per 50 ms cannot finish sooner than ~1 s; the upper bound only catches a hang
    assert 0.95 <= seconds < 60


def test_in_flight_bound(monkeypatch, tmp_path):
    """max_in_flight caps the requests the server is answering at once (100 ms each, 40 single-pair requests).

    Counted at the server, not timed: a timing bound (wide < narrow / 2) failed once in CI.
    """
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    peaks = []
    for cap in (4, 40):
        server = JudgeServer(JudgeConfig(latency_s=0.1))
        with server as url:
            annotate_pairs(make_rows(40), pool(judge(base_url=url), max_in_flight=cap), str(tmp_path / str(cap)))
            assert server.state.stats["requests"] == 40
            peaks.append(server.state.stats["max_in_flight"])
    assert peaks[0] == 4  # never more than the cap, and the cap is used
    assert peaks[1] > 4  # a wider cap lets more through at once


# ----------------------------------------------------------------------------- Prefect
def test_prefect_secret_and_global_rate_limit(prefect_harness, monkeypatch, tmp_path):
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client
    from prefect.utilities.asyncutils import run_coro_as_sync

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    Secret(value=KEY).save("farmflow-test-judge-key", overwrite=True)
    with JudgeServer(JudgeConfig(api_key=KEY)) as url:
        cfg = pool(
            judge(base_url=url),
            api_key_secret="farmflow-test-judge-key",
            requests_per_minute=240,
            rate_limit_name="farmflow-test-rate",
        )
        start = time.perf_counter()
        table, totals = annotate(make_rows(10), cfg, str(tmp_path))
        elapsed = time.perf_counter() - start
    assert totals["judged"] == 10

    async def read():
        async with get_client() as client:
            return await client.read_global_concurrency_limit_by_name("farmflow-test-rate")

    limit = run_coro_as_sync(read())
    assert limit.slot_decay_per_second == pytest.approx(4.0) and limit.limit == 4
    assert elapsed >= 1.0  # 10 requests, a burst of 4 then 4 per second


def test_a_json_secret_gives_its_api_key_and_a_key_is_not_taken_for_a_variable_name(prefect_harness):
    """A JSON Secret block gives its api_key field (never str(dict)); a key passed as api_key_env is refused without
    being echoed."""
    from prefect.blocks.system import Secret

    from farmflow.annotators.api import AnnotationError, api_key
    from farmflow.config import AnnotatorConfig, ConfigError, load_config

    Secret(value={"api_key": KEY}).save("farmflow-test-json-key", overwrite=True)
    assert api_key(AnnotatorConfig(api_key_secret="farmflow-test-json-key")) == KEY
    Secret(value={"token": KEY}).save("farmflow-test-no-key", overwrite=True)
    with pytest.raises(AnnotationError, match="must hold the key as a string") as err:
        api_key(AnnotatorConfig(api_key_secret="farmflow-test-no-key"))
    assert KEY not in str(err.value)
    with pytest.raises(ConfigError, match="name of an environment variable") as err:
        load_config("synthetic-micro", ["annotation.api_key_env=sk-proj-SECRETVALUE"])
    assert "SECRETVALUE" not in str(err.value)


def test_annotate_task_uses_the_row_cache_across_flows(server, tmp_path):
    """Two stages (another key, same pairs) pay once: the second reads every row from the cache."""
    from farmflow.tasks import annotate_task

    store = open_store(tmp_path)
    rows = make_rows(24)
    pairs = store.put_table(
        "sample_pairs",
        "k1",
        pa.Table.from_pylist([{k: r[k] for k in SCHEMAS["pairs"].names} for r in rows], schema=SCHEMAS["pairs"]),
        "pairs",
    )
    cfg = pool(judge(batch_size=3, base_url=server.url))
    ref = annotate_task.fn(str(tmp_path), cfg, pairs)
    assert ref.metrics["judged"] == 24 and ref.metrics["requests"] == 8 and ref.metrics["cost_usd"] > 0
    # max_in_flight is operational (not in the stage key): same stage, nothing runs
    assert annotate_task.fn(str(tmp_path), cfg.model_copy(update={"max_in_flight": 2}), pairs).key == ref.key
    ref2 = annotate_task.fn(
        str(tmp_path), cfg.model_copy(update={"seed": 1}), pairs
    )  # another stage key, the same judged pairs
    assert ref2.key != ref.key and ref2.metrics["cached"] == 24 and ref2.metrics["requests"] == 0
    assert server.state.stats["requests"] == 8
    assert (
        store.read_table(ref2).column("preference").to_pylist()
        == store.read_table(ref).column("preference").to_pylist()
    )


def test_judge_answers_on_a_kept_alive_connection_without_the_nagle_stall(monkeypatch):
    """The listening socket turns Nagle off (asyncio only does for sockets created with IPPROTO_TCP): with it on,
    every answer on a reused connection waits ~40 ms for the client's delayed ACK (76% of the benchmark's
    ceiling)."""
    import httpx

    from farmflow.annotators.prompts import Item, render

    row = make_rows(1)[0]
    body = {
        "model": "gpt-4o-mini",
        "max_tokens": 8,
        "messages": render([Item(row["instruction"], row["input"], row["output_1"], row["output_2"])], "choice"),
    }
    with (
        sharp_server(monkeypatch, latency_s=0.0) as url,
        httpx.Client(headers={"Authorization": f"Bearer {KEY}"}) as client,
    ):
        seconds = []
        for _ in range(11):  # one connection, kept alive
            start = time.perf_counter()
            assert client.post(f"{url}/chat/completions", json=body).status_code == 200
            seconds.append(time.perf_counter() - start)
    seconds = sorted(seconds[1:])
    assert seconds[len(seconds) // 2] < 0.030, seconds  # 40+ ms each with the stall, ~1 ms without


def test_judge_listening_socket_turns_nagle_off():
    from farmflow.annotators.server import listening_socket

    sock = listening_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        sock.close()


# ----------------------------------------------------------------------------- request failures
def test_a_cut_json_body_fails_its_request_not_the_run(monkeypatch, tmp_path):
    """A 200 reply whose JSON body is cut mid-way makes the SDK raise json.JSONDecodeError (not an APIError): the
    request is asked once more, then its pairs are failed rows with the reason; the run goes on and writes
    everything (escaping asyncio.gather, it would end the run in a traceback with the pairs in flight lost)."""
    rows = make_rows(20)
    srv = sharp_server(monkeypatch, fault_rate=1.0, faults=["truncated_body"])
    with srv as url:
        table, totals = annotate(rows, pool(judge(base_url=url)), str(tmp_path), allow_incomplete=True)
    assert srv.state.stats["status_200_truncated"] == srv.state.stats["requests"] == 40  # each asked twice
    assert totals["failed"] == 20 and table.column("preference").null_count == 20
    log = open_store(tmp_path).read_rows("annotations", "annotations").to_pylist()
    assert len(log) == 20 and {r["status"] for r in log} == {"failed"}
    assert all(
        r["error"].startswith("bad_response: unreadable reply")
        and "JSONDecodeError" in r["error"]
        and r["error"].endswith("(after one re-ask)")
        for r in log
    )


def test_half_the_bodies_cut_every_pair_judged_or_failed_none_lost(monkeypatch, tmp_path):
    rows = make_rows(40)
    srv = sharp_server(monkeypatch, fault_rate=0.5, faults=["truncated_body"])
    with srv as url:
        cfg = pool(judge(base_url=url), judge("j5", batch_size=5, base_url=url))
        table, totals = annotate(rows, cfg, str(tmp_path), allow_incomplete=True)
    log = open_store(tmp_path).read_rows("annotations", "annotations").to_pylist()
    assert len(log) == len({r["key"] for r in log}) == 40 == totals["judged"] + totals["failed"]
    assert totals["reasks"] > 0 and totals["judged"] > 20  # a re-ask usually gets a readable reply
    assert [p for p in table.column("preference").to_pylist() if p is not None] == [
        gold_pref(r) for r, p in zip(rows, table.column("preference").to_pylist()) if p is not None
    ]


@pytest.mark.parametrize("fault, status", [("409", 409), ("400", 400)])
def test_a_client_error_is_not_retried_and_shows_the_server_body(monkeypatch, tmp_path, fault, status):
    """The SDK would retry a 409 on its own; no 4xx other than 408/429 is worth asking again."""
    rows = make_rows(6)
    srv = sharp_server(monkeypatch, fault_rate=1.0, faults=[fault])
    with srv as url:
        _, totals = annotate(rows, pool(judge(base_url=url), max_retries=3), str(tmp_path), allow_incomplete=True)
    assert srv.state.stats["requests"] == 6 and totals["failed"] == 6
    errors = {r["error"] for r in open_store(tmp_path).read_rows("annotations", "annotations").to_pylist()}
    body = {"409": "idempotency key is in progress", "400": "maximum context length is 4096 tokens"}[fault]
    assert len(errors) == 1 and (error := errors.pop()).startswith(f"http_{status}: the server said: {{")
    assert body in error and error.endswith("(not retried)") and "\n" not in error


def test_server_errors_are_retried_and_say_how_often(monkeypatch, tmp_path):
    srv = sharp_server(monkeypatch, fault_rate=1.0, faults=["500"])
    with srv as url:
        cfg = pool(judge(base_url=url), max_retries=2)
        _, totals = annotate(make_rows(3), cfg, str(tmp_path), allow_incomplete=True)
    assert srv.state.stats["requests"] == 9 and totals["failed"] == 3  # 1 + 2 retries each
    log = open_store(tmp_path).read_rows("annotations", "annotations").to_pylist()
    body = (
        '{"error":{"message":"The server had an error while processing your request.","type":"server_error",'
        '"param":null,"code":null}}'
    )
    assert {r["error"] for r in log} == {f"http_500: the server said: {body} (after 2 retries)"}


# ----------------------------------------------------------------------------- served_model
def three_models(url, **kw):
    return pool(
        judge("g4", model="gpt-4o", prompt_format="json", batch_size=4, base_url=url),
        judge("mini", batch_size=1, style="strict", base_url=url),
        judge("d3", model="gpt-4.1-mini", batch_size=5, temperature=0.5, base_url=url),
        **kw,
    )


def test_served_model_sends_one_model_name_and_is_part_of_the_cache_identity(monkeypatch, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    rows = make_rows(30)
    srv = sharp_server(monkeypatch, models=["judge-7b"])
    with srv as url:
        with pytest.raises(AnnotationError) as err:  # the pool's own model names: the endpoint does not serve them
            annotate(rows, three_models(url), str(tmp_path))
        assert srv.state.stats["requests"] == 1  # the first request goes alone, a 404 is not retried, no other is sent
        assert "does not serve model" in str(err.value) and "annotation.served_model" in str(err.value)
        assert "The model 'gpt-4o" in str(err.value)  # the server's own words
        _no_key_anywhere(caplog, str(err.value))

        table, totals = annotate(rows, three_models(url, served_model="judge-7b"), str(tmp_path))
        assert sum(n for m, n in srv.state.models.items() if m != "judge-7b") == 1  # only the first, refused request
        assert srv.state.models["judge-7b"] == totals["requests"] and totals["failed"] == 0
        assert table.column("preference").to_pylist() == [gold_pref(r) for r in rows]
        assert {r["annotator"] for r in table.to_pylist()} == {"g4", "mini", "d3"}  # each annotator keeps its format...
        log = open_store(tmp_path).read_rows("annotations", "annotations").to_pylist()
        assert {r["model"] for r in log} == {"judge-7b"} and {r["prompt_format"] for r in log} == {"json", "choice"}
        biggest = {}
        for r in log:
            biggest[r["annotator"]] = max(biggest.get(r["annotator"], 0), r["items"])
        assert biggest == {"g4": 4, "mini": 1, "d3": 5}  # ...and batch size

        # the same served model: all cached; another served model: other judges, asked again
        _, again = annotate(rows, three_models(url, served_model="judge-7b"), str(tmp_path))
        assert again["cached"] == 30 and again["requests"] == 0
        srv.state.config.models = None
        _, other = annotate(rows, three_models(url, served_model="judge-13b"), str(tmp_path))
        assert other["cached"] == 0 and other["judged"] == 30 and srv.state.models["judge-13b"] == other["requests"]


def test_served_model_in_the_stage_key_and_prices():
    from farmflow.annotators import judges_key
    from farmflow.config import ModelPrice

    a = three_models("http://127.0.0.1:9/v1")
    b = a.model_copy(update={"served_model": "judge-7b"})
    assert judges_key(a) != judges_key(b) != judges_key(b.model_copy(update={"served_model": "x"}))
    # a cost cap needs the price of the model asked: the served one, not the pool's
    with pytest.raises(ValueError, match=r"add \['judge-7b'\] to prices"):
        three_models("http://127.0.0.1:9/v1", served_model="judge-7b", max_cost_usd=1.0)
    three_models(
        "http://127.0.0.1:9/v1",
        served_model="judge-7b",
        max_cost_usd=1.0,
        prices={"judge-7b": ModelPrice(prompt_usd_per_mtok=0.1, completion_usd_per_mtok=0.2)},
    )


def test_cli_served_model_and_a_stopped_run_still_writes_its_output(monkeypatch, tmp_path):
    import json

    from typer.testing import CliRunner

    from farmflow.cli import app

    rows = make_rows(10)
    src = tmp_path / "pairs.json"
    src.write_text(json.dumps([{k: r[k] for k in ("instruction", "input", "output_1", "output_2")} for r in rows]))
    runner = CliRunner()
    with sharp_server(monkeypatch, models=["judge-7b"]) as url:
        args = ["annotate", str(src), "--annotator", "p_sim_eval", "--base-url", url, "--store", str(tmp_path / "st")]
        res = runner.invoke(app, args)
        assert res.exit_code == 1
        assert "annotation.served_model" in " ".join(res.output.split())
        summary = json.loads(res.stdout[res.stdout.index("{") : res.stdout.rindex("}") + 1])
        assert summary["pairs"] == 10 and summary["unsent"] == 10 and summary["judged"] == 0
        assert [r["preference"] for r in json.loads((tmp_path / "pairs.annotated.json").read_text())] == [None] * 10
        res = runner.invoke(app, [*args, "--served-model", "judge-7b"])
    assert res.exit_code == 0, res.output
    out = json.loads((tmp_path / "pairs.annotated.json").read_text())
    assert [round(r["preference"]) for r in out] == [gold_pref(r) for r in rows]  # logprobs annotators give fractions


INTERRUPTED_RUN = """
import sys
sys.path.insert(0, {tests!r})
from test_api_annotators import make_rows, pool, judge
from farmflow.annotators import annotate
annotate(make_rows(400, seed=2), pool(judge(base_url={url!r}), max_in_flight=4, chunk_size=1000), {store!r})
"""


def test_ctrl_c_writes_every_answer_received_to_the_row_cache(monkeypatch, tmp_path):
    """SIGINT cancels the run; on the way out every answer received is appended to the row log, the journal is gone."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from procs import python_env

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    store = tmp_path / "store"
    srv = JudgeServer(JudgeConfig(latency_s=0.02))
    with srv as url:
        code = INTERRUPTED_RUN.format(tests=str(Path(__file__).parent), url=url, store=str(store))
        proc = subprocess.Popen(
            [sys.executable, "-c", code], env=python_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + 120
        while srv.state.stats["items_answered"] < 100:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1].decode()[-2000:]
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        answered = srv.state.stats["items_answered"]
    assert proc.returncode != 0 and b"KeyboardInterrupt" in err  # interrupted, not finished
    rows = open_store(store).read_rows("annotations", "annotations").num_rows
    assert answered - 4 <= rows <= answered < 400  # chunk_size 1000: one append, on the way out
    assert list((store / "_journal" / "annotations").glob("*.jsonl")) == []

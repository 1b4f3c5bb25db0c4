"""Reliability of the API annotators against the real loopback server: injected faults, a killed process."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import python_env, run_and_kill_when
from test_api_annotators import KEY, judge, make_rows, pool

from farmflow.annotators import annotate
from farmflow.annotators.server import FAULTS, JudgeConfig, JudgeServer
from farmflow.storage import open_store

ROOT = Path(__file__).resolve().parents[1]


def mixed_pool(url, **kw):
    return pool(
        judge("c1", base_url=url),
        judge("c5", batch_size=5, base_url=url),
        judge("j4", model="gpt-4o", prompt_format="json", batch_size=4, base_url=url),
        judge("lp", prompt_format="logprobs", base_url=url),
        **kw,
    )


def test_twenty_percent_faults_of_every_kind(monkeypatch, tmp_path):
    """Every pair ends judged or failed with a reason; none lost, duplicated or paid twice."""
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    rows = make_rows(300, seed=11)
    # no SDK retries here, so HTTP faults become failed rows too (retries: test_retry_after_is_honored).
    # Runs without injected faults wait long: on a loaded 2-core machine the in-process server can
    # stall past half a second (CI once timed out 22 of 300 fault-free pairs at timeout_s=0.5).
    patient = dict(max_in_flight=16, timeout_s=30.0, max_retries=0)
    with JudgeServer(JudgeConfig(seed=1)) as clean_url:  # the reference: same judge, no faults
        reference, _ = annotate(rows, mixed_pool(clean_url, **patient), str(tmp_path / "clean"))
    reference = reference.column("preference").to_pylist()

    srv = JudgeServer(JudgeConfig(seed=1, fault_rate=0.2, retry_after_s=0.05, timeout_sleep_s=4.0))
    with srv as url:
        cfg = mixed_pool(url, max_in_flight=16, timeout_s=2.0, max_retries=0)
        table, totals = annotate(rows, cfg, str(tmp_path), allow_incomplete=True)
        stats = dict(srv.state.stats)
        assert all(stats[f"fault_{k}"] > 0 for k in FAULTS), stats
        log = open_store(tmp_path).read_rows("annotations", "annotations").to_pylist()
        # none lost, none duplicated: one cache row per pair, judged or failed with a reason
        assert len(log) == len({r["key"] for r in log}) == 300 == totals["judged"] + totals["failed"]
        assert totals["unsent"] == 0
        failed = [r for r in log if r["status"] == "failed"]
        assert all(r["error"] and r["preference"] is None for r in failed)
        assert all(r["status"] == "ok" and r["error"] is None for r in log if r not in failed)
        assert 0 < len(failed) < 100
        reasons = {r["error"].split(":")[0] for r in failed}
        assert reasons <= {"parse", "rate_limited", "http_500", "http_400", "http_409", "timeout", "bad_response"}
        assert {"bad_response", "http_400", "http_409"} <= reasons
        # what was judged equals the fault-free answers
        prefs = table.column("preference").to_pylist()
        assert sum(p is None for p in prefs) == len(failed)
        assert all(p is None or p == pytest.approx(q) for p, q in zip(prefs, reference))
        # none paid twice: the client accounts for exactly the tokens the server billed, and a pair is
        # answered at most twice (one re-ask after an unreadable answer)
        assert (
            totals["prompt_tokens"] == stats["prompt_tokens"]
            and totals["completion_tokens"] == stats["completion_tokens"]
        )
        assert max(srv.state.pairs.values()) <= 2
        assert totals["reasks"] > 0

        # the rerun, faults off, asks exactly the failed pairs again (the timeout is not part of the key)
        srv.state.config.fault_rate = 0.0
        before = srv.state.stats["items_answered"]
        table, totals = annotate(rows, mixed_pool(url, **patient), str(tmp_path))
        assert srv.state.stats["items_answered"] - before == len(failed) == totals["judged"]
        assert totals["cached"] == 300 - len(failed)
    assert table.column("preference").to_pylist() == pytest.approx(reference)


KILLED_RUN = """
import sys
sys.path.insert(0, {tests!r})
from test_api_annotators import make_rows, pool, judge
from farmflow.annotators import annotate
annotate(make_rows(600, seed=2), pool(judge(base_url={url!r}), max_in_flight=4, chunk_size=25), {store!r})
"""


@pytest.mark.slow
def test_sigkill_mid_run_re_asks_only_the_requests_in_flight(monkeypatch, tmp_path):
    """Every answer is journaled as it arrives: after a SIGKILL the rerun asks the judge again only for
    what was in flight (at most max_in_flight single-pair requests), not for a whole unwritten chunk."""
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    store = str(tmp_path / "store")
    srv = JudgeServer(JudgeConfig(latency_s=0.02))
    with srv as url:
        code = KILLED_RUN.format(tests=str(ROOT / "tests"), url=url, store=store)
        run_and_kill_when([code], cue=lambda: srv.state.stats["items_answered"] >= 150, what="150 answered pairs")
        time.sleep(0.3)  # let the server finish what was in flight
        answered = srv.state.stats["items_answered"]
        chunks = open_store(store).read_rows("annotations", "annotations").num_rows
        assert 150 <= answered < 600 and chunks % 25 == 0  # killed mid-run, between two chunks

        _, totals = annotate(make_rows(600, seed=2), pool(judge(base_url=url), max_in_flight=4, chunk_size=25), store)
        re_asked = srv.state.stats["items_answered"] - answered
        assert totals["cached"] + totals["judged"] == 600 and totals["cached"] == 600 - re_asked
        assert re_asked <= 600 - answered + 4  # what was never answered, plus at most the 4 requests in flight
        assert totals["cached"] >= answered - 4  # journaled answers count, not only the chunks written before the kill
    log = open_store(store).read_rows("annotations", "annotations").to_pylist()
    assert len(log) == len({r["key"] for r in log}) == 600


KILLED_BETWEEN_APPEND_AND_EMPTY = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import farmflow.annotators.journal as journal
from test_api_annotators import make_rows, pool, judge
from farmflow.annotators import annotate
journal.Journal.committed = lambda self: os.kill(os.getpid(), signal.SIGKILL)  # dies right after a chunk's append
annotate(make_rows(60, seed=4), pool(judge(base_url={url!r}), max_in_flight=1, chunk_size=25), {store!r})
"""


def test_a_kill_between_a_chunks_append_and_the_journal_emptying_commits_no_row_twice(monkeypatch, tmp_path):
    """The first chunk is in the log and still in the journal when the process dies: recovery skips those rows,
    so the log holds each answer once and the rerun asks only the pairs never answered."""
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    store = str(tmp_path / "store")
    srv = JudgeServer(JudgeConfig())
    with srv as url:
        code = KILLED_BETWEEN_APPEND_AND_EMPTY.format(tests=str(ROOT / "tests"), url=url, store=store)
        done = subprocess.run([sys.executable, "-c", code], env=python_env(), capture_output=True, timeout=120)
        assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
        assert open_store(store).read_rows("annotations", "annotations").num_rows == 25
        journals = list((tmp_path / "store" / "_journal" / "annotations").glob("*.jsonl"))
        assert [len(p.read_text().splitlines()) for p in journals] == [25]  # the same 25 rows, journaled

        asked = srv.state.stats["items_answered"]
        _, totals = annotate(make_rows(60, seed=4), pool(judge(base_url=url), max_in_flight=1, chunk_size=25), store)
        assert totals["cached"] == 25 and totals["judged"] == 35 == srv.state.stats["items_answered"] - asked
    log = open_store(store).read_rows("annotations", "annotations").to_pylist()
    assert len(log) == len({r["key"] for r in log}) == 60
    assert not list((tmp_path / "store" / "_journal" / "annotations").glob("*.jsonl"))


def test_retry_after_is_honored(monkeypatch, tmp_path):
    """The SDK retries 429s after the server's Retry-After (0.2 s here), not its own longer backoff."""
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    srv = JudgeServer(JudgeConfig(seed=3, fault_rate=0.5, faults=["429"], retry_after_s=0.2))
    with srv as url:
        start = time.perf_counter()
        _, totals = annotate(make_rows(12), pool(judge(base_url=url), max_in_flight=1, max_retries=8), str(tmp_path))
        elapsed = time.perf_counter() - start
    n429 = srv.state.stats["status_429"]
    assert totals["judged"] == 12 and totals["failed"] == 0 and n429 >= 3
    assert srv.state.stats["requests"] == 12 + n429
    assert 0.2 * n429 <= elapsed < 0.45 * n429 + 2.0


def test_a_web_page_instead_of_an_api_fails_each_request_clearly(monkeypatch, tmp_path):
    """HTTP 200 with an HTML page (base_url pointing at a web UI) is not a chat completion: every pair fails with
    that reason, logged, and the run ends with one clear error (never an AttributeError from deep inside)."""
    from farmflow.annotators import AnnotationIncomplete

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    rows = make_rows(12, seed=3)
    with JudgeServer(JudgeConfig(fault_rate=1.0, faults=["html"])) as url:
        with pytest.raises(AnnotationIncomplete, match="12 of 12 pairs failed") as err:
            annotate(rows, pool(judge("c1", base_url=url), max_retries=0), str(tmp_path))
    assert "bad_response: not a chat completion" in str(err.value) and KEY not in str(err.value)
    log = open_store(tmp_path).read_rows("annotations", "annotations").to_pylist()
    assert len(log) == 12 and {r["status"] for r in log} == {"failed"}

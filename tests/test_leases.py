"""Concurrent runs on one store share work: leases in the store (local folder and moto S3), pairs asked once across
annotation processes, stages computed once across processes, and a killed holder taken over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from procs import python_env
from test_api_annotators import KEY

from farmflow.annotators.server import JudgeConfig, JudgeServer
from farmflow.storage import open_store
from farmflow.storage.leases import Leases

TESTS = str(Path(__file__).resolve().parent)


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        return open_store(tmp_path / "store")
    return open_store(request.getfixturevalue("s3_uri"))


def test_a_lease_is_held_once_and_a_dead_owner_on_another_machine_expires_after_its_ttl(store):
    a, b = Leases(store, ttl=3.0), Leases(store, ttl=3.0)
    try:
        assert a.try_acquire("stages/x/k") and a.try_acquire("stages/x/k")  # re-entrant for its holder
        assert not b.try_acquire("stages/x/k") and b.holders["stages/x/k"] == a.owner
        assert b.acquire_many(["stages/x/k", "stages/x/other"]) == {"stages/x/other"}
        # a's machine goes silent: its heartbeat stops, written from a host where its pid means nothing
        a.stop.set()
        a.thread.join()
        beat = {"host": "elsewhere:1", "pid": 1, "beat": time.time(), "ttl_s": 3.0}
        store.fs.pipe_file(a._owner_path(a.owner), json.dumps(beat).encode())
        assert not b.try_acquire("stages/x/k")  # fresh heartbeat: still a live holder
        time.sleep(max(0.0, beat["beat"] + 3.1 - time.time()))
        b.memo.clear()
        assert b.try_acquire("stages/x/k")  # expired: taken over by creating the next generation
        assert not b.alive(a.owner) and b.alive(b.owner)
    finally:
        b.close()
    c = Leases(store, ttl=1.0)
    assert c.try_acquire("stages/x/k") and c.try_acquire("stages/x/other")  # released by b.close()
    c.close()


def test_a_local_lease_folder_removed_by_one_holder_while_another_takes_it_is_made_again(tmp_path):
    """On a local store a lease's folder goes with its last file, so a taker can find it gone between making it and
    writing, or between listing it and reading: four holders taking and releasing one lease 500 times each raise
    nothing and end with no lease left."""
    store = open_store(tmp_path / "store")
    errors: list[BaseException] = []
    taken = []

    def hammer() -> None:
        leases = Leases(store, ttl=30.0)
        try:
            for _ in range(500):
                if leases.try_acquire("annotations/k"):
                    taken.append(1)
                    leases.release("annotations/k")
        except Exception as err:  # noqa: BLE001 - collected for the assert below
            errors.append(err)
        finally:
            leases.close()

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(taken) >= 500  # the holders did take the lease, again and again
    assert not list((tmp_path / "store" / "_leases").rglob("*.json"))


# ------------------------------------------------------------------ annotation pairs across processes
ANNOTATE = """
import json, os, sys, time
sys.path.insert(0, {tests!r})
from test_api_annotators import make_rows, pool, judge
from farmflow.annotators import annotate
open({ready!r}, "w").close()
while not all(os.path.exists(p) for p in {barrier!r}):  # start asking together
    time.sleep(0.01)
cfg = pool(judge(base_url={url!r}), max_in_flight=4, chunk_size=10, max_retries=0, timeout_s=120)
table, totals = annotate(make_rows({n}, seed=5), cfg, {store!r})  # no SDK retries: any pair asked twice counts
print(json.dumps({{"totals": totals, "prefs": table.column("preference").to_pylist()}}))
"""


def annotate_proc(tmp_path: Path, name: str, url: str, store: str, n: int, barrier: list[str]) -> subprocess.Popen:
    code = ANNOTATE.format(tests=TESTS, ready=str(tmp_path / name), barrier=barrier, n=n, url=url, store=store)
    env = python_env(OPENAI_API_KEY=KEY, FARMFLOW_LEASE_TTL_S="3")
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err.decode()[-3000:]
    return json.loads(out.decode().strip().splitlines()[-1])


def test_two_annotation_processes_at_once_ask_each_pair_once(tmp_path):
    """Two real processes annotate the same 200 pairs on one store at the same moment: the judge server answers 200
    requests (one pair each), not 400, and both runs end with every pair judged, with the same labels."""
    store = str(tmp_path / "store")
    srv = JudgeServer(JudgeConfig(latency_s=0.01))
    with srv as url:
        barrier = [str(tmp_path / "a"), str(tmp_path / "b")]
        procs = [annotate_proc(tmp_path, name, url, store, 200, barrier) for name in ("a", "b")]
        a, b = (finish(p) for p in procs)
        assert srv.state.stats["requests"] == srv.state.stats["items_answered"] == 200
        assert max(srv.state.pairs.values()) == 1  # no pair answered twice
    for run in (a, b):
        assert run["totals"]["judged"] + run["totals"]["cached"] == 200 and None not in run["prefs"]
    assert a["totals"]["judged"] + b["totals"]["judged"] == 200
    assert a["prefs"] == b["prefs"]
    log = open_store(store).read_rows("annotations", "annotations").to_pylist()
    assert len(log) == len({r["key"] for r in log}) == 200
    assert not list((Path(store) / "_leases").rglob("*.json"))  # every lease and heartbeat released


def test_a_killed_annotation_run_is_taken_over_by_the_one_waiting_for_it(tmp_path):
    """B waits for the pairs A leased; A is SIGKILLed mid-run: B recovers A's journal and asks only what A never
    answered, so the judge answers each pair once, plus at most the requests A had in flight."""
    store = str(tmp_path / "store")
    srv = JudgeServer(JudgeConfig(latency_s=1.0))  # slow while A runs, so A is still at it when B is ready
    with srv as url:
        a = annotate_proc(tmp_path, "a", url, store, 120, [str(tmp_path / "a")])
        try:
            deadline = time.monotonic() + 600
            while srv.state.stats["items_answered"] < 20:
                assert a.poll() is None and time.monotonic() < deadline, a.stderr.read().decode()[-2000:]
                time.sleep(0.01)
            b = annotate_proc(tmp_path, "b", url, store, 120, [str(tmp_path / "b")])
            while not (tmp_path / "b").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(1.5)  # B has found A's leases and waits
            os.kill(a.pid, signal.SIGKILL)
        finally:
            a.kill()
            a.wait()
        srv.state.config.latency_s = 0.0
        answered_by_a = srv.state.stats["items_answered"]
        run = finish(b)
        assert answered_by_a < 120 and None not in run["prefs"]
        assert srv.state.stats["items_answered"] <= 120 + 4  # each pair once, plus what A had in flight (4)
        assert run["totals"]["judged"] <= 120 - answered_by_a + 4
    log = open_store(store).read_rows("annotations", "annotations").to_pylist()
    assert {r["key"] for r in log} and len({r["key"] for r in log}) == 120


# ------------------------------------------------------------------ stages across processes
STAGE = """
import sys, time
import pyarrow as pa
from farmflow.tasks.registry import Stage
from farmflow.tasks.stage import Table, run_stage

def slow(run, config):
    with open({marker!r}, "a") as f:
        f.write("started\\n")
    time.sleep(float(sys.argv[1]))
    rows = [{{"id": "1", "instruction": "i", "input": "", "output": "o", "generator": "g", "task": None, "score": 1.0}}]
    return Table(pa.Table.from_pylist(rows), "outputs")

ref = run_stage(Stage(name="micro", version="1"), slow, {store!r}, {{"n": 1}}, {{}})
print(ref.uri)
"""


def stage_proc(store: str, marker: Path, sleep: float) -> subprocess.Popen:
    code = STAGE.format(marker=str(marker), store=store)
    env = python_env(FARMFLOW_LEASE_TTL_S="2")
    return subprocess.Popen(
        [sys.executable, "-c", code, str(sleep)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def stage_output(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err.decode()[-3000:]
    return out.decode().strip().splitlines()[-1]


def test_two_processes_needing_one_stage_compute_it_once(tmp_path, s3_server):
    """Local folder and S3: the second process waits for the first one's commit and reuses it."""
    bucket = s3_server.bucket()
    for store in (str(tmp_path / "store"), f"s3://{bucket}/farm?endpoint_url={s3_server.endpoint}"):
        marker = tmp_path / f"marker-{len(store)}"
        procs = [stage_proc(store, marker, 3.0) for _ in range(2)]
        uris = [stage_output(p) for p in procs]
        assert marker.read_text() == "started\n"  # the stage function ran once
        assert uris[0] == uris[1] and len(open_store(store).list()) == 1


def test_a_killed_stage_holder_is_taken_over(tmp_path):
    store, marker = str(tmp_path / "store"), tmp_path / "marker"
    a = stage_proc(store, marker, 60.0)
    try:
        deadline = time.monotonic() + 600
        while not marker.exists():
            assert a.poll() is None and time.monotonic() < deadline, a.stderr.read().decode()[-2000:]
            time.sleep(0.05)
        b = stage_proc(store, marker, 0.0)
        time.sleep(2.0)
        assert b.poll() is None  # waiting for A's commit
        os.kill(a.pid, signal.SIGKILL)
    finally:
        a.kill()
        a.wait()
    stage_output(b)
    assert marker.read_text() == "started\nstarted\n" and len(open_store(store).list()) == 1

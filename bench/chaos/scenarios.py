"""The chaos suite's scenarios; each returns rows of the report: fault, injected, lost, paid twice, what the user saw.

Lost: pairs without an answer or a failed-row mark (annotation), or work a rerun could not finish (runs).
Paid twice: judge answers paid more than once beyond those a fault destroyed after the judge answered (annotation),
or stages a rerun computed again although they were committed before (runs).
"""

from __future__ import annotations

import json
import random
import signal
from pathlib import Path

from bench.chaos.proxy import FAULTS, FaultProxy, TcpProxy
from bench.chaos.runs import STAGE_LINE, Outcome, committed, env_for, farmflow

MICRO = ["run", "compare", "--preset", "synthetic-micro", "--method", "dpo"]
Row = dict


def _saw(out: Outcome) -> str:
    rc = "timeout" if out.rc is None else out.rc
    last = f": {out.error!r}" if out.rc != 0 else ""
    return f"rc {rc}, {len(out.lines)} lines, {out.tracebacks} tracebacks{last}"


def pairs_file(path: Path, n: int, seed: int = 0) -> list[dict]:
    """`n` synthetic-farm pairs (a correct and a flawed output) in AlpacaEval format."""
    from farmflow.data.synthetic import FAMILIES, correct_output, demonstrate, sample_task

    rng, rows = random.Random(seed), []
    for i in range(n):
        t = sample_task(FAMILIES[i % len(FAMILIES)], rng)
        good, bad = correct_output(t), demonstrate(t, rng, 1.0)
        bad = "no idea" if bad == good else bad
        o1, o2 = (good, bad) if i % 2 else (bad, good)
        rows.append({"instruction": t.instruction, "input": t.input, "output_1": o1, "output_2": o2})
    path.write_text(json.dumps(rows))
    return rows


def annotation_faults(work: Path, n: int = 200, rate: float = 0.2, faults=FAULTS, reruns: int = 1) -> list[Row]:
    """`farmflow annotate` of `n` pairs through the fault proxy in front of the loopback judge (real HTTP); a run that
    ends with failed pairs is rerun (what its message says to do) up to `reruns` times."""
    from farmflow.annotators.server import JudgeConfig, JudgeServer

    work.mkdir(parents=True, exist_ok=True)
    pairs_file(work / "pairs.json", n)
    judge = JudgeServer(JudgeConfig())
    with judge as upstream:
        proxy = FaultProxy(upstream, rate, tuple(faults), seed=1, slow_s=2.0)
        with proxy as url:
            env = env_for(work, OPENAI_API_KEY="chaos")
            args = ["annotate", str(work / "pairs.json"), "--annotator", "p_sim_gpt4", "--base-url", url]
            args += ["--store", str(work / "store"), "--output", str(work / "annotated.json")]
            outs = [farmflow(args, work, env, timeout_s=900)]
            while outs[-1].rc != 0 and len(outs) <= reruns:
                outs.append(farmflow(args, work, env, timeout_s=900))
        answers = sorted(judge.state.pairs.values())
    out_file = work / "annotated.json"
    rows = json.loads(out_file.read_text()) if out_file.exists() else []
    answered = sum(r.get("preference") is not None for r in rows)
    lost = n - len(rows)  # a pair neither answered nor marked failed in the output
    paid_twice = sum(c - 1 for c in answers if c > 1)
    excess = max(0, paid_twice - proxy.paid_lost)
    kinds = {k: v for k, v in proxy.counts.items() if k in FAULTS}
    injected = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
    runs = "; ".join(f"run {i + 1}: {_saw(o)}" for i, o in enumerate(outs))
    return [
        {
            "fault": f"judge API at {rate:.0%} faults ({', '.join(faults)}), {n} pairs",
            "injected": f"{sum(kinds.values())} of {proxy.counts['requests']} requests ({injected})",
            "lost": lost,
            "paid twice": f"{excess} (+{paid_twice - excess} pairs whose paid answer a fault destroyed)",
            "saw": f"{answered}/{n} annotated, {n - answered - lost} marked failed; {runs}",
        }
    ]


def _after_stage(n: int, delay: float):
    """A `signal_when` that holds `delay` seconds after the run logged its n-th stage."""
    seen: dict[str, float] = {}

    def when(out: str, t: float) -> bool:
        if "at" not in seen and len(STAGE_LINE.findall(out)) >= n:
            seen["at"] = t
        return "at" in seen and t >= seen["at"] + delay

    return when


def kill_runs(work: Path, sig: int, count: int, seed: int = 0) -> list[Row]:
    """`count` micro comparisons killed with `sig` at a random point, each then rerun to the end."""
    rng, rows = random.Random(seed + sig), []
    for i in range(count):
        store = work / f"store-{sig}-{i}"
        after, delay = rng.randint(1, 8), rng.uniform(0, 6)  # a random point: after the n-th stage, plus a delay
        args = [*MICRO, "--store", str(store)]
        killed = farmflow(args, work, signal_when=_after_stage(after, delay), sig=sig, timeout_s=900)
        before = committed(store)
        rerun = farmflow(args, work, timeout_s=900)
        again = rerun.ran() & before
        stop = f" (stopped in {killed.stop_seconds:.1f} s)" if killed.stop_seconds is not None else " (ended first)"
        rows.append(
            {
                "fault": f"{signal.Signals(sig).name} of `farmflow run compare --method dpo` (synthetic-micro) "
                f"{delay:.1f} s after its stage {after} ended",
                "injected": 1,
                "lost": 0 if rerun.rc == 0 else "rerun failed",
                "paid twice": len(again),
                "saw": f"{_saw(killed)}{stop}; processes left behind {len(killed.left_behind)}; "
                f"rerun: rc {rerun.rc}, {len(before)} stages reused, {len(rerun.ran())} computed",
            }
        )
    return rows


def corrupt_artifacts(work: Path, n: int = 40) -> list[Row]:
    """A committed artifact of a finished micro run truncated to half, then the rerun; and a chunk of the annotation
    row cache truncated to half, then `farmflow annotate` of the same pairs again (judge on loopback)."""
    from farmflow.annotators.server import JudgeConfig, JudgeServer

    store = work / "store-corrupt"
    args = [*MICRO, "--store", str(store)]
    first = farmflow(args, work, timeout_s=900)
    rows = []
    files = sorted(store.glob("annotate/*/*.parquet"))
    if files:
        size = files[0].stat().st_size
        files[0].write_bytes(files[0].read_bytes()[: size // 2])
        rerun = farmflow(args, work, timeout_s=900)
        sql = farmflow(["sql", "SELECT count(*) FROM preferences", "--store", str(store)], work, timeout_s=300)
        still = files[0].exists() and files[0].stat().st_size < size
        rows.append(
            {
                "fault": f"committed artifact truncated to half ({files[0].relative_to(store)})",
                "injected": 1,
                "lost": "the artifact stays corrupt, undetected" if still else 0,
                "paid twice": len(rerun.ran()),
                "saw": f"rerun: {_saw(rerun)}, {len(rerun.ran())} stages computed again; "
                f"`farmflow sql` on the store: {_saw(sql)}",
            }
        )
    else:
        rows.append({"fault": "committed artifact truncated", "injected": 0, "lost": "-", "paid twice": "-",
                     "saw": f"no annotate artifact after the first run ({_saw(first)})"})  # fmt: skip
    work.mkdir(parents=True, exist_ok=True)
    pairs_file(work / "pairs.json", n, seed=5)
    judge = JudgeServer(JudgeConfig())
    with judge as url:
        env = env_for(work, OPENAI_API_KEY="chaos")
        ann = ["annotate", str(work / "pairs.json"), "--annotator", "p_sim_gpt4", "--base-url", url]
        ann += ["--store", str(work / "store-rows"), "--output", str(work / "annotated.json")]
        farmflow(ann, work, env, timeout_s=600)
        paid = sum(judge.state.pairs.values())
        chunks = sorted((work / "store-rows").glob("_rows/annotations/**/*.parquet"))
        for chunk in chunks[:1]:
            chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
        again = farmflow(ann, work, env, timeout_s=600)
        repaid = sum(judge.state.pairs.values()) - paid
    out = work / "annotated.json"
    done = json.loads(out.read_text()) if out.exists() and again.rc == 0 else []
    rows.append(
        {
            "fault": f"annotation row-cache chunk truncated to half ({len(chunks)} chunks), same {n} pairs again",
            "injected": 1 if chunks else 0,
            "lost": n - sum(r.get("preference") is not None for r in done),
            "paid twice": repaid,
            "saw": _saw(again),
        }
    )
    return rows


def s3_outage(work: Path, down_s: float = 15.0) -> list[Row]:
    """A micro run on an S3 store (moto on loopback) whose endpoint resets every connection for `down_s` seconds
    once SFT is done, then comes back with its data."""
    import threading
    import time

    from moto.server import ThreadedMotoServer

    creds = {"AWS_ACCESS_KEY_ID": "chaos", "AWS_SECRET_ACCESS_KEY": "chaos", "AWS_DEFAULT_REGION": "us-east-1"}
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        port = server.get_host_and_port()[1]
        import boto3

        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", region_name="us-east-1",
                          aws_access_key_id="chaos", aws_secret_access_key="chaos")  # fmt: skip
        s3.create_bucket(Bucket="chaos")
        proxy = TcpProxy(port)
        with proxy as endpoint:
            store = f"s3://chaos/farm?endpoint_url={endpoint}"
            args = [*MICRO, "--store", store]
            env = env_for(work, **creds, FARMFLOW_CACHE=str(work / "s3-cache"))
            state = {"down": None}

            def outage(out: str, _t: float) -> bool:
                if state["down"] is None and "sft: ran" in out:
                    state["down"] = time.monotonic()
                    proxy.down()
                    threading.Timer(down_s, proxy.up).start()
                return False

            first = farmflow(args, work, env, signal_when=outage, timeout_s=900)
            rerun = farmflow(args, work, env, timeout_s=900) if first.rc != 0 else first
    finally:
        server.stop()
    return [
        {
            "fault": f"S3 endpoint resets every connection for {down_s:.0f} s after SFT, then returns",
            "injected": f"1 outage, {proxy.refused} connections refused",
            "lost": 0 if rerun.rc == 0 else "rerun failed",
            "paid twice": len(rerun.ran() & first.ran()) if rerun is not first else 0,
            "saw": f"{_saw(first)}" + ("" if rerun is first else f"; rerun rc {rerun.rc}"),
        }
    ]


def full_disk(work: Path, limit_bytes: int = 256 * 1024) -> list[Row]:
    """A micro run whose files may not grow past `limit_bytes` (RLIMIT_FSIZE), then a rerun without the limit."""
    store = work / "store-full"
    args = [*MICRO, "--store", str(store)]
    full = farmflow(args, work, fsize_bytes=limit_bytes, timeout_s=900)
    before = committed(store)
    rerun = farmflow(args, work, timeout_s=900)
    return [
        {
            "fault": f"full disk: no file may grow past {limit_bytes // 1024} KiB (RLIMIT_FSIZE)",
            "injected": 1,
            "lost": 0 if rerun.rc == 0 else "rerun failed",
            "paid twice": len(rerun.ran() & before),
            "saw": f"{_saw(full)}; rerun with space: rc {rerun.rc}, {len(before)} stages reused",
        }
    ]

"""API annotator throughput against the loopback judge, side by side with alpaca_eval.

The judge server (`farmflow judge-server`, its own process) answers every request after
200 ms. Synthetic pairs are annotated with batch sizes 1 and 5 (2,000 requests each: 2,000
and 10,000 pairs) and 32 requests in flight, so the ceiling is 32 × batch / 0.2 s pairs per
second (160 and 800). Each run includes its fixed costs (the first request goes alone, one
latency; the last requests drain), about 2% of a 2,000-request run. Reported:
achieved pairs/s and its fraction of the ceiling (goal >= 90%), and the same pairs
annotated by `alpaca_eval`'s PairwiseAnnotator (32 threads, same prompt, same server),
with the ratio (goal >= 2x).

alpaca_eval is not a farmflow dependency: it lives in its own virtual environment,
.farmflow/bench/alpaca-eval-venv, created with the pinned ALPACA_EVAL version when
missing (`make bench` does it; pass --no-peer to skip the peer).

Writes bench/results/annotators.json and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.venvs import ensure_venv

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "results" / "annotators.json"
PEER_VENV = ROOT / ".farmflow" / "bench" / "alpaca-eval-venv"
ALPACA_EVAL = "alpaca_eval==0.6.6"
REQUESTS, LATENCY_S, IN_FLIGHT, MODEL = 2000, 0.2, 32, "gpt-4o-mini"

PEER = r"""
import json, sys, time, logging
logging.disable(logging.WARNING)
from alpaca_eval.annotators import PairwiseAnnotator
args = json.loads(sys.argv[1])
pairs = json.load(open(args["pairs"]))
annotator = PairwiseAnnotator(annotators_config=args["config"], caching_path=None, is_avoid_reannotations=False)
start = time.perf_counter()
out = annotator.annotate_pairs(pairs)
seconds = time.perf_counter() - start
prefs = [o.get("preference") for o in out]
print(json.dumps({"seconds": seconds, "annotated": len(out), "valid": sum(p in (1, 2, 1.0, 2.0) for p in prefs)}))
"""


def make_pairs(n: int, seed: int = 0) -> list[dict]:
    from farmflow.data.synthetic import FAMILIES, correct_output, demonstrate, sample_task, task_to_json

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        t = sample_task(FAMILIES[i % len(FAMILIES)], rng)
        good, bad = correct_output(t), demonstrate(t, rng, 1.0)
        rows.append(
            {
                "id": str(i),
                "split": "pref",
                "instruction": t.instruction,
                "input": t.input,
                "task": task_to_json(t),
                "output_1": good if i % 2 else bad,
                "output_2": bad if i % 2 else good,
            }
        )
    return rows


def start_server(latency_s: float) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "farmflow.cli.annotators", "--port", "0", "--latency-ms", str(latency_s * 1000)],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise RuntimeError("the judge server did not start")
    return proc, line.rsplit(" ", 1)[1].strip()


def ours(rows: list[dict], url: str, batch: int) -> dict:
    from farmflow.annotators import annotate
    from farmflow.config import AnnotatorConfig

    cfg = AnnotatorConfig(
        kind="api",
        api_pool=[{"name": f"bench_b{batch}", "model": MODEL, "batch_size": batch}],
        base_url=url,
        max_in_flight=IN_FLIGHT,
        label_noise=0.0,
    )
    with tempfile.TemporaryDirectory() as store:  # a fresh row cache: every pair is asked
        start, cpu = time.perf_counter(), time.process_time()
        _, totals = annotate(rows, cfg, store)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {
        "seconds": seconds,
        "pairs_per_s": len(rows) / seconds,
        "requests": totals["requests"],
        "judged": totals["judged"],
        "client_cpu_ms_per_request": 1000 * cpu / totals["requests"],
    }


def peer_template(batch: int) -> str:
    """Our choice-format prompt with alpaca_eval's placeholders, as a chatml template."""
    from farmflow.annotators.prompts import Item, render

    items = [Item("{instruction}", "", "{output_1}", "{output_2}")] * batch
    system, user = render(items, "choice")
    return f"<|im_start|>system\n{system['content']}\n<|im_end|>\n<|im_start|>user\n{user['content']}\n<|im_end|>"


def ensure_peer_venv() -> Path:
    return ensure_venv(PEER_VENV, [ALPACA_EVAL])


def peer(rows: list[dict], url: str, batch: int, python: Path, work: Path) -> dict:
    name = f"farmflow_judge_b{batch}"
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prompt.txt").write_text(peer_template(batch))
    (folder / "configs.yaml").write_text(
        yaml.safe_dump(
            {
                name: {
                    "prompt_template": str(folder / "prompt.txt"),
                    "fn_completions": "openai_completions",
                    "completions_kwargs": {
                        "model_name": MODEL,
                        "max_tokens": 16 + 12 * batch,
                        "temperature": 1.0,
                        "requires_chatml": True,
                    },
                    "fn_completion_parser": "regex_parser",
                    "completion_parser_kwargs": {"outputs_to_match": {1: r"\(a\)", 2: r"\(b\)"}},
                    "batch_size": batch,
                }
            }
        )
    )
    pairs = work / "pairs.json"
    # alpaca_eval has no input field: the input goes inside the instruction placeholder, so the
    # rendered prompt is exactly ours (with or without an input section)
    pairs.write_text(
        json.dumps(
            [
                {
                    "instruction": r["instruction"]
                    + (f"\n</instruction>\n<input>\n{r['input']}" if r["input"] else ""),
                    "output_1": r["output_1"],
                    "output_2": r["output_2"],
                }
                for r in rows
            ]
        )
    )
    env = os.environ | {"OPENAI_API_BASE": url, "OPENAI_API_KEY": "bench", "OPENAI_MAX_CONCURRENCY": str(IN_FLIGHT)}
    proc = subprocess.run(
        [str(python), "-c", PEER, json.dumps({"pairs": str(pairs), "config": str(folder / "configs.yaml")})],
        capture_output=True,
        text=True,
        env=env,
        cwd=work,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"alpaca_eval failed: {proc.stderr.strip()[-1500:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out | {"pairs_per_s": len(rows) / out["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--requests", type=int, default=REQUESTS, help="requests per batch size (pairs = requests x batch)"
    )
    parser.add_argument("--no-peer", action="store_true", help="skip alpaca_eval")
    args = parser.parse_args()
    os.environ["OPENAI_API_KEY"] = "bench"  # the loopback judge accepts any key
    results: dict = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "load_average_at_start": os.getloadavg()},
        "setup": {
            "requests_per_batch_size": args.requests,
            "latency_s": LATENCY_S,
            "in_flight": IN_FLIGHT,
            "model_name": MODEL,
            "server": "farmflow judge-server, own process, 200 ms per answer",
            "peer": ALPACA_EVAL,
        },
        "batch_sizes": {},
    }
    server, url = start_server(LATENCY_S)
    try:
        python = None if args.no_peer else ensure_peer_venv()
        with tempfile.TemporaryDirectory() as tmp:
            for batch in (1, 5):
                limit = IN_FLIGHT * batch / LATENCY_S
                rows = make_pairs(args.requests * batch)
                entry = {"pairs": len(rows), "limit_pairs_per_s": limit}
                r = ours(rows, url, batch)
                entry["farmflow"] = r | {"fraction_of_limit": r["pairs_per_s"] / limit}
                print(
                    f"batch {batch}: farmflow {r['pairs_per_s']:.0f} pairs/s = "
                    f"{100 * r['pairs_per_s'] / limit:.1f}% of {limit:.0f}",
                    flush=True,
                )
                if python is not None:
                    try:
                        p = peer(rows, url, batch, python, Path(tmp))
                        entry["alpaca_eval"] = p | {"fraction_of_limit": p["pairs_per_s"] / limit}
                        entry["ratio_farmflow_over_alpaca_eval"] = r["pairs_per_s"] / p["pairs_per_s"]
                        print(
                            f"batch {batch}: alpaca_eval {p['pairs_per_s']:.0f} pairs/s; "
                            f"ratio {entry['ratio_farmflow_over_alpaca_eval']:.2f}x",
                            flush=True,
                        )
                    except RuntimeError as err:
                        entry["alpaca_eval"] = {"error": str(err)}
                        print(f"batch {batch}: alpaca_eval could not run: {err}", flush=True)
                results["batch_sizes"][str(batch)] = entry
    finally:
        server.terminate()
        server.wait(timeout=10)
    results["machine"]["load_average_at_end"] = os.getloadavg()
    results["goals"] = {
        "fraction_of_limit_>=_0.9": all(
            e["farmflow"]["fraction_of_limit"] >= 0.9 for e in results["batch_sizes"].values()
        ),
        "ratio_>=_2": all(e.get("ratio_farmflow_over_alpaca_eval", 0) >= 2 for e in results["batch_sizes"].values()),
    }
    cpu_ms = max(e["farmflow"]["client_cpu_ms_per_request"] for e in results["batch_sizes"].values())
    results["notes"] = (
        f"farmflow's client spends {cpu_ms:.1f} ms of CPU per request, so alone on one free core it could send "
        f"{1000 / cpu_ms:.0f} requests/s (the ceiling needs {IN_FLIGHT / LATENCY_S:.0f}). The load average went from "
        f"{results['machine']['load_average_at_start'][0]:.1f} to "
        f"{results['machine']['load_average_at_end'][0]:.1f} on "
        f"{os.cpu_count()} cores during the run: when other jobs share the machine, the judge server and the client "
        "get a fraction of a core each and the achieved fraction of the ceiling drops with it; the ratio to "
        "alpaca_eval is measured under the same conditions, side by side."
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

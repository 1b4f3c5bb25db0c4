"""API annotator throughput against the loopback judge, side by side with alpaca_eval.

The judge server (`farmflow judge-server`, its own process) answers every request after
200 ms. Distinct synthetic pairs (no two alike, so neither side can skip one as a duplicate,
and every pair counted was sent) are annotated with batch sizes 1 and 5 (--requests requests
each) and 32 requests in flight, so the ceiling is 32 × batch / 0.2 s pairs per second (160
and 800). Each run includes its fixed costs (the first request goes alone, one latency; the
last requests drain). Reported: achieved pairs/s and its fraction of the ceiling (goal >=
90%), and the same pairs annotated by `alpaca_eval`'s PairwiseAnnotator (same prompt, same
server) with its own concurrency setting (``num_procs`` = 32 in the annotator config), its
documented client config (OPENAI_CLIENT_CONFIG_PATH: one client, the loopback server) and one
openai client for all requests (alpaca_eval builds its clients inside every request; the peer
script memoizes that), in one process, with the ratio (goal >= 2x). The two run
interleaved (`bench.harness.interleave`: one warm-up each, then A B, B A, ...); each
alpaca_eval run is a fresh process whose imports are outside its timing.

alpaca_eval is not a farmflow dependency: it lives in its own virtual environment,
.farmflow/bench/alpaca-eval-venv, created with the pinned ALPACA_EVAL version when
missing (`make bench` does it; pass --no-peer to skip the peer).

``--smoke`` (CI): 20 requests per batch size, one round, farmflow only. Writes bench/results/annotators.json.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.harness import arguments, entry, interleave, machine, save
from bench.venvs import ensure_venv

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "results" / "annotators.json"
PEER_VENV = ROOT / ".farmflow" / "bench" / "alpaca-eval-venv"
ALPACA_EVAL = "alpaca_eval==0.6.6"
REQUESTS, LATENCY_S, IN_FLIGHT, MODEL, ROUNDS = 1000, 0.2, 32, "gpt-4o-mini", 5

PEER = r"""
import json, sys, time, logging
logging.disable(logging.WARNING)
import alpaca_eval.utils
from alpaca_eval.annotators import PairwiseAnnotator
build_clients, clients = alpaca_eval.utils.get_all_clients, {}
def one_client(*a, **k):  # alpaca_eval builds its clients in every request; one client serves them all here
    key = repr((a, sorted(k.items(), key=repr)))
    if key not in clients:
        clients[key] = build_clients(*a, **k)
    return clients[key]
alpaca_eval.utils.get_all_clients = one_client
args = json.loads(sys.argv[1])
pairs = json.load(open(args["pairs"]))
annotator = PairwiseAnnotator(annotators_config=args["config"], caching_path=None, is_avoid_reannotations=False)
start = time.perf_counter()
out = annotator.annotate_pairs(pairs)
seconds = time.perf_counter() - start
prefs = [o.get("preference") for o in out]
print(json.dumps({"seconds": seconds, "annotated": len(out), "valid": sum(p in (1, 2, 1.0, 2.0) for p in prefs)}))
"""


def make_pairs(n: int, seed: int = 0, distinct: bool = False) -> list[dict]:
    """n synthetic pairs (a correct answer and a flawed demonstration, order alternating); with `distinct`, no two
    with the same instruction, input and outputs."""
    from farmflow.data.synthetic import FAMILIES, correct_output, demonstrate, sample_task, task_to_json

    rng = random.Random(seed)
    rows: list[dict] = []
    seen: set[tuple] = set()
    while len(rows) < n:
        i = len(rows)
        t = sample_task(FAMILIES[i % len(FAMILIES)], rng)
        good, bad = correct_output(t), demonstrate(t, rng, 1.0)
        pair = (t.instruction, t.input, good if i % 2 else bad, bad if i % 2 else good)
        if distinct and (pair in seen or good == bad):
            continue
        seen.add(pair)
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
    if totals["judged"] != len(rows):
        raise RuntimeError(f"farmflow judged {totals['judged']:.0f} of {len(rows)} distinct pairs")
    return {
        "seconds": seconds,
        "pairs_per_s": totals["judged"] / seconds,
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
                        "num_procs": IN_FLIGHT,
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
    clients = folder / "openai_configs.yaml"  # alpaca_eval's documented client config: one client, our server
    clients.write_text(yaml.safe_dump({"default": [{"api_key": "bench", "base_url": url}]}))
    env = os.environ | {"OPENAI_CLIENT_CONFIG_PATH": str(clients), "OPENAI_API_KEY": "bench"}
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
    if out["annotated"] != len(rows):
        raise RuntimeError(f"alpaca_eval annotated {out['annotated']} of {len(rows)} distinct pairs")
    return out | {"pairs_per_s": out["annotated"] / out["seconds"]}


def main(argv: list[str] | None = None) -> dict:
    parser = arguments(
        __doc__, OUT, ROUNDS, "CI: 20 requests per batch size, one round, no peer", "interleaved rounds per batch size"
    )
    parser.add_argument(
        "--requests", type=int, default=REQUESTS, help="requests per batch size (pairs = requests x batch)"
    )
    parser.add_argument("--no-peer", action="store_true", help="skip alpaca_eval")
    args = parser.parse_args(argv)
    if args.smoke:
        args.requests, args.rounds, args.no_peer = 20, 1, True
    os.environ["OPENAI_API_KEY"] = "bench"  # the loopback judge accepts any key
    results: dict = {
        "machine": machine(),
        "setup": {
            "requests_per_batch_size": args.requests,
            "rounds": args.rounds,
            "latency_s": LATENCY_S,
            "in_flight": IN_FLIGHT,
            "model_name": MODEL,
            "server": "farmflow judge-server, own process, 200 ms per answer",
            "peer": ALPACA_EVAL,
            "pairs": "distinct (none deduplicated or skipped on either side); pairs/s = pairs judged / seconds",
        },
        "entries": [],
        "batch_sizes": {},
    }
    server, url = start_server(LATENCY_S)
    try:
        python = None if args.no_peer else ensure_peer_venv()
        with tempfile.TemporaryDirectory() as tmp:
            for batch in (1, 5):
                limit = IN_FLIGHT * batch / LATENCY_S
                rows = make_pairs(args.requests * batch, distinct=True)
                contenders = {"farmflow": lambda: ours(rows, url, batch)}
                if python is not None:
                    contenders["alpaca_eval"] = lambda: peer(rows, url, batch, python, Path(tmp))
                runs = interleave(contenders, rounds=args.rounds, warmup=0 if args.smoke else 1)
                rates = {side: [r["pairs_per_s"] for r in rs] for side, rs in runs.items()}
                results["batch_sizes"][str(batch)] = {
                    "pairs": len(rows),
                    "limit_pairs_per_s": limit,
                    "runs": runs,
                    "fraction_of_limit_median": {side: sorted(xs)[len(xs) // 2] / limit for side, xs in rates.items()},
                }
                print(
                    f"batch {batch}: "
                    + ", ".join(f"{s} {sorted(x)[len(x) // 2]:.0f} pairs/s" for s, x in rates.items()),
                    flush=True,
                )
                if python is not None:
                    results["entries"].append(
                        entry(
                            f"API annotation, batch {batch} pairs/request, 32 in flight, 200 ms judge",
                            "pairs/s",
                            rates,
                            goal=2.0,
                            note=f"ceiling {limit:.0f} pairs/s; farmflow at "
                            f"{100 * results['batch_sizes'][str(batch)]['fraction_of_limit_median']['farmflow']:.0f}%",
                        )
                    )
    finally:
        server.terminate()
        server.wait(timeout=10)
    results["machine"]["load_average_at_end"] = list(os.getloadavg())
    cpu_ms = max(r["client_cpu_ms_per_request"] for e in results["batch_sizes"].values() for r in e["runs"]["farmflow"])
    results["notes"] = (
        f"farmflow's client spends up to {cpu_ms:.1f} ms of CPU per request, so alone on one free core it could send "
        f"{1000 / cpu_ms:.0f} requests/s (the ceiling needs {IN_FLIGHT / LATENCY_S:.0f}). When other jobs share the "
        "machine, the judge server and the clients get a fraction of a core each and the achieved fraction of the "
        "ceiling drops with it; the ratio to alpaca_eval is measured under the same conditions, interleaved."
    )
    return save(results, args.out)


if __name__ == "__main__":
    main()

"""`python -m bench.chaos` (`make chaos`): the chaos suite against real components on loopback; writes
docs/reliability.md.

    python -m bench.chaos [--only annotation,kill,corrupt,s3,disk,inputs] [--pairs 200] [--kills 2] [--out FILE]

Scenarios (bench/chaos/scenarios.py): the judge API behind a fault-injecting proxy (bench/chaos/proxy.py), SIGKILL
and SIGTERM at random points of a synthetic-micro comparison, truncated artifacts and row-cache chunks, an S3 store
(moto) whose endpoint goes away and comes back mid-run, a full disk (RLIMIT_FSIZE), and the table of bad inputs
(bench/chaos/inputs.py), each run as its own `farmflow` process. tests/test_chaos.py runs a CI-sized part.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.chaos import scenarios
from bench.chaos.inputs import CASES, expand, judge, make_files
from bench.chaos.runs import REPO, env_for

ALL = ("annotation", "kill", "corrupt", "s3", "disk", "inputs")


def bad_inputs(work: Path) -> list[dict]:
    """Every case of the table as a real `farmflow` process (a few at once: each is mostly imports)."""
    make_files(work)

    def one(case):
        what, argv, env = case
        cmd = [sys.executable, "-c", "from farmflow.cli import main; main()", *expand(argv, work)]
        try:
            done = subprocess.run(cmd, env=env_for(work, **env), cwd=work, capture_output=True, text=True, timeout=300)
            ok, seen = judge(done.returncode, done.stdout, done.stderr)
            return {"input": what, "rc": done.returncode, "one line": "yes" if ok else "NO", "saw": seen[:160]}
        except subprocess.TimeoutExpired:
            return {"input": what, "rc": "timeout", "one line": "NO", "saw": "still running after 300 s"}

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, CASES))


def table(rows: list[dict], columns: list[str]) -> list[str]:
    cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]


def write_report(path: Path, faults: list[dict], inputs: list[dict], command: str, minutes: float) -> None:
    good = sum(r["one line"] == "yes" for r in inputs)
    text = [
        "# Reliability: the chaos suite",
        "",
        "What farmflow does when its environment misbehaves, measured by `make chaos` against real components on",
        "loopback: the project's judge server behind a fault-injecting HTTP proxy, real `farmflow` processes killed",
        "with signals, an S3 server (moto) whose endpoint goes away, a full disk, corrupted files, bad inputs.",
        "",
        "* **lost**: pairs with neither an answer nor a failed-row mark in the output, or work no rerun could finish",
        "  (goal 0);",
        "* **paid twice**: judge answers paid again beyond those a fault destroyed after the judge had answered, or",
        "  stages a rerun computed again although they were committed (goal 0);",
        "* **saw**: the exit code, how many lines the user read, tracebacks among them, and the last error line.",
        "",
        f"Made by {command} ({minutes:.0f} min on a shared 2-core machine; rows in bench/results/chaos.json).",
        "",
        "## Faults",
        "",
        *table(faults, ["fault", "injected", "lost", "paid twice", "saw"]),
        "",
        f"## Bad inputs: {good} of {len(inputs)} give one clear line",
        "",
        "Each is a `farmflow` process; passing means a non-zero exit code, exactly one `error:` line on stderr (a",
        "`full log:` line may follow) and no traceback. The same table runs in process in tests/test_bad_inputs.py.",
        "",
        *table(inputs, ["input", "rc", "one line", "saw"]),
        "",
    ]
    path.write_text("\n".join(text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(ALL), help=f"comma-separated subset of {', '.join(ALL)}")
    parser.add_argument("--pairs", type=int, default=200, help="pairs annotated through the fault proxy")
    parser.add_argument("--kills", type=int, default=1, help="runs killed per signal (SIGKILL, SIGTERM)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "reliability.md")
    parser.add_argument(
        "--results", type=Path, default=REPO / "bench" / "results" / "chaos.json",
        help="every scenario's rows; a run of some scenarios (--only) replaces theirs and keeps the others'",
    )  # fmt: skip
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    results = json.loads(args.results.read_text()) if args.results.exists() else {"scenarios": {}}
    command = "make chaos" if not argv else "python -m bench.chaos " + shlex.join(argv)
    with tempfile.TemporaryDirectory(prefix="farmflow-chaos-") as tmp:
        work = Path(tmp)
        steps = {
            "annotation": lambda: scenarios.annotation_faults(work / "annotation", args.pairs),
            "kill": lambda: [
                row
                for sig in (signal.SIGKILL, signal.SIGTERM)
                for row in scenarios.kill_runs(work / "kill", sig, args.kills)
            ],
            "corrupt": lambda: scenarios.corrupt_artifacts(work / "corrupt"),
            "s3": lambda: scenarios.s3_outage(work / "s3"),
            "disk": lambda: scenarios.full_disk(work / "disk"),
            "inputs": lambda: bad_inputs(work / "inputs"),
        }
        for name in chosen:
            t = time.monotonic()
            try:
                rows = steps[name]()
            except Exception as err:  # noqa: BLE001 - a scenario that breaks is a row of the report, not the end
                rows = [{"fault": name, "injected": "-", "lost": "-", "paid twice": "-",
                         "saw": f"the scenario itself failed: {type(err).__name__}: {err}"}]  # fmt: skip
            minutes = (time.monotonic() - t) / 60
            if args.results.exists():  # another run of some scenarios may have written meanwhile
                results = json.loads(args.results.read_text())
            results["scenarios"][name] = {"rows": rows, "minutes": minutes, "command": command}
            print(f"chaos: {name} done in {minutes:.1f} min", file=sys.stderr, flush=True)
            args.results.write_text(json.dumps(results, indent=1) + "\n")
            report(results, args.out)  # after each scenario
    print(f"chaos: wrote {args.out} and {args.results}", file=sys.stderr)
    return 0


def report(results: dict, out: Path) -> None:
    done = {name: results["scenarios"][name] for name in ALL if name in results["scenarios"]}
    faults = [row for name, s in done.items() if name != "inputs" for row in s["rows"]]
    inputs = done.get("inputs", {}).get("rows", [])
    commands = sorted({s["command"] for s in done.values()})
    write_report(
        out, faults, inputs, " and ".join(f"`{c}`" for c in commands), sum(s["minutes"] for s in done.values())
    )


if __name__ == "__main__":
    sys.exit(main())

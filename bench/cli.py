"""Fixed cost of a fully cached `farmflow run` as a user sees it, with and without a running Prefect server.

The command, `farmflow run best-of-n --preset synthetic-micro --store <temporary store> --json`, runs with every
stage a cache hit (one un-timed run fills the store first); each run is a subprocess, timed from start to exit.

* server: PREFECT_API_URL points at `farmflow server` (Prefect's server with farmflow's environment) on a free
  loopback port, with its own PREFECT_HOME; started once and warmed by one run.
* temporary: no PREFECT_API_URL, the default: each run starts Prefect's temporary server and stops it at exit
  (its database already created by the filling run).
* imports: `python -c` importing what a cached run imports (`IMPORTS`: the flows, and the leaderboard's libraries,
  `farmflow.evaluation.LEADERBOARD_LIBRARIES`; no torch: stages import model code when they run), the part of a run no
  server saves; server − imports is what a run costs beyond its imports (goal: at most 3 s).

Runs are interleaved by `bench.harness.interleave` (server, temporary, imports, then reversed; --rounds rounds
after one warm-up of each), so load from other processes on a shared machine falls on all three alike; the entry
is runs/min with a server against the temporary server, noting the fixed cost beyond imports. ``--smoke`` (CI)
times `farmflow --help` against the imports, once. Children run with .pyc caching on, as in a user's
shell. Writes bench/results/cli.json.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

from bench.harness import arguments, entry, interleave, machine, save, summary
from farmflow.loopback import free_port, server_process

OUT = Path(__file__).parent / "results" / "cli.json"
REPEATS = 7
GOAL_BEYOND_IMPORTS_S = 3.0
FARMFLOW = str(Path(sys.executable).parent / "farmflow")  # the console script a user runs
ARGS = ["run", "best-of-n", "--preset", "synthetic-micro", "--json"]


def child_env(prefect_home: Path, **extra: str) -> dict:
    """A user's shell: no PREFECT_API_URL unless given, .pyc caching on, Prefect state in `prefect_home`."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PYTHONDONTWRITEBYTECODE")}
    return env | {"PREFECT_HOME": str(prefect_home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **extra}


def farmflow_run(store: Path, env: dict, cached: bool = True) -> tuple[float, float]:
    """Wall seconds of one `farmflow run` subprocess and the flow's own seconds (its `wall_seconds`); with
    `cached`, fails unless every stage was a cache hit."""
    start = time.perf_counter()
    done = subprocess.run(
        [FARMFLOW, *ARGS, "--store", str(store)], env=env, capture_output=True, text=True, timeout=900
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"farmflow run failed ({done.returncode}): {done.stderr[-2000:]}")
    summary = json.loads(done.stdout)
    missed = [s["stage"] for s in summary["stages"] if not s["cached"]]
    if cached and missed:
        raise RuntimeError(f"not a fully cached run: {', '.join(missed)} ran")
    return wall, summary["wall_seconds"]


IMPORTS = (
    "import farmflow.flows; from farmflow.evaluation import LEADERBOARD_LIBRARIES as m; [__import__(x) for x in m]"
)


def imports(env: dict) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", IMPORTS], env=env, check=True, timeout=600)
    return time.perf_counter() - start


@contextmanager
def running_server(prefect_home: Path, log: Path) -> Iterator[str]:
    """`farmflow server` on a free loopback port until the block ends (stopped by SIGINT, as Ctrl-C would); yields
    the PREFECT_API_URL it printed, once it answers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}/api"
    command = [FARMFLOW, "server", "--port", str(port)]
    with server_process(
        command,
        url + "/health",
        log,
        "farmflow server",
        env=child_env(prefect_home),
        stop_signal=signal.SIGINT,
        group=True,
        grace=60,
    ):
        if f"export PREFECT_API_URL={url}" not in log.read_text():
            raise RuntimeError(f"farmflow server did not print the export line for {url}")
        yield url


def main(argv: list[str] | None = None) -> dict:
    parser = arguments(
        __doc__,
        OUT,
        REPEATS,
        "CI: `farmflow --help` in place of the cached run, no server, one round (checks the wiring in seconds)",
    )
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="farmflow-bench-cli-"))
    store = tmp / "store"
    temporary_env = child_env(tmp / "prefect-temporary")
    load_before = os.getloadavg()
    flows: dict[str, list[float]] = {"server": [], "temporary": []}

    def run_with(name: str, env: dict):
        def run() -> float:
            if args.smoke:
                start = time.perf_counter()
                subprocess.run([FARMFLOW, "--help"], env=env, capture_output=True, check=True, timeout=600)
                return time.perf_counter() - start
            wall, flow = farmflow_run(store, env)
            flows[name].append(flow)
            return wall

        return run

    try:
        with ExitStack() as servers:
            contenders = {}
            if not args.smoke:
                print("filling the store (one un-timed run with a temporary server)...", flush=True)
                farmflow_run(store, temporary_env, cached=False)
                url = servers.enter_context(running_server(tmp / "prefect-server", tmp / "server.log"))
                contenders["server"] = run_with("server", child_env(tmp / "prefect-client", PREFECT_API_URL=url))
            contenders["temporary"] = run_with("temporary", temporary_env)
            contenders["imports"] = lambda: imports(temporary_env)
            walls = interleave(contenders, rounds=1 if args.smoke else args.rounds, warmup=0 if args.smoke else 1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    med = {name: statistics.median(xs) for name, xs in walls.items()}
    per_min = {name: [60 / x for x in xs] for name, xs in walls.items()}
    results: dict = {
        "machine": machine() | {"load_average_before": list(load_before)},
        "command": "farmflow --help (smoke)"
        if args.smoke
        else "farmflow " + " ".join(ARGS) + " --store <store filled by one un-timed run>",
        "rounds": len(walls["imports"]),
        "wall_s": {name: summary(xs) | {"runs": xs} for name, xs in walls.items()},
        "in_flow_median_s": {name: statistics.median(xs) for name, xs in flows.items() if xs},
        "entries": [],
        "notes": (
            "wall: seconds from starting the subprocess to its exit, as a user sees it. server: PREFECT_API_URL "
            "set to `farmflow server` on loopback; temporary: no PREFECT_API_URL (Prefect's temporary server per "
            "run); imports: python -c importing the flows and the leaderboard's libraries (IMPORTS). in_flow: the "
            "run's own wall_seconds (the flow call). Runs interleaved (bench.harness.interleave: server, temporary, "
            "imports, then reversed); "
            "beyond imports = median(server) - median(imports); paired: median over rounds of server - imports."
        ),
    }
    if "server" in walls:
        beyond = med["server"] - med["imports"]
        paired = statistics.median(a - i for a, i in zip(walls["server"], walls["imports"]))
        results |= {
            "server_beyond_imports_s": beyond,
            "server_beyond_imports_paired_median_s": paired,
            "goal_beyond_imports_s": GOAL_BEYOND_IMPORTS_S,
            "goal_met": beyond <= GOAL_BEYOND_IMPORTS_S,
        }
        results["entries"].append(
            entry(
                "cached `farmflow run best-of-n` (synthetic-micro): with `farmflow server` vs Prefect's temporary "
                "server",
                "runs/min",
                {"server": per_min["server"], "temporary": per_min["temporary"]},
                note=f"fixed cost beyond imports {beyond:.1f} s (paired {paired:.1f} s; goal <= "
                f"{GOAL_BEYOND_IMPORTS_S:g} s: {'met' if beyond <= GOAL_BEYOND_IMPORTS_S else 'not met'})",
            )
        )
    else:
        results["entries"].append(entry("`farmflow --help` vs `import farmflow.flows` (smoke)", "runs/min", per_min))
    save(results, args.out)
    for name, st in results["wall_s"].items():
        print(f"{name:9s} median {st['median']:.1f}s (min {st['min']:.1f}, max {st['max']:.1f}, n={st['rounds']})")
    if "server" in walls:
        print(f"temporary / server: {med['temporary'] / med['server']:.2f}x; beyond imports {beyond:.1f}s")
    return results


if __name__ == "__main__":
    main()

"""How every benchmark measures: interleaved rounds, warm-up, medians with their spread, ratios, the machine.

* `interleave` runs the contenders A B, B A, A B ... for `rounds` rounds after one untimed warm-up
  of each, so load from other processes and thermal or cache drift fall on all of them alike;
* `summary` reports the median and the range (min, max) of a contender's rounds; `ratio` the
  ratio of two medians with its range over rounds (the worst and best pairing of rounds);
* `machine` records what a reader needs to judge a number: CPUs, load, versions, commit, date;
* `entry` is one row of BENCHMARKS.md (`bench.report` renders every result file's entries).

A contender is a function of no arguments that returns its measurement: a number (higher is
better, e.g. tokens/s) or a dict holding it under `metric`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]


def arguments(
    doc: str, out: Path, rounds: int, smoke: str, rounds_help: str = "interleaved rounds"
) -> argparse.ArgumentParser:
    """A bench's command line: --rounds, --smoke (CI: seconds), --out; the bench adds its own options."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=rounds, help=f"{rounds_help} (after one warm-up each)")
    parser.add_argument("--smoke", action="store_true", help=smoke)
    parser.add_argument("--out", type=Path, default=out, help="results file")
    return parser


def interleave(contenders: dict[str, Callable[[], Any]], rounds: int, warmup: int = 1) -> dict[str, list[Any]]:
    """Each contender's measurements over `rounds` interleaved rounds (the order alternates every round).

    Every contender first runs `warmup` times untimed (kernels, allocator, file cache); then round r runs
    them in their given order when r is even, reversed when odd.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    names = list(contenders)
    for _ in range(warmup):
        for name in names:
            contenders[name]()
    runs: dict[str, list[Any]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            runs[name].append(contenders[name]())
    return runs


def values(runs: list[Any], metric: str | None = None) -> list[float]:
    """The measured numbers of a contender's rounds (`metric` picks them out of dict measurements)."""
    return [float(r[metric] if metric else r) for r in runs]


def summary(xs: list[float]) -> dict[str, float]:
    """Median and range of one contender's rounds."""
    if not xs:
        raise ValueError("no measurements")
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "rounds": len(xs)}


def ratio(a: list[float], b: list[float]) -> dict[str, float]:
    """median(a) / median(b), and the range of a/b over every pairing of rounds (min a / max b .. max a / min b)."""
    if min(b) <= 0:
        raise ValueError("the denominator's measurements must be positive")
    return {"ratio": statistics.median(a) / statistics.median(b), "low": min(a) / max(b), "high": max(a) / min(b)}


def entry(
    what: str, unit: str, runs: dict[str, list[float]], goal: float | None = None, note: str = ""
) -> dict[str, Any]:
    """One benchmark row: the first contender against the second (medians, spread, ratio and the goal it is held to)."""
    (a, xs), (b, ys) = list(runs.items())[:2]
    r = ratio(xs, ys)
    return {
        "what": what,
        "unit": unit,
        "contenders": [a, b],
        "medians": {a: summary(xs), b: summary(ys)},
        "ratio": r["ratio"],
        "ratio_range": [r["low"], r["high"]],
        "goal": goal,
        "met": None if goal is None else r["ratio"] >= goal,
        "note": note,
    }


def save(results: dict[str, Any], out: Path) -> dict[str, Any]:
    """Write a bench's results file; print each entry (both contenders' medians, the ratio, the note) and the path."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    for e in results.get("entries", []):
        (a, b), m = e["contenders"], e["medians"]
        note = f"; {e['note']}" if e.get("note") else ""
        print(
            f"{e['what']}: {a} {m[a]['median']:.3g} vs {b} {m[b]['median']:.3g} {e['unit']} ({e['ratio']:.2f}x){note}",
            flush=True,
        )
    print(f"wrote {out}", flush=True)
    return results


def native_bf16() -> bool:
    """Whether this machine computes bfloat16 natively: a GPU, or a CPU with avx512_bf16/AMX."""
    import torch

    from farmflow.models.runtime import cpu_flags, slow_half_precision

    return not slow_half_precision("bfloat16", torch.cuda.is_available(), cpu_flags())


def machine() -> dict[str, Any]:
    """The machine, versions and date a result was measured on."""
    import torch
    import transformers

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "native_bf16": native_bf16(),  # bfloat16 results differ by kind on a CPU (farmflow.models.runtime)
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()),
        "commit": commit,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }

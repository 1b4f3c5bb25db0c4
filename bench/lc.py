"""A leaderboard's length-controlled win rates: the cross-validation fits in worker processes against all in this one.

`farmflow.evaluation.leaderboard.leaderboard_rows` gives every system an LC win rate whose instruction difficulty is
fitted on the other systems' judgments (leave one out): at synthetic-tiny's size, 9 systems and 1,860 evaluation
instructions, that is 9 joint fits of ~30,000 rows, each choosing its penalty among 10 by 5-fold cross-validation
(`farmflow.evaluation.glm_lc.fit_soft_logistic`, liblinear as alpaca_eval). Fits of `PARALLEL_MIN_ROWS` rows or more
run their 50 held-out fits in worker processes, one per CPU; the peer is the same code with that threshold out of
reach (every fit in this process, as alpaca_eval does it).

Judgments: generated in the farm's shape, not read from a store (a fresh machine has none): per instruction an
effect, per system a quality, output lengths of 5 to 150 characters against a reference's, and hard labels (1 or 2)
drawn from sigmoid(quality + effect + length preference). Both sides fit the same judgments, interleaved
(`bench.harness.interleave`: one warm-up each, which also starts the worker processes, then A B, B A, ...);
reported: leaderboards per minute, median and range, the ratio, and the largest difference between the two sides'
LC win rates (0: liblinear seeds its random state on every fit, in whichever process).

``--smoke`` (CI): 2 systems of 60 instructions, the threshold lowered so that the workers run, one round.
Writes bench/results/lc.json.
"""

from __future__ import annotations

import math
import time

import numpy as np

from bench.harness import ROOT, arguments, entry, interleave, machine, save, values

OUT = ROOT / "bench" / "results" / "lc.json"


def judged_rows(systems: int, instructions: int, seed: int = 0) -> list[list[dict]]:
    """Each system's evaluation rows (instruction, input, output_1 = reference, output_2, preference)."""
    rng = np.random.default_rng(seed)
    effect = rng.normal(0, 1, instructions)
    ref_len = rng.integers(5, 150, instructions)
    out = []
    for s in range(systems):
        quality = rng.normal(0, 0.5)
        lengths = rng.integers(5, 150, instructions)
        logit = quality + effect + 0.5 * np.tanh((lengths - ref_len) / 40)
        wins = rng.random(instructions) < 1 / (1 + np.exp(-logit))
        out.append(
            [
                {
                    "instruction": f"task {i}",
                    "input": "",
                    "output_1": "r" * ref_len[i],
                    "output_2": "o" * lengths[i],
                    "preference": 2.0 if wins[i] else 1.0,
                }
                for i in range(instructions)
            ]
        )
    return out


def board(entries: list[dict], threshold: float, got: dict, name: str):
    from farmflow.evaluation import glm_lc
    from farmflow.evaluation.leaderboard import leaderboard_rows

    def run() -> dict:
        glm_lc.PARALLEL_MIN_ROWS = threshold
        start = time.perf_counter()
        got[name] = {r["method"]: r["lc_win_rate"] for r in leaderboard_rows(entries)}
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "boards_per_min": 60 / seconds}

    return run


def main(argv: list[str] | None = None) -> dict:
    from farmflow.evaluation import glm_lc

    parser = arguments(__doc__, OUT, 3, "2 systems of 60 instructions, workers forced: seconds, for CI")
    parser.add_argument("--systems", type=int, default=9, help="systems on the leaderboard (synthetic-tiny: 9)")
    parser.add_argument("--instructions", type=int, default=1860, help="evaluation instructions (synthetic-tiny)")
    args = parser.parse_args(argv)
    systems, n = (2, 60) if args.smoke else (args.systems, args.instructions)
    metrics = {"win_rate": 50.0, "standard_error": 1.0, "avg_length": 0, "n_total": n}
    entries = [
        {
            "method": f"system {s}",
            "metrics": metrics,
            "rows": rows,
            "annotator": "",
            "reference": "",
            "group": "g",
            "evaluation_key": str(s),
        }
        for s, rows in enumerate(judged_rows(systems, n))
    ]
    default = glm_lc.PARALLEL_MIN_ROWS
    got: dict = {}
    runs = interleave(
        {
            "worker processes": board(entries, 1 if args.smoke else default, got, "workers"),
            "this process": board(entries, math.inf, got, "here"),
        },
        rounds=1 if args.smoke else args.rounds,
        warmup=0 if args.smoke else 1,
    )
    glm_lc.PARALLEL_MIN_ROWS = default
    diff = max(abs(got["workers"][m] - got["here"][m]) for m in got["here"])
    rates = {name: values(rs, "boards_per_min") for name, rs in runs.items()}
    what = f"LC leaderboard, {systems} systems × {n} instructions (leave-one-out difficulty)"
    results = {
        "machine": machine(),
        "setup": {"systems": systems, "instructions": n, "parallel_min_rows": default, "smoke": args.smoke},
        "entries": [entry(what, "boards/min", rates, note=f"LC win rates differ by at most {diff:.1e}")],
        "runs": runs,
    }
    return save(results, args.out)


if __name__ == "__main__":
    main()

"""Judging throughput of one local model two ways: in process (annotation kind ``hf``) against the same checkpoint
behind `transformers serve` on loopback (annotation kind ``api``), end to end through `farmflow.annotators.annotate`.

Pairs: the first --pairs AlpacaEval instructions of ../shared/data, Davinci003's reference output against the next
instruction's reference. Judge: SmolLM2-135M-Instruct from the model cache (`farmflow models get
smollm2-135m-instruct`), float32 on both sides.

* in process: the hf judge (`farmflow.annotators.hf_judge`), its default batch size, each pair read in both orders
  (two forward passes, no generation), the shared judging guidance read once per run.
* served: `transformers serve` with the same folder, one `logprobs` annotator at temperature 0 whose answer is held to
  the tokens "a" and "b" by a logit bias of +100 (the set-up docs/real-farm.md runs; a 135M model keeps to no richer
  format), one pair per request, the order shown drawn per pair, `max_in_flight` 2 (the server runs one generation at
  a time on a CPU; more in flight only queues).

So the two sides do different work per pair (two forward passes against one prefill plus one decoding step and an
HTTP round trip); the number compared is what a user gets: pairs judged per second. Each round annotates the pairs
into a fresh store (no row-cache hits); the server is started once and warmed by the first round. Rounds interleave
(`bench.harness.interleave`). ``--smoke`` (CI): a tiny random Llama with a chat template, 4 pairs, one round.
Writes bench/results/serve_judge.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from bench.harness import ROOT, arguments, entry, interleave, machine, save, values
from bench.judge import EVAL_FILE, MODEL, tiny_judge
from farmflow.loopback import free_port, server_process

OUT = ROOT / "bench" / "results" / "serve_judge.json"
TRANSFORMERS = Path(sys.executable).parent / "transformers"


def rows_of(n: int) -> list[dict]:
    rows = json.loads(EVAL_FILE.read_text())[: n + 1]
    return [
        {
            "id": f"b{i}",
            "instruction": r["instruction"],
            "input": "",
            "output_1": r["output"],
            "output_2": nxt["output"],
        }
        for i, (r, nxt) in enumerate(zip(rows, rows[1:]))
    ]


@contextmanager
def served(folder: str, log: Path):
    """`transformers serve` for `folder` on a free loopback port until the block ends; yields its /v1 URL."""
    port = free_port()
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [str(TRANSFORMERS), "serve", folder, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    with server_process(command, f"http://127.0.0.1:{port}/health", log, "transformers serve", env=env):
        yield f"http://127.0.0.1:{port}/v1"


def side(rows: list[dict], cfg, scratch: Path):
    from farmflow.annotators import annotate

    def run() -> dict:
        with tempfile.TemporaryDirectory(dir=scratch) as store:
            start = time.perf_counter()
            table, totals = annotate(rows, cfg, store, allow_incomplete=True)
            seconds = time.perf_counter() - start
        judged = sum(p is not None for p in table.column("preference").to_pylist())
        return {"seconds": seconds, "pairs_per_s": len(rows) / seconds, "judged": judged, "failed": totals["failed"]}

    return run


def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoTokenizer

    from farmflow.config import AnnotatorConfig
    from farmflow.modelcache import resolve_model

    parser = arguments(__doc__, OUT, 5, "a tiny random judge and 4 pairs: seconds, for CI")
    parser.add_argument("--pairs", type=int, default=24, help="AlpacaEval pairs per round")
    args = parser.parse_args(argv)
    os.environ.setdefault("OPENAI_API_KEY", "local")  # transformers serve takes any key
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        if args.smoke:
            folder = tiny_judge(scratch / "tiny-judge", chat=True)
        else:
            folder = str(resolve_model(MODEL))
        tok = AutoTokenizer.from_pretrained(folder)
        a, b = tok.convert_tokens_to_ids(["a", "b"])
        rows = rows_of(4 if args.smoke else args.pairs)
        in_process = AnnotatorConfig(kind="hf", hf={"model": folder, "max_prompt_tokens": 704}, label_noise=0.0)
        with served(folder, scratch / "server.log") as url:
            api = AnnotatorConfig(
                kind="api",
                base_url=url,
                served_model=folder,
                timeout_s=600,
                max_in_flight=2,
                label_noise=0.0,
                api_pool=[
                    {
                        "name": "served-ab",
                        "model": MODEL,
                        "prompt_format": "logprobs",
                        "temperature": 0,
                        "logit_bias": {str(a): 100.0, str(b): 100.0},
                    }
                ],
            )
            runs = interleave(
                {
                    "in process (hf)": side(rows, in_process, scratch),
                    "transformers serve (api)": side(rows, api, scratch),
                },
                rounds=1 if args.smoke else args.rounds,
                warmup=0 if args.smoke else 1,
            )
    what = "tiny random Llama (smoke)" if args.smoke else f"{MODEL} (fp32)"
    judged = {name: min(r["judged"] for r in rs) for name, rs in runs.items()}
    results = {
        "machine": machine(),
        "setup": {
            "judge": what,
            "pairs": len(rows),
            "max_in_flight": 2,
            "batch_size_in_process": "the judge's default",
        },
        "entries": [
            entry(
                f"judge, {what}: in process vs transformers serve",
                "pairs/s",
                {name: values(rs, "pairs_per_s") for name, rs in runs.items()},
                note="in process: both orders, probabilities; served: one order, a/b held by logit_bias; "
                + ", ".join(f"{name} judged ≥ {n} of {len(rows)}" for name, n in judged.items()),
            )
        ],
        "runs": runs,
    }
    return save(results, args.out)


if __name__ == "__main__":
    main()

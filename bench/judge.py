"""The in-process hf judge's forward passes: the shared judging guidance read once (its key/value cache reused by every
batch) against every prompt read whole.

Pairs: the first --pairs AlpacaEval instructions of ../shared/data, Davinci003's reference output against the next
instruction's reference (realistic lengths), each in both orders as the judge sees them. Judge: SmolLM2-135M-Instruct
from the model cache (`farmflow models get smollm2-135m-instruct`), float32, a 704-token prompt limit (pairs at full
length) and the judge's default batch size. The two sides run interleaved (`bench.harness.interleave`: one warm-up
each, then A B, B A, ...) on the same prompts; reported: prompts/s, median and range, the ratio, and the largest
difference between the two sides' probabilities.

``--smoke`` (CI): a tiny random Llama judge, 4 pairs, one round. Writes bench/results/judge.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.harness import ROOT, arguments, entry, interleave, machine, save, values

OUT = ROOT / "bench" / "results" / "judge.json"
EVAL_FILE = ROOT.parent / "shared" / "data" / "alpaca_eval_davinci003_outputs.json"
MODEL = "smollm2-135m-instruct"


def pairs_of(n: int) -> list[tuple[str, str, str, str]]:
    rows = json.loads(EVAL_FILE.read_text())[: n + 1]
    return [(r["instruction"], "", r["output"], rows[i + 1]["output"]) for i, r in enumerate(rows[:n])]


def tiny_judge(folder: Path, chat: bool = False) -> str:
    """A random 1-layer Llama with a small BPE tokenizer trained on the judging prompt's words (`chat`: with a plain
    chat template, so that an OpenAI-compatible server can serve it)."""
    from farmflow.annotators import hf
    from farmflow.models import random_llama, train_tokenizer

    tok = train_tokenizer([hf.SYSTEM, hf.QUESTION, hf.ANSWER_LEAD + " (a) (b) ## Instruction ## Output"] * 3, 300)
    if chat:
        tok.chat_template = (
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}"
        )
    random_llama(tok, max_positions=2048).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def side(judge, prompts, batch: int, shared: bool, got: dict):
    from farmflow.annotators import hf_judge

    def run() -> dict:
        hf_judge.MIN_SHARED = 16 if shared else 10**9
        judge.prefix = None  # each round reads the guidance again: its cost counts
        start = time.perf_counter()
        got[shared] = hf_judge.answer_probs(judge, prompts, batch)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "prompts_per_s": len(prompts) / seconds}

    return run


def main(argv: list[str] | None = None) -> dict:
    import tempfile

    from farmflow.annotators import hf_judge
    from farmflow.config import HFJudgeConfig

    parser = arguments(__doc__, OUT, 5, "a tiny random judge and 4 pairs: seconds, for CI")
    parser.add_argument("--pairs", type=int, default=48, help="AlpacaEval pairs (each judged in both orders)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_judge(Path(tmp) / "tiny-judge") if args.smoke else MODEL
        cfg = HFJudgeConfig(model=model, max_prompt_tokens=704)
        judge = hf_judge.load_judge(cfg)
        pairs = pairs_of(4 if args.smoke else args.pairs)
        prompts = [p for pair in pairs for p in hf_judge.fit(judge, *pair)[0]]
        got: dict = {}
        runs = interleave(
            {
                "guidance read once": side(judge, prompts, cfg.batch_size, True, got),
                "every prompt whole": side(judge, prompts, cfg.batch_size, False, got),
            },
            rounds=1 if args.smoke else args.rounds,
            warmup=0 if args.smoke else 1,
        )
    hf_judge.MIN_SHARED = 16
    diff = max(abs(a[0] - b[0]) for a, b in zip(got[True], got[False]))
    head = len(hf_judge.shared_prefix(judge, prompts, "cpu")[0])
    mean = sum(len(p.ids) for p in prompts) / len(prompts)
    what = "tiny random Llama (smoke)" if args.smoke else f"{MODEL} (fp32)"
    rates = {name: values(rs, "prompts_per_s") for name, rs in runs.items()}
    results = {
        "machine": machine(),
        "setup": {
            "judge": what,
            "prompts": len(prompts),
            "batch_size": cfg.batch_size,
            "shared_tokens": head,
            "mean_prompt_tokens": mean,
        },
        "entries": [
            entry(
                f"hf judge forward passes, {what}",
                "prompts/s",
                rates,
                note=f"{head} of {mean:.0f} tokens per prompt shared; probabilities differ by at most {diff:.1e}",
            )
        ],
        "runs": runs,
    }
    return save(results, args.out)


if __name__ == "__main__":
    main()

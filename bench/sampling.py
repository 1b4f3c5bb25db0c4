"""Sampling throughput: farmflow's sampler against Hugging Face `generate`, on the real model.

Model: SmolLM2-135M-Instruct from the model cache (`farmflow models get smollm2-135m-instruct`); prompts: AlpacaEval
instructions (../shared/data) in farmflow's prompt format. `--smoke` (CI) uses a tiny random model instead.

1. **n = 1** (generation for evaluation) and 2. **best-of-n** (n = 16, reranking): `farmflow.models.sample_ids`
   against `model.generate(do_sample=True, num_return_sequences=n)`. Both sides get the same token ids (farmflow's
   `prompt_ids`: BOS + prompt), the same batches (prompts sorted by length, so farmflow's own length sort changes
   nothing), temperature 1, no top-k/top-p truncation, the same `max_new_tokens`, stopping at EOS (no forced length),
   a KV cache. Tokens/s counts each side's generated tokens up to and including EOS; the two draw different random
   streams, so the counts differ a little and the rate, not the time, is compared.
3. **best-of-n curve** (n = 1, 2, 4, 8, 16 as the over-optimization flow needs): sampling and scoring the largest n
   once and taking every smaller n from the first candidates, against sampling each n apart; the share of
   identical picks is recorded (equal up to float rounding in differently shaped batches).

Contenders run interleaved (`bench.harness`), warmed, for `--rounds` rounds. Writes bench/results/sampling.json.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from bench.harness import arguments, entry, interleave, machine, save, summary, values

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "results" / "sampling.json"
EVAL_FILE = ROOT.parent / "shared" / "data" / "alpaca_eval_davinci003_outputs.json"
MODEL = "smollm2-135m-instruct"


def real_setup(prompts: int, max_len: int):
    from farmflow.config import ModelConfig
    from farmflow.data.alpaca import load_eval
    from farmflow.data.prompts import format_prompt
    from farmflow.models import load_pretrained

    model, tok = load_pretrained(ModelConfig(pretrained=MODEL, max_seq_len=max_len))
    rows = load_eval(EVAL_FILE)[:prompts]
    return model.eval(), tok, [format_prompt(r["instruction"], r.get("input", "")) for r in rows], f"{MODEL} (fp32)"


def tiny_setup(prompts: int, max_len: int):
    from farmflow.config import preset
    from farmflow.data import build_synthetic_farm, prompts_of, split_rows
    from farmflow.models import build_policy, train_tokenizer

    cfg = preset("synthetic-micro")
    cfg.data.eval_size, cfg.model.max_seq_len = prompts, max_len
    table = build_synthetic_farm(cfg.data)
    rows = table.to_pylist()
    tok = train_tokenizer(prompts_of(rows) + [r["output"] for r in rows if r["output"]], cfg.model.vocab_size)
    return (
        build_policy(cfg.model, tok).eval(),
        tok,
        prompts_of(split_rows(table, "eval"))[:prompts],
        "tiny random Llama (smoke)",
    )


def generated_tokens(rows: list[list[int]], eos: int, pad: int) -> int:
    """Tokens generated per row, up to and including the first EOS, padding excluded."""
    total = 0
    for r in rows:
        r = r[: r.index(eos) + 1] if eos in r else r
        total += sum(1 for t in r if t != pad)
    return total


def farmflow_side(model, tok, prompts: list[str], n: int, new: int, batch: int):
    from farmflow.models import sample_ids

    calls = iter(range(10**9))

    def run() -> dict:
        start = time.perf_counter()
        out = sample_ids(
            model, tok, prompts, n=n, temperature=1.0, max_new_tokens=new, batch_size=batch, seed=next(calls)
        )
        seconds = time.perf_counter() - start
        tokens = sum(len(r) for per_prompt in out for r in per_prompt)
        return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}

    return run


def hf_side(model, tok, prompts: list[str], n: int, new: int, batch: int):
    from farmflow.models import prompt_ids

    ids = prompt_ids(tok, prompts, model.config.max_position_embeddings - new)
    pad, eos = tok.pad_token_id, tok.eos_token_id

    def run() -> dict:
        tokens, start = 0, time.perf_counter()
        for i in range(0, len(ids), batch):
            chunk = ids[i : i + batch]
            width = max(len(x) for x in chunk)
            input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in chunk])
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in chunk])
            with torch.no_grad():
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=mask,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=new,
                    num_return_sequences=n,
                    pad_token_id=pad,
                    eos_token_id=eos,
                )
            tokens += generated_tokens(out[:, width:].tolist(), eos, pad)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}

    return run


def curve_sides(model, tok, prompts: list[str], new: int, batch: int):
    """The over-optimization flow's best-of-n points: the largest n once (prefixes) vs each n apart, and their picks."""
    import tempfile

    from farmflow.methods.best_of_n import pick_best, scored_candidates
    from farmflow.models import reward_from_policy, save

    with tempfile.TemporaryDirectory() as tmp:
        save(model, tok, tmp)
        reward_model = reward_from_policy(tmp).eval()
    ns, args = (1, 2, 4, 8, 16), dict(temperature=1.0, top_p=1.0, max_new_tokens=new, batch_size=batch, seed=0)
    picks: dict[str, dict] = {}

    def once() -> float:
        start = time.perf_counter()
        candidates, rewards = scored_candidates(model, tok, reward_model, tok, prompts, n=max(ns), **args)
        picks["once"] = {k: pick_best(candidates, rewards, n=k)[0] for k in ns}
        return 1.0 / (time.perf_counter() - start)

    def apart() -> float:
        start = time.perf_counter()
        picks["apart"] = {
            k: pick_best(*scored_candidates(model, tok, reward_model, tok, prompts, n=k, **args))[0] for k in ns
        }
        return 1.0 / (time.perf_counter() - start)

    return {"largest_n_once": once, "each_n_apart": apart}, picks


def main(argv: list[str] | None = None) -> dict:
    parser = arguments(
        __doc__, OUT, 5, "a tiny random model and a few prompts: seconds, for CI", "interleaved rounds per comparison"
    )
    parser.add_argument(
        "--prompts", type=int, default=64, help="AlpacaEval prompts for n = 1 (best-of-n: an eighth of them, ≥ 2)"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        model, tok, prompts, what = tiny_setup(prompts=8, max_len=96)
        new, batch, n_best, best_prompts = 8, 4, 4, 2
    else:
        model, tok, prompts, what = real_setup(prompts=args.prompts, max_len=512)
        new, batch, n_best, best_prompts = 64, 16, 16, max(2, args.prompts // 8)
    prompts = sorted(
        prompts, key=lambda p: len(tok(p, add_special_tokens=False)["input_ids"])
    )  # the same batches on both sides
    results: dict = {
        "machine": machine(),
        "setup": {
            "model": what,
            "prompts": len(prompts),
            "max_new_tokens": new,
            "batch_size": batch,
            "best_of_n": n_best,
            "best_of_n_prompts": best_prompts,
            "rounds": args.rounds,
            "temperature": 1.0,
        },
        "entries": [],
        "runs": {},
    }
    comparisons = {
        "n=1": (prompts, 1),
        f"best-of-{n_best}": (prompts[:best_prompts], n_best),
    }
    for name, (ps, n) in comparisons.items():
        runs = interleave(
            {
                "farmflow": farmflow_side(model, tok, ps, n, new, batch),
                "hf_generate": hf_side(model, tok, ps, n, new, batch),
            },
            rounds=args.rounds,
        )
        rates = {side: values(rs, "tokens_per_s") for side, rs in runs.items()}
        results["entries"].append(entry(f"sampling {name}, {what}", "generated tokens/s", rates, goal=1.5))
        results["runs"][name] = runs
        print(
            f"{name}: farmflow {summary(rates['farmflow'])['median']:.0f} vs HF generate "
            f"{summary(rates['hf_generate'])['median']:.0f} tokens/s ({results['entries'][-1]['ratio']:.2f}x)",
            flush=True,
        )
    sides, picks = curve_sides(model, tok, prompts[:best_prompts], new, batch)
    runs = interleave(sides, rounds=args.rounds)
    # sample j of a prompt draws the same random stream either way, but batches of other shapes round the logits
    # differently: on a real model a few candidates, and so picks, can differ
    same = [a == b for k in picks["once"] for a, b in zip(picks["once"][k], picks["apart"][k])]
    results["entries"].append(
        entry(
            f"best-of-n curve (n=1..16), {what}",
            "curves/s",
            runs,
            note=f"largest n once vs each n apart; {100 * sum(same) / len(same):.0f}% of picks identical",
        )
    )
    results["runs"]["curve"] = runs
    return save(results, args.out)


if __name__ == "__main__":
    main()

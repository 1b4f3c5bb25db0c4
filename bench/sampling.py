"""Sampling throughput: farmflow's batched KV-cache sampler against simple and HF peers.

Side by side, on the synthetic-tiny model shape (random weights, so every sample runs to
max_new_tokens and all contenders do the same amount of work):

1. batched sampling vs a per-prompt loop (the same sampler with batch size 1);
2. best-of-n (n=16): one prefill per prompt with the KV cache repeated n times, vs
   Hugging Face `generate(do_sample=True, num_return_sequences=n)`, which prefills every
   copy of the prompt;
3. an over-optimization curve's best-of-n points (n = 1, 2, 4, 8, 16): sampling and scoring
   each n apart vs sampling and scoring n = 16 once and taking every smaller n from the first
   n candidates (`pick_best(..., n=k)`, what the over-optimization flow does); the outputs
   must be identical (checked).

Writes bench/results/sampling.json and prints the ratios.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from farmflow.config import preset
from farmflow.data import build_synthetic_farm, prompts_of, split_rows
from farmflow.methods.best_of_n import pick_best, scored_candidates
from farmflow.models import build_policy, reward_from_policy, sample, save, train_tokenizer

OUT = Path(__file__).parent / "results" / "sampling.json"


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    cfg = preset("synthetic-tiny")
    cfg.data.sft_size, cfg.data.pref_size, cfg.data.unlabeled_size, cfg.data.val_size, cfg.data.eval_size = 400, 10, 10, 10, 256
    table = build_synthetic_farm(cfg.data)
    rows = table.to_pylist()
    tok = train_tokenizer(prompts_of(rows) + [r["output"] for r in rows if r["output"]], cfg.model.vocab_size)
    model = build_policy(cfg.model, tok).eval()
    prompts = prompts_of(split_rows(table, "eval"))
    new = 48
    results: dict = {"machine": {"cpu_threads": torch.get_num_threads(), "platform": platform.platform()}, "max_new_tokens": new}

    # 1. batched vs per-prompt loop (n=1)
    few = prompts[:32]
    loop_s = _timed(lambda: [sample(model, tok, [p], max_new_tokens=new, batch_size=1) for p in few]) * len(prompts) / len(few)
    batched_s = _timed(lambda: sample(model, tok, prompts, max_new_tokens=new, batch_size=128))
    results["batched_vs_loop"] = {
        "prompts": len(prompts), "batched_seconds": batched_s, "loop_seconds_extrapolated": loop_s,
        "batched_tokens_per_s": len(prompts) * new / batched_s, "speedup": loop_s / batched_s,
    }

    # 2. best-of-n: shared prefill vs HF generate(num_return_sequences=n)
    n, subset = 16, prompts[:64]
    ours_s = _timed(lambda: sample(model, tok, subset, n=n, max_new_tokens=new, batch_size=8))
    tok.padding_side = "left"

    def hf():
        for i in range(0, len(subset), 8):
            enc = tok(["<s>" + p for p in subset[i: i + 8]], return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                model.generate(**enc, do_sample=True, num_return_sequences=n, max_new_tokens=new, min_new_tokens=new,
                               pad_token_id=tok.pad_token_id, top_k=0)

    hf_s = _timed(hf)
    results["best_of_n"] = {
        "n": n, "prompts": len(subset), "farmflow_seconds": ours_s, "hf_generate_seconds": hf_s,
        "farmflow_samples_per_s": len(subset) * n / ours_s, "hf_samples_per_s": len(subset) * n / hf_s, "speedup": hf_s / ours_s,
    }
    # 3. a best-of-n curve: each n apart vs the largest n once + prefixes
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        save(model, tok, tmp)
        reward_model = reward_from_policy(tmp).eval()
    ns, args = (1, 2, 4, 8, 16), dict(temperature=1.0, top_p=1.0, max_new_tokens=new, batch_size=128, seed=0)
    apart: dict = {}
    apart_s = _timed(lambda: apart.update({n: pick_best(*scored_candidates(model, tok, reward_model, tok, subset, n=n, **args))[0] for n in ns}))
    shared: dict = {}

    def once():
        candidates, rewards = scored_candidates(model, tok, reward_model, tok, subset, n=max(ns), **args)
        shared.update({n: pick_best(candidates, rewards, n=n)[0] for n in ns})

    shared_s = _timed(once)
    if shared != apart:
        raise SystemExit("best-of-n curve: prefixes of the largest n differ from sampling each n apart")
    results["best_of_n_curve"] = {
        "ns": list(ns), "prompts": len(subset), "each_n_apart_seconds": apart_s, "largest_n_once_seconds": shared_s,
        "samples_drawn_apart": len(subset) * sum(ns), "samples_drawn_once": len(subset) * max(ns), "speedup": apart_s / shared_s,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    print(f"batched vs per-prompt loop: {results['batched_vs_loop']['speedup']:.1f}x; "
          f"best-of-{n} vs HF generate: {results['best_of_n']['speedup']:.2f}x; "
          f"best-of-n curve, largest n once vs each n apart: {results['best_of_n_curve']['speedup']:.2f}x  (written to {OUT})")


if __name__ == "__main__":
    main()

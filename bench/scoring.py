"""Best-of-n scoring by a fine-tuned reward model: each prompt read once before its candidates, against a padded row
per candidate.

What best-of-n spends its scoring time on once the reward model is trained whole (`reward.train_backbone=true`):
`farmflow.models.score`, one forward pass of the backbone over every distinct (prompt, candidate). A reward model
trained with `reward.packing` also reads packed (`farmflow.models.packed_reads`): a batch's candidates of one prompt go
after one copy of it (`farmflow.models.pack_shared`), in rows of `PACKED_WIDTH` tokens, each attending to the prompt
and itself. On the synthetic farm the prompt (about 47 SmolLM2 tokens with its template) is four times a candidate's
length, so most of a padded row is its prompt. Model: SmolLM2-135M-Instruct from the model cache with a fresh scalar
head, bfloat16 weights as the study's fine-tuned reward models are stored (a CPU with native bfloat16 computes in it);
candidates: the lookup farm's SFT prompts, each with `--candidates` distinct demonstrations of other prompts (best-of-n
candidates have the same lengths), read in the default batches of 64 with no memo. Contenders: packed in rows of 256
tokens (the default), padded, and packed in rows of 1024 (a wider row's dense mask costs more than the padding it
saves). Reported: candidates/s, median and range, the ratios, and how far packed rewards lie from padded ones beside
how far padded rewards lie from themselves read in other batches (bfloat16 rounding depends on the batch's shape):
the largest difference and the share of prompts whose best candidate is the same.

``--smoke`` (CI): a tiny random Llama in float32, 4 prompts of 8 candidates, one round. Writes
bench/results/scoring.json.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from bench.features import backbone, lookup_pairs
from bench.harness import ROOT, arguments, entry, interleave, machine, save, values

OUT = ROOT / "bench" / "results" / "scoring.json"


def side(model, tok, prompts: list[str], outputs: list[str], width: int | None, got: dict, name: str):
    import farmflow.models.sampling as sampling
    from farmflow.models import score

    def run() -> dict:
        model.config.farmflow_packing = width is not None
        sampling.PACKED_WIDTH = width or sampling.PACKED_WIDTH
        start = time.perf_counter()
        got[name] = score(model, tok, prompts, outputs)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "candidates_per_s": len(outputs) / seconds}

    return run


def main(argv: list[str] | None = None) -> dict:
    import farmflow.models.sampling as sampling
    from farmflow.models import reward_from_policy, score
    from farmflow.models import save as save_model

    parser = arguments(__doc__, OUT, 3, "a tiny random Llama, 4 prompts of 8 candidates: seconds, for CI")
    parser.add_argument("--prompts", type=int, default=16, help="prompts scored per round")
    parser.add_argument("--candidates", type=int, default=32, help="distinct candidates per prompt")
    args = parser.parse_args(argv)
    n_p, k = (4, 8) if args.smoke else (args.prompts, args.candidates)
    texts, demos = lookup_pairs(n_p + k)
    prompts = [texts[i] for i in range(n_p) for _ in range(k)]
    outputs = [demos[i + 1 + j] for i in range(n_p) for j in range(k)]  # other prompts' demonstrations
    default = sampling.PACKED_WIDTH
    packed, wide = f"packed, rows of {default}", "packed, rows of 1024"
    got: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model, tok, what = backbone(args.smoke, texts, demos)
        save_model(model if args.smoke else model.to(torch.bfloat16), tok, Path(tmp) / "rm")
        rm = reward_from_policy(Path(tmp) / "rm", seed=0).eval()
        try:
            runs = interleave(
                {
                    packed: side(rm, tok, prompts, outputs, default, got, packed),
                    "padded": side(rm, tok, prompts, outputs, None, got, "padded"),
                    wide: side(rm, tok, prompts, outputs, 1024, got, wide),
                },
                rounds=1 if args.smoke else args.rounds,
                warmup=0 if args.smoke else 1,
            )
            rm.config.farmflow_packing = False
            other = score(rm, tok, prompts, outputs, batch_size=48)  # padded again, in batches of another shape
        finally:
            sampling.PACKED_WIDTH = default
    dtype = str(next(rm.parameters()).dtype).removeprefix("torch.")

    def agreement(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
        same = (a.view(n_p, k).argmax(1) == b.view(n_p, k).argmax(1)).float().mean().item()
        return (a - b).abs().max().item(), same

    diff, same = agreement(got[packed], got["padded"])
    diff_self, same_self = agreement(other, got["padded"])
    note = (
        f"{dtype} weights; packed rewards within {diff:.3g} of padded ones, the same best candidate on {same:.0%} of "
        f"prompts (padded read in other batches: within {diff_self:.3g}, {same_self:.0%})"
    )
    label = f"best-of-n scoring, {what}, {n_p} lookup-farm prompts x {k} candidates"
    results = {
        "machine": machine(),
        "setup": {"model": what, "prompts": n_p, "candidates": k, "batch_size": 64, "dtype": dtype},
        "entries": [
            entry(
                label,
                "candidates/s",
                {name: values(runs[name], "candidates_per_s") for name in (packed, "padded")},
                note=note,
            ),
            entry(
                f"{label}: rows of {default} vs 1024 tokens",
                "candidates/s",
                {name: values(runs[name], "candidates_per_s") for name in (packed, wide)},
            ),
        ],
        "runs": runs,
        "max_difference": {"packed_vs_padded": diff, "padded_vs_padded": diff_self},
        "same_best": {"packed_vs_padded": same, "padded_vs_padded": same_self},
    }
    return save(results, args.out)


if __name__ == "__main__":
    main()

"""A frozen reward model's feature reads: the backbone under bfloat16 autocast against float32.

What `reward.train_backbone=false` spends its time on: `farmflow.models.reward_features`, one forward pass of the
backbone per distinct (prompt, output), for the head's training pairs and for every best-of-n candidate it scores.
`reward.feature_dtype=bfloat16` runs those passes under bfloat16 autocast. Model: SmolLM2-135M-Instruct from the model
cache (`farmflow models get smollm2-135m-instruct`) as the validation study loads it (`model.pretrained`, float32
weights, a pad token of its own) with a fresh scalar head; texts: the lookup farm's SFT demonstrations
(synthetic-lookup's prompts and outputs), all distinct, read in the default batches of 64 with no memo. Both sides read
the same pairs; reported: outputs/s, median and range, the ratio, and how far the bfloat16 features lie from
float32's (relative norm of the difference; the largest over the pairs) and how often a random head's rewards order
two pairs as float32's do.

``--smoke`` (CI): a tiny random Llama, 32 pairs, one round. Writes bench/results/features.json.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from bench.harness import ROOT, arguments, entry, interleave, machine, save, values

OUT = ROOT / "bench" / "results" / "features.json"
MODEL = "smollm2-135m-instruct"


def lookup_pairs(n: int) -> tuple[list[str], list[str]]:
    from farmflow.config import preset
    from farmflow.data import build_synthetic_farm, prompts_of, split_rows

    cfg = preset("synthetic-lookup")
    rows = [r for r in split_rows(build_synthetic_farm(cfg.data), "sft") if r["output"]]
    pairs = list(dict.fromkeys(zip(prompts_of(rows), [r["output"] for r in rows])))[:n]
    return [p for p, _ in pairs], [o for _, o in pairs]


def backbone(smoke: bool, prompts: list[str], outputs: list[str]):
    """SmolLM2-135M-Instruct as the validation study loads it (float32, a pad token of its own), or for `smoke` a tiny
    random Llama with a tokenizer trained on the texts: (model, tokenizer, what it is)."""
    from farmflow.config import ModelConfig
    from farmflow.models import build_policy, load_pretrained, train_tokenizer

    if smoke:
        tok = train_tokenizer(prompts + outputs, 384)
        model = build_policy(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok)
        return model, tok, "tiny random Llama (smoke)"
    model, tok = load_pretrained(ModelConfig(pretrained=MODEL, max_seq_len=256))
    return model, tok, MODEL


def reward_model(folder: Path, smoke: bool, prompts: list[str], outputs: list[str]):
    """A reward model (fresh head) on `backbone`, saved to and loaded from `folder` as the pipeline's reward stage does
    (`farmflow.models.reward_from_policy`)."""
    from farmflow.models import reward_from_policy, save

    model, tok, what = backbone(smoke, prompts, outputs)
    save(model, tok, folder)
    return reward_from_policy(folder, seed=0).eval(), tok, what if smoke else f"{what} (fp32 weights)"


def side(model, tok, p_ids, o_ids, dtype: str, got: dict):
    from farmflow.models import reward_features

    def run() -> dict:
        model.config.farmflow_feature_dtype = dtype
        start = time.perf_counter()
        got[dtype] = reward_features(model, tok, p_ids, o_ids, model.config.max_position_embeddings)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "outputs_per_s": len(o_ids) / seconds}

    return run


def main(argv: list[str] | None = None) -> dict:
    from farmflow.models import tokenize_examples

    parser = arguments(__doc__, OUT, 5, "a tiny random Llama and 32 pairs: seconds, for CI")
    parser.add_argument("--pairs", type=int, default=512, help="distinct (prompt, output) pairs read per round")
    args = parser.parse_args(argv)
    prompts, outputs = lookup_pairs(32 if args.smoke else args.pairs)
    with tempfile.TemporaryDirectory() as tmp:
        model, tok, what = reward_model(Path(tmp) / "rm", args.smoke, prompts, outputs)
        p_ids, o_ids = tokenize_examples(tok, prompts, outputs)
        got: dict = {}
        runs = interleave(
            {
                "bfloat16 autocast": side(model, tok, p_ids, o_ids, "bfloat16", got),
                "float32": side(model, tok, p_ids, o_ids, "float32", got),
            },
            rounds=1 if args.smoke else args.rounds,
            warmup=0 if args.smoke else 1,
        )
    low, full = got["bfloat16"].float(), got["float32"].float()
    error = ((low - full).norm(dim=-1) / full.norm(dim=-1)).max().item()
    head = torch.randn(full.shape[1], generator=torch.Generator().manual_seed(0))
    r_low, r_full = low @ head, full @ head
    i, j = torch.triu_indices(len(r_full), len(r_full), 1)
    order = ((r_low[i] > r_low[j]) == (r_full[i] > r_full[j])).float().mean().item()
    tokens = sum(len(p) + len(o) for p, o in zip(p_ids, o_ids)) / len(p_ids)
    results = {
        "machine": machine(),
        "setup": {"model": what, "pairs": len(p_ids), "mean_tokens": tokens, "batch_size": 64},
        "entries": [
            entry(
                f"frozen reward features, {what}, {len(p_ids)} lookup-farm pairs",
                "outputs/s",
                {name: values(rs, "outputs_per_s") for name, rs in runs.items()},
                note=f"{tokens:.0f} tokens a pair; features within {error:.1%} of float32's; a random head orders "
                f"{order:.2%} of reward pairs as on float32's",
            )
        ],
        "runs": runs,
        "feature_error_max": error,
        "pair_order_agreement": order,
    }
    return save(results, args.out)


if __name__ == "__main__":
    main()

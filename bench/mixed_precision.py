"""Fine-tuning a pretrained reward model on a CPU: bfloat16 weights (mixed precision) against float32 weights, and
the top blocks only (`reward.train_layers`) against every block.

What `reward.train_backbone=true` on a pretrained backbone spends its time on: `farmflow.methods.reward.train_reward`,
forward and backward through every layer for both outputs of each pair. With `model.dtype=bfloat16` on a CPU that has
native bfloat16 (avx512_bf16 or AMX), `farmflow.models.runtime.Runtime` trains under bfloat16 autocast over float32
master weights, as on a GPU; on a CPU that emulates bfloat16 (AVX2 only) it upcasts the bfloat16 weights and trains in
float32, so there both sides should run at float32's speed (bench/results/mixed_precision_avx2.json: this bench with
``--pairs 32 --rounds 3 --out`` that file, on such a CPU); with float32 weights it trains as a plain PyTorch loop.
With ``reward.train_layers=k`` (``--top``, default 4 of SmolLM2's 30 blocks) each step still reads every block
forward, but the backward pass stops at the lowest of the top k and the frozen blocks stay in bfloat16 (under mixed
precision). Model: SmolLM2-135M-Instruct from the model cache (`farmflow models get smollm2-135m-instruct`) with a
fresh scalar head, saved once in each dtype;
pairs: the lookup farm's SFT prompts, each with its demonstration against the next prompt's (preference 1), the
validation study's reward settings (batch 16, lr 1e-5, no packing); a fourth contender reads each batch packed
(``reward.packing``: a pair's prompt once, both outputs after it, no padding rows). Every round trains a fresh copy
on the same pairs for one epoch; reported: pairs/s, median and range, the ratios, and each side's first and last
training losses (the first is the same batch on the same weights, so the two dtypes agree to bfloat16 rounding; later
ones are taken after updates that the rounding has already moved apart, so they need not agree).

``--smoke`` (CI): a tiny random Llama (its one block as the top), 32 pairs, one round. Writes
bench/results/mixed_precision.json (there: ``--rounds 3`` on a CPU with native bfloat16).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from bench.features import backbone, lookup_pairs
from bench.harness import ROOT, arguments, entry, interleave, machine, save, values

OUT = ROOT / "bench" / "results" / "mixed_precision.json"


def checkpoints(folder: Path, smoke: bool, prompts: list[str], outputs: list[str]) -> tuple[dict[str, Path], str]:
    """The same backbone (`bench.features.backbone`) saved in float32 and in bfloat16; the reward model is built from
    either as the pipeline's reward stage builds it (`farmflow.models.reward_from_policy`)."""
    from farmflow.models import save

    model, tok, what = backbone(smoke, prompts, outputs)
    paths = {}
    for dtype in (torch.float32, torch.bfloat16):
        paths[str(dtype).removeprefix("torch.")] = path = folder / str(dtype)
        save(model.to(dtype), tok, path)
    return paths, what


def side(
    path: Path,
    pairs: tuple[list[str], list[str], list[str]],
    losses: dict,
    name: str,
    top: int | None = None,
    packing: bool = False,
):
    from farmflow.config import RewardConfig
    from farmflow.methods.reward import train_reward
    from farmflow.models import load_tokenizer, reward_from_policy

    cfg = RewardConfig(epochs=1, batch_size=16, lr=1e-5, train_backbone=True, train_layers=top, packing=packing)
    tok = load_tokenizer(path)
    prompts, out_1, out_2 = pairs

    def run() -> dict:
        model = reward_from_policy(path, seed=0)
        start = time.perf_counter()
        metrics = train_reward(model, tok, prompts, out_1, out_2, [1.0] * len(prompts), cfg, 256)
        seconds = time.perf_counter() - start
        losses.setdefault(name, [metrics["train_loss_first"], metrics["train_loss_last"]])
        return {"seconds": seconds, "pairs_per_s": len(prompts) / seconds}

    return run


def main(argv: list[str] | None = None) -> dict:
    parser = arguments(__doc__, OUT, 5, "a tiny random Llama and 32 pairs: seconds, for CI")
    parser.add_argument("--pairs", type=int, default=96, help="pairs trained per round (one epoch, batch 16)")
    parser.add_argument("--top", type=int, default=4, help="top blocks the third contender trains")
    args = parser.parse_args(argv)
    n = 32 if args.smoke else args.pairs
    top = 1 if args.smoke else args.top
    partial = f"bfloat16 weights, train_layers={top}"
    packed = "bfloat16 weights, reward.packing"
    prompts, outputs = lookup_pairs(n + 1)
    pairs = (prompts[:n], outputs[:n], outputs[1 : n + 1])
    losses: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths, what = checkpoints(Path(tmp), args.smoke, prompts, outputs)
        runs = interleave(
            {
                "bfloat16 weights": side(paths["bfloat16"], pairs, losses, "bfloat16 weights"),
                "float32 weights": side(paths["float32"], pairs, losses, "float32 weights"),
                partial: side(paths["bfloat16"], pairs, losses, partial, top),
                packed: side(paths["bfloat16"], pairs, losses, packed, packing=True),
            },
            rounds=1 if args.smoke else args.rounds,
            warmup=0 if args.smoke else 1,
        )
    from farmflow.models.runtime import cpu_flags, mixed_precision

    mixed = mixed_precision(torch.bfloat16, torch.cuda.is_available(), cpu_flags())
    bf16 = "bfloat16 weights"

    def compared(what_vs: str, a: str, b: str, lead: str = "") -> dict:
        notes = ", ".join(f"{k} {losses[k][0]:.4f}/{losses[k][1]:.4f}" for k in (a, b))
        return entry(
            f"reward model fine-tuning, {what}, {n} lookup-farm pairs{what_vs}",
            "pairs/s",
            {k: values(runs[k], "pairs_per_s") for k in (a, b)},
            note=f"{lead}training loss first/last: {notes}",
        )

    results = {
        "machine": machine(),
        "setup": {"model": what, "pairs": n, "batch_size": 16, "bfloat16_precision": mixed, "train_layers": top},
        "entries": [
            compared("", bf16, "float32 weights", f"bfloat16 weights train with mixed precision {mixed!r}; "),
            compared(f": reward.train_layers={top} vs every block", partial, bf16),
            compared(
                ": reward.packing vs two padded rows per pair",
                packed,
                bf16,
                "the same rewards and gradients up to float rounding; ",
            ),
        ],
        "runs": runs,
        "losses": losses,
    }
    return save(results, args.out)


if __name__ == "__main__":
    main()

"""Training throughput: farmflow's SFT, reward-model and DPO loops against TRL's trainers.

Model (``--model``): SmolLM2-135M-Instruct from the model cache on Alpaca demonstrations (default; pairs are an
instruction's own answer against the next instruction's answer), or a tiny Llama in synthetic-tiny's shape on the
synthetic farm (``--model tiny``; ``--smoke`` runs it for 3 steps on farmflow's side only, for CI). Same model, same
data, same batches, same loss, same optimizer and schedule on both sides:

* SFT: the demonstrations; `train_sft` vs `trl.SFTTrainer`
  (prompt-completion loss, mean over response tokens).
* Reward model: the preference pairs (tiny: a correct answer vs a flawed demonstration of
  the same task, labelled by the gold reward); `train_reward` vs `trl.RewardTrainer`
  (Bradley-Terry, the scalar head of LlamaForSequenceClassification, both outputs of a
  pair in one forward pass).
* DPO: the same pairs, β = 0.1, sequence log-probs summed over response tokens;
  `train_dpo` vs `trl.DPOTrainer(precompute_ref_log_probs=True)`. Both sides compute the
  reference log-probs before training, outside the timed steps.

Fairness: both sides see the same token sequences (farmflow's ``encode_examples``
encoding, given to TRL pre-tokenized, so TRL's tokenization happens in its constructor,
outside the timing, while farmflow tokenizes each batch inside its loop), in the same
batches (farmflow's `batch_order`; TRL reads the rows sequentially in that order), right
padded to the longest sequence of the batch (except farmflow's reward model, run with
``reward.packing``: see DIFFERENCES), in float32 without gradient checkpointing,
with AdamW (``optim="adamw_torch"``, farmflow's `torch.optim.AdamW`), gradient clipping
at 1.0, linear warmup then cosine decay. Logging, evaluation, saving and reporting are
off in TRL. Each (trainer, side) runs in a fresh process with the same thread count;
the rounds alternate which side goes first.

Tokens/s: the real (non-padding) tokens of every sequence a step trains on, the
attention-mask sum of its batch (SFT: one sequence per example; reward and DPO: both
outputs of each pair), summed over the timed steps, divided by the time from the end
of the last warm-up step to the end of the last step. The count is taken on each side
from the batches it actually trained on, and the two must agree.

TRL is not a farmflow dependency: it lives in .farmflow/bench/trl-venv, created on first
run with the pinned TRL_REQUIREMENTS on top of .venv's packages (torch, transformers,
farmflow), which it reuses unchanged.

Writes bench/results/training.json (ratios farmflow / TRL; goals: SFT and DPO >= 1.5, reward model >= 1.2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from bench.harness import entry, interleave, machine, save, values
from bench.venvs import ensure_venv

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "results" / "training.json"
TRL_VENV = ROOT / ".farmflow" / "bench" / "trl-venv"
TRL_REQUIREMENTS = [
    "trl==1.16.0",
    "datasets==5.2.0",
    "pandas==3.1.1",
    "dill==0.4.1",
    "multiprocess==0.70.19",
    "xxhash==4.1.0",
]
# per model: the longest sequence, and per trainer the sequences or pairs per step and the learning rate
SETUPS = {
    "tiny": {
        "max_len": 160,
        "trainers": {
            "sft": {"batch": 32, "lr": 3e-3},
            "reward": {"batch": 32, "lr": 5e-4},
            "dpo": {"batch": 32, "lr": 1e-4},
        },
        "describe": (
            "tiny Llama, synthetic-tiny shape (hidden 128, 2 layers, 4 heads, MLP 384, vocab 1024, tied embeddings)"
        ),
    },
    "smollm2": {
        "max_len": 256,
        "trainers": {
            "sft": {"batch": 8, "lr": 2e-5},
            "reward": {"batch": 8, "lr": 1e-5},
            "dpo": {"batch": 8, "lr": 1e-6},
        },
        "describe": (
            "SmolLM2-135M-Instruct (model cache), Alpaca demonstrations; "
            "pairs: an instruction's own answer vs another's"
        ),
    },
}
TRAINERS = tuple(SETUPS["tiny"]["trainers"])
REAL_DATA = ROOT.parent / "shared" / "data" / "alpaca_en_demo.json"
WARMUP_RATIO, BETA, SEED = 0.03, 0.1, 0
TOKEN_COUNT = (
    "real (non-padding) tokens: the attention-mask sum of every batch a step trains on (SFT: one sequence per example; "
    "reward and DPO: both outputs of each pair), counted on each side from its own batches (they must agree); "
    "tokens/s = tokens of the timed steps / time from the end of the last warm-up step to the end of the last step "
    "(wall clock; per CPU second: process CPU time)"
)
DIFFERENCES = [
    "TRL tokenizes in its constructor (here: takes farmflow's token ids), outside the timed steps; "
    "farmflow encodes each batch inside its loop, so that cost is in farmflow's time.",
    "TRL computes per-step metrics: SFT and DPO entropy and top-1 accuracy from its fused LM head, "
    "reward min/mean/max/accuracy/margin; farmflow records the loss (and DPO's implicit-reward accuracy).",
    "SFT and DPO log-probs: TRL's fused LM head (chunked log-softmax; on CPU the torch fallback over every position); "
    "farmflow projects only the positions that predict a response token onto the vocabulary (logits_to_keep mask) "
    "and takes cross-entropy (SFT) or logit - logsumexp (DPO) there. Same values: the first step's loss is equal on "
    "both sides up to float rounding (for DPO trivially log 2, since policy = reference at step 1).",
    "Learning rate: Hugging Face's linear warmup starts at 0 (farmflow's at lr/warmup_steps), "
    "so losses after step 1 differ slightly.",
    "DPO: TRL's DPOTrainer with _prepare_dataset overridden to take pre-tokenized prompt/chosen/rejected ids.",
    "Reward model: TRL pads both outputs of every pair to the batch's longest sequence, one row each, so it reads "
    "every prompt twice; farmflow runs with reward.packing (its best configuration): a batch's pairs in rows of up "
    "to 2 x max_len positions, a pair as prompt, output_1, output_2 with output_2 attending to the prompt and "
    "itself only (pack_pairs; the same rewards up to float rounding). TRL's RewardTrainer has no packing, so "
    "padding is its best configuration. The tokens counted are the same on both sides (both outputs with their "
    "prompt); computed_positions_per_step gives the positions each side runs through the model.",
]


# ------------------------------------------------------------------ shared inputs
def prepare(folder: Path, steps: dict[str, int], model: str = "tiny") -> None:
    """The tokenizer, the initial policy and the data both sides train on, written to `folder`."""
    if model != "tiny":
        return prepare_real(folder, steps)
    trainers = SETUPS["tiny"]["trainers"]
    from bench.annotators import make_pairs
    from farmflow.config import DataConfig, preset
    from farmflow.data import build_synthetic_farm, format_prompt, gold_reward, prompts_of, split_rows
    from farmflow.models import build_policy, save, train_tokenizer

    n_sft = steps["sft"] * trainers["sft"]["batch"]
    n_pairs = max(steps["reward"] * trainers["reward"]["batch"], steps["dpo"] * trainers["dpo"]["batch"])
    sft = split_rows(
        build_synthetic_farm(DataConfig(sft_size=n_sft, pref_size=1, unlabeled_size=1, val_size=1, eval_size=2)), "sft"
    )
    pairs = []
    for r in make_pairs(2 * n_pairs, seed=1):  # a correct answer vs a flawed demonstration, order alternating
        g1, g2 = gold_reward(r["task"], r["output_1"]), gold_reward(r["task"], r["output_2"])
        if g1 != g2:  # ties carry no preference (DPO skips them)
            pairs.append(
                {
                    "prompt": format_prompt(r["instruction"], r["input"]),
                    "output_1": r["output_1"],
                    "output_2": r["output_2"],
                    "preference": 1.0 if g1 > g2 else 2.0,
                }
            )
    if len(pairs) < n_pairs:
        raise RuntimeError(f"only {len(pairs)} untied pairs, {n_pairs} needed")
    pairs = pairs[:n_pairs]
    data = {
        "sft": {"prompts": prompts_of(sft), "responses": [r["output"] for r in sft]},
        "pairs": {k: [p[k] for p in pairs] for k in ("prompt", "output_1", "output_2", "preference")},
    }
    texts = (
        data["sft"]["prompts"]
        + data["sft"]["responses"]
        + data["pairs"]["prompt"]
        + data["pairs"]["output_1"]
        + data["pairs"]["output_2"]
    )
    model_cfg = preset("synthetic-tiny").model.model_copy(update={"max_seq_len": SETUPS["tiny"]["max_len"]})
    tok = train_tokenizer(texts, model_cfg.vocab_size)
    save(build_policy(model_cfg, tok), tok, folder / "policy")
    (folder / "data.json").write_text(json.dumps({"data": data, "steps": steps} | SETUPS["tiny"]))


def prepare_real(folder: Path, steps: dict[str, int]) -> None:
    """SmolLM2-135M-Instruct and Alpaca demonstrations; a pair is an instruction's own answer (preferred) against the
    answer of the next instruction in the file (a fluent but off-topic output)."""
    from farmflow.config import ModelConfig
    from farmflow.data.alpaca import load_instructions
    from farmflow.data.prompts import format_prompt
    from farmflow.models import load_pretrained, save

    setup = SETUPS["smollm2"]
    trainers = setup["trainers"]
    rows = load_instructions(REAL_DATA)
    n_sft = steps["sft"] * trainers["sft"]["batch"]
    n_pairs = max(steps["reward"] * trainers["reward"]["batch"], steps["dpo"] * trainers["dpo"]["batch"])
    if max(n_sft, n_pairs) + 1 > len(rows):
        raise SystemExit(f"{REAL_DATA} has {len(rows)} rows; {max(n_sft, n_pairs) + 1} needed: fewer steps")
    prompts = [format_prompt(r["instruction"], r.get("input", "")) for r in rows]
    data = {
        "sft": {"prompts": prompts[:n_sft], "responses": [r["output"] for r in rows[:n_sft]]},
        "pairs": {
            "prompt": prompts[:n_pairs],
            "output_1": [r["output"] for r in rows[:n_pairs]],
            "output_2": [r["output"] for r in rows[1 : n_pairs + 1]],
            "preference": [1.0] * n_pairs,
        },
    }
    model, tok = load_pretrained(ModelConfig(pretrained="smollm2-135m-instruct", max_seq_len=setup["max_len"]))
    save(model, tok, folder / "policy")
    (folder / "data.json").write_text(json.dumps({"data": data, "steps": steps} | setup))


def batches(n: int, batch: int, steps: int) -> list[list[int]]:
    from farmflow.models import batch_order

    return batch_order(n, batch, steps, SEED)


def encoded(tok, prompts: list[str], responses: list[str], max_len: int) -> tuple[list[list[int]], list[list[int]]]:
    """farmflow's encoding of each example, unpadded: (input ids, labels)."""
    from farmflow.models import encode_examples

    ids, mask, labels = encode_examples(tok, prompts, responses, max_len)
    lengths = mask.sum(1).tolist()
    return [x[:n] for x, n in zip(ids.tolist(), lengths)], [x[:n] for x, n in zip(labels.tolist(), lengths)]


def chosen_rejected(pairs: dict) -> tuple[list[str], list[str], list[str]]:
    second = [p > 1.5 for p in pairs["preference"]]
    chosen = [b if s else a for a, b, s in zip(pairs["output_1"], pairs["output_2"], second)]
    rejected = [a if s else b for a, b, s in zip(pairs["output_1"], pairs["output_2"], second)]
    return pairs["prompt"], chosen, rejected


# -------------------------------------------------------------------- farmflow side
def run_farmflow(kind: str, folder: Path, inputs: dict) -> dict:
    from farmflow.config import DPOConfig, RewardConfig, SFTConfig
    from farmflow.methods import dpo, reward, sft
    from farmflow.models import encode_examples, load_policy, pack_pairs, reward_from_policy, tokenize_examples

    model, tok = load_policy(folder / "policy")
    steps, batch, lr = inputs["steps"][kind], inputs["trainers"][kind]["batch"], inputs["trainers"][kind]["lr"]
    max_len = inputs["max_len"]
    common = {
        "epochs": 1.0,
        "batch_size": batch,
        "lr": lr,
        "warmup_ratio": WARMUP_RATIO,
        "weight_decay": 0.0,
        "seed": SEED,
    }
    ends: list[float] = []
    module = {"sft": sft, "reward": reward, "dpo": dpo}[kind]
    real_progress = module.progress

    @contextmanager
    def timed_progress(*args, **kwargs):  # the loop's own progress bar, plus a timestamp at the end of every step
        with real_progress(*args, **kwargs) as bar:
            update = bar.update
            bar.update = lambda k=1: (ends.append((time.perf_counter(), time.process_time())), update(k))
            yield bar

    if kind == "sft":
        d = inputs["data"]["sft"]
        n = steps * batch
        prompts, responses = d["prompts"][:n], d["responses"][:n]
        shapes = [
            encode_examples(tok, [prompts[i] for i in b], [responses[i] for i in b], max_len)[1]
            for b in batches(n, batch, steps)
        ]
        computed = [m.numel() for m in shapes]

        def train():
            return sft.train_sft(model, tok, prompts, responses, SFTConfig(**common), max_len)

    else:
        d = inputs["data"]["pairs"]
        n = steps * batch
        prompts, out_1, out_2, prefs = d["prompt"][:n], d["output_1"][:n], d["output_2"][:n], d["preference"][:n]
        shapes = [
            encode_examples(tok, [prompts[i] for i in b] * 2, [out_1[i] for i in b] + [out_2[i] for i in b], max_len)[1]
            for b in batches(n, batch, steps)
        ]
        computed = [m.numel() for m in shapes]
        if kind == "reward":  # with packing the loop lays out each batch's pairs by pack_pairs
            p_ids, o_ids = tokenize_examples(tok, prompts, out_1 + out_2)
            computed = [
                pack_pairs(
                    tok, [p_ids[i] for i in b], [o_ids[i] for i in b], [o_ids[n + i] for i in b], max_len
                ).input_ids.numel()
                for b in batches(n, batch, steps)
            ]
            model = reward_from_policy(folder / "policy", seed=SEED)

            def train():
                cfg = RewardConfig(**common, packing=True)  # farmflow's best configuration (TRL's has no packing)
                return reward.train_reward(model, tok, prompts, out_1, out_2, prefs, cfg, max_len)

        else:
            ref_1, ref_2 = dpo.reference_logps(model, tok, prompts, out_1, out_2, max_len, batch_size=batch)

            def train():
                return dpo.train_dpo(
                    model, tok, prompts, out_1, out_2, prefs, ref_1, ref_2, DPOConfig(beta=BETA, **common), max_len
                )

    module.progress = timed_progress  # only around the training loop (not DPO's reference pass)
    metrics = train()
    return {
        "step_ends": ends,
        "tokens": [int(m.sum()) for m in shapes],
        "padded": computed,
        "loss_first": metrics["train_loss_first"],
        "loss_last": metrics["train_loss_last"],
    }


# ------------------------------------------------------------------------- TRL side
def run_trl(kind: str, folder: Path, inputs: dict) -> dict:
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.utils import logging as hf_logging

    from farmflow.models import load_policy, reward_from_policy

    hf_logging.set_verbosity_error()
    os.environ["TQDM_DISABLE"] = "1"
    model, tok = load_policy(folder / "policy")
    steps, batch, lr = inputs["steps"][kind], inputs["trainers"][kind]["batch"], inputs["trainers"][kind]["lr"]
    max_len = inputs["max_len"]
    n = steps * batch
    order = [i for b in batches(n, batch, steps) for i in b]  # farmflow's batches, read sequentially
    ends, tokens, padded = [], [], []

    class StepEnd(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append((time.perf_counter(), time.process_time()))

    common = dict(
        output_dir=str(folder / f"trl-{kind}"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=lr,
        weight_decay=0.0,
        warmup_steps=WARMUP_RATIO,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        optim="adamw_torch",
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        train_sampling_strategy="sequential",
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        use_cpu=not torch.cuda.is_available(),
        seed=SEED,
        max_length=max_len,
    )
    if kind == "sft":
        d = inputs["data"]["sft"]
        ids, labels = encoded(tok, d["prompts"][:n], d["responses"][:n], max_len)
        dataset = Dataset.from_dict({"input_ids": [ids[i] for i in order], "labels": [labels[i] for i in order]})
        trainer = trl.SFTTrainer(
            model=model,
            args=trl.SFTConfig(packing=False, **common),
            train_dataset=dataset,
            processing_class=tok,
            callbacks=[StepEnd()],
        )
    else:
        prompts, chosen, rejected = chosen_rejected({k: v[:n] for k, v in inputs["data"]["pairs"].items()})
        c_ids, _ = encoded(tok, prompts, chosen, max_len)
        r_ids, _ = encoded(tok, prompts, rejected, max_len)
        if kind == "reward":
            dataset = Dataset.from_dict(
                {"chosen_ids": [c_ids[i] for i in order], "rejected_ids": [r_ids[i] for i in order]}
            )
            trainer = trl.RewardTrainer(
                model=reward_from_policy(folder / "policy", seed=SEED),
                args=trl.RewardConfig(**common),
                train_dataset=dataset,
                processing_class=tok,
                callbacks=[StepEnd()],
            )
        else:
            _, c_labels = encoded(tok, prompts, chosen, max_len)
            p_len = [lab.count(-100) for lab in c_labels]  # the prompt part: <s> and the prompt's tokens
            if any(c[:k] != r[:k] for c, r, k in zip(c_ids, r_ids, p_len)):
                raise RuntimeError("dpo: a pair's two encodings do not share the prompt tokens (truncation)")
            dataset = Dataset.from_dict(
                {
                    "prompt_ids": [c_ids[i][: p_len[i]] for i in order],
                    "chosen_ids": [c_ids[i][p_len[i] :] for i in order],
                    "rejected_ids": [r_ids[i][p_len[i] :] for i in order],
                }
            )

            class PreTokenizedDPOTrainer(trl.DPOTrainer):  # rows already hold farmflow's prompt / chosen / rejected ids
                def _prepare_dataset(self, dataset, *args, **kwargs):
                    return dataset

            config = trl.DPOConfig(beta=BETA, loss_type=["sigmoid"], precompute_ref_log_probs=True, **common)
            trainer = PreTokenizedDPOTrainer(
                model=model, args=config, train_dataset=dataset, processing_class=tok, callbacks=[StepEnd()]
            )
    collate = trainer.data_collator

    def counting_collator(examples):
        out = collate(examples)
        tokens.append(int(out["attention_mask"].sum()))
        padded.append(out["attention_mask"].numel())
        return out

    trainer.data_collator = counting_collator
    losses = []
    compute_loss = trainer.compute_loss

    def recording_loss(*a, **k):  # the loss of every step, as farmflow's loop records it
        loss = compute_loss(*a, **k)
        losses.append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
        return loss

    trainer.compute_loss = recording_loss
    trainer.train()
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "step_ends": ends,
        "tokens": tokens,
        "padded": padded,
        "loss_first": losses[0],
        "loss_last": sum(tail) / len(tail),
        "trl_version": trl.__version__,
    }


# --------------------------------------------------------------------------- driver
def worker(side: str, kind: str, folder: Path, threads: int) -> None:
    import resource

    torch.set_num_threads(threads)
    inputs = json.loads((folder / "data.json").read_text())
    out = (run_farmflow if side == "farmflow" else run_trl)(kind, folder, inputs)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    print("RESULT " + json.dumps(out | {"threads_after": torch.get_num_threads(), "peak_rss_mb": peak_mb}), flush=True)


def measure(python: Path, side: str, kind: str, folder: Path, threads: int, warmup: int) -> dict:
    env = os.environ | {
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_DISABLED": "true",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    proc = subprocess.run(
        [str(python), "-m", "bench.training", "--worker", side, kind, str(folder), "--threads", str(threads)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{side} {kind} failed: {proc.stderr.strip()[-3000:]}")
    r = json.loads(lines[-1][len("RESULT ") :])
    ends = r.pop("step_ends")
    if len(ends) != len(r["tokens"]):
        raise RuntimeError(f"{side} {kind}: {len(ends)} steps timed, {len(r['tokens'])} batches counted")
    (wall, cpu), timed = [b - a for a, b in zip(ends[warmup - 1], ends[-1])], sum(r["tokens"][warmup:])
    return r | {
        "steps": len(ends),
        "timed_steps": len(ends) - warmup,
        "seconds": wall,
        "cpu_seconds": cpu,
        "tokens_timed": timed,
        "tokens_per_s": timed / wall,
        "tokens_per_cpu_s": timed / cpu,
        "ms_per_step": 1000 * wall / (len(ends) - warmup),
    }


GOALS = {"sft": 1.5, "reward": 1.2, "dpo": 1.5}  # farmflow / TRL tokens/s, the goals of the benchmark issue


def cpu_entry(kind: str, model: str, runs: dict) -> dict:
    """The comparison in tokens per CPU second of each side's process: on a machine shared with other work, the
    share of a core each side gets can differ between its rounds, which moves wall-clock rates but much less this."""
    return entry(
        f"{kind} training, {model}, per CPU second",
        "trained tokens per CPU second",
        {side: values(rs, "tokens_per_cpu_s") for side, rs in runs.items()},
        goal=GOALS[kind],
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=3, metavar=("SIDE", "TRAINER", "FOLDER"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--model", choices=list(SETUPS), default="smollm2", help="the real model (default) or the tiny one"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads on both sides (default 1: a shared 2-core machine)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved repetitions per trainer; medians are reported"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps at the start of every run")
    parser.add_argument(
        "--steps",
        type=int,
        nargs=3,
        default=(9, 9, 9),
        metavar=("SFT", "REWARD", "DPO"),
        help="steps per run, warm-up included",
    )
    parser.add_argument(
        "--only",
        choices=list(TRAINERS),
        action="append",
        help="run these trainers only (replacing theirs in the results file, keeping the others')",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="CI: the tiny model, 3 steps, one round, farmflow's side only"
    )
    parser.add_argument("--out", type=Path, default=OUT, help="results file")
    args = parser.parse_args(argv)
    if args.worker:
        side, kind, folder = args.worker
        return worker(side, kind, Path(folder), args.threads)
    if args.smoke:
        args.model, args.steps, args.warmup, args.rounds = "tiny", (3, 3, 3), 1, 1
    sides = ["farmflow"] if args.smoke else ["farmflow", "trl"]
    pythons = {"farmflow": Path(sys.executable)}
    if "trl" in sides:
        pythons["trl"] = ensure_venv(TRL_VENV, TRL_REQUIREMENTS, share=True)
    kinds = args.only or list(TRAINERS)
    steps = dict(zip(TRAINERS, args.steps))
    setup = SETUPS[args.model]
    results: dict = {
        "machine": machine() | {"threads": args.threads},
        "setup": {
            "model": setup["describe"],
            "max_len": setup["max_len"],
            "trainers": setup["trainers"],
            "steps": steps,
            "warmup_steps": args.warmup,
            "rounds": args.rounds,
            "token_count": TOKEN_COUNT,
            "peer": TRL_REQUIREMENTS[0],
            "dtype": "float32",
            "optimizer": "AdamW (torch.optim.AdamW, not fused) + clip 1.0 + warmup/cosine",
        },
        "differences": DIFFERENCES,
        "entries": [],
        "trainers": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        prepare(folder, steps, args.model)
        for kind in kinds:

            def contender(side: str, kind: str = kind):
                def run() -> dict:  # one fresh process; its warm-up steps are untimed inside it
                    r = measure(pythons[side], side, kind, folder, args.threads, args.warmup)
                    print(
                        f"{kind} {side}: {r['tokens_per_s']:.0f} tokens/s, {r['tokens_per_cpu_s']:.0f} per CPU second "
                        f"({r['ms_per_step']:.0f} ms/step)",
                        flush=True,
                    )
                    return r

                return run

            runs = interleave({side: contender(side) for side in sides}, rounds=args.rounds, warmup=0)
            ff = runs["farmflow"]
            if any(r["tokens"] != ff[0]["tokens"] for rs in runs.values() for r in rs):
                raise RuntimeError(f"{kind}: the sides did not train on the same batches")
            results["trainers"][kind] = {
                "tokens_per_step": statistics.mean(ff[0]["tokens"]),
                "computed_positions_per_step": {side: statistics.mean(rs[0]["padded"]) for side, rs in runs.items()},
                "first_step_loss": {side: rs[0]["loss_first"] for side, rs in runs.items()},
                "peak_rss_mb_median": {side: statistics.median(values(rs, "peak_rss_mb")) for side, rs in runs.items()},
                "runs": {
                    side: [{k: v for k, v in r.items() if k not in ("tokens", "padded")} for r in rs]
                    for side, rs in runs.items()
                },
            }
            if "trl" in runs:
                rates = {side: values(rs, "tokens_per_s") for side, rs in runs.items()}
                ff_cpu = statistics.median(values(ff, "tokens_per_cpu_s"))
                trl_cpu = statistics.median(values(runs["trl"], "tokens_per_cpu_s"))
                rss = results["trainers"][kind]["peak_rss_mb_median"]
                e = entry(
                    f"{kind} training, {args.model}",
                    "trained tokens/s",
                    rates,
                    goal=GOALS[kind],
                    note=f"per CPU second: {ff_cpu / trl_cpu:.2f}x; peak RSS {rss['farmflow']:,.0f} vs "
                    f"{rss['trl']:,.0f} MB (whole process)",
                )
                results["entries"].append(e)
                results["entries"].append(cpu_entry(kind, args.model, runs))
                results["machine"]["trl_version"] = runs["trl"][0].get("trl_version")
                print(
                    f"{kind}: farmflow / TRL {e['ratio']:.2f}x ({e['ratio_range'][0]:.2f}-{e['ratio_range'][1]:.2f})",
                    flush=True,
                )
    results["machine"]["load_average_at_end"] = list(os.getloadavg())
    if args.only and args.out.exists():  # a partial run replaces its trainers in the results file, keeps the others
        old = json.loads(args.out.read_text())
        if old.get("setup", {}).get("model") == results["setup"]["model"]:
            prefixes = tuple(f"{kind} training" for kind in kinds)
            results["trainers"] = old.get("trainers", {}) | results["trainers"]
            results["entries"] = [e for e in old.get("entries", []) if not e["what"].startswith(prefixes)] + results[
                "entries"
            ]
            results["machine"]["runs_of_other_trainers"] = old.get("machine")
    return save(results, args.out)


if __name__ == "__main__":
    main()

"""GPU numbers (issue 8): SFT throughput and MFU of a ~1B Llama, sampling tokens/s, PPO step breakdown.

    python -m bench.gpu          # a CUDA GPU: the ~1B model in bf16, a few minutes; writes bench/results/gpu.json
    python -m bench.gpu --tiny   # anywhere: a toy model on the CPU in seconds (the CI smoke test);
                                 # prints, or writes --out

Without a CUDA GPU the full run is skipped with a message (exit status 0), so `make bench`
runs everywhere. Everything is random-init from a config (no downloads): a Llama-style
model from farmflow's `build_policy` (hidden 2048, 16 layers, 16 heads, MLP 5632, vocab
32000, tied embeddings: 0.89B parameters) and a word-level tokenizer with exactly that
vocabulary, so every text has a known token count. On the GPU the weights are stored in
bf16 (`model.dtype: bfloat16`): sampling runs in bf16, and training, as farmflow's `Runtime`
does it, keeps float32 master weights and AdamW states under bf16 autocast. On the CPU
everything is float32.

1. **SFT**: farmflow's own loop, `farmflow.methods.sft.train_sft` (encoding each batch,
   `sft_loss`, the `Runtime`'s accelerate backward, clip 1.0, AdamW, schedule), beside a plain
   PyTorch loop on the same model and batches (pre-tokenized and on the GPU;
   `model(..., labels=...)` under the same autocast, backward, clip, AdamW), eager and
   `torch.compile`d. Sequences of exactly 512 tokens (no padding), batch 16. Tokens/s counts
   every token trained on (8192 per step) over the timed steps.
   MFU = tokens/s x FLOPs per token / the GPU's peak dense bf16 FLOP/s (PEAK_TFLOPS; an
   unknown GPU or the CPU: null). FLOPs per token follow PaLM (Chowdhery et al., 2022,
   appendix B): 6N + 12·L·H·Q·T, with N the parameters of every matrix product (the
   attention and MLP weights and the LM head; the tied embedding counted once),
   L layers, H heads of width Q, T the sequence length; the attention term counts the full
   T x T score matrix (causal masking skips half of it, the formula does not).
2. **Sampling**: `farmflow.models.sample_ids` (prefill once, KV cache, ancestral sampling)
   beside Hugging Face `generate(do_sample=True)` on the same model, and vLLM when it is
   installed (the same weights saved with `save_pretrained`), for batches of 16 / 64 / 256
   prompts of 128 tokens, 128 new tokens, temperature 1. Tokens/s = generated tokens
   (each side's own count, EOS included) / seconds.
3. **PPO step breakdown**: `farmflow.methods.ppo.train_ppo` with the ~1B policy, a frozen
   copy as the SFT reference, and a 0.15B reward model whose backbone also serves as the
   value model (rollout 64 prompts of 128 tokens, 128 new tokens, step batch 32, micro batch
   16, 2 PPO epochs). Measured around the public functions the loop calls: `sample_ids`
   (generation), the reward function (scoring), `rollout` (the rest of it: log-probs of the
   policy and the reference, values, advantages) and the step end (`on_step`; training = the
   PPO epochs: forward, backward, AdamW). The first step is reported apart (warm-up).

Every timing synchronizes CUDA first. Results: bench/results/gpu.json, with the hardware.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

OUT = Path(__file__).parent / "results" / "gpu.json"

# Peak dense (no sparsity) bf16 tensor-core TFLOP/s from NVIDIA's datasheets; matched in this order.
PEAK_TFLOPS = [
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
]
MFU_GOAL = 0.40

SIZES = {
    "full": {
        "model": {
            "hidden_size": 2048,
            "num_layers": 16,
            "num_heads": 16,
            "intermediate_size": 5632,
            "vocab": 32000,
            "max_seq_len": 512,
        },
        "reward": {"hidden_size": 1024, "num_layers": 8, "num_heads": 8, "intermediate_size": 2816},
        "sft": {"batch": 16, "seq": 512, "warmup": 3, "steps": 12},
        "gen": {"batches": [16, 64, 256], "prompt": 128, "new": 128},
        "ppo": {"rollout": 64, "step_batch": 32, "micro": 16, "prompt": 128, "new": 128, "steps": 3},
    },
    "tiny": {
        "model": {
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "intermediate_size": 128,
            "vocab": 512,
            "max_seq_len": 64,
        },
        "reward": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
        "sft": {"batch": 4, "seq": 64, "warmup": 1, "steps": 4},
        "gen": {"batches": [2, 4], "prompt": 8, "new": 8},
        "ppo": {"rollout": 4, "step_batch": 2, "micro": 2, "prompt": 8, "new": 8, "steps": 2},
    },
}


# ------------------------------------------------------------------------ helpers
def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def peak_tflops(gpu_name: str | None) -> float | None:
    """Peak dense bf16 TFLOP/s of a GPU by name (None: the CPU or a GPU not in the table)."""
    for key, value in PEAK_TFLOPS if gpu_name else []:
        if key in gpu_name:
            return value
    return None


def machine() -> dict:
    facts = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": None,
        "gpu_memory_gib": None,
        "driver": None,
    }
    import transformers

    facts["transformers"] = transformers.__version__
    try:
        import vllm

        facts["vllm"] = vllm.__version__
    except ImportError:
        facts["vllm"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            gpus=torch.cuda.device_count(),
            compute_capability=f"{props.major}.{props.minor}",
        )
        if shutil.which("nvidia-smi"):
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
            )
            facts["driver"] = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    return facts


def word_tokenizer(vocab: int):
    """A word-level tokenizer with exactly `vocab` tokens: <pad> <s> </s> w3 ... w{vocab-1}, split on spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from farmflow.models import BOS, EOS, PAD

    words = {PAD: 0, BOS: 1, EOS: 2} | {f"w{i}": i for i in range(3, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, padding_side="right"
    )


def texts(n: int, words: int, vocab: int, seed: int) -> list[str]:
    """n texts of exactly `words` tokens each."""
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(3, vocab)}" for _ in range(words)) for _ in range(n)]


def policy(size: dict, tok, device: str, dtype: torch.dtype):
    """farmflow's Llama-style policy from a config, built on `device` in `dtype` (seeded: both sides get the same
    weights)."""
    from farmflow.config import ModelConfig
    from farmflow.models import build_policy

    m = size["model"]
    cfg = ModelConfig(
        hidden_size=m["hidden_size"],
        num_layers=m["num_layers"],
        num_heads=m["num_heads"],
        intermediate_size=m["intermediate_size"],
        max_seq_len=m["max_seq_len"],
        vocab_size=m["vocab"],
    )
    with torch.device(device):
        model = build_policy(cfg, tok)
    return model.to(dtype)


def flops_per_token(model, seq: int) -> tuple[float, int]:
    """PaLM's 6N + 12·L·H·Q·T training FLOPs per token, and N (parameters of the matrix products, tied embedding
    once)."""
    c = model.config
    n = sum(
        p.numel() for p in model.parameters() if p.dim() == 2
    )  # embedding (= the LM head when tied) + linear weights
    if not c.tie_word_embeddings:
        n -= model.get_input_embeddings().weight.numel()  # a lookup, not a product
    return 6.0 * n + 12.0 * c.num_hidden_layers * c.hidden_size * seq, n


@contextmanager
def step_clock(module, ends: list[float]):
    """Timestamps at the end of every step of a farmflow loop, from its own progress bar (`module.progress`)."""
    real = module.progress

    @contextmanager
    def timed(*args, **kwargs):
        with real(*args, **kwargs) as bar:
            update = bar.update

            def tick(k=1):
                sync()
                ends.append(time.perf_counter())
                return update(k)

            bar.update = tick
            yield bar

    module.progress = timed
    try:
        yield
    finally:
        module.progress = real


def rate(tokens_per_step: int, ends: list[float], warmup: int) -> dict:
    timed = len(ends) - warmup
    seconds = ends[-1] - ends[warmup - 1]
    return {"timed_steps": timed, "step_ms": 1000 * seconds / timed, "tokens_per_s": tokens_per_step * timed / seconds}


# ----------------------------------------------------------------------------- SFT
def bench_sft(size: dict, device: str, dtype: torch.dtype, peak: float | None, compile_peer: bool) -> dict:
    from farmflow.config import SFTConfig
    from farmflow.methods import sft
    from farmflow.models import batch_order, encode_examples

    s, vocab = size["sft"], size["model"]["vocab"]
    tok = word_tokenizer(vocab)
    steps, batch, seq, warmup = s["warmup"] + s["steps"], s["batch"], s["seq"], s["warmup"]
    prompt_words = seq // 4 - 1
    prompts = texts(steps * batch, prompt_words, vocab, seed=1)
    responses = texts(steps * batch, seq - prompt_words - 2, vocab, seed=2)  # <s> prompt response </s> = seq tokens
    cfg = SFTConfig(epochs=1.0, batch_size=batch, lr=1e-5, warmup_ratio=0.0, seed=0)
    precision = (
        "float32" if dtype == torch.float32 else f"float32 master weights, {str(dtype).removeprefix('torch.')} autocast"
    )
    out: dict = {
        "batch": batch,
        "seq": seq,
        "tokens_per_step": batch * seq,
        "warmup_steps": warmup,
        "timed_steps": s["steps"],
        "precision": precision,
        "peak_tflops": peak,
    }

    model = policy(size, tok, device, dtype)
    fpt, n = flops_per_token(model, seq)
    out.update(
        parameters=sum(p.numel() for p in model.parameters()),
        matmul_parameters=n,
        flops_per_token=fpt,
        flops_formula="6N + 12*L*H*Q*T (PaLM appendix B), N = parameters of the matrix products (tied embedding once)",
    )
    ends: list[float] = []
    with step_clock(sft, ends):
        metrics = sft.train_sft(model, tok, prompts, responses, cfg, seq)
    if metrics["train_tokens"] != steps * batch * seq:
        raise RuntimeError(
            f"sft: trained on {metrics['train_tokens']:.0f} tokens, expected {steps * batch * seq} "
            "(padding or truncation)"
        )
    sides = {"farmflow": rate(batch * seq, ends, warmup) | {"loss_first": metrics["train_loss_first"]}}
    del model
    free()

    # the peer: the same batches, pre-tokenized and on the device, a minimal loop around the model's own loss
    batches = []
    for idx in batch_order(len(prompts), batch, steps, cfg.seed):
        ids, mask, labels = encode_examples(tok, [prompts[i] for i in idx], [responses[i] for i in idx], seq)
        batches.append((ids.to(device), mask.to(device), labels.to(device)))
    for name, compiled in (("plain_pytorch", False), ("plain_pytorch_compiled", True)):
        if compiled and not compile_peer:
            sides[name] = None
            continue
        try:
            run = plain_loop(size, tok, device, dtype, batches, cfg, compiled)
            sides[name] = rate(batch * seq, run["ends"], warmup) | {"loss_first": run["loss_first"]}
        except (
            Exception
        ) as err:  # the compiled peer needs a working inductor toolchain; its failure is a result, not a crash
            if not compiled:
                raise
            sides[name] = {"error": f"{type(err).__name__}: {str(err)[:500]}"}
        free()
    for side in sides.values():
        if side and "tokens_per_s" in side:
            side["mfu"] = side["tokens_per_s"] * fpt / (peak * 1e12) if peak else None
    out["sides"] = sides
    ff = sides["farmflow"]["tokens_per_s"]
    out["ratio_farmflow_over_plain"] = ff / sides["plain_pytorch"]["tokens_per_s"]
    compiled_side = sides["plain_pytorch_compiled"] or {}
    out["ratio_farmflow_over_compiled"] = (
        ff / compiled_side["tokens_per_s"] if "tokens_per_s" in compiled_side else None
    )
    mfu = sides["farmflow"]["mfu"]
    out["goal"] = f"SFT MFU >= {MFU_GOAL:.0%}: " + (
        "no GPU peak known, not measured" if mfu is None else "met" if mfu >= MFU_GOAL else "not met"
    )
    return out


def plain_loop(size: dict, tok, device: str, dtype: torch.dtype, batches: list, cfg, compiled: bool) -> dict:
    """The peer: a minimal PyTorch loop around the model's own loss, float32 master weights under autocast;
    step-end times."""
    from farmflow.models import optimizer_and_schedule

    autocast = torch.autocast(device, dtype) if dtype != torch.float32 else contextlib.nullcontext()
    model = policy(size, tok, device, dtype).float()  # float32 master weights, as the Runtime keeps them
    model.train()
    opt, sched = optimizer_and_schedule(model, cfg.lr, cfg.weight_decay, len(batches), cfg.warmup_ratio)
    forward = torch.compile(model) if compiled else model
    ends, first = [], None
    for ids, mask, labels in batches:
        with autocast:
            loss = forward(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        first = loss.item() if first is None else first
        sync()
        ends.append(time.perf_counter())
    return {"ends": ends, "loss_first": first}


# ------------------------------------------------------------------------ sampling
def bench_generation(size: dict, device: str, dtype: torch.dtype) -> dict:
    from farmflow.models import sample_ids

    g, vocab = size["gen"], size["model"]["vocab"]
    tok = word_tokenizer(vocab)
    model = policy(size, tok, device, dtype).eval()
    new = g["new"]
    prompts = texts(max(g["batches"]), g["prompt"] - 1, vocab, seed=3)  # + <s> = g["prompt"] tokens
    tok_left = copy.deepcopy(tok)
    tok_left.padding_side = "left"

    # The model is an argument, not a closure variable, so that the `del model` below really releases it.
    def farmflow(model, batch: list[str]) -> int:
        out = sample_ids(model, tok, batch, n=1, temperature=1.0, max_new_tokens=new, batch_size=len(batch), seed=0)
        return sum(len(r[0]) for r in out)

    def hf_generate(model, batch: list[str]) -> int:
        enc = tok_left(["<s> " + p for p in batch], return_tensors="pt", padding=True, add_special_tokens=False).to(
            device
        )
        with torch.no_grad():
            ids = model.generate(
                **enc,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new,
                pad_token_id=tok.pad_token_id,
            )
        gen = ids[:, enc["input_ids"].shape[1] :].tolist()
        return sum(len(r[: r.index(tok.eos_token_id) + 1] if tok.eos_token_id in r else r) for r in gen)

    contenders = {"farmflow_sample_ids": farmflow, "hf_generate": hf_generate}
    rows = []
    for name, fn in contenders.items():
        fn(model, prompts[:2])  # warm-up: kernels, allocator
    for b in g["batches"]:
        row = {"batch": b, "prompt_tokens": g["prompt"], "max_new_tokens": new}
        for name, fn in contenders.items():
            sync()
            start = time.perf_counter()
            n_tokens = fn(model, prompts[:b])
            sync()
            seconds = time.perf_counter() - start
            row[name] = {"seconds": seconds, "generated_tokens": n_tokens, "tokens_per_s": n_tokens / seconds}
        row["ratio_farmflow_over_hf_generate"] = (
            row["farmflow_sample_ids"]["tokens_per_s"] / row["hf_generate"]["tokens_per_s"]
        )
        rows.append(row)
    vllm_rows, vllm_status = None, "needs a GPU"
    if device == "cuda":
        try:
            vllm_rows = bench_vllm(model, tok, prompts, g, dtype)
            vllm_status = "measured" if vllm_rows else "not installed"
        except Exception as err:  # an installed vLLM that cannot run here is reported, not fatal
            vllm_status = f"failed: {type(err).__name__}: {str(err)[:500]}"
    del model
    free()
    for row, v in zip(rows, vllm_rows or []):
        row["vllm"] = v
        row["ratio_farmflow_over_vllm"] = row["farmflow_sample_ids"]["tokens_per_s"] / v["tokens_per_s"]
    return {"rows": rows, "vllm": vllm_status}


def bench_vllm(model, tok, prompts: list[str], g: dict, dtype: torch.dtype) -> list[dict] | None:
    """The same weights through vLLM (when installed): engine start excluded, one generate call per batch."""
    try:
        import vllm
    except ImportError:
        return None
    from farmflow.generation import prompt_token_ids, texts_from_vllm
    from farmflow.models import decode_response, save

    with tempfile.TemporaryDirectory() as folder:
        save(model, tok, folder)
        llm = vllm.LLM(
            model=folder,
            dtype=str(dtype).removeprefix("torch."),
            seed=0,
            max_model_len=model.config.max_position_embeddings,
            gpu_memory_utilization=0.5,
        )  # the HF model is still on the GPU
        ids = [{"prompt_token_ids": x} for x in prompt_token_ids(tok, prompts, g["prompt"])]
        params = vllm.SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=g["new"], seed=0)
        llm.generate(ids[:2], params, use_tqdm=False)  # warm-up
        rows = []
        for b in g["batches"]:
            start = time.perf_counter()
            outs = llm.generate(ids[:b], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            texts_from_vllm(
                outs, 1, lambda t: decode_response(tok, t)
            )  # farmflow's conversion, checked on real outputs
            n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.append({"seconds": seconds, "generated_tokens": n_tokens, "tokens_per_s": n_tokens / seconds})
        del llm
        free()
    return rows


# ----------------------------------------------------------------------------- PPO
def bench_ppo(size: dict, device: str, dtype: torch.dtype) -> dict:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from farmflow.config import PPOConfig
    from farmflow.methods import ppo, rl
    from farmflow.models import ValueModel

    p, r, vocab = size["ppo"], size["reward"], size["model"]["vocab"]
    tok = word_tokenizer(vocab)
    model = policy(size, tok, device, dtype)
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    rm_config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=r["hidden_size"],
        intermediate_size=r["intermediate_size"],
        num_hidden_layers=r["num_layers"],
        num_attention_heads=r["num_heads"],
        num_key_value_heads=r["num_heads"],
        max_position_embeddings=size["model"]["max_seq_len"],
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        num_labels=1,
    )
    with torch.device(device):
        reward = LlamaForSequenceClassification(rm_config).to(dtype).eval()
        value = ValueModel(copy.deepcopy(reward.model), r["hidden_size"]).to(
            dtype
        )  # farmflow.models.value_from_reward, in memory
    cfg = PPOConfig(
        epochs=1.0,
        rollout_batch_size=p["rollout"],
        step_batch_size=p["step_batch"],
        micro_batch_size=p["micro"],
        max_new_tokens=p["new"],
        warmup_steps=0,
        penalty_reward_value=None,
    )
    prompts = texts(p["rollout"] * p["steps"], p["prompt"] - 1, vocab, seed=4)

    marks: dict[str, list[float]] = {"generate": [], "score": [], "rollout": [], "rollout_end": [], "step_end": []}

    def timed(fn, name):
        def wrapper(*args, **kwargs):
            sync()
            start = time.perf_counter()
            result = fn(*args, **kwargs)
            sync()
            marks[name].append(time.perf_counter() - start)
            if name == "rollout":
                marks["rollout_end"].append(time.perf_counter())
            return result

        return wrapper

    reward_fn = timed(rl.reward_model_fn(reward, tok, batch_size=p["micro"]), "score")
    real = {"sample_ids": rl.sample_ids, "rollout": ppo.rollout}
    rl.sample_ids, ppo.rollout = timed(real["sample_ids"], "generate"), timed(real["rollout"], "rollout")
    try:
        ppo.train_ppo(
            model,
            ref,
            value,
            reward_fn,
            tok,
            prompts,
            cfg,
            on_step=lambda step, _: (sync(), marks["step_end"].append(time.perf_counter())),
        )
    finally:
        rl.sample_ids, ppo.rollout = real["sample_ids"], real["rollout"]
    steps = []
    for i in range(p["steps"]):
        train = marks["step_end"][i] - marks["rollout_end"][i]
        gen, score, roll = marks["generate"][i], marks["score"][i], marks["rollout"][i]
        steps.append(
            {
                "generation_s": gen,
                "scoring_s": score,
                "rollout_forward_s": roll - gen - score,
                "training_s": train,
                "total_s": roll + train,
            }
        )
    del model, ref, reward, value
    free()
    later = steps[1:] or steps
    mean = {k: statistics.mean(s[k] for s in later) for k in steps[0]}
    share = {k.removesuffix("_s"): v / mean["total_s"] for k, v in mean.items() if k != "total_s"}
    return {
        "rollout_batch": p["rollout"],
        "step_batch": p["step_batch"],
        "micro_batch": p["micro"],
        "prompt_tokens": p["prompt"],
        "max_new_tokens": p["new"],
        "ppo_epochs": cfg.ppo_epochs,
        "reward_and_value_model": r,
        "first_step": steps[0],
        "mean_after_first": mean,
        "share_after_first": share,
        "steps": steps,
    }


# --------------------------------------------------------------------------- driver
def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tiny", action="store_true", help="a toy model on the CPU in seconds (CI smoke test); MFU is null"
    )
    parser.add_argument(
        "--out", type=Path, help=f"where to write the results (default: {OUT} for a GPU run; a --tiny run only prints)"
    )
    parser.add_argument(
        "--no-compile", action="store_true", help="skip the torch.compile peer (saves its compile time)"
    )
    parser.add_argument("--only", choices=["sft", "generation", "ppo"], action="append", help="run these parts only")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        print(
            f"bench.gpu: skipped, no CUDA GPU here (torch {torch.__version__}, CUDA build: {torch.version.cuda}). "
            "`python -m bench.gpu --tiny` runs the CPU smoke version.",
            flush=True,
        )
        return None
    mode = "tiny" if args.tiny else "full"
    size = SIZES[mode]
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    facts = machine()
    peak = peak_tflops(facts["gpu"]) if device == "cuda" else None
    results: dict = {
        "mode": mode,
        "device": device,
        "machine": facts,
        "model": size["model"],
        "peak_bf16_tflops_table": dict(PEAK_TFLOPS),
    }
    parts = args.only or ["sft", "generation", "ppo"]
    started = time.perf_counter()
    if "sft" in parts:
        results["sft"] = bench_sft(size, device, dtype, peak, compile_peer=not (args.tiny or args.no_compile))
        s = results["sft"]
        print(
            f"sft: farmflow {s['sides']['farmflow']['tokens_per_s']:.0f} tokens/s, plain PyTorch ratio "
            f"{s['ratio_farmflow_over_plain']:.2f}x; {s['goal']}",
            flush=True,
        )
    if "generation" in parts:
        results["generation"] = bench_generation(size, device, dtype)
        for row in results["generation"]["rows"]:
            print(
                f"sampling batch {row['batch']}: farmflow {row['farmflow_sample_ids']['tokens_per_s']:.0f} tokens/s, "
                f"HF generate {row['hf_generate']['tokens_per_s']:.0f} ({row['ratio_farmflow_over_hf_generate']:.2f}x)",
                flush=True,
            )
    if "ppo" in parts:
        results["ppo"] = bench_ppo(size, device, dtype)
        print(
            "ppo step (after the first): "
            + ", ".join(f"{k} {v:.2f}s" for k, v in results["ppo"]["mean_after_first"].items()),
            flush=True,
        )
    results["seconds"] = time.perf_counter() - started
    out = args.out or (None if args.tiny else OUT)
    if out is None:
        print(json.dumps(results, indent=2))
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=2) + "\n")
        tmp.replace(out)
        print(f"written to {out} ({results['seconds']:.0f} s)")
    return results


if __name__ == "__main__":
    main()

"""The CUDA paths: run on a machine with a CUDA GPU (skipped everywhere else, CI included).

    pytest tests/test_cuda.py        # on the GPU machine, from the repository root

What the CPU suite cannot see: bf16 training under autocast with float32 master weights
and the weights saved back in bf16, CUDA numerics against the CPU's, sampling with the
KV cache on the GPU, and every training loop (SFT, reward model, DPO, PPO, Quark) placing
its models and tensors on the GPU. Imports nothing from prefect, duckdb or the stage tasks,
so it also runs on a bare GPU image with torch, transformers, accelerate, tokenizers and
pydantic (docs/real-farm.md, GPU numbers).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from rl_helpers import TOY_PROMPTS, digit_reward, toy_models
from test_models import CFG, PROMPTS, RESPONSES, plain_sft

from farmflow.config import DPOConfig, PPOConfig, QuarkConfig, RewardConfig, SFTConfig
from farmflow.methods import dpo, ppo, quark, reward, sft
from farmflow.models import build_policy, load_policy, reward_from_policy, sample_ids, save, train_tokenizer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

N = 16
OTHER = [r[::-1] + " ok" for r in RESPONSES[:N]]
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(PROMPTS + RESPONSES, vocab_size=384)


def _policy(tok, dtype=torch.float32):
    return build_policy(CFG, tok).to(dtype)  # seeded by CFG.seed: the same weights every call


def test_sft_in_bf16_trains_under_autocast_on_float32_master_weights_and_keeps_bf16(tok):
    model = _policy(tok, torch.bfloat16)
    start = model.model.embed_tokens.weight.detach().float().clone()
    seen = []  # (output dtype, weight dtype, device) of one layer at every forward pass
    model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda m, i, o: seen.append((o.dtype, m.weight.dtype, o.device.type))
    )
    metrics = sft.train_sft(
        model, tok, PROMPTS[:64], RESPONSES[:64], SFTConfig(epochs=4, batch_size=8, lr=3e-3, warmup_ratio=0.0), 128
    )
    assert seen and set(seen) == {(torch.bfloat16, torch.float32, "cuda")}  # bf16 compute on float32 master weights
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # saved back in its own dtype
    assert not torch.equal(model.model.embed_tokens.weight.float().cpu(), start)
    assert (
        metrics["train_loss_last"] < metrics["train_loss_first"] - 1.0
    )  # 32 steps on 64 examples (CPU, float32: 5.94 -> 4.38)


def test_sft_in_float32_on_the_gpu_is_the_plain_loop_and_starts_at_the_cpu_loss(tok):
    cfg = SFTConfig(epochs=1, batch_size=8, lr=3e-3, warmup_ratio=0.25)
    model = _policy(tok)
    metrics = sft.train_sft(model, tok, PROMPTS[:N], RESPONSES[:N], cfg, 128)
    assert (next(model.parameters()).device.type, next(model.parameters()).dtype) == (
        "cuda",
        torch.float32,
    )  # no autocast
    on_cpu = plain_sft(_policy(tok), tok, cfg, N)  # the same loop written out, on the CPU and on the GPU
    plain = _policy(tok).to(CUDA)
    on_gpu = plain_sft(plain, tok, cfg, N, device="cuda")
    assert metrics["train_loss_first"] == pytest.approx(on_cpu[0], rel=1e-5)
    assert on_gpu[0] == pytest.approx(on_cpu[0], rel=1e-5)
    assert on_gpu[-1] == pytest.approx(on_cpu[-1], rel=1e-4)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.allclose(p, q, atol=1e-4, rtol=0), f"{name}: max diff {(p - q).abs().max():.2e}"


def test_reward_model_and_dpo_in_bf16_start_at_log_2(tok, tmp_path):
    policy = _policy(tok, torch.bfloat16)
    save(policy, tok, tmp_path / "sft")
    rm = reward_from_policy(tmp_path / "sft", seed=0)
    assert next(rm.parameters()).device.type == "cuda" and next(rm.parameters()).dtype == torch.bfloat16
    prefs = [1.0, 2.0] * (N // 2)
    rm_metrics = reward.train_reward(
        rm, tok, PROMPTS[:N], RESPONSES[:N], OTHER, prefs, RewardConfig(epochs=1, batch_size=8), 128
    )
    assert math.isfinite(rm_metrics["train_loss_last"]) and next(rm.parameters()).dtype == torch.bfloat16

    policy, _ = load_policy(tmp_path / "sft")
    assert next(policy.parameters()).device.type == "cuda"
    ref_1, ref_2 = dpo.reference_logps(policy, tok, PROMPTS[:N], RESPONSES[:N], OTHER, 128, 8)
    m = dpo.train_dpo(
        policy, tok, PROMPTS[:N], RESPONSES[:N], OTHER, prefs, ref_1, ref_2, DPOConfig(epochs=1, batch_size=8), 128
    )
    assert m["train_loss_first"] == pytest.approx(math.log(2), abs=0.05)  # the policy is its own reference: margin 0


def test_sampling_on_the_gpu_is_seeded_and_matches_the_cpu(tok):
    model = _policy(tok)
    prompts = PROMPTS[:12]
    on_cpu = sample_ids(model, tok, prompts, n=2, max_new_tokens=16, seed=3)
    model.to(CUDA)
    first = sample_ids(model, tok, prompts, n=2, max_new_tokens=16, seed=3)
    again = sample_ids(model, tok, prompts, n=2, max_new_tokens=16, seed=3, batch_size=5)
    assert first == again  # the same streams for any batch size
    same = sum(a == b for p, q in zip(first, on_cpu) for a, b in zip(p, q))
    assert same >= 0.9 * 24  # the same uniforms; logits differ only by rounding
    model.to(torch.bfloat16)
    lengths = [len(s) for p in sample_ids(model, tok, prompts, n=4, max_new_tokens=16) for s in p]
    assert len(lengths) == 48 and all(1 <= n <= 16 for n in lengths)


def test_ppo_and_quark_raise_a_toy_reward_on_the_gpu():
    policy, ref, value, tok = toy_models()
    cfg = PPOConfig(
        epochs=16,
        rollout_batch_size=60,
        step_batch_size=30,
        micro_batch_size=60,
        lr=3e-3,
        warmup_steps=0,
        kl_coef=0.05,
        max_new_tokens=8,
        penalty_reward_value=None,
    )
    summary, _ = ppo.train_ppo(policy, ref, value, digit_reward, tok, TOY_PROMPTS, cfg)
    assert next(policy.parameters()).device.type == "cuda"
    assert summary["reward_last"] > summary["reward_first"] + 0.2  # CPU: 0.08 -> 0.45

    policy, ref, _, tok = toy_models()
    qcfg = QuarkConfig(
        epochs=16,
        rollout_batch_size=60,
        step_batch_size=30,
        grad_steps_per_rollout=2,
        micro_batch_size=60,
        lr=3e-3,
        warmup_steps=0,
        kl_coef=0.05,
        max_new_tokens=8,
        penalty_reward_value=None,
    )
    summary, _ = quark.train_quark(policy, copy.deepcopy(ref), digit_reward, tok, TOY_PROMPTS, qcfg)
    assert summary["reward_last"] > summary["reward_first"] + 0.15  # CPU: 0.08 -> 0.36

"""farmflow.models.runtime: micro-batches equal the full batch, CPU training unchanged, micro_batch_size operational."""

from __future__ import annotations

import pytest
import torch
from test_models import CFG, PROMPTS, RESPONSES, plain_sft

from farmflow.config import DPOConfig, RewardConfig, SFTConfig
from farmflow.methods import dpo, reward, sft
from farmflow.models import build_policy, encode_examples, reward_from_policy, save, train_tokenizer
from farmflow.models.runtime import Runtime, mixed_precision
from farmflow.tasks.core import key_config

N = 16  # examples (pairs): 2 optimizer steps of 8
OTHER = [r[::-1] + " ok" for r in RESPONSES[:N]]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(PROMPTS + RESPONSES, vocab_size=384)


@pytest.fixture(scope="module")
def sft_checkpoint(tok, tmp_path_factory):
    folder = tmp_path_factory.mktemp("policy")
    save(build_policy(CFG, tok), tok, folder)
    return folder


def _policy(tok):
    return build_policy(CFG, tok)  # seeded by CFG.seed: the same weights every call


def _same_params(a: torch.nn.Module, b: torch.nn.Module, atol: float) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    moved = 0
    for name, p in pa.items():
        assert torch.allclose(p, pb[name], atol=atol, rtol=0), f"{name}: max diff {(p - pb[name]).abs().max():.2e}"
        moved += 1
    assert moved > 0


def test_sft_two_micro_batches_equal_one_full_batch(tok):
    cfg = SFTConfig(epochs=1, batch_size=8, lr=3e-3, warmup_ratio=0.0)
    full, micro = _policy(tok), _policy(tok)
    start = {k: v.clone() for k, v in full.state_dict().items()}
    m_full = sft.train_sft(full, tok, PROMPTS[:N], RESPONSES[:N], cfg, 128)
    m_micro = sft.train_sft(micro, tok, PROMPTS[:N], RESPONSES[:N], cfg.model_copy(update={"micro_batch_size": 4}), 128)
    assert m_full["steps"] == m_micro["steps"] == 2
    assert not torch.allclose(full.model.embed_tokens.weight, start["model.embed_tokens.weight"])  # it trained
    _same_params(full, micro, atol=1e-5)
    assert m_micro["train_loss_first"] == pytest.approx(m_full["train_loss_first"], rel=1e-5)
    assert m_micro["train_tokens"] == m_full["train_tokens"]


def test_sft_micro_batches_weight_by_response_tokens(tok):
    """Micro-batches with very different numbers of response tokens still give the full batch's mean loss."""
    cfg = SFTConfig(epochs=1, batch_size=8, lr=3e-3, warmup_ratio=0.0)
    short, long = RESPONSES[:4], [" ".join([r] * 5) for r in RESPONSES[4:8]]
    full, micro = _policy(tok), _policy(tok)
    sft.train_sft(full, tok, PROMPTS[:8], short + long, cfg, 128)
    sft.train_sft(micro, tok, PROMPTS[:8], short + long, cfg.model_copy(update={"micro_batch_size": 4}), 128)
    _same_params(full, micro, atol=1e-5)


def test_reward_two_micro_batches_equal_one_full_batch(tok, sft_checkpoint):
    cfg = RewardConfig(epochs=1, batch_size=8, lr=1e-3, warmup_ratio=0.0)
    prefs = [1.0, 2.0, 1.0, 1.7] * 4
    full, micro = reward_from_policy(sft_checkpoint, seed=0), reward_from_policy(sft_checkpoint, seed=0)
    head = full.score.weight.detach().clone()
    args = (tok, PROMPTS[:N], RESPONSES[:N], OTHER, prefs)
    m_full = reward.train_reward(full, *args, cfg, 128)
    m_micro = reward.train_reward(micro, *args, cfg.model_copy(update={"micro_batch_size": 2}), 128)
    assert not torch.allclose(full.score.weight, head)
    _same_params(full, micro, atol=5e-5)  # 5% of one AdamW step (lr 1e-3): Adam magnifies rounding in tiny gradients
    assert m_micro["train_loss_first"] == pytest.approx(m_full["train_loss_first"], rel=1e-5)


def test_dpo_two_micro_batches_equal_one_full_batch(tok):
    cfg = DPOConfig(epochs=1, batch_size=8, lr=1e-3, warmup_ratio=0.0)
    prefs = [1.0, 2.0] * 8
    ref_1, ref_2 = [-20.0 - i for i in range(N)], [-22.0 + i for i in range(N)]
    full, micro = _policy(tok), _policy(tok)
    args = (tok, PROMPTS[:N], RESPONSES[:N], OTHER, prefs, ref_1, ref_2)
    m_full = dpo.train_dpo(full, *args, cfg, 128)
    m_micro = dpo.train_dpo(micro, *args, cfg.model_copy(update={"micro_batch_size": 3}), 128)  # 3 + 3 + 2
    _same_params(full, micro, atol=1e-5)
    assert m_micro["implicit_reward_accuracy_last"] == pytest.approx(m_full["implicit_reward_accuracy_last"], abs=1e-6)


def test_cpu_runtime_is_the_plain_loop_bit_for_bit_without_autocast(tok):
    """On the CPU the runtime adds nothing: no autocast, float32 kept, the same numbers as a hand-written loop."""
    cfg = SFTConfig(epochs=1, batch_size=8, lr=3e-3, warmup_ratio=0.25)
    model = _policy(tok)
    autocast_seen = []
    model.register_forward_pre_hook(
        lambda *_: autocast_seen.append(torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled())
    )
    sft.train_sft(model, tok, PROMPTS[:N], RESPONSES[:N], cfg, 128)
    assert autocast_seen and not any(autocast_seen)
    assert {p.dtype for p in model.parameters()} == {torch.float32} and {p.device.type for p in model.parameters()} == {
        "cpu"
    }

    plain = _policy(tok)  # what the loop did before the runtime
    plain_sft(plain, tok, cfg, N)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name


def test_mixed_precision_by_weights_dtype_device_and_cpu_flags():
    native, emulated = {"avx2", "avx512_bf16"}, {"avx2", "fma"}
    assert mixed_precision(torch.bfloat16, True, set()) == "bf16"
    assert mixed_precision(torch.float16, True, set()) == "fp16"
    assert mixed_precision(torch.float32, True, native) == "no"
    assert mixed_precision(torch.bfloat16, False, native) == "bf16"
    assert mixed_precision(torch.bfloat16, False, {"amx_bf16"}) == "bf16"
    assert mixed_precision(torch.bfloat16, False, emulated) == "no"  # emulated bf16 is slower than float32
    assert mixed_precision(torch.float16, False, native | {"avx512_fp16"}) == "no"  # no loss scaler on a CPU
    assert mixed_precision(torch.float32, False, native) == "no"


@pytest.mark.parametrize("flags", [{"avx2", "avx512_bf16"}, {"avx2", "fma"}])
def test_bf16_weights_on_a_cpu_train_mixed_only_where_it_is_native(tok, monkeypatch, flags):
    """With native bfloat16 the CPU trains bf16 weights as a GPU does: autocast over float32 master weights, saved back
    in bfloat16, the first loss within bfloat16 rounding of the float32 model's. Where bfloat16 is emulated they train
    in float32 (no autocast), saved back in bfloat16."""
    import farmflow.models.runtime as runtime

    monkeypatch.setattr(runtime, "cpu_flags", lambda: flags)
    mixed = "avx512_bf16" in flags
    cfg = SFTConfig(epochs=1, batch_size=8, lr=3e-3, warmup_ratio=0.0)
    model, reference = _policy(tok).to(torch.bfloat16), _policy(tok)
    seen = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda m, i, o: seen.append((torch.is_autocast_enabled("cpu"), m.weight.dtype, o.dtype))
    )
    metrics = sft.train_sft(model, tok, PROMPTS[:N], RESPONSES[:N], cfg, 128)
    first = sft.train_sft(reference, tok, PROMPTS[:N], RESPONSES[:N], cfg, 128)["train_loss_first"]
    assert seen and set(seen) == {
        (True, torch.float32, torch.bfloat16) if mixed else (False, torch.float32, torch.float32)
    }
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # saved back in its own dtype
    assert metrics["train_loss_first"] == pytest.approx(first, rel=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_weights_a_cpu_cannot_mix_train_as_their_float32_copy_would(tok, monkeypatch, dtype):
    """Where the CPU emulates bfloat16 (and for float16 on any CPU) half-precision weights train as float32 master
    weights: the result is exactly the float32 copy of the stored weights trained, then rounded back once. Trained as
    stored, most updates of a small learning rate round away (bfloat16 keeps 8 bits: a weight of 0.05 moves in steps
    of 2.4e-4): here 15% of the bfloat16 weights would move, against 36% rounded back from float32."""
    import farmflow.models.runtime as runtime

    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    cfg = SFTConfig(epochs=2, batch_size=4, lr=1e-5, warmup_ratio=0.0)
    model = _policy(tok).to(dtype)
    start = [p.detach().clone() for p in model.parameters()]
    copy32 = _policy(tok).to(dtype).float()  # the same stored weights, as float32
    sft.train_sft(model, tok, PROMPTS[:N], RESPONSES[:N], cfg, 128)
    sft.train_sft(copy32, tok, PROMPTS[:N], RESPONSES[:N], cfg, 128)
    for (name, p), q in zip(model.named_parameters(), copy32.parameters()):
        assert p.dtype == dtype and torch.equal(p, q.to(dtype)), name
    moved = sum(int((p != s).sum()) for p, s in zip(model.parameters(), start))
    assert moved > 0.25 * sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("native", [False, True])
def test_loaded_half_weights_compute_in_float32_where_emulated_and_save_back_in_their_dtype(
    tok, monkeypatch, tmp_path, native
):
    """A bfloat16 checkpoint loaded on a CPU that emulates bfloat16 computes in float32 (sampling, scoring, training)
    and a stage that trains it saves it back in bfloat16, the same weights as its float32 copy trained and rounded.
    With native bfloat16 it loads as stored."""
    import json

    import farmflow.models.runtime as runtime
    from farmflow.models import load_policy, load_reward
    from farmflow.models.runtime import STORED_DTYPE

    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"} if native else {"avx2"}))
    save(_policy(tok).to(torch.bfloat16), tok, tmp_path / "policy")
    model, _ = load_policy(tmp_path / "policy")
    assert next(model.parameters()).dtype == (torch.bfloat16 if native else torch.float32)
    assert model.__dict__.get(STORED_DTYPE) == (None if native else torch.bfloat16)
    scorer = reward_from_policy(tmp_path / "policy")
    save(scorer, tok, tmp_path / "reward")
    assert {p.dtype for p in load_reward(tmp_path / "reward")[0].parameters()} == (
        {torch.bfloat16} if native else {torch.float32}
    )
    if native:
        return
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"avx512_bf16"}))  # loads as stored
    copy32 = load_policy(tmp_path / "policy")[0].float()
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"avx2"}))
    cfg = SFTConfig(epochs=1, batch_size=8, lr=1e-4, warmup_ratio=0.0)
    sft.train_sft(model, tok, PROMPTS[:N], RESPONSES[:N], cfg, 128)
    sft.train_sft(copy32, tok, PROMPTS[:N], RESPONSES[:N], cfg, 128)
    assert STORED_DTYPE not in model.__dict__
    save(model, tok, tmp_path / "trained")
    assert json.loads((tmp_path / "trained" / "config.json").read_text())["dtype"] == "bfloat16"
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    trained, _ = load_policy(tmp_path / "trained")
    for (name, p), q in zip(trained.named_parameters(), copy32.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q.to(torch.bfloat16)), name


@pytest.mark.parametrize("flags", [{"avx2", "avx512_bf16"}, {"avx2"}])
def test_a_snapshot_of_half_weights_saves_in_their_dtype_as_the_trained_model_does(tok, monkeypatch, tmp_path, flags):
    """Mid-training a bfloat16 model computes over float32 weights (master weights under autocast, or upcast where
    bfloat16 is emulated); a snapshot saves them rounded to bfloat16, as the trained model is saved: same dtype, same
    bytes, embeddings still tied to the output layer (float32 would double the file)."""
    import json

    from safetensors import safe_open

    import farmflow.models.runtime as runtime
    from farmflow.models import load_policy

    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset(flags))
    cfg = SFTConfig(epochs=2, batch_size=8, lr=1e-3, warmup_ratio=0.0, snapshot_epochs=[1.0])
    model = _policy(tok).to(torch.bfloat16)
    taken = {}

    def snapshot(epochs, step, plain):
        taken.update({k: p.detach().clone() for k, p in plain.named_parameters()})
        save(plain, tok, tmp_path / "snapshot")

    sft.train_sft(model, tok, PROMPTS[:N], RESPONSES[:N], cfg, 128, snapshot=snapshot)
    save(model, tok, tmp_path / "final")
    assert {p.dtype for p in taken.values()} == {torch.float32}  # taken of float32 weights
    for name in ("snapshot", "final"):
        assert json.loads((tmp_path / name / "config.json").read_text())["dtype"] == "bfloat16"
        with safe_open(str(tmp_path / name / "model.safetensors"), "pt") as f:
            assert "lm_head.weight" not in f.keys()  # tied: stored once
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    sizes = [(tmp_path / n / "model.safetensors").stat().st_size for n in ("snapshot", "final")]
    assert sizes[0] == sizes[1]
    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"avx512_bf16"}))  # loads as stored
    snap, final = load_policy(tmp_path / "snapshot")[0], load_policy(tmp_path / "final")[0]
    assert snap.lm_head.weight.data_ptr() == snap.model.embed_tokens.weight.data_ptr()
    for name, p in snap.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, taken[name].to(torch.bfloat16)), name
    assert any(not torch.equal(p, q) for p, q in zip(snap.parameters(), final.parameters()))  # a second epoch on


def test_a_gathered_full_state_saves_in_its_dtype_and_config_json_says_so(tok, tmp_path):
    """Under FSDP/DeepSpeed `Runtime.finish` keeps the gathered state dict, cast to the stored dtype, on a model whose
    own parameters are float32 masters; the checkpoint holds that state and config.json names its dtype
    (`save_pretrained` empties the dict it is given, so the dtype is read before)."""
    import json

    from safetensors import safe_open

    from farmflow.models.runtime import FULL_STATE

    model = _policy(tok)
    model.__dict__[FULL_STATE] = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    save(model, tok, tmp_path / "gathered")
    assert json.loads((tmp_path / "gathered" / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "gathered" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


def test_a_trained_half_reward_model_is_measured_on_val_as_later_stages_score_it(tmp_path, monkeypatch):
    """The reward stage's held-out measurement after training scores the weights back in bfloat16 as a later stage
    loads them: in float32 where the CPU emulates bfloat16 (not at emulated speed, many times slower), the same scores
    as the saved checkpoint gives, which stays bfloat16."""
    import json

    import farmflow.models as models
    import farmflow.models.runtime as runtime
    from farmflow import tasks
    from farmflow.config import load_config
    from farmflow.data import prompts_of, split_rows
    from farmflow.models import load_policy, load_reward
    from farmflow.storage import open_store

    monkeypatch.setattr(runtime, "cpu_flags", lambda: frozenset({"avx2"}))
    cfg = load_config("synthetic-micro", [f"store.uri={tmp_path}"])
    uri, store = cfg.store.uri, open_store(cfg.store.uri)
    data = tasks.data_task.fn(uri, cfg.data)
    sft = tasks.sft_task.fn(uri, cfg.sft, data, tasks.base_model_task.fn(uri, cfg.model, data))
    prefs = tasks.annotate_task.fn(uri, cfg.annotation, tasks.sample_pairs_task.fn(uri, cfg.pairs, data, sft))
    policy, tok = load_policy(store.model_dir(sft))
    with store.put_model("sft", "bfloat16-copy", "policy") as (folder, _):
        save(policy.to(torch.bfloat16), tok, folder)
    half = store.get("sft", "bfloat16-copy")
    scored = []  # (parameter dtype, scores) of every score call

    def spy(model, *args, **kwargs):
        out = real_score(model, *args, **kwargs)
        scored.append((next(model.parameters()).dtype, out))
        return out

    real_score = models.score
    monkeypatch.setattr(models, "score", spy)
    assert cfg.reward.eval_every == 0  # measured once, after training
    rm = tasks.train_reward_task.fn(uri, cfg.reward, prefs, half)
    assert [dtype for dtype, _ in scored] == [torch.float32]  # both outputs of the val pairs in one call
    assert json.loads((store.model_dir(rm) / "config.json").read_text())["dtype"] == "bfloat16"
    saved, _ = load_reward(store.model_dir(rm))
    held = split_rows(store.read_table(prefs), "val")
    outputs = [r["output_1"] for r in held] + [r["output_2"] for r in held]
    assert torch.equal(scored[0][1], real_score(saved, tok, prompts_of(held) * 2, outputs))


def test_runtime_on_cpu_splits_nothing_and_needs_no_gpu(tok):
    rt = Runtime(_policy(tok), batch_size=10, micro_batch_size=4, name="t")
    assert (rt.device.type, rt.precision, rt.processes, rt.accumulation) == ("cpu", "no", 1, 3)
    assert rt.micro_batches() == [slice(0, 4), slice(4, 8), slice(8, 10)]
    assert Runtime(_policy(tok), batch_size=10, name="t").micro_batches() == [slice(0, 10)]
    assert Runtime(_policy(tok), batch_size=3, micro_batch_size=8, name="t").micro_batches() == [slice(0, 3)]


def test_micro_batch_size_is_operational():
    """Memory only: not part of any stage key (the sft, reward and dpo sections)."""
    for section in (SFTConfig, RewardConfig, DPOConfig):
        assert key_config(section(micro_batch_size=2)) == key_config(section())
        assert "micro_batch_size" not in key_config(section())
    assert key_config(SFTConfig(batch_size=64)) != key_config(SFTConfig())


def test_unwrap_keeps_autocast_on_the_model_being_trained(tok):
    """Unwrapping a prepared model keeps its autocast forward: the training loops unwrap right after `prepare`
    (checkpoint state, rollouts).

    With one process the prepared model IS the module, and unwrapping with
    keep_fp32_wrapper=False would strip accelerate's autocast forward in place, so mixed-precision
    training would silently go on in float32. CPU bf16 autocast stands in for the GPU here.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    model = _policy(tok)
    rt = Runtime(model, batch_size=8)
    AcceleratorState._reset_state()
    try:
        rt.precision, rt.accelerator = "bf16", Accelerator(mixed_precision="bf16", cpu=True)
        (prepared,) = rt.prepare(model)
        seen = []
        hook = prepared.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        ids, mask, _ = encode_examples(tok, PROMPTS[:2], RESPONSES[:2], 128)
        rt.unwrap(prepared)
        prepared(input_ids=ids, attention_mask=mask)
        assert seen == [torch.bfloat16]  # float32 if unwrap dropped the autocast forward
        assert next(prepared.parameters()).dtype == torch.float32  # float32 master weights
        hook.remove()
    finally:
        AcceleratorState._reset_state()

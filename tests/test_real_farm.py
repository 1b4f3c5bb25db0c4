"""The real farm: a pretrained model by path, and a micro run on real Alpaca data through the loopback judge."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from farmflow.config import ModelConfig
from farmflow.models import encode_examples, load_policy, load_pretrained, random_llama, sample, train_tokenizer
from farmflow.models.runtime import stored_dtype
from farmflow.storage import open_store

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
ALPACA, EVAL = DATA / "alpaca_en_demo.json", DATA / "alpaca_eval_davinci003_outputs.json"


def tiny_llama_without_pad(folder: Path) -> Path:
    """A random tiny Llama and a BPE tokenizer with BOS/EOS but no pad token, saved like any hub model."""
    tokenizer = train_tokenizer(["Write a response that appropriately completes the request."] * 4, 300, pad=False)
    random_llama(tokenizer, max_positions=512).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_pretrained_by_path_adds_pad_and_keeps_working(tmp_path):
    path = tiny_llama_without_pad(tmp_path / "hub-model")
    before = LlamaForCausalLM.from_pretrained(path).get_input_embeddings().weight.detach().clone()
    cfg = ModelConfig(pretrained=str(path), dtype="bfloat16", max_seq_len=96, gradient_checkpointing=True)
    model, tokenizer = load_pretrained(cfg)
    assert tokenizer.pad_token == "<pad>" and tokenizer.pad_token_id == before.shape[0]  # one new row
    emb = model.get_input_embeddings().weight
    assert emb.shape[0] == before.shape[0] + 1 and emb.dtype == torch.bfloat16
    assert torch.allclose(
        emb[-1].float(), before.mean(0).to(torch.bfloat16).float(), atol=1e-2
    )  # the new row is the mean
    assert model.config.max_position_embeddings == 96 and model.config.pad_token_id == tokenizer.pad_token_id
    assert model.config._attn_implementation == "sdpa"
    ids, mask, labels = encode_examples(tokenizer, ["Write a"], ["response that"], 96)
    assert ids[0, 0] == tokenizer.bos_token_id and ids[0, int(mask.sum()) - 1] == tokenizer.eos_token_id
    model.save_pretrained(tmp_path / "saved")
    tokenizer.save_pretrained(tmp_path / "saved")
    again, tok2 = load_policy(tmp_path / "saved")  # what every later stage does
    assert (
        stored_dtype(again) == torch.bfloat16  # computed in float32 where the CPU emulates bfloat16
        and again.is_activation_checkpointing
        and tok2.pad_token_id == tokenizer.pad_token_id
    )
    out = sample(again.float(), tok2, ["Write a", "Write a response that appropriately"], n=2, max_new_tokens=5, seed=0)
    assert len(out) == 2 and all(len(o) == 2 for o in out)


def test_the_chosen_attention_kernel_survives_every_later_load(tmp_path):
    """model.attn_implementation holds for every later load (SFT, the reward and value models), not only the
    base-model stage's own: config.json does not keep the kernel, so farmflow records it as
    farmflow_attn_implementation."""
    from farmflow.models import load_reward, reward_from_policy, save, value_from_reward

    path = tiny_llama_without_pad(tmp_path / "hub-model")
    model, tokenizer = load_pretrained(ModelConfig(pretrained=str(path), attn_implementation="eager", max_seq_len=96))
    assert model.config._attn_implementation == "eager"
    save(model, tokenizer, tmp_path / "base")
    assert load_policy(tmp_path / "base")[0].config._attn_implementation == "eager"
    rm = reward_from_policy(tmp_path / "base")
    assert rm.config._attn_implementation == "eager"
    save(rm, tokenizer, tmp_path / "rm")
    assert load_reward(tmp_path / "rm")[0].config._attn_implementation == "eager"
    assert value_from_reward(tmp_path / "rm").backbone.config._attn_implementation == "eager"
    default, tok = load_pretrained(ModelConfig(pretrained=str(path), max_seq_len=96))
    save(default, tok, tmp_path / "default")
    assert load_policy(tmp_path / "default")[0].config._attn_implementation == "sdpa"


def test_a_pad_token_that_is_also_eos_gets_a_token_of_its_own(tmp_path):
    """A tokenizer with pad == EOS (Qwen2.5, SmolLM2-Instruct) gets its own pad token: sampling drops padding, and
    with pad == EOS it would drop every EOS, so every PPO/Quark response would get the no-EOS penalty."""
    from transformers import AutoTokenizer

    path = tiny_llama_without_pad(tmp_path / "hub-model")
    tok = AutoTokenizer.from_pretrained(path)
    tok.pad_token = tok.eos_token
    tok.save_pretrained(path)
    model, tokenizer = load_pretrained(ModelConfig(pretrained=str(path), max_seq_len=96))
    assert tokenizer.pad_token == "<pad>" and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert (
        model.get_input_embeddings().weight.shape[0] == len(tokenizer)
        and model.config.pad_token_id == tokenizer.pad_token_id
    )
    from farmflow.models import sample_ids

    eos = tokenizer.eos_token_id
    model.lm_head.register_forward_hook(
        lambda m, i, out: out.index_fill(-1, torch.tensor([eos]), 100.0)
    )  # EOS every time
    out = sample_ids(model, tokenizer, ["Write a"], n=2, max_new_tokens=4, seed=0)
    assert out[0] == [[eos], [eos]]  # kept: sampling drops only padding


def test_base_model_task_dispatches_on_pretrained(tmp_path):
    from farmflow.config import DataConfig
    from farmflow.tasks import base_model_task, data_task

    path = tiny_llama_without_pad(tmp_path / "hub-model")
    store = str(tmp_path / "store")
    data = data_task.fn(store, DataConfig(sft_size=8, pref_size=8, unlabeled_size=0, val_size=2, eval_size=2))
    ref = base_model_task.fn(store, ModelConfig(pretrained=str(path), max_seq_len=128), data)
    model, tokenizer = load_policy(open_store(store).model_dir(ref))
    assert (
        model.config.hidden_size == 32
        and tokenizer.pad_token == "<pad>"
        and ref.metrics["parameters"] == sum(p.numel() for p in model.parameters())
    )
    scratch = base_model_task.fn(
        store, ModelConfig(hidden_size=16, num_heads=2, num_layers=1, intermediate_size=32, vocab_size=300), data
    )
    assert scratch.key != ref.key and load_policy(open_store(store).model_dir(scratch))[0].config.hidden_size == 16

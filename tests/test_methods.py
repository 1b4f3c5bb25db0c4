"""FeedME, reward conditioning, DPO and expert iteration: data handling, training signals, resume."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch
from procs import python_env, run_and_kill_when
from test_models import CFG, PROMPTS, RESPONSES

from farmflow.config import DPOConfig, RewardConditioningConfig, SFTConfig
from farmflow.methods import dpo, feedme, reward_conditioning
from farmflow.methods.sft import train_sft
from farmflow.models import build_policy, encode_examples, load_policy, save, train_tokenizer
from farmflow.models.checkpoint import Checkpointer, load_state, save_state
from farmflow.storage import LocalStore


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(PROMPTS + RESPONSES + ["yes yes yes", "no no no"], vocab_size=384)


def _model(tok, seed=0):
    torch.manual_seed(seed)
    return build_policy(CFG.model_copy(update={"seed": seed}), tok)


def _rows(prefs):
    return [
        {
            "id": f"p{i}",
            "instruction": f"Say something {i}.",
            "input": "",
            "output_1": f"first {i}",
            "output_2": f"second {i}",
            "preference": p,
        }
        for i, p in enumerate(prefs)
    ]


# ------------------------------------------------------------------------- FeedME
def test_feedme_keeps_the_preferred_output_and_skips_ties():
    prompts, chosen = feedme.chosen_examples(_rows([1.0, 2.0, 1.5, 1.8, 1.2]))
    assert chosen == ["first 0", "second 1", "second 3", "first 4"]
    assert len(prompts) == 4 and "Say something 3." in prompts[2]


def test_feedme_with_only_ties_is_a_clear_error(tok):
    with pytest.raises(ValueError, match="no pair"):
        feedme.train_feedme(_model(tok), tok, _rows([1.5, 1.5]), SFTConfig(epochs=1, batch_size=2), 64)


# ------------------------------------------------------------ reward conditioning
def test_reward_conditioning_doubles_the_pairs_with_control_tokens():
    prompts, responses = reward_conditioning.conditioned_examples(_rows([2.0, 1.0, 1.5]), "<|good|>", "<|bad|>")
    assert responses == ["second 0", "first 0", "first 1", "second 1"]
    assert [p.endswith(t) for p, t in zip(prompts, ["<|good|>", "<|bad|>"] * 2)] == [True] * 4
    assert prompts[0].removesuffix("<|good|>") == prompts[1].removesuffix("<|bad|>")


def test_control_tokens_start_at_the_mean_embedding_and_survive_save_load(tok, tmp_path):
    model, tokenizer = _model(tok), _fresh_tokenizer(tok)
    old_vocab = len(tokenizer)
    mean_in = model.get_input_embeddings().weight.detach().mean(0).clone()
    ids = reward_conditioning.add_control_tokens(model, tokenizer, ["<|good|>", "<|bad|>"])
    assert ids == [old_vocab, old_vocab + 1] and len(tokenizer) == old_vocab + 2
    emb = model.get_input_embeddings().weight.detach()
    assert emb.shape[0] == old_vocab + 2
    assert torch.allclose(emb[old_vocab], mean_in, atol=1e-6) and torch.allclose(emb[old_vocab + 1], mean_in, atol=1e-6)
    assert model.get_output_embeddings().weight.shape[0] == old_vocab + 2

    save(model, tokenizer, tmp_path / "rc")
    loaded, loaded_tok = load_policy(tmp_path / "rc")
    for text, token in (("What is 2 + 2?<|good|>", "<|good|>"), ("Hi<|bad|>", "<|bad|>")):
        pieces = loaded_tok(text, add_special_tokens=False)["input_ids"]
        assert pieces[-1] == loaded_tok.convert_tokens_to_ids(token) == tokenizer.convert_tokens_to_ids(token)
    assert torch.equal(loaded.get_input_embeddings().weight, model.get_input_embeddings().weight)
    # adding them again is a no-op: same ids, no resize
    assert reward_conditioning.add_control_tokens(loaded, loaded_tok, ["<|good|>", "<|bad|>"]) == ids
    assert len(loaded_tok) == old_vocab + 2


def _fresh_tokenizer(tok):
    """A fresh copy of the module tokenizer (add_special_tokens mutates it)."""
    import copy

    return copy.deepcopy(tok)


def test_reward_conditioning_config_rejects_equal_tokens():
    with pytest.raises(ValueError, match="must differ"):
        RewardConditioningConfig(good_token="<x>", bad_token="<x>")


# --------------------------------------------------------------------------- DPO
def test_sequence_logps_sums_response_token_logprobs(tok):
    model = _model(tok).eval()
    prompts, responses = [PROMPTS[0], PROMPTS[1]], [RESPONSES[0], "x"]
    got = dpo.sequence_logps(model, tok, prompts, responses, 128)
    mean = dpo.sequence_logps(
        model, tok, prompts, responses, 128, average=True
    )  # per token (the reward report's baseline)
    for i in range(2):
        ids, mask, labels = encode_examples(tok, prompts[i : i + 1], responses[i : i + 1], 128)
        logp = model(input_ids=ids, attention_mask=mask).logits[0].log_softmax(-1)
        terms = [logp[t - 1, labels[0, t]].item() for t in range(1, ids.shape[1]) if labels[0, t] != -100]
        assert got[i].item() == pytest.approx(sum(terms), abs=1e-4)
        assert mean[i].item() == pytest.approx(sum(terms) / len(terms), abs=1e-5)
    assert (
        len(tok("x")["input_ids"]) + 1 < len(tok(RESPONSES[0])["input_ids"]) + 1
    )  # the two rows average over different counts


def test_dpo_raises_implicit_reward_accuracy_on_its_training_pairs(tok):
    """Chosen outputs share a style ("yes ..."), rejected ones another ("no ..."): DPO must learn to rank them."""
    model = _model(tok, seed=1)
    prompts = PROMPTS[:32]
    out_1 = [("yes yes yes " if i % 2 else "no no no ") + RESPONSES[i] for i in range(32)]
    out_2 = [("no no no " if i % 2 else "yes yes yes ") + RESPONSES[i] for i in range(32)]
    prefs = [1.0 if i % 2 else 2.0 for i in range(32)]  # "yes" always preferred
    ref_1, ref_2 = dpo.reference_logps(model, tok, prompts, out_1, out_2, 128, batch_size=16)
    metrics = dpo.train_dpo(
        model,
        tok,
        prompts,
        out_1,
        out_2,
        prefs,
        ref_1,
        ref_2,
        DPOConfig(epochs=6, batch_size=8, lr=3e-3, warmup_ratio=0.0),
        128,
    )
    assert metrics["implicit_reward_accuracy_first"] < 0.75
    assert metrics["implicit_reward_accuracy_last"] == 1.0
    assert metrics["train_loss_first"] == pytest.approx(math.log(2), abs=0.05)  # pi = pi_ref at the start
    assert metrics["train_loss_last"] < 0.5
    with torch.no_grad():
        new_1 = dpo.sequence_logps(model.eval(), tok, prompts, out_1, 128)
        new_2 = dpo.sequence_logps(model, tok, prompts, out_2, 128)
    margin = (new_2 - torch.tensor(ref_2)) - (new_1 - torch.tensor(ref_1))  # implicit reward of output_2 minus output_1
    assert all((m > 0) == (p > 1.5) for m, p in zip(margin.tolist(), prefs))


# -------------------------------------------------------------- checkpoint/resume
def test_training_state_round_trip_restores_model_optimizer_schedule(tok, tmp_path):
    from farmflow.models import optimizer_and_schedule

    model = _model(tok)
    opt, sched = optimizer_and_schedule(model, 1e-3, 0.0, 10, 0.1)
    ids, mask, labels = encode_examples(tok, PROMPTS[:4], RESPONSES[:4], 128)
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    opt.step()
    sched.step()
    gen = torch.Generator().manual_seed(7)
    save_state(
        tmp_path,
        step=1,
        modules={"m": model},
        optimizers={"o": opt},
        schedulers={"s": sched},
        generators={"g": gen},
        extra={"x": [1, 2]},
    )
    assert not list(tmp_path.glob("*.pt")) and not list(tmp_path.glob("*.pkl"))

    other = _model(tok, seed=5)
    opt2, sched2 = optimizer_and_schedule(other, 1e-3, 0.0, 10, 0.1)
    gen2 = torch.Generator().manual_seed(0)
    step, extra = load_state(
        tmp_path, modules={"m": other}, optimizers={"o": opt2}, schedulers={"s": sched2}, generators={"g": gen2}
    )
    assert (step, extra) == (1, {"x": [1, 2]})
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    for k in s1["state"]:
        for slot in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1["state"][k][slot], s2["state"][k][slot])
    assert sched2.last_epoch == sched.last_epoch and sched2.get_last_lr() == sched.get_last_lr()
    assert torch.equal(gen.get_state(), gen2.get_state())


def test_interrupted_sft_resumes_to_the_same_weights(tok, tmp_path):
    """6 steps straight == 4 steps, a crash, then a resumed run (checkpoint every 2 steps)."""
    cfg = SFTConfig(epochs=2, batch_size=8, lr=1e-3, warmup_ratio=0.2)
    prompts, responses = PROMPTS[:24], RESPONSES[:24]
    straight = _model(tok)
    m_straight = train_sft(straight, tok, prompts, responses, cfg, 128)

    store = LocalStore(tmp_path)
    crashing = _model(tok)

    class Crash(Exception):
        pass

    class CrashAfter(Checkpointer):
        def save(self, step, **kw):
            saved = super().save(step, **kw)
            if step == 4:
                raise Crash
            return saved

    with pytest.raises(Crash):
        train_sft(crashing, tok, prompts, responses, cfg, 128, CrashAfter(store, "sft", "k", every_steps=2))
    assert store.latest_checkpoint("sft", "k")[0] == 4
    resumed = _model(tok)  # a fresh process would start from the initial weights
    ckpt = Checkpointer(store, "sft", "k", every_steps=2)
    m_resumed = train_sft(resumed, tok, prompts, responses, cfg, 128, ckpt)
    assert m_resumed["resumed_from_step"] == 4 and m_resumed["steps"] == m_straight["steps"] == 6
    assert m_resumed["train_loss_first"] == m_straight["train_loss_first"]
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    ckpt.clear()
    assert store.latest_checkpoint("sft", "k") is None


def test_a_switched_off_checkpointer_neither_saves_nor_restores(tmp_path):
    # what `Runtime.checkpointer` hands a loop under FSDP/DeepSpeed: same stage and key, nothing written or read
    store, module = LocalStore(tmp_path), torch.nn.Linear(2, 2)
    on = Checkpointer(store, "sft", "k", every_steps=1)
    assert on.save(1, modules={"m": module}) and store.latest_checkpoint("sft", "k")[0] == 1
    off = on.switched_off()
    assert (off.stage, off.key, off.enabled) == ("sft", "k", False)
    assert not off.save(2, force=True, modules={"m": module})
    assert off.restore(modules={"m": module}) == (0, {}) and store.latest_checkpoint("sft", "k")[0] == 1
    assert on.restore(modules={"m": module})[0] == 1


RESUME_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from farmflow.config import DPOConfig
    from farmflow.methods import dpo
    from farmflow.models import load_policy
    from farmflow.models.checkpoint import Checkpointer
    from farmflow.storage import LocalStore
    store_root, model_dir, data = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3]))
    model, tok = load_policy(model_dir)
    ckpt = Checkpointer(LocalStore(store_root), "dpo", "resume-test", every_steps=1)
    cfg = DPOConfig(epochs=40, batch_size=4, lr=1e-3)
    m = dpo.train_dpo(
        model, tok, data["prompts"], data["out_1"], data["out_2"], data["prefs"], data["ref_1"], data["ref_2"],
        cfg, 128, ckpt,
    )
    print(json.dumps(m))
""")


def test_dpo_resumes_after_sigkill(tok, tmp_path):
    import json

    model = _model(tok)
    save(model, tok, tmp_path / "sft")
    prompts, out_1, out_2 = PROMPTS[:8], RESPONSES[:8], RESPONSES[8:16]
    ref_1, ref_2 = dpo.reference_logps(model, tok, prompts, out_1, out_2, 128)
    (tmp_path / "data.json").write_text(
        json.dumps(
            {
                "prompts": prompts,
                "out_1": out_1,
                "out_2": out_2,
                "prefs": [1.0, 2.0] * 4,
                "ref_1": ref_1,
                "ref_2": ref_2,
            }
        )
    )
    args = [RESUME_SCRIPT, str(tmp_path / "store"), str(tmp_path / "sft"), str(tmp_path / "data.json")]
    store = LocalStore(tmp_path / "store")
    run_and_kill_when(
        args, lambda: (store.latest_checkpoint("dpo", "resume-test") or (0,))[0] >= 5, "DPO's 5th checkpoint"
    )
    killed_at = store.latest_checkpoint("dpo", "resume-test")[0]
    assert 5 <= killed_at < 80
    out = subprocess.run(
        [sys.executable, "-c", *args], env=python_env(), capture_output=True, text=True, timeout=300, check=True
    )
    metrics = json.loads(out.stdout.strip().splitlines()[-1])
    assert metrics["steps"] == 80  # 40 epochs x 2 batches: the same count as an uninterrupted run
    assert metrics["resumed_from_step"] >= killed_at
    assert math.isfinite(metrics["train_loss_last"])

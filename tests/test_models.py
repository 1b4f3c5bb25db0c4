"""farmflow.models: tokenizer, encoding, sampling with a KV cache, reward scores, schedule."""

import math
import random

import pytest
import torch

from farmflow.config import ModelConfig
from farmflow.data.prompts import format_prompt
from farmflow.data.synthetic import correct_output, sample_task
from farmflow.models import (
    BOS,
    EOS,
    IGNORE,
    PAD,
    batch_order,
    build_policy,
    encode_examples,
    load_policy,
    optimizer_and_schedule,
    pack_examples,
    reward_from_policy,
    sample,
    sample_ids,
    sample_seed,
    sample_uniforms,
    save,
    score,
    tokenize_examples,
    train_tokenizer,
)

FAMILIES = ("arithmetic", "sort", "reverse", "list_items", "max_number")
CFG = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=384, max_seq_len=128)


def _texts(n=300, seed=0):
    rng = random.Random(seed)
    tasks = [sample_task(FAMILIES[i % len(FAMILIES)], rng) for i in range(n)]
    return [format_prompt(t.instruction, t.input) for t in tasks], [correct_output(t) for t in tasks]


PROMPTS, RESPONSES = _texts()


def plain_sft(model, tok, cfg, n: int, device: str = "cpu") -> list[float]:
    """farmflow's SFT loop written out in plain PyTorch (zero_grad, backward, clip 1.0, AdamW, schedule) on the
    first `n` examples: what the runtime must reduce to. Returns each step's loss."""
    from farmflow.methods.sft import sft_loss

    steps = max(1, round(cfg.epochs * math.ceil(n / cfg.batch_size)))
    opt, sched = optimizer_and_schedule(model, cfg.lr, cfg.weight_decay, steps, cfg.warmup_ratio)
    losses = []
    for idx in batch_order(n, cfg.batch_size, steps, cfg.seed):
        ids, mask, labels = (
            t.to(device) for t in encode_examples(tok, [PROMPTS[i] for i in idx], [RESPONSES[i] for i in idx], 128)
        )
        loss = sft_loss(model(input_ids=ids, attention_mask=mask).logits, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(PROMPTS + RESPONSES, vocab_size=384)


@pytest.fixture(scope="module")
def policy(tok):
    """A random tiny Llama with large weights (std 0.3), so greedy decoding has clear margins and
    depends on the whole context; the </s> row is scaled so some continuations stop early."""
    model = build_policy(CFG, tok)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        model.get_output_embeddings().weight[tok.eos_token_id] *= 2.0
    model.eval()
    return model


# Prompts of very different lengths, deliberately not sorted by length. Picked so that the
# greedy continuations of `policy` all differ, some stop early and one runs to MAX_NEW
# (test_greedy_reference_is_well_conditioned); re-pick when the farm's text changes.
SAMPLE_PROMPTS = [PROMPTS[3], "Hi", PROMPTS[0], PROMPTS[1], "What is 2 + 2?", PROMPTS[12]]
MAX_NEW = 16


def greedy_by_hand(model, tok, prompt, max_new_tokens=MAX_NEW):
    """Argmax decoding with full forward passes, no cache, no padding; also the smallest top-2 margin."""
    ids = torch.tensor([[tok.bos_token_id] + tok(prompt, add_special_tokens=False)["input_ids"]])
    gen, margin = [], math.inf
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=ids).logits[0, -1]
            top = logits.topk(2).values
            margin = min(margin, float(top[0] - top[1]))
            nxt = int(logits.argmax())
            gen.append(nxt)
            if nxt == tok.eos_token_id:
                break
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    stopped = tok.eos_token_id in gen
    if stopped:
        gen = gen[: gen.index(tok.eos_token_id)]
    return tok.decode(gen, skip_special_tokens=True).strip(), len(gen), stopped, margin


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip(tok):
    prompt = format_prompt("Sort the following numbers in ascending order.", "12, 85, 3")
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == prompt
    # BPE merges were learned: far fewer tokens than bytes
    assert len(ids) < len(prompt.encode()) / 2
    # any byte sequence round-trips (byte-level), even text unseen in training
    odd = "Zebra ✓ 9999 — ünïcode\n\t!"
    assert tok.decode(tok(odd, add_special_tokens=False)["input_ids"]) == odd


def test_tokenizer_special_tokens(tok):
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == (PAD, BOS, EOS)
    ids = (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)
    assert len(set(ids)) == 3
    assert ids == (0, 1, 2)
    assert len(tok) == 384
    # special tokens are single tokens, never produced from ordinary text
    assert tok("<s>", add_special_tokens=False)["input_ids"] == [tok.bos_token_id]
    assert not set(ids) & set(tok(PROMPTS[0], add_special_tokens=False)["input_ids"])


def test_tokenizer_is_deterministic(tok):
    again = train_tokenizer(PROMPTS + RESPONSES, vocab_size=384)
    assert again.get_vocab() == tok.get_vocab()


# ----------------------------------------------------------------------------- encoding


def test_encode_examples_masks_prompt_and_padding(tok):
    prompts, responses = ["What is 2 + 2?", "List 3 colors."], ["4", "red, blue, green"]
    ids, mask, labels = encode_examples(tok, prompts, responses, max_len=128)

    def enc(s):
        return tok(s, add_special_tokens=False)["input_ids"]

    bos, eos, pad = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    rows = [[bos] + enc(p) + enc(r) + [eos] for p, r in zip(prompts, responses)]
    width = max(map(len, rows))
    assert ids.shape == mask.shape == labels.shape == (2, width)
    assert ids.dtype == mask.dtype == labels.dtype == torch.long
    for i, (p, r) in enumerate(zip(prompts, responses)):
        n_prompt, n_resp = 1 + len(enc(p)), len(enc(r)) + 1
        n_pad = width - n_prompt - n_resp
        assert ids[i].tolist() == rows[i] + [pad] * n_pad
        assert mask[i].tolist() == [1] * (n_prompt + n_resp) + [0] * n_pad
        # -100 on <s> + prompt and on padding; the response and the closing </s> are labels
        assert labels[i].tolist() == [IGNORE] * n_prompt + enc(r) + [eos] + [IGNORE] * n_pad
    assert (mask == 0).sum() > 0  # one row is padded


def test_a_dataset_tokenized_once_packs_every_batch_as_encoding_it_would(tok):
    """SFT and the reward model tokenize their data once and pack batches from the ids."""
    p_ids, r_ids = tokenize_examples(tok, PROMPTS, RESPONSES)
    for rows in ([0, 1, 2], [17, 5, 250, 3], list(range(40, 72))):
        packed = pack_examples(tok, [p_ids[i] for i in rows], [r_ids[i] for i in rows], 128)
        encoded = encode_examples(tok, [PROMPTS[i] for i in rows], [RESPONSES[i] for i in rows], 128)
        assert all(torch.equal(a, b) for a, b in zip(packed, encoded))


def test_encode_examples_exact_small_example(tok):
    # single ASCII letters are single byte-level tokens, and "QZ" never occurs in training
    q, z, j = (tok.convert_tokens_to_ids(c) for c in "QZJ")
    assert tok("QZ", add_special_tokens=False)["input_ids"] == [q, z]
    ids, mask, labels = encode_examples(tok, ["QZ", "Q"], ["J", "J"], max_len=64)
    bos, eos, pad = 1, 2, 0
    assert ids.tolist() == [[bos, q, z, j, eos], [bos, q, j, eos, pad]]
    assert mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert labels.tolist() == [[IGNORE, IGNORE, IGNORE, j, eos], [IGNORE, IGNORE, j, eos, IGNORE]]


def test_encode_examples_truncates_the_response_end(tok):
    def enc(s):
        return tok(s, add_special_tokens=False)["input_ids"]

    prompt, response = "What is 37 + 48?", "The answer is 37 + 48 = 85. " * 8
    n_prompt = 1 + len(enc(prompt))
    max_len = 4 * n_prompt  # a quarter of max_len fits the response, so the whole prompt is kept
    kept = max_len - n_prompt
    ids, mask, labels = encode_examples(tok, [prompt], [response], max_len=max_len)
    assert ids.shape == (1, max_len)
    assert ids[0].tolist() == [tok.bos_token_id] + enc(prompt) + enc(response)[:kept]
    assert labels[0].tolist() == [IGNORE] * n_prompt + enc(response)[:kept]  # no </s>: it was cut
    assert mask[0].tolist() == [1] * max_len


# ----------------------------------------------------------------------------- sampling


def test_sample_shape_and_determinism(policy, tok):
    prompts = SAMPLE_PROMPTS[:3]
    out = sample(policy, tok, prompts, n=3, temperature=1.0, max_new_tokens=8, seed=0)
    assert len(out) == 3 and all(len(o) == 3 and all(isinstance(s, str) for s in o) for o in out)
    # the 3 samples of a prompt differ at temperature 1 from a near-uniform random model
    assert all(len(set(o)) > 1 for o in out)
    assert sample(policy, tok, prompts, n=3, temperature=1.0, max_new_tokens=8, seed=0) == out
    other = sample(policy, tok, prompts, n=3, temperature=1.0, max_new_tokens=8, seed=1)
    assert other != out
    assert all(len(o) == 3 for o in other)
    single = sample(policy, tok, prompts, temperature=1.0, max_new_tokens=8, seed=0)
    assert [len(o) for o in single] == [1, 1, 1]


def test_samples_nest_across_n_and_ignore_batching(policy, tok):
    """Sample j of prompt i has its own random stream: best-of-2's candidates are the first two of best-of-4's,
    whatever the batch size or the other prompts of the call."""
    four = sample_ids(policy, tok, SAMPLE_PROMPTS, n=4, temperature=1.0, max_new_tokens=MAX_NEW, batch_size=64, seed=11)
    two = sample_ids(policy, tok, SAMPLE_PROMPTS, n=2, temperature=1.0, max_new_tokens=MAX_NEW, batch_size=2, seed=11)
    assert [per[:2] for per in four] == two
    assert (
        sample_ids(policy, tok, SAMPLE_PROMPTS, n=4, temperature=1.0, max_new_tokens=MAX_NEW, batch_size=1, seed=11)
        == four
    )
    assert len({tuple(s) for per in four for s in per}) > len(SAMPLE_PROMPTS)  # the candidates of a prompt do differ
    # a prompt's samples depend on its index in the call, not on its neighbours
    alone = sample_ids(policy, tok, SAMPLE_PROMPTS[:1], n=4, temperature=1.0, max_new_tokens=MAX_NEW, seed=11)
    assert alone == four[:1]


def test_sample_seed_and_uniforms():
    assert sample_seed(0, 1, 2) == 8709407026249609678 < 2**63  # a blake2b hash: the same in every process and backend
    assert len({sample_seed(s, i, j) for s in range(3) for i in range(3) for j in range(3)}) == 27
    u = sample_uniforms(5, [2, 0], 3, 7)
    assert u.shape == (6, 7) and u.dtype == torch.float64 and float(u.min()) >= 0 and float(u.max()) < 1
    assert torch.equal(u[3:], sample_uniforms(5, [0], 3, 7))  # rows follow (prompt, sample), not the batch
    assert torch.equal(u[1], sample_uniforms(5, [2], 2, 7)[1])


def test_inverse_cdf_sampling_follows_temperature_and_top_p():
    from farmflow.models import sample_next

    logits = torch.log(torch.tensor([[0.5, 0.0, 0.3, 0.2]])).expand(4000, 4)  # token 1 has probability 0
    u = (torch.arange(4000, dtype=torch.float64) + 0.5) / 4000  # a stratified grid of uniforms
    counts = torch.bincount(sample_next(logits, 1.0, 1.0, u), minlength=4) / 4000
    assert torch.allclose(counts, torch.tensor([0.5, 0.0, 0.3, 0.2]), atol=1e-3)
    # temperature 0.5 squares the probabilities before renormalizing: 25 : 9 : 4
    counts = torch.bincount(sample_next(logits, 0.5, 1.0, u), minlength=4) / 4000
    assert torch.allclose(counts, torch.tensor([25, 0, 9, 4]) / 38, atol=1e-3)
    # top_p 0.6 keeps the smallest set reaching 0.6 (0.5 and 0.3), renormalized
    counts = torch.bincount(sample_next(logits, 1.0, 0.6, u), minlength=4) / 4000
    assert torch.allclose(counts, torch.tensor([0.625, 0.0, 0.375, 0.0]), atol=1e-3)
    edges = sample_next(logits[:2], 1.0, 1.0, torch.tensor([0.0, 1.0 - 1e-12], dtype=torch.float64))
    assert edges.tolist() == [0, 3]  # u = 0 is the first kept token, u -> 1 the last
    with pytest.raises(ValueError, match="non-finite logits"):  # a broken model is an error, not a silent last token
        sample_next(torch.tensor([[0.0, float("nan")]]), 1.0, 1.0, torch.tensor([0.5], dtype=torch.float64))


def test_sample_reports_progress(policy, tok):
    done = []
    sample(policy, tok, SAMPLE_PROMPTS, max_new_tokens=2, batch_size=4, progress=done.append)
    assert done == [4, 2]


def test_greedy_reference_is_well_conditioned(policy, tok):
    refs = [greedy_by_hand(policy, tok, p) for p in SAMPLE_PROMPTS]
    # margins far above float noise (~1e-6): at temperature 1e-4 a margin of 1e-3 is a logit gap
    # of 10, so sampling is effectively greedy
    assert min(r[3] for r in refs) > 1e-3
    # the continuations differ, some stop on </s> early and some run to max_new_tokens
    assert len({r[0] for r in refs}) == len(refs)
    assert any(r[2] and r[1] < MAX_NEW // 2 for r in refs)
    assert any(not r[2] for r in refs)


@pytest.mark.parametrize("batch_size", [64, 4, 1])
def test_kv_cache_sampling_matches_full_forward_greedy(policy, tok, batch_size):
    expected = [greedy_by_hand(policy, tok, p)[0] for p in SAMPLE_PROMPTS]
    batched = sample(
        policy, tok, SAMPLE_PROMPTS, temperature=1e-4, max_new_tokens=MAX_NEW, batch_size=batch_size, seed=3
    )
    assert [o[0] for o in batched] == expected
    alone = [sample(policy, tok, [p], temperature=1e-4, max_new_tokens=MAX_NEW, seed=5)[0][0] for p in SAMPLE_PROMPTS]
    assert alone == expected


def _sample_without_dropping_rows(model, tok, prompts, n, temperature, max_new_tokens, seed):
    """The sampler before finished rows left the batch: every row runs to the batch's longest response."""
    from farmflow.models import left_pad, sample_next, sample_uniforms

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    uniforms = sample_uniforms(seed, order, n, max_new_tokens)
    ids, mask = left_pad(tok, [prompts[i] for i in order], 10_000)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    cache, logits = out.past_key_values, out.logits[:, -1]
    cache.batch_repeat_interleave(n)
    mask, logits, nxt_pos = (
        mask.repeat_interleave(n, 0),
        logits.repeat_interleave(n, 0),
        pos[:, -1].repeat_interleave(n, 0) + 1,
    )
    done, tokens = torch.zeros(len(mask), dtype=torch.bool), []
    for step in range(max_new_tokens):
        nxt = torch.where(
            done, torch.full((len(mask),), tok.pad_token_id), sample_next(logits, temperature, 1.0, uniforms[:, step])
        )
        tokens.append(nxt)
        done |= nxt == tok.eos_token_id
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones(len(mask), 1, dtype=mask.dtype)], dim=1)
        out = model(
            input_ids=nxt[:, None],
            attention_mask=mask,
            position_ids=nxt_pos[:, None],
            past_key_values=cache,
            use_cache=True,
        )
        cache, logits, nxt_pos = out.past_key_values, out.logits[:, -1], nxt_pos + 1
    rows = torch.stack(tokens, 1).tolist()
    result = [[] for _ in prompts]
    for r, row in enumerate(rows):
        row = row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row
        result[order[r // n]].append([t for t in row if t != tok.pad_token_id])
    return result


@torch.no_grad()
def test_dropping_finished_rows_keeps_every_sample(policy, tok):
    """Finished rows leave the batch (speed); the samples are the ones the full batch draws, token for token."""
    expected = _sample_without_dropping_rows(policy, tok, SAMPLE_PROMPTS, 4, 1.0, MAX_NEW, seed=7)
    lengths = [len(s) for per in expected for s in per]
    assert min(lengths) < MAX_NEW // 2 and max(lengths) == MAX_NEW  # rows do finish early, others run to the end
    assert (
        sample_ids(policy, tok, SAMPLE_PROMPTS, n=4, temperature=1.0, max_new_tokens=MAX_NEW, batch_size=64, seed=7)
        == expected
    )


def test_kv_cache_repeat_for_n_samples(policy, tok):
    expected = [greedy_by_hand(policy, tok, p)[0] for p in SAMPLE_PROMPTS]
    out = sample(policy, tok, SAMPLE_PROMPTS, n=3, temperature=1e-4, max_new_tokens=MAX_NEW, seed=0)
    assert out == [[e] * 3 for e in expected]


def test_tiny_top_p_is_greedy_at_temperature_one(policy, tok):
    expected = [greedy_by_hand(policy, tok, p)[0] for p in SAMPLE_PROMPTS]
    out = sample(policy, tok, SAMPLE_PROMPTS, n=2, temperature=1.0, top_p=1e-6, max_new_tokens=MAX_NEW, seed=0)
    assert out == [[e] * 2 for e in expected]


# ----------------------------------------------------------------------------- reward scores


@pytest.fixture(scope="module")
def reward_model(policy, tok, tmp_path_factory):
    folder = tmp_path_factory.mktemp("policy")
    save(policy, tok, folder)
    return reward_from_policy(folder, seed=0), folder


def test_save_load_policy_round_trip(policy, tok, reward_model):
    _, folder = reward_model
    assert list(folder.glob("*.safetensors"))
    loaded, loaded_tok = load_policy(folder)
    assert loaded_tok.get_vocab() == tok.get_vocab()
    for (name, a), (_, b) in zip(policy.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_reward_model_backbone_from_policy(policy, reward_model):
    rm, folder = reward_model
    assert rm.config.num_labels == 1
    assert torch.equal(rm.model.embed_tokens.weight, policy.model.embed_tokens.weight)
    # the fresh head is seeded
    assert torch.equal(reward_from_policy(folder, seed=0).score.weight, rm.score.weight)
    assert not torch.equal(reward_from_policy(folder, seed=1).score.weight, rm.score.weight)


def test_score_reads_the_last_non_pad_token(tok, reward_model):
    rm, _ = reward_model
    prompts = [PROMPTS[0], "Hi", PROMPTS[5], PROMPTS[9], "What is 2 + 2?"]
    responses = [RESPONSES[0], "a much longer response than the others, to force padding", "", RESPONSES[9], "4"]
    scores = score(rm, tok, prompts, responses, batch_size=2)
    assert scores.shape == (5,) and scores.dtype == torch.float32
    assert len(scores.tolist()) == 5 and all(isinstance(s, float) for s in scores.tolist())
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(prompts, responses)):
            ids, _, _ = encode_examples(tok, [p], [r], rm.config.max_position_embeddings)  # alone: no padding
            assert ids[0, -1] == tok.eos_token_id
            hidden = rm.model(input_ids=ids).last_hidden_state[0, -1]
            assert scores[i].item() == pytest.approx(rm.score(hidden).item(), abs=1e-5)
    # batch composition does not matter
    assert torch.allclose(score(rm, tok, prompts, responses, batch_size=64), scores, atol=1e-5)
    assert score(rm, tok, [], []).shape == (0,)
    assert len(set(round(s, 5) for s in scores.tolist())) == 5


# ----------------------------------------------------------------------------- schedule


def test_optimizer_and_schedule_warmup_then_cosine():
    model = torch.nn.Linear(2, 1)
    lr, total = 0.1, 20
    opt, sched = optimizer_and_schedule(model, lr=lr, weight_decay=0.01, total_steps=total, warmup_ratio=0.2)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["weight_decay"] == 0.01
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # warmup = int(20 * 0.2) = 4 steps: lr * (k + 1) / 4
    assert lrs[:4] == pytest.approx([0.025, 0.05, 0.075, 0.1])
    # then cosine from the peak to 0 over the remaining 16 steps
    for k in range(4, total):
        assert lrs[k] == pytest.approx(lr * 0.5 * (1 + math.cos(math.pi * (k - 4) / 16)))
    assert lrs[4] == pytest.approx(lr)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lrs[-1] < 0.01 * lr
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)  # after the last step


def test_schedule_without_warmup_starts_at_peak():
    opt, sched = optimizer_and_schedule(
        torch.nn.Linear(2, 1), lr=1.0, weight_decay=0.0, total_steps=10, warmup_ratio=0.0
    )
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0)


def test_encode_examples_keeps_response_tokens_when_the_prompt_is_too_long(tok):
    long_prompt = "Sort these numbers: " + ", ".join(str(i) for i in range(200))
    ids, mask, labels = encode_examples(tok, [long_prompt], ["1, 2, 3"], 32)
    assert ids.shape[1] <= 32
    assert ids[0, 0].item() == tok.bos_token_id
    assert (labels[0] != -100).sum().item() >= 1  # something to learn from, never an all-ignored row


def test_next_token_rows_by_hand():
    from farmflow.models import next_token_rows

    labels = torch.tensor([[IGNORE, IGNORE, IGNORE, 7, 2, IGNORE], [IGNORE, IGNORE, 9, 2, IGNORE, IGNORE]])
    rows, targets = next_token_rows(labels)
    # position t predicts label t + 1: row 0's columns 2, 3 predict 7, 2; row 1's columns 1, 2 predict 9, 2
    assert rows.tolist() == [[False, False, True, True, False, False], [False, True, True, False, False, False]]
    assert targets.tolist() == [7, 2, 9, 2]
    assert rows.dtype == torch.bool


def _loss_and_grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_response_rows_loss_equals_the_full_logits_loss_and_its_gradients(policy, tok):
    """SFT on the response rows only (`logits_to_keep` mask, shifted labels): the same loss and the same gradient
    as `sft_loss` over the full logits, up to float rounding."""
    from farmflow.methods.sft import lm_loss, response_rows_loss, sft_loss

    responses = ["four", "a much longer answer than the others", "ok", "7", "4", "x y"]
    ids, mask, labels = encode_examples(tok, SAMPLE_PROMPTS, responses, 64)
    assert (labels != IGNORE).sum() < mask.sum() // 2  # most positions are prompt or padding
    policy.train()
    try:
        full, g_full = _loss_and_grads(
            policy, lambda: sft_loss(policy(input_ids=ids, attention_mask=mask).logits, labels)
        )
        rows, g_rows = _loss_and_grads(policy, lambda: response_rows_loss(policy, ids, mask, labels))
        same, _ = _loss_and_grads(policy, lambda: lm_loss(policy, ids, mask, labels, response_rows=False))
    finally:
        policy.zero_grad(set_to_none=True)
        policy.eval()
    assert rows.item() == pytest.approx(full.item(), rel=1e-6)
    assert torch.equal(same, full)  # the full-logits path of the loop is sft_loss exactly (no KV cache changes nothing)
    for name, g in g_full.items():
        assert torch.allclose(g_rows[name], g, rtol=1e-4, atol=1e-6), name
    assert any(g.abs().max() > 1e-3 for g in g_full.values())  # gradients worth comparing


def test_sft_loop_on_response_rows_trains_like_the_full_logits_loop(tok, monkeypatch):
    """The SFT loop switches to response rows from `RESPONSE_ROWS_MIN_VOCAB` on: two steps end at the same weights."""
    from farmflow.config import SFTConfig
    from farmflow.methods import sft

    cfg = SFTConfig(epochs=1, batch_size=4, lr=1e-2, warmup_ratio=0.0, seed=0)
    full, rows = build_policy(CFG, tok), build_policy(CFG, tok)
    m_full = sft.train_sft(full, tok, PROMPTS[:8], RESPONSES[:8], cfg, 96)
    monkeypatch.setattr(sft, "RESPONSE_ROWS_MIN_VOCAB", CFG.vocab_size)
    m_rows = sft.train_sft(rows, tok, PROMPTS[:8], RESPONSES[:8], cfg, 96)
    assert m_rows["train_loss_first"] == pytest.approx(m_full["train_loss_first"], rel=1e-6)
    assert m_rows["train_loss_last"] == pytest.approx(m_full["train_loss_last"], rel=1e-5)
    for (name, p), q in zip(full.named_parameters(), rows.parameters()):
        assert torch.allclose(p, q, atol=1e-5), name
    assert not torch.equal(full.get_output_embeddings().weight, build_policy(CFG, tok).get_output_embeddings().weight)


@torch.no_grad()
def test_dpo_and_ppo_log_probs_on_response_positions_equal_full_logits(policy, tok):
    """DPO's sequence log-probs (sum and per-token mean) and PPO's response logits skip the prompt columns'
    vocabulary projection: same numbers."""
    import torch.nn.functional as F

    from farmflow.methods.dpo import sequence_logps
    from farmflow.methods.ppo import response_logits

    responses = ["four", "a much longer answer than the others", "ok", "7", "4", "x y"]
    ids, mask, labels = encode_examples(tok, SAMPLE_PROMPTS, responses, 64)
    logps = F.log_softmax(policy(input_ids=ids, attention_mask=mask).logits[:, :-1].float(), -1)
    targets = labels[:, 1:]
    full = (logps.gather(2, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (targets != IGNORE)).sum(-1)
    assert torch.allclose(sequence_logps(policy, tok, SAMPLE_PROMPTS, responses, 64), full, atol=1e-4)
    mean = sequence_logps(policy, tok, SAMPLE_PROMPTS, responses, 64, average=True)
    assert torch.allclose(mean, full / (targets != IGNORE).sum(-1), atol=1e-5)

    prompt = torch.tensor([[0, 0, 1, 5, 6], [1, 7, 8, 9, 10]])
    tokens = torch.tensor([[11, 12, 2], [13, 2, 0]])
    attention = torch.cat([(prompt != 0).long(), torch.tensor([[1, 1, 1], [1, 1, 0]])], 1)
    batch = {
        "input_ids": torch.cat([prompt, tokens], 1),
        "attention_mask": attention,
        "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
        "tokens": tokens,
    }
    everything = policy(
        input_ids=batch["input_ids"], attention_mask=attention, position_ids=batch["position_ids"]
    ).logits
    assert torch.allclose(response_logits(policy, batch, 0.7), everything[:, 4:7].float() / 0.7, atol=1e-5)


def test_an_over_long_prompt_keeps_its_bos_when_cut_to_fit():
    """An over-long prompt loses its oldest tokens but keeps BOS, as in training: the cut is made after [BOS]."""
    from farmflow.models import prompt_ids

    tok = train_tokenizer(PROMPTS + RESPONSES, vocab_size=384)
    full = tok([PROMPTS[0]], add_special_tokens=False)["input_ids"][0]
    assert len(full) > 6
    assert prompt_ids(tok, [PROMPTS[0]], 6) == [[tok.bos_token_id] + full[-5:]]
    assert prompt_ids(tok, [PROMPTS[0]], 1000) == [[tok.bos_token_id] + full]  # fits: unchanged


# ----------------------------------------------------------------------------- batch order


def _quadratic_batch_order(n: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """The reference: drop each batch from the front of the remaining order (quadratic in the indices drawn)."""
    rng = random.Random(seed)
    order: list[int] = []
    batches = []
    for _ in range(steps):
        while len(order) < min(batch_size, n):
            epoch = list(range(n))
            rng.shuffle(epoch)
            order += epoch
        batches.append(order[:batch_size])
        order = order[batch_size:]
    return batches


def test_batch_order_is_pinned_and_equals_the_reference():
    assert batch_order(5, 2, 6, 0) == [[2, 1], [0, 4], [3, 0], [2, 1], [3, 4], [1, 0]]  # batches straddle epochs
    assert batch_order(3, 8, 2, 1) == [[1, 2, 0], [2, 0, 1]]  # a batch larger than the data: one epoch each
    assert batch_order(7, 3, 2, 42) == [[1, 3, 4], [2, 6, 0]]
    for n, size, steps, seed in [(1, 1, 3, 0), (10, 3, 17, 5), (10, 10, 4, 2), (4, 6, 5, 3), (100, 7, 60, 9)]:
        assert batch_order(n, size, steps, seed) == _quadratic_batch_order(n, size, steps, seed)
    big = batch_order(50_000, 128, 2_000, 0)  # 256,000 indices drawn in linear time
    assert all(len(b) == 128 for b in big)
    first_epoch = [i for b in big[:390] for i in b] + big[390][:80]  # 390 * 128 + 80 = 50,000
    assert sorted(first_epoch) == list(range(50_000))


# ----------------------------------------------------------------------------- packing


def test_pack_rows_by_hand():
    from farmflow.models import pack_rows

    P = 0
    ids = torch.tensor([[1, 5, 6, 2, P], [1, 7, 2, P, P], [1, 8, 9, 4, 2]])
    mask = (ids != P).long()
    labels = torch.tensor([[IGNORE, IGNORE, 6, 2, IGNORE], [IGNORE, 7, 2, IGNORE, IGNORE], [IGNORE, IGNORE, 9, 4, 2]])
    p_ids, pos, p_labels = pack_rows(ids, mask, labels, max_len=8, pad_id=P)
    # rows of up to 8 tokens: 4 + 3 fit together, the 5-token example starts a row of its own
    assert p_ids.tolist() == [[1, 5, 6, 2, 1, 7, 2], [1, 8, 9, 4, 2, P, P]]
    assert pos.tolist() == [[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 0, 1]]
    assert p_labels.tolist() == [
        [IGNORE, IGNORE, 6, 2, IGNORE, 7, 2],
        [IGNORE, IGNORE, 9, 4, 2, IGNORE, IGNORE],
    ]


def test_packed_loss_equals_the_padded_loss_and_its_gradients(policy, tok):
    """Packed examples (position ids restarting, no attention mask) see only themselves: the same loss and gradient
    as the padded batch, on both loss paths."""
    from farmflow.methods.sft import lm_loss
    from farmflow.models import pack_rows

    responses = ["four", "a much longer answer than the others", "ok", "7", "4", "x y"]
    ids, mask, labels = encode_examples(tok, SAMPLE_PROMPTS, responses, 64)
    p_ids, pos, p_labels = pack_rows(ids, mask, labels, CFG.max_seq_len, tok.pad_token_id)
    assert p_ids.numel() < ids.numel() and p_ids.shape[0] < ids.shape[0]  # fewer rows, less padding
    assert (p_labels != IGNORE).sum() == (labels != IGNORE).sum()
    policy.train()
    try:
        for rows in (False, True):
            padded, g_padded = _loss_and_grads(policy, lambda: lm_loss(policy, ids, mask, labels, rows))
            packed, g_packed = _loss_and_grads(policy, lambda: lm_loss(policy, p_ids, None, p_labels, rows, pos))
            assert packed.item() == pytest.approx(padded.item(), rel=1e-5)
            for name, g in g_padded.items():
                assert torch.allclose(g_packed[name], g, rtol=1e-3, atol=1e-5), name
            # attention crossing examples would change the loss: the same rows with one shared position range do
            leaky, _ = _loss_and_grads(
                policy, lambda: lm_loss(policy, p_ids, None, p_labels, rows, torch.arange(p_ids.shape[1])[None])
            )
            assert abs(leaky.item() - padded.item()) > 1e-3
    finally:
        policy.zero_grad(set_to_none=True)
        policy.eval()


def test_sft_loop_with_packing_trains_like_the_padded_loop(tok):
    from farmflow.config import SFTConfig
    from farmflow.methods import sft

    cfg = SFTConfig(epochs=1, batch_size=4, lr=1e-2, warmup_ratio=0.0, seed=0)
    padded, packed = build_policy(CFG, tok), build_policy(CFG, tok)
    m_padded = sft.train_sft(padded, tok, PROMPTS[:8], RESPONSES[:8], cfg, 96)
    m_packed = sft.train_sft(packed, tok, PROMPTS[:8], RESPONSES[:8], cfg.model_copy(update={"packing": True}), 96)
    assert m_packed["train_loss_first"] == pytest.approx(m_padded["train_loss_first"], rel=1e-5)
    assert m_packed["train_tokens"] == m_padded["train_tokens"]
    for (name, p), q in zip(padded.named_parameters(), packed.parameters()):
        assert torch.allclose(p, q, atol=1e-5), name


def test_pack_pairs_by_hand():
    """Three pairs (max_len 8): two share their prompt, one cuts its long prompt differently for each output."""
    from types import SimpleNamespace

    from farmflow.models import pack_pairs

    t = SimpleNamespace(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    prompts = [[5, 6], [10, 11, 12, 13, 14, 15, 16], [5]]
    out_1, out_2 = [[7], [], [7]], [[8, 9], [18, 19], [7]]
    packed = pack_pairs(t, prompts, out_1, out_2, max_len=8)
    # pair 1 (16 tokens: the empty output leaves its prompt one more token) fills row 0; pairs 0 and 2 share row 1
    assert packed.input_ids.tolist() == [
        [1, 11, 12, 13, 14, 15, 16, 2, 1, 12, 13, 14, 15, 16, 18, 19],
        [1, 5, 6, 7, 2, 8, 9, 2, 1, 5, 7, 2, 7, 2, 0, 0],
    ]
    assert packed.position_ids.tolist() == [
        [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7],
        [0, 1, 2, 3, 4, 3, 4, 5, 0, 1, 2, 3, 2, 3, 0, 0],
    ]
    assert packed.ends.tolist() == [[[1, 4], [1, 7]], [[0, 7], [0, 15]], [[1, 11], [1, 13]]]
    seen = packed.allowed[:, 0]
    assert seen[1, 5].nonzero().flatten().tolist() == [0, 1, 2, 5]  # output_2 of pair 0: its prompt, not output_1
    assert seen[1, 4].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert seen[1, 12].nonzero().flatten().tolist() == [8, 9, 12]  # pair 2 sees nothing of pair 0
    assert seen[0, 9].nonzero().flatten().tolist() == [8, 9]  # pair 1's second copy of its prompt starts afresh
    assert seen[1, 14].nonzero().flatten().tolist() == [14]  # padding: itself only


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_pair_rewards_equal_each_output_read_alone_and_their_gradients(tok, reward_model, attn):
    """The packed forward (each prompt read once, several pairs a row) gives every output the reward and the
    gradient it gets read in its own right-padded row, on both attention kernels."""
    from farmflow.methods.reward import bradley_terry_loss, pair_rewards

    _, folder = reward_model
    rm = reward_from_policy(folder, seed=0)
    rm.set_attn_implementation(attn)
    max_len = 40  # short enough that one long prompt is cut differently for its two outputs
    prompts = [PROMPTS[0], "Hi", PROMPTS[5] * 3, PROMPTS[9], "What is 2 + 2?"]
    out_1 = [RESPONSES[0], "a much longer response than the others, to force padding", "", RESPONSES[9], "4"]
    out_2 = [RESPONSES[1], "no", RESPONSES[5] * 2, "", "five"]
    prefs = torch.tensor([1.0, 2.0, 1.0, 2.0, 1.5])
    p_ids, o_ids = tokenize_examples(tok, prompts, out_1 + out_2)
    o1, o2 = o_ids[:5], o_ids[5:]
    ids, mask, _ = pack_examples(tok, p_ids * 2, o1 + o2, max_len)

    def alone():
        r = rm(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, 0]
        alone.rewards = r.detach()
        return bradley_terry_loss(r[:5], r[5:], prefs)

    def packed():
        r1, r2 = pair_rewards(rm, tok, p_ids, o1, o2, max_len, packed=True)
        packed.rewards = torch.cat([r1, r2]).detach()
        return bradley_terry_loss(r1, r2, prefs)

    rm.train()
    loss, grads = _loss_and_grads(rm, alone)
    p_loss, p_grads = _loss_and_grads(rm, packed)
    assert torch.allclose(packed.rewards, alone.rewards, atol=1e-5)
    assert len(set(alone.rewards.tolist())) == 10  # every output scored differently: a mix-up would show
    assert p_loss.item() == pytest.approx(loss.item(), rel=1e-5)
    for name, g in grads.items():
        assert torch.allclose(p_grads[name], g, rtol=1e-3, atol=1e-5), name
    from farmflow.models import pack_pairs

    assert not torch.equal(ids[2, :3], ids[7, :3])  # pair 2's outputs read differently cut prompts (not shared)
    assert pack_pairs(tok, p_ids, o1, o2, max_len).input_ids.numel() < ids.numel()  # fewer positions than 2 rows a pair


def test_reward_loop_with_packing_trains_like_the_padded_loop(tok, reward_model, tmp_path):
    from farmflow.config import RewardConfig
    from farmflow.methods import reward

    _, folder = reward_model
    cfg = RewardConfig(epochs=1, batch_size=4, lr=1e-3, warmup_ratio=0.0, seed=0)
    padded, packed = reward_from_policy(folder, seed=0), reward_from_policy(folder, seed=0)
    prefs = [1.0, 2.0] * 4
    args = (tok, PROMPTS[:8], RESPONSES[:8], RESPONSES[8:16], prefs)
    m_padded = reward.train_reward(padded, *args, cfg, 96)
    m_packed = reward.train_reward(packed, *args, cfg.model_copy(update={"packing": True}), 96)
    assert m_packed["train_loss_first"] == pytest.approx(m_padded["train_loss_first"], rel=1e-5)
    assert m_packed["train_loss_last"] == pytest.approx(m_padded["train_loss_last"], rel=1e-4)
    moved = 0
    for (name, p), q, r in zip(padded.named_parameters(), packed.parameters(), reward_from_policy(folder).parameters()):
        assert torch.allclose(p, q, atol=1e-5), name
        moved += not torch.equal(p, r)
    assert moved > 0  # the two steps trained something
    from farmflow.models import load_reward, packed_reads

    assert packed_reads(packed) and not packed_reads(padded)  # a model trained packed scores packed
    save(packed, tok, tmp_path / "rm")
    assert packed_reads(load_reward(tmp_path / "rm")[0])  # recorded with the model


def test_head_features_are_what_the_score_head_reads(tok, reward_model):
    from farmflow.models import reward_features, tokenize_examples

    model, _ = reward_model
    p_ids, o_ids = tokenize_examples(tok, PROMPTS[:10], RESPONSES[:10])
    max_len = model.config.max_position_embeddings  # as the task passes it, and as `score` cuts
    features = reward_features(model, tok, p_ids, o_ids, max_len, batch_size=3)  # batched by length, in order
    assert features.shape == (10, CFG.hidden_size)
    read = model.score(features)[:, 0]
    assert torch.allclose(read, score(model, tok, PROMPTS[:10], RESPONSES[:10]), atol=1e-5)
    assert len(set(read.tolist())) == 10  # every output read differently: a mix-up would show


def _count_reads(model) -> list[int]:
    """Rows each forward pass of `model`'s backbone reads, appended per call."""
    reads = []
    model.base_model.register_forward_hook(lambda _m, _a, out: reads.append(out[0].shape[0]))
    return reads


def test_score_reads_each_distinct_pair_once(tok, reward_model):
    model, _ = reward_model
    prompts, responses = PROMPTS[:4] * 2 + PROMPTS[:2], RESPONSES[:4] * 2 + RESPONSES[:2]  # 10 rows, 4 distinct
    reads = _count_reads(model)
    seen = []
    r = score(model, tok, prompts, responses, batch_size=3, progress=seen.append)
    assert reads == [3, 1] and sum(seen) == 10  # two batches of distinct pairs; the bar counts every row
    alone = torch.stack([score(model, tok, [p], [o])[0] for p, o in zip(prompts[:4], responses[:4])])
    assert torch.allclose(r, torch.cat([alone, alone, alone[:2]]), atol=1e-5)  # each row its own pair's reward
    assert torch.equal(r[:4], r[4:8])  # a repeat is the same read


def test_a_feature_memo_reads_a_frozen_backbone_once_for_every_head(tok, reward_model):
    from farmflow.models import FeatureMemo

    _, folder = reward_model
    a, b = reward_from_policy(folder, seed=0), reward_from_policy(folder, seed=1)  # one backbone, two heads
    a_reads, b_reads = _count_reads(a), _count_reads(b)
    memo = FeatureMemo(backbones=2)
    args = (tok, PROMPTS[:6], RESPONSES[:6])
    ra = score(a, *args, memo=memo)
    rb = score(b, *args, memo=memo)
    assert a_reads == [6] and b_reads == []  # b's head read a's features
    assert torch.allclose(rb, score(b, *args), atol=1e-5) and not torch.allclose(ra, rb, atol=1e-3)
    b_reads.clear()
    with torch.no_grad():
        b.base_model.norm.weight.mul_(1.5)  # another backbone: its own features
    rb2 = score(b, *args, memo=memo)
    assert b_reads == [6] and torch.allclose(rb2, score(b, *args), atol=1e-5) and not torch.allclose(rb2, rb)
    c = reward_from_policy(folder, seed=2)
    with torch.no_grad():
        c.base_model.norm.weight.mul_(0.5)
    score(c, *args, memo=memo)  # a third backbone: the memo keeps two, and a's (b's before) was the least recently used
    a_reads.clear()
    b_reads.clear()
    assert torch.equal(score(b, *args, memo=memo), rb2) and b_reads == []  # the changed b's stays
    assert torch.allclose(score(a, *args, memo=memo), ra, atol=1e-6) and a_reads == [6]


def test_bfloat16_features_are_read_under_autocast_and_scored_by_a_float32_head(tok, reward_model):
    from farmflow.models import FeatureMemo, feature_dtype, reward_features

    _, folder = reward_model
    full, low = reward_from_policy(folder, seed=0), reward_from_policy(folder, seed=0)
    low.config.farmflow_feature_dtype = "bfloat16"
    assert feature_dtype(full) == "float32" and feature_dtype(low) == "bfloat16"
    p_ids, o_ids = tokenize_examples(tok, PROMPTS[:6], RESPONSES[:6])
    f_full, f_low = (reward_features(m, tok, p_ids, o_ids, m.config.max_position_embeddings) for m in (full, low))
    assert f_low.dtype == torch.float32 and not torch.equal(f_low, f_full)  # read in bfloat16, kept as the head's
    assert ((f_low - f_full).norm() / f_full.norm()).item() < 0.03  # bfloat16 products: about 1% apart
    r_low = score(low, tok, PROMPTS[:6], RESPONSES[:6])  # no memo: still the features' precision, not a full forward
    assert torch.equal(r_low, low.score(f_low)[:, 0].float())
    assert not torch.equal(r_low, r_low.bfloat16().float())  # the head ran in float32: rewards not rounded to bfloat16
    memo = FeatureMemo()
    reads = _count_reads(low)
    score(full, tok, PROMPTS[:6], RESPONSES[:6], memo=memo)
    assert torch.equal(score(low, tok, PROMPTS[:6], RESPONSES[:6], memo=memo), r_low)
    assert reads == [6]  # one backbone, two precisions: a table each


def test_a_frozen_reward_model_scores_in_the_feature_dtype_it_trained_in(tok, reward_model, tmp_path):
    from farmflow.config import RewardConfig
    from farmflow.methods import reward
    from farmflow.models import batch_order, feature_dtype, load_reward, reward_features

    _, folder = reward_model
    cfg = RewardConfig(
        epochs=3, batch_size=4, lr=1e-2, warmup_ratio=0.0, seed=0, train_backbone=False, feature_dtype="bfloat16"
    )
    fresh, model = reward_from_policy(folder, seed=0), reward_from_policy(folder, seed=0)
    prefs = [1.0, 2.0] * 4
    metrics = reward.train_reward(model, tok, PROMPTS[:8], RESPONSES[:8], RESPONSES[8:16], prefs, cfg, 96)
    fresh.config.farmflow_feature_dtype = "bfloat16"
    p_ids, o_ids = tokenize_examples(tok, PROMPTS[:8], RESPONSES[:16])
    features = reward_features(fresh, tok, p_ids * 2, o_ids, 96)
    first = batch_order(8, 4, 6, 0)[0]
    r1, r2 = fresh.score(features[first])[:, 0], fresh.score(features[[8 + i for i in first]])[:, 0]
    target = torch.tensor([prefs[i] - 1.0 for i in first])
    by_hand = torch.nn.functional.binary_cross_entropy_with_logits(r2 - r1, target)
    assert metrics["train_loss_first"] == pytest.approx(by_hand.item(), rel=1e-6)  # on the bfloat16-read features
    full = reward_from_policy(folder, seed=0)
    m_full = reward.train_reward(
        full,
        tok,
        PROMPTS[:8],
        RESPONSES[:8],
        RESPONSES[8:16],
        prefs,
        cfg.model_copy(update={"feature_dtype": "float32"}),
        96,
    )
    assert metrics["train_loss_first"] != m_full["train_loss_first"]  # float32's features give another first loss
    assert model.score.weight.dtype == torch.float32
    save(model, tok, tmp_path / "rm")
    loaded, _ = load_reward(tmp_path / "rm")
    assert feature_dtype(loaded) == "bfloat16"  # recorded with the model
    expected = model.score(reward_features(model, tok, p_ids * 2, o_ids, model.config.max_position_embeddings))[:, 0]
    assert torch.equal(score(loaded, tok, PROMPTS[:8] * 2, RESPONSES[:16]), expected)


def test_feature_dtype_needs_a_frozen_backbone():
    from pydantic import ValidationError

    from farmflow.config import RewardConfig

    with pytest.raises(ValidationError, match="feature_dtype='bfloat16' needs train_backbone=False"):
        RewardConfig(feature_dtype="bfloat16")
    assert RewardConfig(feature_dtype="bfloat16", train_backbone=False).feature_dtype == "bfloat16"


def test_frozen_reward_models_on_one_backbone_read_its_features_once(tok, reward_model):
    from farmflow.config import RewardConfig
    from farmflow.methods import reward
    from farmflow.models import FeatureMemo

    _, folder = reward_model
    cfg = RewardConfig(epochs=3, batch_size=4, lr=1e-2, warmup_ratio=0.0, seed=0, train_backbone=False)
    pairs = (PROMPTS[:8], RESPONSES[:8], RESPONSES[8:16])
    memo, alone = FeatureMemo(), reward_from_policy(folder, seed=0)
    first, second = reward_from_policy(folder, seed=0), reward_from_policy(folder, seed=0)
    first_reads, second_reads = _count_reads(first), _count_reads(second)
    m_alone = reward.train_reward(alone, tok, *pairs, [1.0, 2.0] * 4, cfg, 96)
    m_first = reward.train_reward(first, tok, *pairs, [1.0, 2.0] * 4, cfg, 96, memo=memo)
    m_second = reward.train_reward(second, tok, *pairs, [2.0, 1.0] * 4, cfg, 96, memo=memo)  # other labels
    assert first_reads == [16] and second_reads == []
    assert m_first["train_loss_first"] == pytest.approx(m_alone["train_loss_first"], rel=1e-6)
    assert m_second["train_loss_last"] != pytest.approx(m_first["train_loss_last"], rel=1e-3)
    assert not torch.equal(first.score.weight, second.score.weight)


def test_a_frozen_backbone_trains_only_the_head_on_features_read_once(tok, reward_model):
    from farmflow.config import RewardConfig
    from farmflow.methods import reward
    from farmflow.models import batch_order, reward_features, tokenize_examples

    _, folder = reward_model
    fresh, model = reward_from_policy(folder, seed=0), reward_from_policy(folder, seed=0)
    cfg = RewardConfig(epochs=3, batch_size=4, lr=1e-2, warmup_ratio=0.0, seed=0, train_backbone=False)
    prefs = [1.0, 2.0] * 4
    reads = []
    model.base_model.register_forward_hook(lambda _m, _a, out: reads.append(out[0].shape[0]))
    metrics = reward.train_reward(model, tok, PROMPTS[:8], RESPONSES[:8], RESPONSES[8:16], prefs, cfg, 96)
    assert reads == [16]  # each of the 16 outputs read once in one batch, for all 6 steps
    assert metrics["steps"] == 6.0
    # the first step's loss, by hand: Bradley-Terry on the fresh head over the first batch's features
    p_ids, o_ids = tokenize_examples(tok, PROMPTS[:8], RESPONSES[:16])
    features = reward_features(fresh, tok, p_ids * 2, o_ids, 96)
    first = batch_order(8, 4, 6, 0)[0]
    r1, r2 = fresh.score(features[first])[:, 0], fresh.score(features[[8 + i for i in first]])[:, 0]
    target = torch.tensor([prefs[i] - 1.0 for i in first])
    logsig = torch.nn.functional.logsigmoid
    by_hand = -(target * logsig(r2 - r1) + (1 - target) * logsig(r1 - r2))
    assert metrics["train_loss_first"] == pytest.approx(by_hand.mean().item(), rel=1e-5)
    trained = dict(model.named_parameters())
    for name, p in fresh.named_parameters():
        assert torch.equal(trained[name], p) is (not name.startswith("score")), name  # the head moved, nothing else


def test_train_layers_trains_the_top_blocks_and_stops_the_backward_pass_below_them(tok, tmp_path):
    from farmflow.config import RewardConfig
    from farmflow.methods import reward

    save(build_policy(CFG.model_copy(update={"num_layers": 2}), tok), tok, tmp_path / "two")
    cfg = RewardConfig(epochs=1, batch_size=4, lr=1e-2, warmup_ratio=0.0, seed=0, train_layers=1)
    args = (tok, PROMPTS[:8], RESPONSES[:8], RESPONSES[8:16], [1.0, 2.0] * 4)
    fresh, top, whole = (reward_from_policy(tmp_path / "two", seed=0) for _ in range(3))
    below = {"top": [], "whole": []}  # backward passes through the lower block
    for name, model in (("top", top), ("whole", whole)):
        model.base_model.layers[0].register_full_backward_hook(lambda *_, name=name: below[name].append(1))
    m_top = reward.train_reward(top, *args, cfg, 96)
    m_whole = reward.train_reward(whole, *args, cfg.model_copy(update={"train_layers": None}), 96)
    assert below == {"top": [], "whole": [1, 1]} and m_top["steps"] == 2.0
    assert m_top["train_loss_first"] == m_whole["train_loss_first"]  # the same model and batch before any step
    assert m_top["train_loss_last"] != m_whole["train_loss_last"]
    trained = dict(top.named_parameters())
    for name, p in fresh.named_parameters():
        moves = name.startswith(("score", "model.layers.1.", "model.norm"))
        assert torch.equal(trained[name], p) is (not moves), name  # the top block, the final norm and the head moved
    too_many = cfg.model_copy(update={"train_layers": 3})
    with pytest.raises(ValueError, match=r"^reward.train_layers=3: the backbone has 2 transformer blocks$"):
        reward.train_reward(reward_from_policy(tmp_path / "two", seed=0), *args, too_many, 96)


def test_train_layers_needs_a_trained_backbone():
    from pydantic import ValidationError

    from farmflow.config import RewardConfig

    with pytest.raises(ValidationError, match="train_layers needs train_backbone=True"):
        RewardConfig(train_layers=2, train_backbone=False)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        RewardConfig(train_layers=0)


class ScriptedMeasure:
    """A held-out measurement that returns scripted accuracies in call order and keeps the weights it was shown."""

    def __init__(self, accuracies):
        self.accuracies, self.seen = list(accuracies), []

    def __call__(self, model):
        self.seen.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        return {"heldout_accuracy": self.accuracies[len(self.seen) - 1]}


def _same_weights(model, weights) -> bool:
    return all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def test_reward_select_best_val_keeps_the_best_measurements_weights_also_over_a_resume(tok, reward_model, tmp_path):
    from farmflow.config import RewardConfig
    from farmflow.methods import reward
    from farmflow.models.checkpoint import Checkpointer
    from farmflow.storage import LocalStore

    _, folder = reward_model
    # 8 pairs in batches of 4 for 3 epochs: 6 steps, measured after steps 2, 4 and 6
    cfg = RewardConfig(epochs=3, batch_size=4, lr=1e-3, warmup_ratio=0.0, seed=0, eval_every=2, select="best_val")
    args = (tok, PROMPTS[:8], RESPONSES[:8], RESPONSES[8:16], [1.0, 2.0] * 4)
    last, best = ScriptedMeasure([0.5, 0.75, 0.625]), ScriptedMeasure([0.5, 0.75, 0.625])
    m_last = reward_from_policy(folder, seed=0)
    metrics_last = reward.train_reward(m_last, *args, cfg.model_copy(update={"select": "last"}), 96, evaluate=last)
    m_best = reward_from_policy(folder, seed=0)
    metrics_best = reward.train_reward(m_best, *args, cfg, 96, evaluate=best)
    assert len(best.seen) == 3 and all(_same_weights(m_last, w) is (i == 2) for i, w in enumerate(best.seen))
    for a, b in zip(last.seen, best.seen):  # measuring and keeping a copy leave training as it was
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert _same_weights(m_last, last.seen[2]) and _same_weights(m_best, best.seen[1])
    assert metrics_best["selected_step"] == 4.0 and "selected_step" not in metrics_last
    assert (metrics_best["heldout_accuracy"], metrics_last["heldout_accuracy"]) == (0.75, 0.625)  # the kept figures

    class Crash(Exception):
        pass

    def crash_at_the_third(model):
        if len(first.seen) == 2:
            raise Crash
        return first(model)

    store = LocalStore(tmp_path)
    first = ScriptedMeasure([0.5, 0.75])
    with pytest.raises(Crash):  # dies measuring step 6: its latest checkpoint is step 5, the best still step 4's
        reward.train_reward(
            reward_from_policy(folder, seed=0),
            *args,
            cfg,
            96,
            Checkpointer(store, "reward", "k", 1),
            crash_at_the_third,
        )
    assert store.latest_checkpoint("reward", "k")[0] == 5
    resumed, rest = reward_from_policy(folder, seed=0), ScriptedMeasure([0.625])
    metrics = reward.train_reward(resumed, *args, cfg, 96, Checkpointer(store, "reward", "k", 1), rest)
    assert metrics["resumed_from_step"] == 5 and metrics["selected_step"] == 4.0
    assert _same_weights(resumed, best.seen[1])  # step 4's weights came back from the checkpoint


def test_reward_select_best_val_needs_measurements():
    from pydantic import ValidationError

    from farmflow.config import RewardConfig
    from farmflow.methods import reward

    with pytest.raises(ValidationError, match="eval_every > 0"):
        RewardConfig(select="best_val")
    with pytest.raises(ValueError, match="the val split is empty"):
        reward.train_reward(None, None, [], [], [], [], RewardConfig(select="best_val", eval_every=5), 96)


def test_half_precision_on_a_cpu_that_emulates_it_is_flagged():
    from farmflow.models import slow_half_precision

    assert slow_half_precision("bfloat16", False, {"avx2", "fma"})
    assert slow_half_precision("float16", False, {"avx2", "avx512_bf16"})
    assert not slow_half_precision("bfloat16", False, {"avx2", "avx512_bf16"})
    assert not slow_half_precision("bfloat16", False, {"amx_bf16"})
    assert not slow_half_precision("bfloat16", True, set())  # a GPU runs it natively
    assert not slow_half_precision("float32", False, set())


def test_pack_shared_by_hand():
    """Two groups (max_len 8, rows of 9): three outputs of one prompt, split when the third does not fit; a long
    prompt that its two outputs' examples cut differently, so the second carries its own cut."""
    from types import SimpleNamespace

    from farmflow.models import pack_shared

    t = SimpleNamespace(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    groups = [([5, 6], [[7], [8, 9], [3]]), ([10, 11, 12, 13, 14, 15, 16], [[], [18, 19]])]
    packed = pack_shared(t, groups, max_len=8, capacity=9)
    assert packed.input_ids.tolist() == [
        [1, 5, 6, 7, 2, 8, 9, 2],  # the prompt once, both outputs after it
        [1, 11, 12, 13, 14, 15, 16, 2],
        [1, 12, 13, 14, 15, 16, 18, 19],  # its own cut of the prompt
        [1, 5, 6, 3, 2, 0, 0, 0],  # the third output with a copy of the prompt
    ]
    assert packed.position_ids.tolist() == [
        [0, 1, 2, 3, 4, 3, 4, 5],
        [0, 1, 2, 3, 4, 5, 6, 7],
        [0, 1, 2, 3, 4, 5, 6, 7],
        [0, 1, 2, 3, 4, 0, 0, 0],
    ]
    assert packed.ends.tolist() == [[0, 4], [0, 7], [3, 4], [1, 7], [2, 7]]  # the outputs in the given order
    seen = packed.allowed[:, 0]
    assert seen[0, 5].nonzero().flatten().tolist() == [0, 1, 2, 5]  # the second output: the prompt and itself
    assert seen[0, 4].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert seen[3, 3].nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert seen[3, 5].nonzero().flatten().tolist() == [5]  # padding: none of the units


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_packed_reader_scores_every_output_as_read_alone_from_fewer_positions(tok, reward_model, attn):
    """A reward model that reads packed (`packed_reads`) gives each candidate the reward of its own padded row, with
    and without a feature memo, on both attention kernels, from fewer positions: each prompt once per batch."""
    from farmflow.models import FeatureMemo

    _, folder = reward_model
    model = reward_from_policy(folder, seed=0).eval()
    model.set_attn_implementation(attn)
    prompts = [p for p in PROMPTS[:3] for _ in range(6)] + [PROMPTS[0], "Hi"]
    outputs = RESPONSES[:18] + [RESPONSES[0], "a reply to a prompt of its own"]
    positions = []
    model.base_model.register_forward_hook(lambda _m, _a, out: positions.append(out[0].shape[0] * out[0].shape[1]))
    padded = score(model, tok, prompts, outputs, batch_size=5)
    read_padded = sum(positions)
    model.config.farmflow_packing = True
    positions.clear()
    packed = score(model, tok, prompts, outputs, batch_size=5)
    assert torch.allclose(packed, padded, atol=1e-5)
    assert len(set(padded.tolist())) == 19  # every distinct output (one repeats) scored differently: a mix-up shows
    assert sum(positions) < 0.8 * read_padded
    assert torch.allclose(score(model, tok, prompts, outputs, batch_size=7, memo=FeatureMemo()), padded, atol=1e-5)

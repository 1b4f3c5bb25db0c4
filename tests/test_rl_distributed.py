"""PPO and Quark on several processes: two CPU processes joined over gloo by `accelerate launch`.

One launch of this file as a script (`worker`) runs, on each of 2 processes: the global
statistics helpers on fixed tensors (each process holds half of them), a PPO rollout, one PPO
and one Quark optimizer step (Quark's 7 rows padded to 8), a short PPO and a short Quark
training on the toy task, and the process-count errors. It writes what each rank saw; the
tests compare that with one-process computations over the union of the shares. The stage
tests run the PPO and Quark stages of synthetic-micro through the `accelerate` launcher.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # rl_helpers, also when this file runs as the worker script

from rl_helpers import TOY_PROMPTS, ddp_config, digit_reward, micro_artifacts, toy_models  # noqa: E402

from farmflow.config import PPOConfig, QuarkConfig  # noqa: E402
from farmflow.methods import ppo, quark  # noqa: E402
from farmflow.methods import rl as rl_methods  # noqa: E402

# fixed tensors split between the processes: rows 0-2 are rank 0's, rows 3-5 rank 1's (4 columns wide: its last is
# padding)
GEN = torch.Generator().manual_seed(0)
X = torch.randn(6, 5, generator=GEN)
MASK = torch.tensor(
    [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
).float()
SCORES = torch.tensor(
    [0.3, -0.2, 0.9, 0.1, 0.9, 0.5, -1.0, 0.7, 0.4, 0.8]
)  # 5 per process; 0.9 twice (a tie across ranks)

TOY_PPO = PPOConfig(
    epochs=0.8,
    rollout_batch_size=24,
    step_batch_size=12,
    micro_batch_size=5,
    lr=3e-3,
    warmup_steps=0,
    kl_coef=0.05,
    max_new_tokens=6,
    penalty_reward_value=None,
    seed=1,
)
TOY_QUARK = QuarkConfig(
    epochs=0.8,
    rollout_batch_size=40,
    step_batch_size=7,
    micro_batch_size=3,
    grad_steps_per_rollout=2,
    lr=3e-3,
    warmup_steps=0,
    max_new_tokens=6,
    seed=1,
)  # pool 40 // 5 = 8, 7 rows per step: 4 + 3 and one padding row


ROLLOUT_KEYS = ("tokens", "response_mask", "logprobs", "values", "advantages", "returns")
ONE_STEP_PPO = TOY_PPO.model_copy(
    update={"step_batch_size": 24, "ppo_epochs": 1, "micro_batch_size": 1}
)  # the whole rollout
ONE_STEP_QUARK = TOY_QUARK.model_copy(
    update={"grad_steps_per_rollout": 1, "micro_batch_size": 4}
)  # 7 of a pool of 8: rows 0-3, 4-6


def one_ppo_update(batch: dict[str, torch.Tensor]) -> list[torch.nn.Module]:
    """One PPO optimizer step from the toy models on `batch` (this process's share), through a Runtime."""
    from farmflow.models.runtime import Runtime

    policy, _, value, _ = toy_models()
    rt = Runtime(policy, ONE_STEP_PPO.step_batch_size, ONE_STEP_PPO.micro_batch_size, "ppo")
    params = list({id(p): p for p in [*policy.parameters(), *value.parameters()]}.values())
    opt = torch.optim.AdamW(params, lr=1e-2, eps=1e-5)
    trained, wrapped_value, opt = rt.prepare(policy, value, opt)
    ppo._optimize(rt, trained, wrapped_value, opt, params, batch, ONE_STEP_PPO, seed=0)
    return [policy, value]


def fixed_pool() -> dict[str, torch.Tensor]:
    """8 (prompt, response) rows with fixed random responses: a Quark pool."""
    _, _, _, tok = toy_models()
    gen = torch.Generator().manual_seed(5)
    responses = [
        torch.randint(5, 300, (int(n),), generator=gen).tolist() for n in torch.randint(1, 7, (8,), generator=gen)
    ]
    return rl_methods.pack(tok, TOY_PROMPTS[:8], responses, 64 - ONE_STEP_QUARK.max_new_tokens)


def one_quark_update(pool: dict[str, torch.Tensor]) -> list[torch.nn.Module]:
    """One Quark optimizer step from the toy policy on 7 rows of `pool` (padded to 8 on 2 processes), through a
    Runtime."""
    from farmflow.models.runtime import Runtime, num_processes

    policy, ref, _, _ = toy_models()
    n = num_processes()
    rt = Runtime(policy, -(-ONE_STEP_QUARK.step_batch_size // n) * n, ONE_STEP_QUARK.micro_batch_size, "quark")
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2, eps=1e-5)
    trained, opt = rt.prepare(policy, opt)
    quark._optimize(rt, trained, ref.eval(), opt, pool, ONE_STEP_QUARK, seed=0)
    return [policy]


# ------------------------------------------------------------------------------- the worker
def _share(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t[:3] if rank == 0 else t[3:, :4]


def _save_weights(path: Path, *modules: torch.nn.Module) -> None:
    from safetensors.torch import save_file

    save_file(
        {f"{i}.{k}": v.detach().clone().contiguous() for i, m in enumerate(modules) for k, v in m.state_dict().items()},
        str(path),
    )


def worker(out: Path) -> None:
    """Run under `accelerate launch --num_processes 2`: every rank writes rank<r>.json and its trained weights."""
    from farmflow.models.runtime import process_state

    state = process_state()
    rank, seen = state.process_index, {"processes": state.num_processes}
    x, mask = _share(X, rank), _share(MASK, rank)
    seen["whiten"] = rl_methods.masked_whiten(x, mask).tolist()
    seen["whiten_keep_mean"] = rl_methods.masked_whiten(x, mask, shift_mean=False).tolist()
    seen["row_mean"] = rl_methods.global_mean(x.sum(1)).item()
    responses = [[rank, i] for i in range(5)]
    got, scores, ended = rl_methods.gather_rollout(
        responses, SCORES[5 * rank : 5 * rank + 5], torch.tensor([rank == 0] * 5)
    )
    seen["gathered"] = {
        "responses": got,
        "scores": scores.tolist(),
        "ended": ended.tolist(),
        "keep": quark.top_quantile(scores, 3).tolist(),
    }

    policy, ref, value, tok = toy_models()
    batch, stats = ppo.rollout(
        policy,
        ref,
        value,
        digit_reward,
        tok,
        TOY_PROMPTS[12 * rank : 12 * rank + 12],
        TOY_PPO,
        seed=rl_methods.share_seed(7, rank),
    )
    seen["rollout"] = {"stats": stats, **{k: batch[k].tolist() for k in ROLLOUT_KEYS}}
    _save_weights(out / f"rank{rank}-ppo-step.safetensors", *one_ppo_update(batch))
    _save_weights(out / f"rank{rank}-quark-step.safetensors", *one_quark_update(fixed_pool()))

    policy, ref, value, tok = toy_models()
    summary, history = ppo.train_ppo(policy, ref, value, digit_reward, tok, TOY_PROMPTS, TOY_PPO)
    seen["ppo"] = {"summary": summary, "history": history}
    _save_weights(out / f"rank{rank}-ppo.safetensors", policy, value)

    policy, ref, _, tok = toy_models()
    summary, history = quark.train_quark(policy, ref, digit_reward, tok, TOY_PROMPTS, TOY_QUARK)
    seen["quark"] = {"summary": summary, "history": history}
    _save_weights(out / f"rank{rank}-quark.safetensors", policy)

    errors = {}
    for name, train, cfg in [
        ("ppo_rollout", ppo.train_ppo, PPOConfig(rollout_batch_size=23, step_batch_size=12, max_new_tokens=6)),
        ("ppo_step", ppo.train_ppo, PPOConfig(rollout_batch_size=24, step_batch_size=11, max_new_tokens=6)),
        ("quark_rollout", quark.train_quark, QuarkConfig(rollout_batch_size=23, max_new_tokens=6)),
    ]:
        policy, ref, value, tok = toy_models()
        try:
            train(policy, ref, *([value] if train is ppo.train_ppo else []), digit_reward, tok, TOY_PROMPTS, cfg)
        except ValueError as e:
            errors[name] = str(e)
    seen["errors"] = errors
    (out / f"rank{rank}.json").write_text(json.dumps(seen))


# -------------------------------------------------------------------- one process (fast)
def test_in_one_process_the_helpers_are_the_local_computation():
    assert torch.equal(rl_methods.global_mean(X), X.mean()) and torch.equal(
        rl_methods.global_mean(X, MASK), rl_methods.masked_mean(X, MASK)
    )
    responses, ended = [[1, 2], [3]], torch.tensor([True, False])
    got = rl_methods.gather_rollout(responses, SCORES[:2], ended)
    assert got[0] is responses and torch.equal(got[1], SCORES[:2]) and torch.equal(got[2], ended)
    assert rl_methods.share_seed(1_000_003, 0) == 1_000_003  # rank 0 (and one process) samples exactly as before
    seeds = {rl_methods.share_seed(s, r) for s in range(50) for r in range(1, 9)}
    assert len(seeds) == 400 and all(0 <= x < 2**32 for x in seeds)  # distinct within torch's 32-bit CPU seeds


def test_a_batch_that_does_not_split_names_the_field():
    rl_methods.check_shares("ppo", 8, rollout_batch_size=512, step_batch_size=256)
    with pytest.raises(
        ValueError, match=r"^quark.rollout_batch_size \(100\) does not divide evenly between the 8 processes"
    ):
        rl_methods.check_shares("quark", 8, rollout_batch_size=100)


def test_local_micro_batches_are_the_share_counted_from_zero():
    from farmflow.models.runtime import Runtime

    policy = toy_models()[0]
    rt = Runtime(policy, 12, 5, "ppo")
    assert rt.processes == 1 and rt.local_micro_batches() == rt.micro_batches() == [
        slice(0, 5),
        slice(5, 10),
        slice(10, 12),
    ]
    assert Runtime(policy, 12, None, "ppo").local_micro_batches() == [slice(0, 12)]


# ------------------------------------------------------------------ two processes (slow)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[list[dict], Path]:
    from farmflow.loopback import free_port

    out = tmp_path_factory.mktemp("rl-distributed")
    argv = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ddp_config(out)),
        "--main_process_port",
        str(free_port()),
        __file__,
        "worker",
        str(out),
    ]
    src = str(TESTS.parent / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)], out


@pytest.mark.slow  # one accelerate launch of 2 processes for the module (~35 s)
def test_whitening_and_means_span_both_processes(ranks):
    seen, _ = ranks
    assert [s["processes"] for s in seen] == [2, 2]
    # the one-process computation over the union of the shares (rank 1's rows padded back to 5 columns)
    union = rl_methods.masked_whiten(X, MASK)
    got = torch.cat([torch.tensor(seen[0]["whiten"]), torch.nn.functional.pad(torch.tensor(seen[1]["whiten"]), (0, 1))])
    assert torch.allclose(got, union, atol=1e-5)
    assert rl_methods.masked_mean(got, MASK).item() == pytest.approx(0.0, abs=1e-6)
    assert rl_methods.masked_mean(got**2, MASK).item() == pytest.approx(1.0, abs=1e-4)
    local = rl_methods.masked_whiten(X[:3], MASK[:3])  # what whitening rank 0's share alone would give: not that
    assert (local - got[:3]).abs().max() > 0.1
    kept = torch.cat(
        [
            torch.tensor(seen[0]["whiten_keep_mean"]),
            torch.nn.functional.pad(torch.tensor(seen[1]["whiten_keep_mean"]), (0, 1)),
        ]
    )
    assert torch.allclose(kept, rl_methods.masked_whiten(X, MASK, shift_mean=False), atol=1e-5)
    # by hand: the mean of the 6 row sums the two processes hold (rank 1's rows are 4 columns wide)
    row_sums = torch.cat([X[:3].sum(1), X[3:, :4].sum(1)])
    assert seen[0]["row_mean"] == seen[1]["row_mean"] == pytest.approx(row_sums.mean().item(), abs=1e-6)


@pytest.mark.slow
def test_quark_pool_is_ranked_over_the_gathered_rollout(ranks):
    seen, _ = ranks
    for s in seen:
        g = s["gathered"]
        assert g["responses"] == [[0, i] for i in range(5)] + [[1, i] for i in range(5)]
        assert g["scores"] == pytest.approx(SCORES.tolist()) and g["ended"] == [True] * 5 + [False] * 5
        assert g["keep"] == quark.top_quantile(SCORES, 3).tolist() == [2, 4, 9]  # the tie 0.9/0.9 keeps rank order


@pytest.mark.slow
def test_ppo_rollout_statistics_are_those_of_the_union(ranks):
    seen, _ = ranks
    r0, r1 = seen[0]["rollout"], seen[1]["rollout"]
    assert r0["stats"] == r1["stats"]  # every process logs the same numbers
    from farmflow.models import decode_response

    _, _, _, tok = toy_models()
    texts, lengths = [], []
    for r, rank in ((r0, 0), (r1, 1)):
        for tokens, mask in zip(r["tokens"], r["response_mask"]):
            ids = [t for t, m in zip(tokens, mask) if m]
            texts.append(decode_response(tok, ids))
            lengths.append(len(ids))
    prompts = TOY_PROMPTS[:24]
    assert r0["stats"]["reward"] == pytest.approx(digit_reward(prompts, texts).mean().item(), abs=1e-6)
    assert r0["stats"]["response_tokens"] == pytest.approx(sum(lengths) / 24, abs=1e-6)
    # advantages are whitened over both shares together
    adv = [a for r in (r0, r1) for row, m in zip(r["advantages"], r["response_mask"]) for a, k in zip(row, m) if k]
    mean = sum(adv) / len(adv)
    assert mean == pytest.approx(0.0, abs=1e-5) and sum((a - mean) ** 2 for a in adv) / len(adv) == pytest.approx(
        1.0, abs=1e-3
    )
    # the two shares sampled different responses (their own seeds)
    assert r0["tokens"] != r1["tokens"]


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _union_batch(shares: list[dict]) -> dict[str, torch.Tensor]:
    """The two processes' rollout shares as one batch: packed again (prompts, responses), response columns padded
    right."""
    _, _, _, tok = toy_models()
    responses = [
        [t for t, m in zip(row, mask) if m] for s in shares for row, mask in zip(s["tokens"], s["response_mask"])
    ]
    batch = rl_methods.pack(tok, TOY_PROMPTS[:24], responses, 64 - TOY_PPO.max_new_tokens)
    width = batch["tokens"].shape[1]
    for k in ROLLOUT_KEYS[2:]:
        rows = [torch.nn.functional.pad(torch.tensor(s[k]), (0, width - len(s[k][0]))) for s in shares]
        batch[k] = torch.cat(rows)
    return batch


@pytest.mark.slow
def test_one_ppo_update_on_two_processes_equals_one_process_on_the_union(ranks):
    """DDP through Runtime: one optimizer step over the whole rollout (each process holding half) = one process over
    all of it."""
    seen, out = ranks
    a, b = _weights(out / "rank0-ppo-step.safetensors"), _weights(out / "rank1-ppo-step.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    batch = _union_batch([seen[0]["rollout"], seen[1]["rollout"]])
    assert torch.equal(
        batch["response_mask"].sum(1), torch.tensor([sum(m) for s in seen for m in s["rollout"]["response_mask"]])
    )
    one = {f"{i}.{k}": v for i, m in enumerate(one_ppo_update(batch)) for k, v in m.state_dict().items()}
    start = {f"{i}.{k}": v for i, m in enumerate(toy_models()[::2][:2]) for k, v in m.state_dict().items()}
    moved = 0
    for k in one:
        assert torch.allclose(a[k], one[k], atol=1e-5, rtol=1e-4), f"{k}: max diff {(a[k] - one[k]).abs().max():.2e}"
        moved += not torch.equal(one[k], start[k])
    assert moved > len(one) // 2  # the step changed most tensors (the value head starts at 0, so ~all of them)


@pytest.mark.slow
def test_one_quark_update_with_a_padded_share_equals_one_process(ranks):
    """7 rows over 2 processes (4 + 3 and a masked padding row): the same step as one process on the 7 rows."""
    _, out = ranks
    a, b = _weights(out / "rank0-quark-step.safetensors"), _weights(out / "rank1-quark-step.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    one = {f"0.{k}": v for k, v in one_quark_update(fixed_pool())[0].state_dict().items()}
    start = {f"0.{k}": v for k, v in toy_models()[0].state_dict().items()}
    assert any(not torch.equal(one[k], start[k]) for k in one)
    for k in one:
        assert torch.allclose(a[k], one[k], atol=1e-5, rtol=1e-4), f"{k}: max diff {(a[k] - one[k]).abs().max():.2e}"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ppo", "quark"])
def test_both_ranks_train_to_identical_weights(ranks, method):
    seen, out = ranks
    a, b = _weights(out / f"rank0-{method}.safetensors"), _weights(out / f"rank1-{method}.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    policy, _, value, _ = toy_models()
    start = {f"0.{k}": v for k, v in policy.state_dict().items()}
    assert any(not torch.equal(a[k], start[k]) for k in start)  # it trained
    h0, h1 = seen[0][method]["history"], seen[1][method]["history"]
    assert h0 == h1 and len(h0) == int(0.8 * len(TOY_PROMPTS) / (24 if method == "ppo" else 40))
    assert seen[0][method]["summary"]["processes"] == 2.0
    assert all(math.isfinite(v) for h in h0 for v in h.values())
    if method == "quark":  # the pool threshold is the 8th best of all 40 samples; the padding row weighs nothing
        assert all(h["pool_reward"] >= h["pool_threshold"] for h in h0)
        assert all(0 < h["nll"] < 20 and h["kl"] >= 0 for h in h0)


@pytest.mark.slow
def test_a_batch_that_does_not_split_between_the_processes_is_one_clear_error(ranks):
    seen, _ = ranks
    for s in seen:
        assert s["errors"] == {
            "ppo_rollout": "ppo.rollout_batch_size (23) does not divide evenly between the 2 processes "
            "(execution.num_processes): "
            "every process takes an equal share of each batch",
            "ppo_step": "ppo.step_batch_size (11) does not divide evenly between the 2 processes "
            "(execution.num_processes): "
            "every process takes an equal share of each batch",
            "quark_rollout": "quark.rollout_batch_size (23) does not divide evenly between the 2 processes "
            "(execution.num_processes): "
            "every process takes an equal share of each batch",
        }


# ------------------------------------------------------------------------ the stages, launched
@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    return micro_artifacts(tmp_path_factory.mktemp("rl-dist-micro") / "store")


def _stage(method: str, micro: dict):
    from farmflow.tasks import rl

    task, config = (
        (rl.ppo_task, micro["cfg"].ppo.model_copy(update={"snapshot_every": 2}))
        if method == "ppo"
        else (rl.quark_task, micro["cfg"].quark)
    )
    return task, config, dict(data=micro["data"], sft=micro["sft"], reward=micro["reward"])


@pytest.mark.slow  # an accelerate launch of the stage per method (~30 s each)
@pytest.mark.parametrize("method", ["ppo", "quark"])
def test_stage_on_two_processes_commits_the_inline_key_and_record(micro, method, tmp_path):
    import shutil

    from farmflow.config import ExecutionConfig
    from farmflow.models import load_policy
    from farmflow.storage import open_store
    from farmflow.tasks import rl
    from farmflow.tasks.core import launching

    task, config, inputs = _stage(method, micro)
    uri = str(tmp_path / "store")
    shutil.copytree(micro["uri"], uri, ignore=shutil.ignore_patterns("ppo", "quark"))  # the same upstream artifacts
    with launching(ExecutionConfig(launcher="accelerate", accelerate_config=str(ddp_config(tmp_path)))):
        two = task.fn(uri, config, **inputs)
    inline = task.fn(micro["uri"], config, **inputs)
    assert two.key == inline.key and two.stage == inline.stage == method
    assert two.metrics["processes"] == 2.0 and inline.metrics["processes"] == 1.0
    assert two.metrics["steps"] == inline.metrics["steps"] == 5 and len(rl.read_history(uri, two)) == 5
    rec_two, rec_inline = open_store(uri).record(two), open_store(micro["uri"]).record(inline)
    assert rec_two["config"] == rec_inline["config"] and rec_two["inputs"] == rec_inline["inputs"]
    sft = dict(load_policy(open_store(uri).model_dir(micro["sft"]))[0].named_parameters())
    trained = dict(load_policy(open_store(uri).model_dir(two))[0].named_parameters())
    assert trained.keys() == sft.keys() and any(not torch.equal(trained[k], sft[k]) for k in sft)  # it trained
    assert not list((Path(uri) / ".staging").iterdir())
    if method == "ppo":  # snapshots for over-optimization curves: written by rank 0, committed by the parent
        assert sorted(rl.ppo_snapshots(uri, two)) == sorted(rl.ppo_snapshots(micro["uri"], inline)) == [2, 4]


@pytest.mark.slow
def test_a_rollout_that_does_not_split_is_one_clear_launch_error(micro, tmp_path):
    from farmflow.config import ExecutionConfig
    from farmflow.tasks.core import launching
    from farmflow.tasks.launch import StageLaunchError

    task, config, inputs = _stage("ppo", micro)
    bad = config.model_copy(update={"rollout_batch_size": 45})
    with (
        launching(ExecutionConfig(launcher="accelerate", accelerate_config=str(ddp_config(tmp_path)))),
        pytest.raises(StageLaunchError) as err,
    ):
        task.fn(micro["uri"], bad, **inputs)
    message = str(err.value)
    assert message.startswith("stage ppo: accelerate launch exited with code 1; the last lines of its log:")
    assert message.splitlines()[-1] == (
        "ValueError: ppo.rollout_batch_size (45) does not divide evenly between the 2 processes "
        "(execution.num_processes): every process takes an equal share of each batch"
    )
    assert err.value.__cause__ is None and err.value.__context__ is None
    from farmflow.tasks.core import lookup

    assert lookup("ppo", micro["uri"], bad, **inputs)[2] is None  # nothing committed


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(Path(sys.argv[2]))

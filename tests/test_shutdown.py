"""Stopping: every training loop checkpoints when asked to stop and resumes to the weights of an uninterrupted run;
`farmflow run` stops within seconds on SIGTERM and leaves no process behind on SIGKILL."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from prefect_server import migrated_home
from procs import python_env
from rl_helpers import TOY_PROMPTS, digit_reward, toy_models
from test_models import CFG, PROMPTS, RESPONSES

from farmflow import shutdown
from farmflow.config import DPOConfig, PPOConfig, QuarkConfig, RewardConditioningConfig, RewardConfig, SFTConfig
from farmflow.methods import dpo, expert_iteration, feedme, ppo, quark, reward, reward_conditioning, sft
from farmflow.models import build_policy, train_tokenizer
from farmflow.models.checkpoint import Checkpointer
from farmflow.storage import LocalStore

STOP_AT = 2  # the stop request arrives once this many steps are done


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(PROMPTS + RESPONSES, vocab_size=384)


def _policy(tok):
    torch.manual_seed(0)
    return build_policy(CFG, tok)


def _rows(n=16):
    return [
        {"instruction": PROMPTS[i], "input": "", "output_1": RESPONSES[i], "output_2": RESPONSES[i + n]}
        | {"preference": 1.0 + (i % 2)}
        for i in range(n)
    ]


SMALL = SFTConfig(epochs=1, batch_size=4, lr=1e-3, warmup_ratio=0.2)


def _case(name, tok):
    """(fresh models -> the trained modules, train(models, checkpointer) -> final loss) of one training loop."""
    if name in ("sft", "feedme", "reward_conditioning", "expert_iteration"):

        def train(models, ckpt):
            (m,) = models
            if name == "sft":
                out = sft.train_sft(m, tok, PROMPTS[:16], RESPONSES[:16], SMALL, 128, ckpt)
            elif name == "feedme":
                out = feedme.train_feedme(m, tok, _rows(), SMALL, 128, ckpt)
            elif name == "expert_iteration":
                out = expert_iteration.train_expert_iteration(m, tok, PROMPTS[:16], RESPONSES[:16], SMALL, 128, ckpt)
            else:
                rc = RewardConditioningConfig(train=SFTConfig(epochs=1, batch_size=8, lr=1e-3))
                out = reward_conditioning.train_reward_conditioning(m, copy.deepcopy(tok), _rows(), rc, 128, ckpt)
            return out["train_loss_last"]

        return lambda: [_policy(tok)], train
    if name == "reward":
        from farmflow.models import reward_from_policy, save

        def fresh():
            folder = Path(os.environ["FARMFLOW_TEST_TMP"]) / "sft-for-reward"
            if not folder.exists():
                save(_policy(tok), tok, folder)
            return [reward_from_policy(folder, seed=0)]

        def train(models, ckpt):
            rows, cfg = _rows(), RewardConfig(epochs=1, batch_size=4, lr=1e-3)
            out = reward.train_reward(
                models[0], tok, PROMPTS[:16], [r["output_1"] for r in rows], [r["output_2"] for r in rows],
                [r["preference"] for r in rows], cfg, 128, ckpt,
            )  # fmt: skip
            return out["train_loss_last"]

        return fresh, train
    if name == "dpo":

        def train(models, ckpt):
            m, ref = models
            out_1, out_2 = RESPONSES[:16], RESPONSES[16:32]
            ref_1, ref_2 = dpo.reference_logps(ref, tok, PROMPTS[:16], out_1, out_2, 128)
            cfg = DPOConfig(epochs=1, batch_size=4, lr=1e-3)
            out = dpo.train_dpo(m, tok, PROMPTS[:16], out_1, out_2, [1.0, 2.0] * 8, ref_1, ref_2, cfg, 128, ckpt)
            return out["train_loss_last"]

        return lambda: [_policy(tok), _policy(tok)], train

    def fresh_rl():
        policy, ref, value, rl_tok = toy_models()
        return [policy, ref, value, rl_tok]

    def train_rl(models, ckpt):
        policy, ref, value, rl_tok = models
        common = dict(rollout_batch_size=12, step_batch_size=6, micro_batch_size=12, max_new_tokens=4, lr=1e-3)
        if name == "ppo":
            cfg = PPOConfig(epochs=4 * 12 / 24, warmup_steps=0, **common)
            summary, _ = ppo.train_ppo(policy, ref, value, digit_reward, rl_tok, TOY_PROMPTS[:24], cfg, ckpt)
        else:
            cfg = QuarkConfig(epochs=4 * 12 / 24, warmup_steps=0, num_quantiles=2, **common)
            summary, _ = quark.train_quark(policy, ref, digit_reward, rl_tok, TOY_PROMPTS[:24], cfg, ckpt)
        return summary["steps"]

    return fresh_rl, train_rl


class StopAt(Checkpointer):
    """A checkpointer whose process gets SIGTERM (what the handler does: `shutdown.request`) after step STOP_AT."""

    def save(self, step, **kw):
        if step == STOP_AT:
            shutdown.request(signal.SIGTERM)
        return super().save(step, **kw)


@pytest.mark.parametrize(
    "method", ["sft", "feedme", "reward_conditioning", "expert_iteration", "reward", "dpo", "ppo", "quark"]
)
def test_a_stop_checkpoints_and_the_rerun_resumes_to_the_same_weights(method, tok, tmp_path, monkeypatch):
    monkeypatch.setenv("FARMFLOW_TEST_TMP", str(tmp_path))
    fresh, train = _case(method, tok)
    straight = fresh()
    final_straight = train(straight, None)

    store = LocalStore(tmp_path / "store")
    shutdown.reset()
    stopped = fresh()
    try:
        with pytest.raises(shutdown.Stopped, match=f"stopped after step {STOP_AT} .checkpoint at step {STOP_AT}"):
            train(stopped, StopAt(store, method, "k", every_seconds=3600))  # by time: only the stop saves
        assert store.latest_checkpoint(method, "k")[0] == STOP_AT
        assert shutdown.notes() == [f"{method}: stopped after step {STOP_AT} (checkpoint at step {STOP_AT}, a rerun "
                                    "resumes there)"]  # fmt: skip
    finally:
        shutdown.reset()
    resumed = fresh()  # a new process starts from the initial weights
    final_resumed = train(resumed, Checkpointer(store, method, "k", every_seconds=3600))
    assert final_resumed == pytest.approx(final_straight, rel=1e-5)
    trained = [m for m in straight if isinstance(m, torch.nn.Module)]
    for a, b in zip(trained, [m for m in resumed if isinstance(m, torch.nn.Module)], strict=True):
        for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
            assert torch.allclose(pa, pb, atol=1e-6)


def test_a_stage_does_not_start_after_a_stop(tmp_path):
    from farmflow.flows.runner import StageRunner

    runner = StageRunner(str(tmp_path / "store"))
    shutdown.request(signal.SIGINT)
    try:
        with pytest.raises(shutdown.Stopped, match="sft: not started"):
            runner(type("T", (), {"name": "sft"})(), None)
    finally:
        shutdown.reset()
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").iterdir())


# ------------------------------------------------------------------ the CLI process
def _farmflow(args, tmp_path, env=None, **kw):
    home = migrated_home(tmp_path / "prefect")
    env = python_env() | {"PREFECT_HOME": str(home), "FARMFLOW_LOG_DIR": str(tmp_path / "logs")} | (env or {})
    env.pop("PREFECT_API_URL", None)
    cmd = [sys.executable, "-c", "from farmflow.cli import main; main()", *args]
    return subprocess.Popen(cmd, env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True, **kw)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_for_server(proc, deadline_s=240.0) -> int:
    """The pid of the temporary Prefect server `proc` started (its child running uvicorn)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and proc.poll() is None:
        for child in _children(proc.pid):
            if "uvicorn" in Path(f"/proc/{child}/cmdline").read_text(errors="replace"):
                return child
        time.sleep(0.2)
    raise AssertionError(f"no temporary server (rc {proc.poll()})")


@pytest.mark.slow
def test_sigkill_of_a_run_leaves_no_temporary_server(tmp_path):
    proc = _farmflow(["run", "dpo", "--preset", "synthetic-micro", "--store", str(tmp_path / "store")], tmp_path)
    server = _wait_for_server(proc)
    assert "guard.py" in Path(f"/proc/{server}/cmdline").read_text()
    proc.kill()
    proc.wait(10)
    end = time.monotonic() + 15
    while _alive(server) and time.monotonic() < end:
        time.sleep(0.1)
    alive = _alive(server)
    if alive:
        os.kill(server, signal.SIGKILL)
    assert not alive, "the temporary Prefect server outlived its killed parent"


@pytest.mark.slow
def test_sigterm_reaches_a_launched_training_child_which_checkpoints(tmp_path):
    """execution.launcher=process: SFT trains in a child process. SIGTERM to `farmflow run` is passed on to the child,
    which saves a checkpoint in the store and stops; the command says what was saved and exits 143, and no child is
    left. (That a rerun resumes from such a checkpoint to the same weights: the test above, for every loop.)"""
    import re
    import threading

    store = tmp_path / "store"
    args = ["run", "best-of-n", "--preset", "synthetic-micro", "--store", str(store)]
    # 3200 steps (~70 s): the stop comes at the first progress line, long before SFT could finish on a busy machine
    args += ["--set", "execution.launcher=process", "--set", "sft.epochs=400"]
    env = {"FARMFLOW_PROGRESS_EVERY_S": "1", "PREFECT_LOGGING_LEVEL": "INFO"}  # the child's progress, relayed
    proc = _farmflow(args, tmp_path, env=env)
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(line) for line in proc.stderr], daemon=True).start()
    deadline, child = time.monotonic() + 300, None
    while not any(re.search(r"sft: [1-9]\d*/3200 steps", line) for line in lines):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
        child = child or next(
            (c for c in _children(proc.pid) if b"farmflow.tasks.child" in Path(f"/proc/{c}/cmdline").read_bytes()),
            None,
        )
        time.sleep(0.2)
    assert child is not None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM, "".join(lines)[-3000:]
    time.sleep(0.5)  # the reader thread's last lines
    (error,) = [line for line in lines if line.startswith("error: ")]
    stopped = re.search(r"stopped by SIGTERM; sft: stopped after step (\d+) \(checkpoint at step \1", error)
    assert stopped, error
    step = int(stopped[1])
    assert 0 < step < 3200 and not _alive(child), "the launched child outlived the stopped run"
    (key,) = [p.name for p in (store / "_checkpoints" / "sft").iterdir()]
    assert LocalStore(store).latest_checkpoint("sft", key)[0] == step

"""SFT's snapshots: the policy after chosen epochs of the one SFT run (the validation study's shorter-trained SFT
baselines), committed beside it without changing its key."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from farmflow import tasks
from farmflow.config import SFTConfig, load_config
from farmflow.data import prompts_of, split_rows
from farmflow.storage import open_store
from farmflow.tasks.registry import sft_snapshots_complete


@pytest.fixture
def upstream(tmp_path):
    cfg = load_config("synthetic-micro", [f"store.uri={tmp_path / 'store'}"])
    uri = cfg.store.location
    data = tasks.data_task.fn(uri, cfg.data)
    return uri, cfg, data, tasks.base_model_task.fn(uri, cfg.model, data=data)


def _weights(uri, ref):
    from farmflow.models import load_policy

    return list(load_policy(open_store(uri).model_dir(ref))[0].parameters())


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_snapshots_are_added_to_a_committed_sft_run_under_its_key(upstream):
    uri, cfg, data, base = upstream
    two_epochs = cfg.sft.model_copy(update={"epochs": 2.0})  # 120 examples, batch 16: 8 steps an epoch, 16 in all
    tasks.EXECUTED.clear()
    first = tasks.sft_task.fn(uri, two_epochs, data=data, base=base)
    # 1.03 epochs round to step 8 like 1.0: both are committed
    asked = SFTConfig.model_validate(two_epochs.model_dump() | {"snapshot_epochs": (0.5, 1.0, 1.03)})
    store = open_store(uri)
    assert sft_snapshots_complete(store, first, two_epochs) and not sft_snapshots_complete(store, first, asked)

    again = tasks.sft_task.fn(uri, asked, data=data, base=base)
    assert again == first and tasks.EXECUTED["sft"] == 2  # the same key, trained again with the same seed
    snaps = {e: tasks.sft_snapshot(uri, first, e) for e in asked.snapshot_epochs}
    assert {e: (s.stage, s.metrics["step"], s.metrics["epochs"]) for e, s in snaps.items()} == {
        0.5: ("sft_snapshot", 4.0, 0.5),
        1.0: ("sft_snapshot", 8.0, 1.0),
        1.03: ("sft_snapshot", 8.0, 1.03),
    }
    assert all(store.record(s)["inputs"] == {"sft": first.key} for s in snaps.values())
    half, one, one_and_a_bit = (_weights(uri, snaps[e]) for e in (0.5, 1.0, 1.03))
    final, untrained = _weights(uri, first), _weights(uri, base)
    assert _same(one, one_and_a_bit)  # the same step's policy
    for a, b in ((untrained, half), (half, one), (one, final)):  # each is its own step's policy: 0, 4, 8, then 16
        assert not _same(a, b)

    tasks.sft_task.fn(uri, asked, data=data, base=base)
    assert tasks.EXECUTED["sft"] == 2  # complete now: a hit
    with pytest.raises(LookupError, match=r"has no snapshot after 1\.5 epochs \(sft\.snapshot_epochs\)"):
        tasks.sft_snapshot(uri, first, 1.5)


def test_a_run_stopped_at_a_snapshot_takes_it_when_resumed(upstream):
    """The snapshot is taken before its step's checkpoint, so a run that dies taking it resumes before that step and
    takes it then; one that dies after the checkpoint has committed it."""
    from farmflow.methods.sft import train_sft
    from farmflow.models import load_policy
    from farmflow.models.checkpoint import Checkpointer

    uri, cfg, data, base = upstream
    store = open_store(uri)
    rows = split_rows(store.read_table(data), "sft")
    prompts, responses = prompts_of(rows), [r["output"] for r in rows]
    sft = SFTConfig.model_validate(cfg.sft.model_dump() | {"snapshot_epochs": (0.5,)})  # 8 steps; the snapshot at 4
    taken = []

    def dies_there(epochs, step, model):
        taken.append(step)
        raise RuntimeError("the machine went away")

    model, tok = load_policy(store.model_dir(base))
    with pytest.raises(RuntimeError, match="went away"):
        train_sft(model, tok, prompts, responses, sft, 128, Checkpointer(store, "sft", "k", 1, 0), snapshot=dies_there)
    assert store.latest_checkpoint("sft", "k")[0] == 3
    model, tok = load_policy(store.model_dir(base))
    metrics = train_sft(
        model,
        tok,
        prompts,
        responses,
        sft,
        128,
        Checkpointer(store, "sft", "k", 1, 0),
        snapshot=lambda epochs, step, m: taken.append(step),
    )
    assert taken == [4, 4] and metrics["resumed_from_step"] == 3.0 and metrics["steps"] == 8.0


def test_snapshot_epochs_lie_inside_the_run():
    with pytest.raises(ValidationError, match=r"snapshot_epochs must lie between 0 and epochs \(2\), got \[2\.0\]"):
        SFTConfig(epochs=2, snapshot_epochs=(1.0, 2.0))

"""What enters a stage key: operational settings (limits, prices, secrets' locations) do not."""

import pytest

from farmflow.config import load_config
from farmflow.storage import canonical_json, open_store, stage_key
from farmflow.tasks.core import key_config


def _annotate_key(overrides):
    cfg = load_config("synthetic-micro", overrides)
    return stage_key("annotate", "1", key_config(cfg.annotation), {"pairs": "k"})


def test_operational_annotator_settings_do_not_change_the_key():
    base = _annotate_key([])
    for override in (
        "annotation.max_in_flight=4", "annotation.timeout_s=5", "annotation.max_retries=0", "annotation.chunk_size=7",
        "annotation.max_cost_usd=3.5", "annotation.requests_per_minute=60", "annotation.rate_limit_name=\"other\"",
        "annotation.api_key_env=\"MY_KEY\"", "annotation.api_key_secret=\"block\"",
    ):
        assert _annotate_key([override]) == base, override
    # what the annotators decide with does change it
    for override in ("annotation.label_noise=0.1", "annotation.seed=3", "annotation.base_url=\"http://127.0.0.1:1/v1\""):
        assert _annotate_key([override]) != base, override


def test_an_api_judge_from_the_environment_or_a_new_prompt_version_is_a_new_key(monkeypatch):
    """annotate/evaluate keys include $OPENAI_BASE_URL (every preset leaves base_url unset) and the prompt version, so
    switching judges or prompts labels again instead of reusing the other judges' or prompt's labels."""
    from farmflow.annotators import prompts

    def key():
        return _annotate_key(["annotation=p_sim_ann", "annotation.max_in_flight=3"])

    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    openai_judges = key()
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")
    local_judges = key()
    assert local_judges != openai_judges
    monkeypatch.setattr(prompts, "PROMPT_VERSION", prompts.PROMPT_VERSION + "-next")
    assert key() != local_judges
    assert "judges" not in key_config(load_config("synthetic-micro").annotation)  # the offline oracle: unchanged


def test_key_config_is_the_plain_dump_when_nothing_is_excluded():
    cfg = load_config("synthetic-micro")
    assert canonical_json(key_config(cfg.data)) == canonical_json(cfg.data)
    for section in (cfg.sft, cfg.dpo):  # micro_batch_size is operational (not in the key)
        assert canonical_json(key_config(section)) == canonical_json(section.model_dump(exclude={"micro_batch_size"}))
    ei = cfg.expert_iteration.model_dump(exclude={"train": {"micro_batch_size"}})
    assert canonical_json(key_config(cfg.expert_iteration)) == canonical_json(ei)
    for section in (cfg.ppo, cfg.quark):  # so is theirs (it is also their sampling batch; samples do not depend on it)
        operational = {"micro_batch_size", "snapshot_every"} & set(type(section).model_fields)  # snapshots: extra artifacts
        assert canonical_json(key_config(section)) == canonical_json(section.model_dump(exclude=operational))
    # generation.backend and batch_size are operational (not in the key)
    generate = {"sample": cfg.generation, "generator": "sft", "control": ""}
    expected = generate | {"sample": cfg.generation.model_dump(exclude={"backend", "batch_size"})}
    assert canonical_json(key_config(generate)) == canonical_json(expected)


def test_unvalidated_copies_make_the_same_key():
    """model_copy(update=...) skips validation: an int in a float field must not change the key."""
    cfg = load_config("synthetic-micro")
    copied = cfg.dpo.model_copy(update={"epochs": 2})
    assert isinstance(copied.epochs, int)
    assert stage_key("dpo", "1", key_config(copied)) == stage_key("dpo", "1", key_config(cfg.dpo.model_copy(update={"epochs": 2.0})))
    wrapped = {"sample": cfg.generation.model_copy(update={"temperature": 1}), "generator": "sft"}
    assert canonical_json(key_config(wrapped)) == canonical_json(key_config({"sample": cfg.generation.model_copy(update={"temperature": 1.0}), "generator": "sft"}))


def test_a_local_pretrained_folder_is_keyed_by_its_contents(tmp_path):
    """A local base model is keyed by its files, not its path: a model saved again into the same folder is a new key."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from test_models import CFG, PROMPTS, RESPONSES

    from farmflow.config import ModelConfig
    from farmflow.models import build_policy, save, train_tokenizer

    tok = train_tokenizer(PROMPTS + RESPONSES, vocab_size=384)
    folder = tmp_path / "base"
    save(build_policy(CFG, tok), tok, folder)
    cfg = ModelConfig(pretrained=str(folder))
    first = key_config(cfg)
    assert key_config(cfg) == first and "pretrained_files" in first  # deterministic
    save(build_policy(CFG.model_copy(update={"seed": 1}), tok), tok, folder)  # other weights, same folder and shapes
    assert key_config(cfg) != first
    assert key_config(ModelConfig(pretrained="org/model", revision="abc123")) != key_config(ModelConfig(pretrained="org/model"))
    assert "pretrained_files" not in key_config(ModelConfig())  # the synthetic farm's model: unchanged


def test_part_key_narrows_an_input_to_the_parts_a_stage_reads():
    from farmflow.storage import ArtifactRef, part_key

    ref = ArtifactRef(uri="", stage="data", key="k" * 32, kind="table", format="instructions", created="now", parts={"sft": "a", "eval": "b"})
    assert part_key(ref, None) == ref.key  # the whole artifact
    assert part_key(ref, ("sft",)) == part_key(ref.model_copy(update={"key": "other", "parts": {"sft": "a", "eval": "c"}}), ("sft",))
    assert part_key(ref, ("sft",)) != part_key(ref.model_copy(update={"parts": {"sft": "z", "eval": "b"}}), ("sft",))
    assert part_key(ref, ("eval", "sft")) == part_key(ref, ("sft", "eval")) != part_key(ref, ("sft",))
    assert part_key(ref, ()) == part_key(ref.model_copy(update={"parts": {"sft": "x"}}), ())  # reads nothing of it
    old = ref.model_copy(update={"parts": {}})  # committed before part digests: keyed as a whole, as then
    assert part_key(old, ("sft",)) == part_key(old, ()) == old.key
    with pytest.raises(ValueError, match="no part 'unlabeled'"):
        part_key(ref, ("unlabeled",))


def test_split_digests_change_only_with_their_split(tmp_path):
    from farmflow import tasks
    from farmflow.config import DataConfig

    store = str(tmp_path / "store")
    small = tasks.data_task.fn(store, DataConfig(sft_size=8, pref_size=8, unlabeled_size=4, val_size=2, eval_size=2))
    more_eval = tasks.data_task.fn(store, DataConfig(sft_size=8, pref_size=8, unlabeled_size=4, val_size=2, eval_size=3))
    assert set(small.parts) == {"sft", "pref", "unlabeled", "val", "eval"}
    assert small.key != more_eval.key and open_store(store).get("data", small.key).parts == small.parts  # kept in the commit record
    assert {s for s in small.parts if small.parts[s] != more_eval.parts[s]} == {"eval"}
    # a stage that reads the sft split keeps its key; one that reads eval does not; the synthetic tokenizer reads them all
    sft_key = lambda data: stage_key("sft", "1", {}, tasks.core.keyed_inputs("sft", {}, {"data": data}))  # noqa: E731
    eval_key = lambda data: stage_key("evaluate", "1", {}, tasks.core.keyed_inputs("evaluate", {}, {"data": data}))  # noqa: E731
    assert sft_key(small) == sft_key(more_eval) and eval_key(small) != eval_key(more_eval)
    base = lambda cfg, data: tasks.core.keyed_inputs("base_model", cfg, {"data": data})["data"]  # noqa: E731
    from farmflow.config import ModelConfig

    assert base(ModelConfig(), small) == small.key and base(ModelConfig(), more_eval) == more_eval.key
    assert base(ModelConfig(pretrained="org/model"), small) == base(ModelConfig(pretrained="org/model"), more_eval)
    assert base({"pretrained": "org/model"}, small) == base(ModelConfig(pretrained="org/model"), small)  # a config from JSON

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
        "annotation.max_in_flight=4",
        "annotation.timeout_s=5",
        "annotation.max_retries=0",
        "annotation.chunk_size=7",
        "annotation.max_cost_usd=3.5",
        "annotation.requests_per_minute=60",
        'annotation.rate_limit_name="other"',
        'annotation.api_key_env="MY_KEY"',
        'annotation.api_key_secret="block"',
    ):
        assert _annotate_key([override]) == base, override
    # what the annotators decide with does change it
    for override in ("annotation.label_noise=0.1", "annotation.seed=3", 'annotation.base_url="http://127.0.0.1:1/v1"'):
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
    # micro_batch_size and SFT's packing are operational, its snapshots extra artifacts (neither in the key)
    for section in (cfg.sft, cfg.dpo):
        operational = {"micro_batch_size", "packing", "snapshot_epochs"} & set(type(section).model_fields)
        assert canonical_json(key_config(section)) == canonical_json(section.model_dump(exclude=operational))
    ei = cfg.expert_iteration.model_dump(exclude={"train": {"micro_batch_size", "packing", "snapshot_epochs"}})
    assert canonical_json(key_config(cfg.expert_iteration)) == canonical_json(ei)
    for section in (cfg.ppo, cfg.quark):  # so is theirs (it is also their sampling batch; samples do not depend on it)
        # snapshots: extra artifacts; PPO's value_from keys only when not the default, so earlier PPO keys stay
        operational = {"micro_batch_size", "snapshot_every", "value_from"} & set(type(section).model_fields)
        assert canonical_json(key_config(section)) == canonical_json(section.model_dump(exclude=operational))
    assert key_config(cfg.ppo.model_copy(update={"value_from": "policy"}))["value_from"] == "policy"
    # generation.backend and batch_size are operational (not in the key)
    generate = {"sample": cfg.generation, "generator": "sft", "control": ""}
    expected = generate | {"sample": cfg.generation.model_dump(exclude={"backend", "batch_size"})}
    assert canonical_json(key_config(generate)) == canonical_json(expected)


def test_unvalidated_copies_make_the_same_key():
    """model_copy(update=...) skips validation: an int in a float field must not change the key."""
    cfg = load_config("synthetic-micro")
    copied = cfg.dpo.model_copy(update={"epochs": 2})
    assert isinstance(copied.epochs, int)
    assert stage_key("dpo", "1", key_config(copied)) == stage_key(
        "dpo", "1", key_config(cfg.dpo.model_copy(update={"epochs": 2.0}))
    )
    wrapped = {"sample": cfg.generation.model_copy(update={"temperature": 1}), "generator": "sft"}
    assert canonical_json(key_config(wrapped)) == canonical_json(
        key_config({"sample": cfg.generation.model_copy(update={"temperature": 1.0}), "generator": "sft"})
    )


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
    assert key_config(ModelConfig(pretrained="org/model", revision="abc123")) != key_config(
        ModelConfig(pretrained="org/model")
    )
    assert "pretrained_files" not in key_config(ModelConfig())  # the synthetic farm's model: unchanged


def test_part_key_narrows_an_input_to_the_parts_a_stage_reads():
    from farmflow.storage import ArtifactRef, part_key

    ref = ArtifactRef(
        uri="",
        stage="data",
        key="k" * 32,
        kind="table",
        format="instructions",
        created="now",
        parts={"sft": "a", "eval": "b"},
    )
    assert part_key(ref, None) == ref.key  # the whole artifact
    assert part_key(ref, ("sft",)) == part_key(
        ref.model_copy(update={"key": "other", "parts": {"sft": "a", "eval": "c"}}), ("sft",)
    )
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
    more_eval = tasks.data_task.fn(
        store, DataConfig(sft_size=8, pref_size=8, unlabeled_size=4, val_size=2, eval_size=3)
    )
    assert set(small.parts) == {"sft", "pref", "unlabeled", "val", "eval"}
    assert (
        small.key != more_eval.key and open_store(store).get("data", small.key).parts == small.parts
    )  # kept in the commit record
    assert {s for s in small.parts if small.parts[s] != more_eval.parts[s]} == {"eval"}
    # a stage that reads the sft split keeps its key (the synthetic base model's tokenizer among them); one that
    # reads eval does not
    sft_key = lambda data: stage_key("sft", "1", {}, tasks.core.keyed_inputs("sft", {}, {"data": data}))  # noqa: E731
    eval_key = lambda data: stage_key("evaluate", "1", {}, tasks.core.keyed_inputs("evaluate", {}, {"data": data}))  # noqa: E731
    assert sft_key(small) == sft_key(more_eval) and eval_key(small) != eval_key(more_eval)
    base = lambda cfg, data: tasks.core.keyed_inputs("base_model", cfg, {"data": data})["data"]  # noqa: E731
    from farmflow.config import ModelConfig

    assert base(ModelConfig(), small) == base(ModelConfig(), more_eval) != small.key
    assert base(ModelConfig(pretrained="org/model"), small) == base(ModelConfig(pretrained="org/model"), more_eval)
    assert base({"pretrained": "org/model"}, small) == base(
        ModelConfig(pretrained="org/model"), small
    )  # a config from JSON


# Every stage's key for synthetic-micro's configs and fixed input keys, computed before the stage registry existed:
# users' stores are addressed by these keys, so a refactor that changes one silently recomputes (and orphans) work.
PINNED_KEYS = {
    "data": "data-b56a1790aad8144e75862bbcb3940fa6",
    "base_model": "base_model-2a7cce924dd5f2186057172b400621ba",
    "sft": "sft-76ad2664987ec336242bcc5bf98b1479",
    "sample_pairs": "sample_pairs-c8291d9e85d2d028dc79a635e6272b30",
    "annotate": "annotate-518e10c9fe80742205872791251e73d4",
    "human_preferences": "human_preferences-8485e20a618b94c3dbf97d01dd3e94ce",
    "subsample_preferences": "subsample_preferences-cd909ce6c1cc6073ff41928c85a12958",
    "train_reward": "train_reward-a8a662e5161cdb1ba196d0da5c9c2cc1",
    "generate": "generate-ed626207fc38506011a601de05b9e4d0",
    "generate_json": "generate-ed626207fc38506011a601de05b9e4d0",
    "best_of_n": "best_of_n-089e62724ce4d3b86f96a9d071890ff1",
    "best_of_n_prefix": "best_of_n_prefix-6f61d74af9757d7d0aa2dfa7cbec91f7",
    "best_of_n_rescore": "best_of_n_rescore-15fd10d6c8660a859ab1c810eeb34ad4",
    "write": "write-e548bd863a56e0d3c6f20690cbcbac5d",
    "evaluate": "evaluate-e612e33421a02fbe4efb81b8fe1d2e5f",
    "feedme": "feedme-254393a6e02b4540884ae8e5d0ce73b2",
    "reward_conditioning": "reward_conditioning-9d5456ed27b8b61ded9e773afbcd5b91",
    "reference_logps": "reference_logps-fd540a713d2fff8e60ef8e31c9cd75e1",
    "dpo": "dpo-2827a0f4a082c6902ba189dc62a737e9",
    "expert_iteration": "expert_iteration-a77ca15588f0d045eab96348509ec385",
    "ppo": "ppo-dcf236f9c3b9824b8ca0ee4024ef93a9",
    "quark": "quark-022af7452226ab7221368576b64a1ae1",
    "proxy_reward": "proxy_reward-4e93ffff80249955d3e7a59ceb0fbbf9",
    "overoptimization": "overoptimization-c166c29e74bbff9d873854feeb8b12f6",
    "reward_report": "reward_report-83055387a3579eb4e2d5d648dab020cf",
}


def _ref(stage: str, parts: dict | None = None):
    from farmflow.storage import ArtifactRef

    return ArtifactRef(
        uri="", stage=stage, key=stage[:4].ljust(32, "0"), kind="table", format="x", created="now", parts=parts or {}
    )


def _pinned_cases() -> dict:
    import json

    cfg = load_config("synthetic-micro")
    data = _ref("data", {s: s.ljust(16, "1") for s in ("sft", "pref", "unlabeled", "val", "eval")})
    bon = {
        "best_of_n": cfg.best_of_n,
        "max_new_tokens": cfg.generation.max_new_tokens,
        "split": "eval",
        "max_prompts": None,
    }
    gen = {"sample": cfg.generation, "generator": "sft", "control": ""}
    pref, sft, reward, outputs = _ref("annotate"), _ref("sft"), _ref("train_reward"), _ref("generate")
    return {
        "data": (cfg.data, {}),
        "base_model": (cfg.model, {"data": data}),
        "sft": (cfg.sft, {"data": data, "base": _ref("base_model")}),
        "sample_pairs": (cfg.pairs, {"data": data, "policy": sft}),
        "annotate": (cfg.annotation, {"pairs": _ref("sample_pairs")}),
        "human_preferences": ({"labeler": "alice", "labels": "d" * 16}, {"pairs": _ref("sample_pairs")}),
        "subsample_preferences": ({"fraction": 0.25, "seed": 0}, {"preferences": pref}),
        "train_reward": (cfg.reward, {"preferences": pref, "sft": sft}),
        "generate": (gen, {"data": data, "policy": sft}),
        "generate_json": (
            json.loads(json.dumps({**gen, "sample": cfg.generation.model_dump(mode="json")})),
            {"data": data, "policy": sft},
        ),
        "best_of_n": (bon, {"data": data, "policy": sft, "reward": reward}),
        "best_of_n_prefix": ({"n": 2}, {"best_of_n": _ref("best_of_n"), "reward": reward}),
        "best_of_n_rescore": ({}, {"best_of_n": _ref("best_of_n"), "reward": reward}),
        "write": (
            {"writer": "reference", "error_rate": 0.0, "generator": "writer: reference (error 0)", "seed": 0},
            {"data": data},
        ),
        "evaluate": (cfg.evaluation.annotator, {"outputs": outputs, "data": data}),
        "feedme": (cfg.feedme, {"preferences": pref, "sft": sft}),
        "reward_conditioning": (cfg.reward_conditioning, {"preferences": pref, "sft": sft}),
        "reference_logps": ({}, {"preferences": pref, "sft": sft}),
        "dpo": (cfg.dpo, {"preferences": pref, "sft": sft, "reference": _ref("reference_logps")}),
        "expert_iteration": (cfg.expert_iteration.train, {"sft": sft, "selections": _ref("best_of_n")}),
        "ppo": (cfg.ppo, {"data": data, "sft": sft, "reward": reward}),
        "quark": (cfg.quark, {"data": data, "sft": sft, "reward": reward}),
        "proxy_reward": ({}, {"outputs": outputs, "reward": reward}),
        "overoptimization": ({"title": "t", "points": []}, {}),
        "reward_report": (
            {"annotation": cfg.annotation, "title": "t"},
            {"preferences": pref, "sft": sft, "reward": reward},
        ),
    }


def test_every_stage_key_is_pinned():
    from farmflow.config import ModelConfig
    from farmflow.tasks import STAGES, rl
    from farmflow.tasks.core import cache_key

    cases = _pinned_cases()
    assert {name.removesuffix("_json") for name in cases} == set(STAGES)  # a new stage gets a pinned key too
    for name, (config, inputs) in cases.items():
        stage = name.removesuffix("_json")
        assert cache_key(stage)(None, {"config": config, **inputs}) == PINNED_KEYS[name], name
        assert STAGES[stage].key(STAGES[stage].typed_config(config), inputs) == PINNED_KEYS[name].removeprefix(
            f"{stage}-"
        ), name
    hub = ModelConfig(pretrained="org/model", revision="abc")
    assert (
        cache_key("base_model")(None, {"config": hub, "data": cases["base_model"][1]["data"]})
        == "base_model-c7c8d77f2bf19b237ff17387162af217"
    )
    assert rl.snapshot_key("p" * 32, 5) == "cc56db1c46d7e853650915eb7b55d5e8"

"""farmflow.generation: the sampling backend switch (hf | vllm), tested without vLLM installed.

The vLLM path itself needs a GPU and vLLM; here: the import guard, the conversion of vLLM's
outputs (plain objects with vLLM's attributes), the prompt encoding it shares with the hf
sampler, hf as the default everywhere, and stage keys that ignore the backend.
"""

import importlib.util
import inspect
import os
import sys
from types import SimpleNamespace

import pytest

from farmflow import tasks
from farmflow.config import PRESETS, ConfigError, SampleConfig, load_config
from farmflow.flows.distributed import stage_key_of
from farmflow.generation import require_vllm, sample_texts, texts_from_vllm
from farmflow.methods.best_of_n import pick_best
from farmflow.models import decode_response, left_pad, load_policy, load_tokenizer, prompt_ids, sample
from farmflow.storage import open_store
from farmflow.tasks.core import EXECUTED, key_config

needs_no_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    """synthetic-micro data and its untrained base model in a fresh store."""
    cfg = load_config("synthetic-micro")
    uri = str(tmp_path_factory.mktemp("store"))
    data = tasks.data_task.fn(uri, cfg.data)
    base = tasks.base_model_task.fn(uri, cfg.model, data)
    return cfg, uri, data, base


@pytest.fixture(scope="module")
def tok(micro):
    _, uri, _, base = micro
    return load_tokenizer(open_store(uri).model_dir(base))


def test_hf_is_the_default_everywhere():
    assert SampleConfig().backend == "hf"
    for name in PRESETS:
        cfg = load_config(name)
        assert (cfg.generation.backend, cfg.pairs.backend) == ("hf", "hf"), name
    assert inspect.signature(tasks.best_of_n_task.fn).parameters["backend"].default == "hf"
    assert load_config("synthetic-micro", ['generation.backend="vllm"']).generation.backend == "vllm"
    with pytest.raises(ConfigError, match=r"generation\.backend"):
        load_config("synthetic-micro", ['generation.backend="tgi"'])


def test_stage_keys_ignore_the_backend():
    cfg = load_config("synthetic-micro")
    vllm = cfg.generation.model_copy(update={"backend": "vllm"})
    assert key_config(vllm) == key_config(cfg.generation)
    assert key_config(cfg.pairs.model_copy(update={"backend": "vllm"})) == key_config(cfg.pairs)
    assert "backend" not in key_config(cfg.generation)
    gen = lambda sample: {"sample": sample, "generator": "sft", "control": ""}  # noqa: E731
    assert stage_key_of("generate", gen(vllm), {}) == stage_key_of("generate", gen(cfg.generation), {})
    bon = {"best_of_n": cfg.best_of_n, "max_new_tokens": 12, "split": "eval", "max_prompts": None}
    assert stage_key_of("best_of_n", bon, {"backend": "vllm"}) == stage_key_of("best_of_n", bon, {})
    # nor the batch sizes: each sample has its own random stream, so they change memory and speed only
    assert stage_key_of("best_of_n", bon, {"batch_size": 8}) == stage_key_of("best_of_n", bon, {})
    assert key_config(cfg.generation.model_copy(update={"batch_size": 7})) == key_config(cfg.generation)
    for section in (cfg.ppo, cfg.quark):
        assert key_config(section.model_copy(update={"micro_batch_size": 5})) == key_config(section)
    # what the samples depend on still changes it
    assert key_config(cfg.generation.model_copy(update={"seed": 1})) != key_config(cfg.generation)


@needs_no_vllm
def test_selecting_vllm_without_vllm_is_one_clear_error(micro):
    cfg, uri, data, base = micro
    with pytest.raises(
        ConfigError,
        match=r"^generation\.backend is 'vllm' but vLLM is not installed.*`pip install vllm`.*generation\.backend=hf",
    ):
        require_vllm("generation.backend")
    store = open_store(uri)
    sample_cfg = SampleConfig(backend="vllm", max_new_tokens=4, seed=123)  # a key nothing else made
    with pytest.raises(ConfigError, match=r"^generation\.backend is 'vllm'.*pip install vllm"):
        tasks.generate_task.fn(uri, {"sample": sample_cfg, "generator": "g", "control": ""}, data, base)
    with pytest.raises(ConfigError, match=r"^pairs\.backend is 'vllm'.*pip install vllm"):
        tasks.sample_pairs_task.fn(uri, sample_cfg, data, base)
    bon = {
        "best_of_n": cfg.best_of_n.model_copy(update={"seed": 123}),
        "max_new_tokens": 4,
        "split": "eval",
        "max_prompts": 2,
    }
    with pytest.raises(ConfigError, match=r"^generation\.backend is 'vllm'.*pip install vllm"):
        tasks.best_of_n_task.fn(uri, bon, data, base, base, backend="vllm", batch_size=8)
    assert not [
        r for r in store.records() if r["ref"]["stage"] in ("generate", "sample_pairs", "best_of_n")
    ]  # nothing committed


def test_an_artifact_is_reused_whichever_backend_asks(micro):
    cfg, uri, data, base = micro
    before = EXECUTED["generate"]
    ref = tasks.generate_task.fn(uri, {"sample": cfg.generation, "generator": "untrained", "control": ""}, data, base)
    assert ref.rows == cfg.data.eval_size and EXECUTED["generate"] == before + 1
    vllm = cfg.generation.model_copy(update={"backend": "vllm"})
    again = tasks.generate_task.fn(uri, {"sample": vllm, "generator": "untrained", "control": ""}, data, base)
    as_json = tasks.generate_task.fn(  # how a GPU worker receives it in distributed mode
        uri, {"sample": vllm.model_dump(mode="json"), "generator": "untrained", "control": ""}, data, base
    )
    assert again.key == as_json.key == ref.key and EXECUTED["generate"] == before + 1  # no vLLM needed: nothing sampled


def test_hf_backend_is_farmflows_sampler(micro):
    _, uri, _, base = micro
    folder = open_store(uri).model_dir(base)
    prompts = ["What is 2 + 3?", "Sort: 4 1 3", "Hi"]
    got = sample_texts(
        "hf", folder, prompts, n=2, temperature=1.0, top_p=0.9, max_new_tokens=6, batch_size=2, seed=7, field="x"
    )
    model, tok = load_policy(folder)
    assert got == sample(model, tok, prompts, n=2, temperature=1.0, top_p=0.9, max_new_tokens=6, batch_size=2, seed=7)
    assert [len(x) for x in got] == [2, 2, 2]


def test_prompt_encoding_matches_the_hf_sampler(tok):
    prompts = ["What is 2 + 3?", "Hi", "Sort these numbers: 9 4 7 1 3 8 2"]
    for max_len in (64, 5):
        ids, mask = left_pad(tok, prompts, max_len)
        hf = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        assert prompt_ids(tok, prompts, max_len) == hf
    hi = tok("Hi", add_special_tokens=False)["input_ids"]
    assert prompt_ids(tok, ["Hi"], 64) == [[tok.bos_token_id] + hi]
    long = prompt_ids(tok, [prompts[2]], 5)[0]
    assert (
        len(long) == 5 and long == [tok.bos_token_id] + tok(prompts[2], add_special_tokens=False)["input_ids"][-4:]
    )  # <s> kept


class _RecordingEngine:
    """Stands in for `vllm.LLM` (vLLM needs a GPU): records the requests farmflow builds and answers each
    with token ids derived from its seed, the way a seeded vLLM request is reproducible."""

    requests: list = []
    built: list = []

    def __init__(self, model, dtype, seed, max_model_len):
        self.model = model
        type(self).built.append(model)

    def generate(self, prompts, params, use_tqdm=False):
        type(self).requests += list(zip([p["prompt_token_ids"] for p in prompts], params))
        return [SimpleNamespace(outputs=[_completion(0, [10 + p.seed % 50, 10 + p.seed % 37])]) for p in params]


def test_vllm_requests_one_seeded_sample_each_so_candidates_nest(micro, tok, monkeypatch):
    from farmflow.generation import vllm_sample
    from farmflow.models import sample_seed

    _, uri, _, base = micro
    folder = open_store(uri).model_dir(base)
    fake = SimpleNamespace(LLM=_RecordingEngine, SamplingParams=lambda **kw: SimpleNamespace(**kw))
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(_RecordingEngine, "requests", [])
    prompts = ["What is 2 + 3?", "Hi", "Sort: 4 1 3"]
    four = vllm_sample(folder, prompts, n=4, temperature=1.0, top_p=0.9, max_new_tokens=6, seed=7)
    sent = _RecordingEngine.requests
    assert len(sent) == 12 and all(
        p.n == 1 and p.temperature == 1.0 and p.top_p == 0.9 and p.max_tokens == 6 for _, p in sent
    )
    assert [p.seed for _, p in sent] == [
        sample_seed(7, i, j) for i in range(3) for j in range(4)
    ]  # the hf sampler's streams
    assert [ids for ids, _ in sent] == [x for x in prompt_ids(tok, prompts, 128 - 6) for _ in range(4)]
    two = vllm_sample(folder, prompts, n=2, temperature=1.0, top_p=0.9, max_new_tokens=6, seed=7)
    assert [len(c) for c in four] == [4, 4, 4] and two == [
        c[:2] for c in four
    ]  # best-of-2's candidates are best-of-4's first two
    assert len({c for cs in four for c in cs}) > 3


def test_one_vllm_engine_serves_calls_on_the_same_checkpoint(micro, tmp_path, monkeypatch):
    """The engine is built once per checkpoint folder and reused across calls and seeds; another folder, or the same
    folder rewritten, builds a new one; best-of-n's scoring releases it."""
    import shutil

    from farmflow.generation import ENGINES, vllm_sample

    _, uri, _, base = micro
    folder = open_store(uri).model_dir(base)
    copy = shutil.copytree(folder, tmp_path / "copy")
    monkeypatch.setitem(
        sys.modules, "vllm", SimpleNamespace(LLM=_RecordingEngine, SamplingParams=lambda **kw: SimpleNamespace(**kw))
    )
    monkeypatch.setattr(_RecordingEngine, "requests", [])
    monkeypatch.setattr(_RecordingEngine, "built", [])
    ENGINES.release()
    args = {"n": 2, "temperature": 1.0, "top_p": 0.9, "max_new_tokens": 4}
    first = vllm_sample(folder, ["Hi"], seed=1, **args)
    assert vllm_sample(folder, ["Hi"], seed=1, **args) == first
    vllm_sample(folder, ["What is 2 + 3?"], seed=2, **args)
    assert _RecordingEngine.built == [str(folder)]  # three calls, one engine
    vllm_sample(copy, ["Hi"], seed=1, **args)
    vllm_sample(folder, ["Hi"], seed=1, **args)
    assert _RecordingEngine.built == [str(folder), str(copy), str(folder)]  # one slot: switching rebuilds
    weights = next(copy.glob("*.safetensors"))
    vllm_sample(copy, ["Hi"], seed=1, **args)
    os.utime(weights, ns=(weights.stat().st_mtime_ns + 10**9,) * 2)  # rewritten in place: a new modification time
    vllm_sample(copy, ["Hi"], seed=1, **args)
    assert _RecordingEngine.built[3:] == [str(copy), str(copy)]
    ENGINES.release()
    assert ENGINES.engine is None and ENGINES.key is None


def _completion(index, token_ids, finish="stop"):
    return SimpleNamespace(
        index=index, token_ids=token_ids, text="(vLLM's own detokenization, not used)", finish_reason=finish
    )


def test_texts_from_vllm_outputs(tok):
    eos, bos, pad = tok.eos_token_id, tok.bos_token_id, tok.pad_token_id
    words = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    one = lambda *args: SimpleNamespace(outputs=[_completion(0, *args)])  # noqa: E731
    requests = [  # one request per sample, in (prompt, sample) order
        one(words("12 + 3") + [eos]),
        one(words(" 42") + [eos]),
        one(words("1 2 3"), "length"),
        one([bos] + words("a") + [pad] + [eos]),
    ]
    decode = lambda ids: decode_response(tok, ids)  # noqa: E731
    assert texts_from_vllm(requests, 2, decode) == [["12 + 3", "42"], ["1 2 3", "a"]]
    assert texts_from_vllm(requests, 1, decode) == [["12 + 3"], ["42"], ["1 2 3"], ["a"]]
    assert texts_from_vllm([], 2, decode) == []
    with pytest.raises(ValueError, match=r"3 requests came back, not a multiple of n=2"):
        texts_from_vllm(requests[:3], 2, decode)
    two = SimpleNamespace(outputs=[_completion(0, [eos]), _completion(1, [eos])])
    with pytest.raises(ValueError, match=r"prompt 1 sample 1 came back with 2 completions, expected 1"):
        texts_from_vllm(requests[:3] + [two], 2, decode)


def test_pick_best_keeps_the_highest_reward_first_on_ties():
    best, rewards = pick_best([["a", "b", "c"], ["d", "e"]], [0.1, 0.5, 0.5, -1.0, -2.0])
    assert (best, rewards) == (["b", "d"], [0.5, -1.0])
    with pytest.raises(ValueError, match="4 rewards for 5 candidates"):
        pick_best([["a", "b", "c"], ["d", "e"]], [0.1, 0.5, 0.5, -1.0])
    # best-of-k from best-of-N's candidates: only the first k of each prompt compete
    assert pick_best([["a", "b", "c"], ["d", "e", "f"]], [0.1, -0.5, 0.9, -1.0, -2.0, 3.0], n=2) == (
        ["a", "d"],
        [0.1, -1.0],
    )
    assert pick_best([["a", "b", "c"], ["d", "e", "f"]], [0.1, -0.5, 0.9, -1.0, -2.0, 3.0], n=1) == (
        ["a", "d"],
        [0.1, -1.0],
    )
    with pytest.raises(ValueError, match="n=4 but a prompt has 3 candidates"):
        pick_best([["a", "b", "c"]], [0.1, 0.2, 0.3], n=4)


@needs_no_vllm
def test_flows_pass_generation_backend_to_best_of_n(micro, prefect_harness):
    """The flows' best-of-n (and expert iteration's candidates) sample with generation.backend."""
    from farmflow.flows import StageRunner, Upstream, best_of_n_outputs

    cfg, uri, data, base = micro
    cfg = cfg.model_copy(update={"generation": cfg.generation.model_copy(update={"backend": "vllm"})})
    up = Upstream(StageRunner(uri, cfg.execution, cfg.name), cfg)
    up._refs.update(data=data, reward=base)  # upstream artifacts already in the store
    bon = cfg.best_of_n.model_copy(update={"seed": 321})  # a key nothing else made
    with pytest.raises(ConfigError, match=r"^generation\.backend is 'vllm'.*pip install vllm"):
        best_of_n_outputs(up, base, bon, "eval", "best_of_n", max_prompts=2)


def test_a_json_generate_config_keys_like_the_typed_one_under_a_launcher(micro):
    """On a GPU worker (distributed mode) generate's config arrives as JSON, `backend` inside; under a child-process
    launcher it gets the typed config's key, so the commit lands where the calling flow reads it."""
    from farmflow.config import ExecutionConfig
    from farmflow.tasks.core import launching

    cfg, uri, data, base = micro
    sample = SampleConfig(max_new_tokens=3, seed=77)  # a key nothing else made
    typed = {"sample": sample, "generator": "g77", "control": ""}
    as_json = {"sample": sample.model_dump(mode="json"), "generator": "g77", "control": ""}
    assert "backend" in as_json["sample"]
    assert stage_key_of("generate", as_json, {"data": data, "policy": base}) == stage_key_of(
        "generate", typed, {"data": data, "policy": base}
    )
    with launching(ExecutionConfig(launcher="process")):
        ref = tasks.generate_task.fn(uri, as_json, data, base)  # runs in a child process, committed here
    assert ref.key == stage_key_of("generate", typed, {"data": data, "policy": base})
    assert open_store(uri).get("generate", ref.key) is not None

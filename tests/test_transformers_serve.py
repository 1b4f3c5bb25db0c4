"""API annotators against a real third-party OpenAI-compatible server: `transformers serve` on 127.0.0.1.

It serves one tiny checkpoint built here (FORCE_MODEL), answers 400 to any other model name,
and samples only if the checkpoint's generation_config says do_sample. The checkpoint is a
1-layer Llama whose weights are set by hand so that greedy decoding answers "a" (a valid
answer to a one-pair `choice` prompt) while sampling at temperature 1 gives garbage. The
server's access log counts the requests it received.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
from test_api_annotators import judge, make_rows, pool

from farmflow.annotators import AnnotationError, AnnotationIncomplete, annotate, cache
from farmflow.config import AnnotatorConfig
from farmflow.loopback import free_port, server_process
from farmflow.storage import open_store

pytestmark = pytest.mark.slow

TRANSFORMERS = Path(sys.executable).parent / "transformers"


def greedy_a_llama(folder: Path) -> int:
    """A tiny Llama + BPE tokenizer with a chat template: greedy answers "a" then stops; temperature 1 is garbage.

    The attention and MLP outputs are zeroed, so the last hidden state is the last token's
    embedding: +1 on dimension 0 for every token but "a" (-1). After RMSNorm that is ±√32, and
    lm_head turns it into logits "a": +2.8, end of text: -2.8, all ~300 others 0 (after "a" the
    signs flip). Greedy: "a", then the end. Sampled: "a" only ~6% of the time. Returns the id of "a".
    """
    import torch
    from transformers import GenerationConfig

    from farmflow.models import random_llama, train_tokenizer

    tokenizer = train_tokenizer(["Judge the items below. Reply with one line per item: [1] (a)"] * 4, 300, pad=False)
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    model = random_llama(tokenizer, max_positions=8192)
    config = model.config
    a = tokenizer.convert_tokens_to_ids("a")
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.model.embed_tokens.weight[a, 0] = -1.0
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[a, 0] = 0.5
        model.lm_head.weight[config.eos_token_id, 0] = -0.5
    # without do_sample the server decodes greedily whatever the request's temperature says
    model.generation_config = GenerationConfig(do_sample=True, bos_token_id=0, eos_token_id=1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return a


class Served:
    def __init__(self, url: str, model: str, log: Path, a_id: int):
        self.url, self.model, self.log, self.a_id = url, model, log, a_id

    def posts(self) -> list[int]:
        """Status codes of the chat-completion requests the server logged, in order."""
        text = self.log.read_text(errors="replace")
        return [int(s) for s in re.findall(r'"POST /v1/chat/completions HTTP/1.1" (\d{3})', text)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("transformers-serve")
    model = folder / "tiny-judge"
    a_id = greedy_a_llama(model)
    port = free_port()
    log = folder / "server.log"
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [str(TRANSFORMERS), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"]
    # ~10 s on the 2-core machine, mostly imports
    health = f"http://127.0.0.1:{port}/health"
    with server_process([*command, "--default-seed", "0"], health, log, "transformers serve", env=env, timeout=120):
        yield Served(f"http://127.0.0.1:{port}/v1", str(model), log, a_id)


@pytest.fixture
def key(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "local")  # transformers serve takes any key
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)


def wait_for_log(served: Served, n: int) -> list[int]:
    deadline = time.monotonic() + 5  # the access log line follows the response by a moment
    while len(served.posts()) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return served.posts()


def test_the_paper_pool_without_served_model_is_one_clear_error_not_retried(served, key, tmp_path):
    before = len(served.posts())
    cfg = AnnotatorConfig(preset="p_sim_ann", base_url=served.url, max_retries=2)
    with pytest.raises(AnnotationError) as err:
        annotate(make_rows(16), cfg, str(tmp_path))
    message = str(err.value)
    assert "\n" not in message
    assert re.search(r"HTTP 400 from endpoint .*: the endpoint does not serve model 'gpt-4[.\w-]*'", message)
    assert f"Server is pinned to '{served.model}'" in message  # the server's own words
    assert "annotation.served_model" in message and "--served-model" in message
    time.sleep(0.5)
    assert wait_for_log(served, before + 1)[before:] == [400]  # one request, not retried, nothing else sent


def test_the_paper_pool_with_served_model_no_400s_and_garbage_is_parse_failures(served, key, tmp_path):
    """p_sim_ann (13 annotators, 3 model names, temperature 1) through served_model: every request reaches the
    model; its sampled garbage becomes failed rows with a parse reason and the raw completion, which `reparse` finds."""
    from typer.testing import CliRunner

    from farmflow.cli import app

    before = len(served.posts())
    rows = make_rows(24, seed=7)
    cfg = AnnotatorConfig(preset="p_sim_ann", base_url=served.url, served_model=served.model)
    with pytest.raises(AnnotationIncomplete, match=r"\d+ of 24 pairs failed \(parse: \d+\)") as err:
        annotate(rows, cfg, str(tmp_path))
    posts = wait_for_log(served, before + 1)[before:]
    assert posts and set(posts) == {200}  # no 400 (model name), no 500 (parameters)
    log = open_store(tmp_path).read_rows("annotations", "annotations").to_pylist()
    failed = [r for r in log if r["status"] == "failed"]
    assert len(log) == len({r["key"] for r in log}) and len(failed) >= len(log) - 2  # "a" by chance, rarely
    assert failed and all(
        r["error"].startswith("parse: ") and r["error"].endswith("(after one re-ask)") for r in failed
    )
    assert all(r["raw_completion"] for r in failed) and {r["model"] for r in log} == {served.model}
    assert f"{len(failed)} of 24 pairs failed (parse: {len(failed)})" in str(err.value)
    expected = {"failed_rows": len(failed), "reparsed": 0, "still_failed": len(failed)}
    assert cache.reparse(open_store(tmp_path)) == expected
    res = CliRunner().invoke(app, ["annotations", "reparse", "--store", str(tmp_path)])
    assert res.exit_code == 0 and json.loads(res.stdout) == expected


def test_a_greedy_annotator_through_served_model_is_judged_and_cached(served, key, tmp_path):
    """Temperature 0 decodes greedily: "a" for every pair, so the first output shown wins. A float logit_bias is
    accepted (transformers serve fails on integer biases). The rerun is answered from the row cache."""
    rows = make_rows(12, seed=3)
    greedy = judge("greedy", model="gpt-4o", temperature=0.0, logit_bias={str(served.a_id): 1.0}, base_url=served.url)
    cfg = pool(greedy, served_model=served.model, timeout_s=60)
    before = len(served.posts())
    table, totals = annotate(rows, cfg, str(tmp_path))
    assert totals["judged"] == 12 and totals["failed"] == 0 and totals["requests"] == 12
    assert wait_for_log(served, before + 12)[before:] == [200] * 12
    assert [t["preference"] for t in table.to_pylist()] == [2.0 if t["swapped"] else 1.0 for t in table.to_pylist()]
    again, totals = annotate(rows, cfg, str(tmp_path))
    assert totals["cached"] == 12 and totals["requests"] == 0 and len(served.posts()) == before + 12
    assert again.column("preference").to_pylist() == table.column("preference").to_pylist()


def test_a_judge_at_temperature_one_samples(served, key):
    """The checkpoint's generation config sets do_sample (as `farmflow models get` writes it), so a judge at
    temperature > 0 really samples: the same request sent again gets other answers. At temperature 0 it does not."""
    import openai

    client = openai.OpenAI(base_url=served.url, api_key="local", max_retries=0)

    def ask(t):
        return (
            client.chat.completions.create(
                model=served.model,
                messages=[{"role": "user", "content": "Which output is better, (a) or (b)?"}],
                temperature=t,
                max_tokens=8,
            )
            .choices[0]
            .message.content
        )

    assert len({ask(1.0) for _ in range(6)}) > 1
    assert len({ask(0.0) for _ in range(3)}) == 1


def test_logit_bias_constrains_a_small_served_judge_to_its_two_answers(served, key, tmp_path):
    """A served model too small to follow the prompt can still judge: a `logprobs`-format annotator (one token)
    with logit_bias +100 on the answer tokens. The tiny model greedily answers "a"; biasing only "b" makes every
    answer "b", so the server applies the bias farmflow sends, and each pair's preference is the second output shown."""
    from transformers import AutoTokenizer

    b_id = AutoTokenizer.from_pretrained(served.model).convert_tokens_to_ids("b")
    assert b_id != served.a_id
    rows = make_rows(8, seed=5)
    constrained = judge("ab", model="smol", prompt_format="logprobs", temperature=0.0, logit_bias={str(b_id): 100.0})
    cfg = pool(constrained, base_url=served.url, served_model=served.model, timeout_s=60)
    before = len(served.posts())
    table, totals = annotate(rows, cfg, str(tmp_path))
    assert totals["judged"] == 8 and totals["failed"] == 0
    assert wait_for_log(served, before + 8)[before:] == [200] * 8
    assert [t["preference"] for t in table.to_pylist()] == [1.0 if t["swapped"] else 2.0 for t in table.to_pylist()]

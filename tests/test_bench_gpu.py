"""bench/gpu.py: the GPU benchmark's CPU smoke mode (--tiny) runs end to end and writes well-formed results."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(
    0, str(Path(__file__).resolve().parents[1])
)  # the repository root, where bench/ lives (also under plain `pytest`)
from bench import gpu  # noqa: E402


def test_peak_table():
    assert gpu.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu.peak_tflops("NVIDIA H200") == 989.0
    assert gpu.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu.peak_tflops("NVIDIA L40S") == 362.0
    assert gpu.peak_tflops("NVIDIA L4") == 121.0
    assert gpu.peak_tflops("Tesla T4") is None
    assert gpu.peak_tflops(None) is None


def test_flops_per_token_by_hand():
    tok = gpu.word_tokenizer(512)
    model = gpu.policy(gpu.SIZES["tiny"], tok, "cpu", torch.float32)
    # tied 512 x 64 embedding (the LM head) + 2 layers x (4 x 64 x 64 attention + 3 x 64 x 128 MLP)
    n = 512 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128)
    assert gpu.flops_per_token(model, 64) == (6.0 * n + 12 * 2 * 64 * 64, n)
    assert len(tok) == 512 and len(tok(gpu.texts(1, 7, 512, seed=0)[0], add_special_tokens=False)["input_ids"]) == 7


def test_tiny_run_writes_well_formed_results(tmp_path):
    out = tmp_path / "gpu.json"
    gpu.main(["--tiny", "--out", str(out)])
    r = json.loads(out.read_text())
    assert (
        r["mode"] == "tiny"
        and r["device"] == "cpu"
        and r["machine"]["cpus"] >= 1
        and r["machine"]["torch"] == torch.__version__
    )
    s = r["sft"]
    assert s["tokens_per_step"] == 4 * 64 and s["timed_steps"] == 4 and s["peak_tflops"] is None
    for side in ("farmflow", "plain_pytorch"):
        assert (
            s["sides"][side]["tokens_per_s"] > 0 and s["sides"][side]["step_ms"] > 0 and s["sides"][side]["mfu"] is None
        )
    assert s["sides"]["plain_pytorch_compiled"] is None and s["ratio_farmflow_over_compiled"] is None
    assert s["ratio_farmflow_over_plain"] > 0 and "not measured" in s["goal"]
    # same weights, same first batch: the first loss is the same on both sides
    assert s["sides"]["farmflow"]["loss_first"] == pytest.approx(s["sides"]["plain_pytorch"]["loss_first"], rel=1e-5)
    rows = r["generation"]["rows"]
    assert [row["batch"] for row in rows] == [2, 4] and r["generation"]["vllm"] == "needs a GPU"
    for row in rows:
        for side in ("farmflow_sample_ids", "hf_generate"):
            assert 0 < row[side]["generated_tokens"] <= row["batch"] * 8 and row[side]["tokens_per_s"] > 0
        assert row["ratio_farmflow_over_hf_generate"] > 0
    p = r["ppo"]
    assert len(p["steps"]) == 2
    for step in p["steps"]:
        parts = [step[k] for k in ("generation_s", "scoring_s", "rollout_forward_s", "training_s")]
        assert all(x > 0 for x in parts) and step["total_s"] == pytest.approx(sum(parts))
    assert sum(p["share_after_first"].values()) == pytest.approx(1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the full benchmark would run")
def test_full_run_without_a_gpu_is_skipped_with_a_message(capsys):
    assert gpu.main([]) is None
    assert "skipped, no CUDA GPU" in capsys.readouterr().out

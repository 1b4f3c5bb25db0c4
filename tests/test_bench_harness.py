"""bench/harness.py measures fairly (interleaved, warmed, medians and ranges); the sampling benchmark's smoke mode runs
end to end; bench/report.py renders BENCHMARKS.md rows from result entries."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, where bench/ lives
from bench import harness, report, sampling  # noqa: E402


def test_interleave_warms_then_alternates_the_order():
    calls = []
    counter = {"a": 0, "b": 0}

    def contender(name):
        def run():
            counter[name] += 1
            calls.append(name)
            return counter[name]

        return run

    runs = harness.interleave({"a": contender("a"), "b": contender("b")}, rounds=3, warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then a b | b a | a b
    assert runs == {"a": [2, 3, 4], "b": [2, 3, 4]}  # warm-up results are not kept
    with pytest.raises(ValueError, match="rounds"):
        harness.interleave({"a": contender("a")}, rounds=0)


def test_summary_ratio_and_entry_by_hand():
    assert harness.summary([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "rounds": 3}
    r = harness.ratio([4.0, 6.0, 5.0], [2.0, 3.0, 2.5])
    assert r == {"ratio": 5.0 / 2.5, "low": 4.0 / 3.0, "high": 6.0 / 2.0}
    e = harness.entry("x", "tokens/s", {"ours": [4.0, 6.0, 5.0], "peer": [2.0, 3.0, 2.5]}, goal=2.5)
    assert e["contenders"] == ["ours", "peer"] and e["ratio"] == 2.0 and e["met"] is False
    assert e["ratio_range"] == [4.0 / 3.0, 3.0] and e["medians"]["peer"]["median"] == 2.5
    assert harness.values([{"t": 1}, {"t": 3}], "t") == [1.0, 3.0]


def test_generated_tokens_stop_at_eos_and_skip_padding():
    assert sampling.generated_tokens([[5, 6, 2, 7, 7], [5, 0, 0], [9, 9, 9]], eos=2, pad=0) == 3 + 1 + 3


def test_sampling_smoke_writes_entries_and_report_renders_them(tmp_path):
    out = tmp_path / "results" / "sampling.json"
    sampling.main(["--smoke", "--rounds", "1", "--out", str(out)])
    data = json.loads(out.read_text())
    whats = [e["what"] for e in data["entries"]]
    assert len(whats) == 3 and whats[0].startswith("sampling n=1") and whats[1].startswith("sampling best-of-4")
    for e in data["entries"]:
        a, b = e["contenders"]
        assert e["ratio"] == pytest.approx(e["medians"][a]["median"] / e["medians"][b]["median"])
        assert e["medians"][a]["median"] > 0 and e["medians"][a]["rounds"] == 1
    for side in ("farmflow", "hf_generate"):
        run = data["runs"]["n=1"][side][0]
        assert 0 < run["tokens"] <= 8 * 8 and run["tokens_per_s"] == pytest.approx(run["tokens"] / run["seconds"])
    (tmp_path / "results" / "legacy.json").write_text(json.dumps({"machine": {"cpus": 2}, "speedup": 3.0}))
    md = report.render(tmp_path / "results")
    table = [line for line in md.splitlines() if line.startswith("| sampling |")]
    assert len(table) == 3 and f"**{data['entries'][0]['ratio']:.2f}×**" in table[0] and "≥ 1.5×" in table[0]
    native = data["machine"]["native_bf16"]
    assert ("native bf16" in table[0], "bf16 emulated" in table[0]) == (native, not native)
    assert "`bench/results/legacy.json`" in md


def test_training_smoke_runs_farmflow_side(tmp_path):
    from bench import training

    out = tmp_path / "training.json"
    r = training.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text())["setup"]["steps"] == {"sft": 3, "reward": 3, "dpo": 3}
    for kind in ("sft", "reward", "dpo"):
        run = r["trainers"][kind]["runs"]["farmflow"][0]
        assert run["steps"] == 3 and run["timed_steps"] == 2 and run["tokens_per_s"] > 0
    assert r["entries"] == []  # one side only: nothing to compare


def test_store_smoke_interleaves_every_comparison_with_its_peer(tmp_path):
    from bench import store

    r = store.main(["--smoke", "--out", str(tmp_path / "store.json")])
    assert json.loads((tmp_path / "store.json").read_text())["entries"] == r["entries"]
    assert len(r["entries"]) == 7 and r["setup"]["rows"] == 2_000
    for e in r["entries"]:
        assert e["unit"] == "MB/s" and e["contenders"][0] == "farmflow" and e["medians"]["farmflow"]["rounds"] == 1
        assert e["ratio"] > 0
    assert r["duckdb_aggregate"]["rows"] >= 2_000


def test_annotators_smoke_counts_only_distinct_pairs_sent(tmp_path):
    from bench import annotators

    pairs = annotators.make_pairs(200, distinct=True)
    assert len({(p["instruction"], p["input"], p["output_1"], p["output_2"]) for p in pairs}) == 200
    r = annotators.main(["--smoke", "--out", str(tmp_path / "annotators.json")])
    for batch, n in (("1", 20), ("5", 100)):
        (run,) = r["batch_sizes"][batch]["runs"]["farmflow"]
        assert r["batch_sizes"][batch]["pairs"] == n and run["judged"] == n
        assert run["requests"] == n // int(batch) and run["pairs_per_s"] == pytest.approx(n / run["seconds"])
    assert r["entries"] == []  # no peer in the smoke run


def test_judge_smoke_compares_the_two_ways_of_reading_prompts_on_the_same_prompts(tmp_path):
    from bench import judge

    r = judge.main(["--smoke", "--out", str(tmp_path / "judge.json")])
    (e,) = r["entries"]
    assert e["contenders"] == ["guidance read once", "every prompt whole"] and r["setup"]["prompts"] == 8
    assert r["setup"]["shared_tokens"] >= 16 and "differ by at most" in e["note"]
    assert float(e["note"].rsplit(" ", 1)[1]) < 1e-4  # the same answers either way
    for runs in r["runs"].values():
        (run,) = runs
        assert run["prompts_per_s"] == pytest.approx(8 / run["seconds"])


@pytest.mark.slow
def test_serve_judge_smoke_judges_the_same_pairs_in_process_and_through_transformers_serve(tmp_path):
    from bench import serve_judge

    r = serve_judge.main(["--smoke", "--out", str(tmp_path / "serve_judge.json")])
    (e,) = r["entries"]
    assert e["contenders"] == ["in process (hf)", "transformers serve (api)"] and r["setup"]["pairs"] == 4
    for name, runs in r["runs"].items():
        (run,) = runs
        assert run["pairs_per_s"] == pytest.approx(4 / run["seconds"])
        assert run["judged"] == 4, name  # the served random model's answer is held to "a" or "b": every pair parses
    assert (tmp_path / "serve_judge.json").exists()


def test_cli_smoke_times_the_cli_against_its_imports(tmp_path):
    from bench import cli

    r = cli.main(["--smoke", "--out", str(tmp_path / "cli.json")])
    assert set(r["wall_s"]) == {"temporary", "imports"} and r["rounds"] == 1
    (e,) = r["entries"]
    assert e["contenders"] == ["temporary", "imports"] and e["unit"] == "runs/min"
    assert e["medians"]["imports"]["median"] == pytest.approx(60 / r["wall_s"]["imports"]["median"])


def test_lc_smoke_fits_the_same_leaderboard_in_worker_processes_and_in_this_one(tmp_path):
    from bench import lc

    r = lc.main(["--smoke", "--out", str(tmp_path / "lc.json")])
    (e,) = r["entries"]
    assert e["contenders"] == ["worker processes", "this process"] and e["unit"] == "boards/min"
    assert e["note"] == "LC win rates differ by at most 0.0e+00"  # bit for bit
    for runs in r["runs"].values():
        (run,) = runs
        assert run["boards_per_min"] == pytest.approx(60 / run["seconds"])


def test_features_smoke_reads_both_precisions_of_the_same_pairs(tmp_path):
    from bench import features

    r = features.main(["--smoke", "--out", str(tmp_path / "features.json")])
    (e,) = r["entries"]
    assert e["contenders"] == ["bfloat16 autocast", "float32"] and e["medians"]["float32"]["rounds"] == 1
    assert r["setup"]["pairs"] == 32 and 0 < r["feature_error_max"] < 0.05 and r["pair_order_agreement"] > 0.9
    assert json.loads((tmp_path / "features.json").read_text())["entries"][0]["unit"] == "outputs/s"


def test_mixed_precision_smoke_trains_both_dtypes_on_the_same_pairs(tmp_path):
    from bench import mixed_precision

    r = mixed_precision.main(["--smoke", "--out", str(tmp_path / "mixed.json")])
    e, top, packed = r["entries"]
    assert e["contenders"] == ["bfloat16 weights", "float32 weights"] and r["setup"]["pairs"] == 32
    assert top["contenders"] == ["bfloat16 weights, train_layers=1", "bfloat16 weights"]
    assert packed["contenders"] == ["bfloat16 weights, reward.packing", "bfloat16 weights"]
    # packed pairs: the same rewards and gradients up to rounding, so the same losses
    assert r["losses"]["bfloat16 weights, reward.packing"] == pytest.approx(r["losses"]["bfloat16 weights"], rel=0.05)
    (bf_first, _), (fp_first, _) = r["losses"]["bfloat16 weights"], r["losses"]["float32 weights"]
    assert bf_first == pytest.approx(fp_first, rel=0.05)  # the same pairs from the same weights
    # the tiny model's one block is its top: the same model trained, the same losses up to rounding
    assert r["losses"]["bfloat16 weights, train_layers=1"] == pytest.approx(r["losses"]["bfloat16 weights"], rel=0.05)
    assert json.loads((tmp_path / "mixed.json").read_text())["entries"][0]["unit"] == "pairs/s"


def test_scoring_smoke_reads_the_same_candidates_packed_and_padded(tmp_path):
    from bench import scoring

    r = scoring.main(["--smoke", "--out", str(tmp_path / "scoring.json")])
    e, wide = r["entries"]
    assert e["contenders"] == ["packed, rows of 256", "padded"] and e["medians"]["padded"]["rounds"] == 1
    assert wide["contenders"] == ["packed, rows of 256", "packed, rows of 1024"]
    # float32 weights: packed rewards equal padded ones up to rounding, and pick the same best candidates
    assert r["setup"]["dtype"] == "float32" and r["max_difference"]["packed_vs_padded"] < 1e-4
    assert r["same_best"]["packed_vs_padded"] == 1.0
    import farmflow.models.sampling as sampling

    assert sampling.PACKED_WIDTH == 256  # restored after the rounds

"""`farmflow annotate FILE`, `farmflow annotations reparse` and the judge-server command are registered and work."""

import json

from test_api_annotators import KEY, gold_pref, make_rows, sharp_server
from typer.testing import CliRunner

from farmflow.cli import app


def test_annotate_alpaca_eval_file_and_reparse(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    rows = make_rows(12)
    src = tmp_path / "pairs.json"
    src.write_text(json.dumps([{k: r[k] for k in ("instruction", "input", "output_1", "output_2")} for r in rows]))
    runner = CliRunner()
    names = runner.invoke(app, ["--help"]).output
    assert "judge-server" in names and "annotate" in names and "annotations" in names
    with sharp_server(monkeypatch) as url:  # follows gold, so the labels are known
        res = runner.invoke(
            app, ["annotate", str(src), "--annotator", "p_sim_gpt4", "--base-url", url, "--store", str(tmp_path / "st")]
        )
    assert res.exit_code == 0, res.output
    out = json.loads((tmp_path / "pairs.annotated.json").read_text())
    assert [r["preference"] for r in out] == [gold_pref(r) for r in rows] and {r["annotator"] for r in out} == {
        "gpt4_greedy"
    }
    assert out[0]["instruction"] == rows[0]["instruction"] and "task" not in out[0]
    res = runner.invoke(app, ["annotate", str(src), "--annotator", "oracle", "--output", str(tmp_path / "o.json")])
    assert res.exit_code == 0 and len(json.loads((tmp_path / "o.json").read_text())) == 12
    res = runner.invoke(app, ["annotations", "reparse", "--store", str(tmp_path / "st")])
    assert res.exit_code == 0 and json.loads(res.output) == {"failed_rows": 0, "reparsed": 0, "still_failed": 0}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"instruction": "x", "output_1": "a"}]))
    res = runner.invoke(app, ["annotate", str(bad)])
    assert res.exit_code == 2 and "row 0 has no string field 'output_2'" in " ".join(res.output.split())

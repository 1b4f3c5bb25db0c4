"""One METHODS table (`farmflow.config.METHODS`) is the single place that lists methods: adding a method is one file
and one entry, and every list of methods (config sections, GPU stages, stages, tasks, flows, deployments, CLI and
compare choices, leaderboard families, the docs' table) follows."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from farmflow.config import GPU_STAGES, METHODS, FarmConfig, methods_table

ROOT = Path(__file__).resolve().parents[1]

TOY_FILE = '''
"""Toy: supervised fine-tuning of the SFT model on the longer output of each pair (a test of the METHODS table).

Loss: the SFT loss (`farmflow.methods.sft.sft_loss`) on (prompt, longer output).
"""

from farmflow.data import prompts_of
from farmflow.methods.sft import train_sft

VERSION = "1"


def train_toy(model, tokenizer, rows, cfg, max_len, checkpointer=None):
    longer = [max(r["output_1"], r["output_2"], key=len) for r in rows]
    metrics = train_sft(model, tokenizer, prompts_of(rows), longer, cfg, max_len, checkpointer, name="toy")
    return {**metrics, "examples": float(len(rows))}
'''

TOY_ENTRY = """        Method(
            "toy",
            "toy",
            SFTConfig,
            "Toy: SFT on the longer output of each pair.",
            "preferences",
            "SFT → pairs → simulated preferences → toy, evaluated.",
            train="train_toy",
        ),
"""

CHECKS = """
import farmflow.flows
from typer.testing import CliRunner

import farmflow.cli as cli
from farmflow.config import FLOW_NAMES, GPU_STAGES, METHODS, FarmConfig, load_config, methods_table
from farmflow.deployments import deployments
from farmflow.evaluation import method_family
from farmflow.flows import FLOWS, PREFERENCE_METHODS, MethodName
from farmflow.tasks import EXECUTED, STAGES, TASKS

assert list(METHODS)[-1] == "toy" and FLOW_NAMES[-1] == "toy"
assert FarmConfig.model_fields["toy"].description.startswith("Toy:") and FarmConfig().toy.epochs == 3.0
assert "toy" in GPU_STAGES and "toy" in PREFERENCE_METHODS and "toy" in MethodName.__args__
assert methods_table().splitlines()[-1] == (
    "| toy | `toy.py` | `toy` | preferences | `toy` → `generate` |"
)
assert method_family("toy") == "preferences"
stage = STAGES["toy"]
assert (stage.version, stage.inputs, stage.gpu, stage.processes) == ("1", ("preferences", "sft"), True, "all")
assert TASKS["toy"].name == "toy" and farmflow.flows.toy_flow is FLOWS["toy"] and FLOWS["toy"].name == "toy"
deps = deployments("synthetic-micro")
assert [(d.name, d.entrypoint) for d in deps if d.flow_name == "toy"] == [("farmflow", "farmflow.flows.toy_flow")]
out = CliRunner().invoke(cli.app, ["run", "nope"], terminal_width=400)
assert out.exit_code == 2 and ", toy" in out.output, out.output
assert cli.runs.methods_of(["toy,dpo"]) == ["toy", "dpo"]

# and it runs: the shared upstream, then the toy's stage, made from its entry alone
cfg = load_config("synthetic-micro", [f"store.uri={STORE}", "toy.epochs=1", "toy.batch_size=16", "toy.lr=1e-3"])
uri = cfg.store.location
data = TASKS["data"].fn(uri, cfg.data)
base = TASKS["base_model"].fn(uri, cfg.model, data=data)
sft = TASKS["sft"].fn(uri, cfg.sft, data=data, base=base)
pairs = TASKS["sample_pairs"].fn(uri, cfg.pairs, data=data, policy=sft)
preferences = TASKS["annotate"].fn(uri, cfg.annotation, pairs=pairs)
toy = TASKS["toy"].fn(uri, cfg.toy, preferences=preferences, sft=sft)
# the micro farm's 120 PREF pairs, one epoch in batches of 16: ceil(120 / 16) = 8 steps
assert toy.stage == "toy" and toy.metrics["examples"] == 120 and toy.metrics["steps"] == 8, toy.metrics
assert TASKS["toy"].fn(uri, cfg.toy, preferences=preferences, sft=sft).key == toy.key and EXECUTED["toy"] == 1
print("toy ok")
"""


def test_a_method_is_one_file_and_one_methods_entry(tmp_path):
    """Copy the package, write a toy method's file and its METHODS entry (nothing else), and find it everywhere."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "farmflow", src / "farmflow", ignore=shutil.ignore_patterns("__pycache__"))
    (src / "farmflow" / "methods" / "toy.py").write_text(TOY_FILE)
    registry = src / "farmflow" / "config" / "registry.py"
    text = registry.read_text()
    end = text.index('    )\n}\n"""Method name')  # the end of the table: the new entry goes last
    registry.write_text(text[:end] + TOY_ENTRY + text[end:])
    script = f"STORE = {str(tmp_path / 'store')!r}\n" + textwrap.dedent(CHECKS)
    env = {**os.environ, "PYTHONPATH": str(src), "FARMFLOW_PROGRESS_EVERY_S": "0"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and "toy ok" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]


def test_farm_config_has_one_section_per_method_in_table_order():
    fields = list(FarmConfig.model_fields)
    assert fields[fields.index("reward") + 1 : fields.index("generation")] == list(METHODS)
    for m in METHODS.values():
        assert FarmConfig.model_fields[m.name].annotation is m.section
        assert FarmConfig.model_fields[m.name].description == m.description
    # a method's stages load a model: they are in the default GPU stages, each once
    assert {s for m in METHODS.values() for s in m.stages} <= set(GPU_STAGES) and len(set(GPU_STAGES)) == len(
        GPU_STAGES
    )


def test_the_docs_methods_table_is_the_methods_table():
    """docs/methods.md shows `methods_table()` as it is (regenerate: python -c 'from farmflow.config import
    methods_table; print(methods_table())')."""
    assert methods_table() in (ROOT / "docs" / "methods.md").read_text()
    assert methods_table().count("\n") == len(METHODS) + 2

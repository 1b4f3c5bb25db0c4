"""What `farmflow` prints for people and logs: one error line and the log's path, each log line once, tables
in a pipe at full width with brackets as written, and `--format json|csv|md` that parse back to the table's rows.

The runs are the real CLI in a subprocess (stdout and stderr are pipes, as in CI or `| cat`), on one shared store.
"""

from __future__ import annotations

import csv
import importlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from prefect_server import migrated_home
from procs import python_env
from typer.testing import CliRunner

from farmflow.cli import app
from farmflow.cli.errors import FAMILIES, FarmflowGroup

CLI = "from farmflow.cli import main; main()"
# the same, saying on exit whether the run imported torch or transformers (stderr, one line)
CLI_SAYING_IMPORTS = (
    "import atexit, sys; atexit.register(lambda: print('imported:', sorted(m for m in ('torch', 'transformers') "
    "if m in sys.modules), file=sys.stderr)); " + CLI
)
STAMP = re.compile(r"^\d\d:\d\d:\d\d\.\d{3} \| ")  # Prefect's console prefix


def farmflow(*args: str, cwd: Path, timeout: float = 600, code: str = CLI) -> subprocess.CompletedProcess:
    env = python_env(
        PREFECT_HOME=str(migrated_home(cwd / "prefect")),
        PREFECT_LOGGING_LEVEL="INFO",
        FARMFLOW_LOG_DIR=str(cwd / "logs"),
    )
    env.pop("PREFECT_API_URL", None)
    env.pop("FARMFLOW_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    """A synthetic-micro comparison (best-of-n and the baselines) run twice: the second is fully cached."""
    root = tmp_path_factory.mktemp("cli-output")
    args = ["run", "compare", "--preset", "synthetic-micro", "--method", "best-of-n", "--store", str(root / "store")]
    first = farmflow(*args, cwd=root)
    assert first.returncode == 0, first.stderr[-3000:]
    cached = farmflow(*args, cwd=root, code=CLI_SAYING_IMPORTS)
    assert cached.returncode == 0, cached.stderr[-3000:]
    return root, first, cached


def test_a_cached_run_logs_each_line_once(farm):
    _, _, cached = farm
    lines = [STAMP.sub("", line) for line in cached.stderr.splitlines()]
    repeated = {line: lines.count(line) for line in lines if lines.count(line) > 1}
    assert repeated == {}
    # one line per stage: its own cache-hit line; Prefect's "Finished in state Cached" repeats stay in the log file
    hits = [line for line in lines if ": cache hit," in line]
    assert len(hits) >= 10 and not any("Finished in state Cached" in line for line in lines)
    assert sum("evaluate best_of_4" in line for line in lines) == 2  # under p_sim^eval, and [p_sim^ann]'s
    log = Path(re.search(r"; log (\S+\.log)", cached.stdout).group(1))
    assert log.read_text().count("Finished in state Cached") >= 10  # the file keeps every line


def test_a_fully_cached_run_loads_no_model_code(farm):
    """Stage keys come from the registry without importing torch (method versions are read from their source), and
    a stage imports its model code when it runs: a run whose stages are all cached never imports torch or
    transformers (seconds of every such run)."""
    _, _, cached = farm
    assert "imported: []" in cached.stderr.splitlines(), cached.stderr[-2000:]


def test_a_run_in_a_pipe_prints_whole_tables_with_brackets_as_written(farm):
    _, first, cached = farm
    for out in (first.stdout, cached.stdout):
        board = [line for line in out.splitlines() if line.startswith("│ best_of_4")]
        assert len(board) == 1 and board[0].rstrip().endswith("│") and "…" not in out
        assert len(board[0]) > 80  # ten columns, not cut at 80
        assert "evaluate best_of_4 [p_sim^ann] (p_sim^eval)" in out  # not swallowed as rich markup


def test_a_temporary_api_that_cannot_start_is_one_error_line_naming_its_output(tmp_path):
    """Prefect's database cannot be opened (its file is a folder here; a full disk reads the same): the run stops
    with one line that names the temporary API's output file and quotes its last line; the server's own lines and
    tracebacks stay in that file."""
    home = tmp_path / "prefect"
    (home / "prefect.db").mkdir(parents=True)
    env = python_env(
        PREFECT_HOME=str(home),
        FARMFLOW_LOG_DIR=str(tmp_path / "logs"),
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="15",
    )
    env.pop("PREFECT_API_URL", None)
    args = ["run", "best-of-n", "--preset", "synthetic-micro", "--store", str(tmp_path / "store")]
    done = subprocess.run(
        [sys.executable, "-c", CLI, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 1, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: Prefect's temporary API did not start ("), done.stderr
    output = Path(re.search(r"its output: (\S+\.log); its last error: ", errors[0]).group(1))
    assert output.parent == tmp_path / "logs" and "Traceback" in output.read_text()
    assert errors[0].endswith("OperationalError: (sqlite3.OperationalError) unable to open database file")
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


def test_a_failing_run_prints_one_error_line_and_the_log_path(farm, tmp_path):
    """A data file broken mid-row: the data stage fails inside the run; the error is one line naming the file."""
    root, _, _ = farm
    broken = tmp_path / "broken.json"
    broken.write_text('[{"instruction": "a", "input": "", "output": "b"}, {"instruction": ')
    references = Path(__file__).parents[1].parent / "shared/data/alpaca_eval_davinci003_outputs.json"
    args = [
        "run",
        "best-of-n",
        "--preset",
        "synthetic-micro",
        "--store",
        str(root / "store"),
        "--set",
        'data.source="local"',
        "--set",
        f"data.instructions_path={json.dumps(str(broken))}",
        "--set",
        f"data.eval_path={json.dumps(str(references))}",
    ]
    done = farmflow(*args, cwd=root)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    errors = [line for line in lines if "not valid JSON" in line]
    assert len(errors) == 1 and errors[0].startswith(f"error: {broken}: not valid JSON (")
    log = Path(lines[lines.index(errors[0]) + 1].removeprefix("full log: "))
    assert "Traceback" not in done.stderr and "| ERROR" not in done.stderr and log.parent == root / "logs"
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "farmflow.data.alpaca.DataError" in text


def test_errors_before_a_run_are_one_line_without_a_log_and_debug_adds_the_traceback(tmp_path):
    done = farmflow("run", "best-of-n", "--preset", "nope", cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("error: unknown preset 'nope'; known presets: ") and done.stderr.count("\n") == 1
    debug = farmflow("--debug", "run", "best-of-n", "--preset", "nope", cwd=tmp_path, timeout=120)
    assert debug.returncode == 2 and "Traceback" in debug.stderr and "ConfigError" in debug.stderr
    assert debug.stderr.splitlines()[-1].startswith("error: unknown preset 'nope'")
    assert not (tmp_path / "logs").exists()


def boundary_app() -> typer.Typer:
    """A two-command app behind the same error boundary as `farmflow`."""
    demo = typer.Typer(cls=FarmflowGroup)

    @demo.command()
    def bad_value() -> None:
        int("twelve")  # ValueError: bad input

    @demo.command()
    def bug() -> None:
        {}["missing"]  # KeyError: a bug

    return demo


@pytest.mark.parametrize(
    "command, code, line",
    [
        ("bad-value", 2, "error: invalid literal for int() with base 10: 'twelve'\n"),
        ("bug", 1, "error: KeyError: 'missing' (unexpected; `farmflow --debug ...` shows the traceback)\n"),
    ],
)
def test_the_error_boundary_maps_exception_families_to_one_line_and_an_exit_code(command, code, line):
    result = CliRunner().invoke(boundary_app(), [command])
    assert result.exit_code == code and result.stderr == line and result.stdout == ""


@pytest.mark.parametrize("module, name, code", FAMILIES, ids=[name for _, name, _ in FAMILIES])
def test_every_error_family_names_an_exception_class(module, name, code):
    """A renamed or moved exception would silently turn its errors into 'unexpected' ones."""
    family = getattr(importlib.import_module(module), name)
    assert issubclass(family, Exception) and (code is not None or isinstance(family.exit_code, int))


# ------------------------------------------------------------- --format
def invoke(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def test_leaderboard_formats_parse_back_to_the_tables_rows(farm):
    root, _, _ = farm
    store = str(root / "store")
    rows = json.loads(invoke("leaderboard", "--store", store, "--json"))["leaderboard"]
    assert json.loads(invoke("leaderboard", "--store", store, "--format", "json")) == [
        {
            k: r[k]
            for k in (
                "method",
                "win_rate",
                "standard_error",
                "discrete_win_rate",
                "lc_win_rate",
                "lc_standard_error",
                "mean_gold",
                "gold_standard_error",
                "avg_length",
                "n",
            )
        }
        for r in rows
    ]
    parsed = list(csv.DictReader(io.StringIO(invoke("leaderboard", "--store", store, "--format", "csv"))))
    assert [(r["method"], float(r["win_rate"]), int(r["n"])) for r in parsed] == [
        (r["method"], r["win_rate"], r["n"]) for r in rows
    ]
    md = [ln for ln in invoke("leaderboard", "--store", store, "--format", "md").splitlines() if ln.startswith("| ")]
    table = invoke("leaderboard", "--store", store)
    for r, line in zip(rows, md[1:], strict=True):  # md[0]: the header
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == r["method"] and cells[1] == f"{r['win_rate']:.1f}" and cells[-1] == str(r["n"])
        shown = next(t for t in table.splitlines() if t.startswith(f"│ {r['method']} "))
        assert [c.strip() for c in shown.strip("│").split("│")] == cells  # the table shows the same cells


@pytest.mark.parametrize(
    "args",
    [
        ["artifacts", "ls"],
        ["history"],
        # GROUP BY alone returns its rows in any order, and two invocations are compared
        ["sql", "SELECT stage, count(*) AS n FROM artifacts GROUP BY stage ORDER BY stage"],
    ],
    ids=["artifacts-ls", "history", "sql"],
)
def test_table_commands_print_json_csv_and_md_of_the_same_rows(farm, args):
    root, _, _ = farm
    base = [*args, "--store", str(root / "store")]
    as_json = json.loads(invoke(*base, "--format", "json"))
    as_csv = list(csv.DictReader(io.StringIO(invoke(*base, "--format", "csv"))))
    assert len(as_json) == len(as_csv) >= 1
    assert [{k: "" if v is None else str(v) for k, v in r.items()} for r in as_json] == as_csv
    md = [line for line in invoke(*base, "--format", "md").splitlines() if line.startswith("|")]
    if args[0] != "history":  # history's md is one column per run, as its table
        assert len(md) == len(as_json) + 2 and md[0].count("|") == len(as_json[0]) + 1


def test_tables_show_brackets_as_written_and_never_cut(farm):
    root, _, _ = farm
    label = "evaluate sft [p_sim^ann] [red]not markup[/red] " + "x" * 150
    out = invoke("sql", f"SELECT '{label}' AS label", "--store", str(root / "store"))
    assert label in out and "…" not in out

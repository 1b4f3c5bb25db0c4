"""Bad inputs of the `farmflow` command: CLI arguments, config values and data files, each expected to fail in one clear
line (``error: ...``, at most followed by ``full log: FILE``), with no traceback and a non-zero exit code.

`CASES` is the table; `{tmp}` in an argument is a scratch folder that `make_files` fills with the bad files.
`judge(rc, stdout, stderr)` says whether a case passed and what the user saw.
"""

from __future__ import annotations

import json
from pathlib import Path

RUN = ["run", "dpo", "--preset", "synthetic-micro"]

CASES: list[tuple[str, list[str], dict[str, str]]] = [
    # (what, argv, extra environment)
    ("unknown flow", ["run", "nosuch"], {}),
    ("unknown preset", ["run", "compare", "--preset", "nosuch"], {}),
    ("unknown method", ["run", "compare", "--method", "nosuch"], {}),
    ("--method outside compare", [*RUN, "--method", "dpo"], {}),
    ("unknown config field", [*RUN, "--set", "nofield=1"], {}),
    ("unknown nested field", [*RUN, "--set", "sft.nofield=1"], {}),
    ("override without =", [*RUN, "--set", "sft.lr"], {}),
    ("size beyond the machine", [*RUN, "--set", "data.sft_size=100000000000000"], {}),
    ("negative size", [*RUN, "--set", "data.sft_size=-1"], {}),
    ("size not a number", [*RUN, "--set", "data.sft_size=abc"], {}),
    ("zero learning rate", [*RUN, "--set", "sft.lr=0"], {}),
    ("zero epochs", [*RUN, "--set", "sft.epochs=0"], {}),
    ("batch beyond the bound", [*RUN, "--set", "sft.batch_size=1000000000"], {}),
    ("best-of-n n beyond the bound", [*RUN, "--set", "best_of_n.n=10000000"], {}),
    ("heads do not divide width", [*RUN, "--set", "model.hidden_size=31"], {}),
    ("warmup ratio 1", [*RUN, "--set", "sft.warmup_ratio=1"], {}),
    ("top_p above 1", [*RUN, "--set", "generation.top_p=2"], {}),
    ("unknown annotator preset", [*RUN, "--set", "annotation.preset=nosuch"], {}),
    ("too many requests in flight", [*RUN, "--set", "annotation.max_in_flight=100000"], {}),
    ("a section given a number", [*RUN, "--set", "sft=3"], {}),
    ("heartbeat after the unresponsive limit", [*RUN, "--set", "execution.unresponsive_after_s=50"], {}),
    ("local data without files", [*RUN, "--set", "data.source=local"], {}),
    ("farm_dir that does not exist", [*RUN, "--set", "data.farm_dir={tmp}/nodir"], {}),
    ("unknown split file key", [*RUN, "--set", 'data.split_paths={"train": "x.json"}'], {}),
    ("gs:// store", [*RUN, "--store", "gs://bucket/farm"], {}),
    ("http:// store", [*RUN, "--set", "store.uri=http://example.com/farm"], {}),
    ("S3 options on a local store", [*RUN, "--set", "store.endpoint_url=http://127.0.0.1:9"], {}),
    ("credentials in a store URI", [*RUN, "--store", "s3://AKIAEXAMPLE:secret@bucket/farm"], {}),
    (  # credentials set, so what fails is the endpoint, not the credentials lookup before it
        "unreachable S3 endpoint",
        [*RUN, "--store", "s3://bucket/farm?endpoint_url=http://127.0.0.1:9"],
        {"AWS_ACCESS_KEY_ID": "chaos-key-id", "AWS_SECRET_ACCESS_KEY": "chaos-secret"},
    ),
    ("store that is a file", [*RUN, "--store", "{tmp}/a-file.txt"], {}),
    ("store in an unwritable folder", [*RUN, "--store", "/proc/farmflow-store"], {}),
    ("model that is not available", [*RUN, "--set", "model.pretrained=no-such-model-anywhere"], {}),
    ("Prefect API that does not answer", RUN, {"PREFECT_API_URL": "http://127.0.0.1:9/api"}),
    ("unknown demo annotator", ["demo", "--annotator", "nosuch"], {}),
    ("annotate a missing file", ["annotate", "{tmp}/missing.json"], {}),
    ("annotate a file that is not JSON", ["annotate", "{tmp}/not-json.json"], {}),
    ("annotate rows without output_2", ["annotate", "{tmp}/no-output-2.json"], {}),
    ("annotate a JSON object, not a list", ["annotate", "{tmp}/object.json"], {}),
    ("annotate with an unknown annotator", ["annotate", "{tmp}/pairs.json", "--annotator", "nosuch"], {}),
    ("annotator config with a typo", ["annotate", "{tmp}/pairs.json", "--annotator", "{tmp}/annotator-typo.json"], {}),
    (
        "annotate to an unwritable output",
        ["annotate", "{tmp}/pairs.json", "--annotator", "oracle", "--output", "/proc/out.json"],
        {},
    ),
    ("reparse a store that does not exist", ["annotations", "reparse", "--store", "/nonexistent/dir/store"], {}),
    ("sql on a store that does not exist", ["sql", "SELECT 1", "--store", "/nonexistent/dir/store"], {}),
    ("sql that is not SQL", ["sql", "SELEC 1", "--store", "{tmp}/store"], {}),
    ("sql --output in a missing folder", ["sql", "SELECT 1", "--store", "{tmp}/store", "-o", "/nonexistent/x.csv"], {}),
    ("artifacts of a store that does not exist", ["artifacts", "ls", "--store", "/nonexistent/dir/store"], {}),
    ("leaderboard of a store that does not exist", ["leaderboard", "--store", "/nonexistent/dir/store"], {}),
    ("history of a store that does not exist", ["history", "--store", "/nonexistent/dir/store"], {}),
    ("config of an unknown preset", ["config", "show", "--preset", "nosuch"], {}),
    ("label export to an unwritable file", ["label", "export", "--labeler", "bob", "-o", "/proc/l.csv"], {}),
    (
        "label import of a bad file",
        ["label", "import", "{tmp}/labels.csv", "--labeler", "bob", "--store", "{tmp}/st"],
        {},
    ),
    ("unknown model to get", ["models", "get", "no-such-model-anywhere"], {}),
]


def make_files(tmp: Path) -> None:
    """The files the cases name under {tmp}."""
    (tmp / "store").mkdir(parents=True, exist_ok=True)
    (tmp / "a-file.txt").write_text("not a folder\n")
    (tmp / "not-json.json").write_text("[{'instruction': 'single quotes',\n")
    (tmp / "no-output-2.json").write_text(json.dumps([{"instruction": "x", "output_1": "a"}]))
    (tmp / "object.json").write_text(json.dumps({"instruction": "x", "output_1": "a", "output_2": "b"}))
    (tmp / "pairs.json").write_text(json.dumps([{"instruction": "Say hi.", "output_1": "hi", "output_2": "hello"}]))
    (tmp / "annotator-typo.json").write_text(json.dumps({"kind": "api", "max_in_flihgt": 4}))
    (tmp / "labels.csv").write_text("instruction,input,output_1,output_2,preference\nx,,a,b,7\n")


def expand(argv: list[str], tmp: Path) -> list[str]:
    return [a.replace("{tmp}", str(tmp)) for a in argv]


def judge(rc: int, stdout: str, stderr: str) -> tuple[bool, str]:
    """(passed, what the user saw): a non-zero exit, one ``error:`` line (and at most a ``full log:`` line), no
    traceback anywhere."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    rest = [line for line in lines if not line.startswith(("error: ", "full log: "))]
    seen = errors[0] if errors else (lines[-1] if lines else stdout.strip()[-200:])
    ok = rc != 0 and len(errors) == 1 and not rest and "Traceback" not in stdout + stderr
    return ok, seen

"""Labels out of and into the store as CSV or JSONL files, in AlpacaFarm's human-preference layout
(instruction, input, output_1, output_2, preference: 1 or 2, 1.5 for a tie; 0 is read as a tie too).

An imported file is one labeler's labels (annotator ``human:<name>``, an annotator of its own): its rows become
``annotations`` rows like the page's, with no recorded display order (``swapped`` null).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from farmflow.data.alpaca import DataError, check_records
from farmflow.evaluation.stats import parse_preference
from farmflow.labeling.labels import (
    PAIR_COLUMNS,
    annotator,
    append,
    label_row,
    labels,
    own_preference,
    pair_key,
    read_named,
)

COLUMNS = ["instruction", "input", "output_1", "output_2", "preference", "annotator"]
FORMATS = ("csv", "jsonl")


def export_rows(store, labeler: str, pairs: list[dict] | None = None) -> list[dict]:
    """`labeler`'s labels in force: oldest first in canonical output order, or with `pairs` in the pairs' order and
    each pair's own output order, with its ``id`` (pairs without a label left out)."""
    given = labels(store, labeler)
    if pairs is None:
        return [{c: r[c] for c in COLUMNS} for r in given]
    by_key = {r["key"]: r for r in given}
    out = []
    for pair in pairs:
        row = by_key.get(pair_key(labeler, pair))
        if row is not None:
            out.append(
                {
                    "id": pair["id"],
                    **{c: pair[c] for c in COLUMNS[:4]},
                    "preference": own_preference(row, pair),
                    "annotator": row["annotator"],
                }
            )
    return out


def write_rows(rows: list[dict], path: str | Path, fmt: str) -> None:
    """Write rows as CSV (a header line) or JSONL; the file appears whole (written aside, then renamed)."""
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: use csv or jsonl")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("w", encoding="utf-8", newline="") as out:
            if fmt == "csv":
                writer = csv.DictWriter(out, fieldnames=list(rows[0]) if rows else COLUMNS)
                writer.writeheader()
                writer.writerows(rows)
            else:
                out.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        tmp.replace(path)
    except OSError as err:
        raise ValueError(f"{path}: cannot be written ({err.strerror or err})") from None


def import_file(store, path: str | Path, labeler: str) -> int:
    """Append a file of labels as `labeler`'s (one chunk, so all or none); the number of rows imported.

    Every row is checked first: a bad one raises `DataError` naming the file and row, and nothing is written."""
    annotator(labeler)
    raw, names = read_named(path)
    rows = check_records(raw, path, PAIR_COLUMNS, {"input": str}, names=names)
    out = []
    for i, row in enumerate(rows):
        preference = parse_preference(row.get("preference"))
        if preference is None:
            where = names[i] if names else f"row {i}"
            raise DataError(
                f"{path}: {where}: column 'preference' is {row.get('preference')!r}; "
                "use 1 or 2 (the better output), 1.5 or 0 for a tie"
            )
        out.append(label_row(labeler, row, preference))
    append(store, out)
    return len(out)

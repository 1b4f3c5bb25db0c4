"""Human labels: pairs to label, the order each labeler sees them in, and the rows a label becomes.

A label is a row of the store's ``annotations`` row log, like any annotator's (`farmflow.annotators.cache`):
annotator ``human:<name>``, the pair's outputs in canonical (sorted) order and the preference relative to them,
``swapped`` true when the canonical ``output_2`` was shown first, ``raw_completion`` the key the labeler pressed
(``1``, ``2`` or ``t``, in the order shown) and ``created`` when. Its ``key`` is the cache key of the pair for the
labeler's own annotator hash, so labels are keyed by (pair, labeler) and several labelers can label the same pairs.

The displayed order is drawn per (pair, labeler) from a hash (`shown_swapped`): random over pairs, the same on every
reload, and recorded in the row. The log is append-only, so undo appends a tombstone (same key, ``status``
``undone``, no preference): the latest row of a key is its state (`current`). `farmflow.annotators.cache.read`
would still take an undone label (it keeps a key's latest ``ok`` row), but no annotator asks for a human's hash; and
as a tombstone always follows a label, it is never among the failed rows that ``annotations reparse`` retries.
"""

from __future__ import annotations

import csv
import hashlib
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from farmflow.annotators.cache import NAMESPACE, canonical, now, row_key, to_table
from farmflow.annotators.oracle import unit_hash
from farmflow.data.alpaca import DataError, check_records, read_records

PREFIX = "human:"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
KEYS = {"1": 1.0, "2": 2.0, "t": 1.5}
"""The key pressed → the preference in the order shown (t: a tie)."""
PAIR_COLUMNS = {"instruction": str, "output_1": str, "output_2": str}


def annotator(labeler: str) -> str:
    """``human:<labeler>``; a labeler name is letters, digits and ``_.@-`` (it appears in SQL and file names)."""
    if not isinstance(labeler, str) or not NAME.fullmatch(labeler):
        raise ValueError(f"labeler name {labeler!r}: use 1-64 letters, digits or _.@-, starting with a letter or digit")
    return PREFIX + labeler


def labeler_hash(labeler: str) -> str:
    """The labeler's annotator hash (the ``annotator_hash`` column): a human is an annotator of their own."""
    return hashlib.sha256(annotator(labeler).encode()).hexdigest()[:16]


def pair_key(labeler: str, pair: dict) -> str:
    """The row key of `labeler`'s label of `pair`, whichever order its outputs come in."""
    c1, c2, _ = canonical(pair["output_1"], pair["output_2"])
    return row_key(labeler_hash(labeler), pair["instruction"], pair["input"], c1, c2)


def shown_swapped(labeler: str, pair: dict) -> bool:
    """Whether `labeler` sees the canonical output_2 first: a fair coin per (pair, labeler), fixed across reloads."""
    return unit_hash("label-order", pair_key(labeler, pair)) < 0.5


def shown(labeler: str, pair: dict) -> tuple[str, str]:
    """The two outputs in the order `labeler` sees them (blind: nothing says which is the pair's output_1)."""
    c1, c2, _ = canonical(pair["output_1"], pair["output_2"])
    return (c2, c1) if shown_swapped(labeler, pair) else (c1, c2)


def label_row(
    labeler: str, pair: dict, preference: float, swapped: bool | None = None, pressed: str | None = None
) -> dict:
    """The ``annotations`` row of `labeler`'s label of `pair`; `preference` in the pair's own output_1/output_2 terms.

    `swapped` and `pressed`: the order shown and the key pressed (None for imported labels, shown elsewhere)."""
    c1, c2, flipped = canonical(pair["output_1"], pair["output_2"])
    return {
        "key": pair_key(labeler, pair),
        "annotator": annotator(labeler),
        "annotator_hash": labeler_hash(labeler),
        "model": "human",
        "instruction": pair["instruction"],
        "input": pair["input"],
        "output_1": c1,
        "output_2": c2,
        "preference": 3.0 - preference if flipped else preference,
        "status": "ok",
        "error": None,
        "raw_completion": pressed,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "price_usd": 0.0,
        "latency_s": 0.0,
        "created": now(),
        "prompt_format": None,
        "item": None,
        "items": None,
        "swapped": swapped,
        "p_1_shown_first": None,
        "p_1_shown_second": None,
    }


def pressed_row(labeler: str, pair: dict, pressed: str) -> dict:
    """The row of a key pressed on the page (1, 2 or t, in the order `labeler` was shown), mapped back to the pair."""
    if pressed not in KEYS:
        raise ValueError(f"label {pressed!r}: use 1, 2 or t (a tie)")
    swapped = shown_swapped(labeler, pair)
    in_canonical = 3.0 - KEYS[pressed] if swapped else KEYS[pressed]
    _, _, flipped = canonical(pair["output_1"], pair["output_2"])
    return label_row(labeler, pair, 3.0 - in_canonical if flipped else in_canonical, swapped, pressed)


def tombstone(row: dict) -> dict:
    """The row that undoes the label `row`: same key, status ``undone``, no preference."""
    return row | {"preference": None, "status": "undone", "error": "undone by the labeler", "created": now()}


def own_preference(row: dict, pair: dict) -> float:
    """A label row's preference in the pair's own output_1/output_2 terms."""
    _, _, flipped = canonical(pair["output_1"], pair["output_2"])
    return 3.0 - row["preference"] if flipped else row["preference"]


def append(store, rows: list[dict]) -> None:
    """Commit label rows to the ``annotations`` row log: one chunk, visible at once and whole."""
    store.append_rows(NAMESPACE, to_table(rows), NAMESPACE)


def current(store, labeler: str) -> dict[str, dict]:
    """Row key → the latest row of each pair `labeler` labeled (an ``undone`` row: the label was taken back)."""
    table = store.read_rows(NAMESPACE, NAMESPACE)
    if table.num_rows:
        table = table.filter(pc.equal(table.column("annotator"), pa.scalar(annotator(labeler))))
    return {row["key"]: row for row in table.to_pylist()}


def labels(store, labeler: str) -> list[dict]:
    """`labeler`'s labels in force (latest row ``ok``), oldest first."""
    return sorted((r for r in current(store, labeler).values() if r["status"] == "ok"), key=lambda r: r["created"])


def all_labels(store) -> list[dict]:
    """Every person's labels in force (annotators ``human:*``, latest row of each key ``ok``), oldest first."""
    table = store.read_rows(NAMESPACE, NAMESPACE)
    if not table.num_rows:
        return []
    table = table.filter(pc.starts_with(table.column("annotator"), PREFIX))
    latest = {row["key"]: row for row in table.to_pylist()}
    return sorted((r for r in latest.values() if r["status"] == "ok"), key=lambda r: r["created"])


def simulated_labels(store) -> list[dict]:
    """The row cache's ok labels of every simulated (not ``human:``) annotator."""
    table = store.read_rows(NAMESPACE, NAMESPACE)
    if not table.num_rows:
        return []
    table = table.filter(pc.invert(pc.starts_with(table.column("annotator"), PREFIX)))
    latest = {row["key"]: row for row in table.to_pylist()}
    return [r for r in latest.values() if r["status"] == "ok" and r["preference"] is not None]


# ---------------------------------------------------------------- pairs
def read_named(path: str | Path) -> tuple[list, list[str] | None]:
    """(rows, their names in error messages) of a .json or .parquet file (None: "row i"), or of a .jsonl or .csv
    file (its "line n")."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix != ".csv":
        rows = read_records(path)
        if suffix != ".jsonl":
            return rows, None
        lines = path.read_text(encoding="utf-8").splitlines()
        return rows, [f"line {n + 1}" for n, line in enumerate(lines) if line.strip()]
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        with path.open(encoding="utf-8", newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        raise DataError(f"{path}: cannot be read as CSV ({type(err).__name__}: {err})") from None
    return rows, [f"line {i + 2}" for i in range(len(rows))]


def check_pairs(rows: list, names: list[str] | None, where: str) -> list[dict]:
    """Rows with instruction, input and the two outputs as strings; an ``id`` of its own or ``<where>:<row>``."""
    rows = check_records(rows, where, PAIR_COLUMNS, {"input": str}, names=names)
    return [
        {
            "id": str(r.get("id") or f"{Path(where).name}:{i}"),
            "instruction": r["instruction"],
            "input": r["input"],
            "output_1": r["output_1"],
            "output_2": r["output_2"],
        }
        for i, r in enumerate(rows)
    ]


def load_pairs(store, source: str) -> list[dict]:
    """The pairs of a file (.json, .jsonl, .parquet, .csv) or of a committed table artifact with two outputs per row
    (a ``pairs`` or ``preferences`` stage output), named by its key, a unique prefix of it, or stage/key."""
    if Path(source).is_file():
        return check_pairs(*read_named(source), where=source)
    stage, _, wanted = source.rpartition("/")
    matches = [r for r in store.list() if r.key.startswith(wanted) and (not stage or r.stage == stage)]
    if len(matches) != 1:
        found = ", ".join(f"{r.stage}/{r.key[:12]}" for r in matches[:5])
        what = "no such file, and no artifact key matches" if not matches else f"{len(matches)} artifacts match"
        raise DataError(f"--pairs {source!r}: {what}" + (f" ({found}); give more of the key" if found else ""))
    ref = matches[0]
    if ref.kind != "table" or ref.format not in ("pairs", "preferences", "evaluation", "leaderboard"):
        raise DataError(f"--pairs {source!r}: artifact {ref.stage}/{ref.key[:12]} holds {ref.format}, not pairs")
    if ref.format == "leaderboard":
        return leaderboard_pairs(store, ref)
    return check_pairs(store.read_table(ref).to_pylist(), None, f"artifact {ref.stage}/{ref.key[:12]}")


def leaderboard_pairs(store, board) -> list[dict]:
    """The evaluation pairs (reference output vs the method's) of every method on a leaderboard, instruction by
    instruction; a pair two methods share (the same outputs) once. Ids are ``<method>:<instruction id>``."""
    rows, seen = [], set()
    for entry in store.read_table(board).to_pylist():
        ref = store.get("evaluate", entry["evaluation_key"])
        if ref is None:
            missing = entry["evaluation_key"][:12]
            raise DataError(f"leaderboard {board.key[:12]}: evaluation {missing} is not in the store")
        for r in store.read_table(ref).to_pylist():
            c1, c2, _ = canonical(r["output_1"], r["output_2"])
            if (r["instruction"], r["input"], c1, c2) not in seen:
                seen.add((r["instruction"], r["input"], c1, c2))
                rows.append(r | {"id": f"{entry['method']}:{r['id']}", "order": r["id"]})
    rows.sort(key=lambda r: r["order"])
    return check_pairs(rows, None, f"leaderboard {board.key[:12]}")

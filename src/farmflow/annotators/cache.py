"""The row-level annotation cache: every judged pair, in the store's ``annotations`` row log.

A row's key is ``sha256(annotator hash, instruction, input, output_1, output_2)`` with the
two outputs in canonical (sorted) order, and its preference is relative to that order.
The annotator hash covers everything that changes an answer: endpoint, the model asked
(the pool's `served_model` when set, else the annotator's), prompt format and style, batch
size, temperature, token cap, logit bias and the prompt version; not the annotator's name,
nor limits, prices or retries. So a pair judged once by an
annotator is never paid for again, in any run or flow, whichever order its outputs come
in.

The log is append-only (``store.append_rows``, one Parquet file per chunk). The latest
``ok`` row of a key wins; failed rows (``status`` 'failed', with ``error`` and the raw
completion when there was one) stay for `reparse` and are asked again by the next run.
A run writes through a `Writer`: rows not yet in a chunk wait in a local `journal`, which
`recover` commits after a crash.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

import farmflow.annotators.journal as journal
import farmflow.annotators.prompts as prompts
from farmflow.annotators.oracle import unit_hash
from farmflow.config import AnnotatorConfig, ApiAnnotatorConfig
from farmflow.config.credentials import CredentialsInValue, refuse_credentials
from farmflow.progress import log
from farmflow.storage import LocalStore, canonical_json
from farmflow.storage.schemas import SCHEMAS

NAMESPACE = "annotations"
OPENAI_URL = "https://api.openai.com/v1"


def resolve_base_url(annotator: ApiAnnotatorConfig, cfg: AnnotatorConfig) -> str:
    """The annotator's endpoint: its own, the pool's, $OPENAI_BASE_URL, or OpenAI's (never one with credentials in
    it)."""
    env = os.environ.get("OPENAI_BASE_URL")
    if env and not (annotator.base_url or cfg.base_url):
        try:
            refuse_credentials(env, "the API key comes from api_key_env or api_key_secret")
        except CredentialsInValue as err:
            raise ValueError(f"$OPENAI_BASE_URL {err}") from None
    return (annotator.base_url or cfg.base_url or env or OPENAI_URL).rstrip("/")


def max_tokens(annotator: ApiAnnotatorConfig) -> int:
    return annotator.max_tokens or prompts.default_max_tokens(annotator.prompt_format, annotator.batch_size)


def asked_model(annotator: ApiAnnotatorConfig, cfg: AnnotatorConfig) -> str:
    """The model name sent for this annotator: the pool's served_model when set."""
    return cfg.served_model or annotator.model


def annotator_hash(annotator: ApiAnnotatorConfig, base_url: str, served_model: str | None = None) -> str:
    payload = {
        "prompt_version": prompts.PROMPT_VERSION,
        "base_url": base_url,
        "model": served_model or annotator.model,
        "prompt_format": annotator.prompt_format,
        "style": annotator.style,
        "batch_size": annotator.batch_size,
        "temperature": annotator.temperature,
        "max_tokens": max_tokens(annotator),
        "logit_bias": annotator.logit_bias,
    }
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:16]


def row_key(ahash: str, instruction: str, input: str, output_1: str, output_2: str) -> str:
    """Cache key of a pair for one annotator; the outputs must be in canonical order."""
    return hashlib.sha256(json.dumps([ahash, instruction, input, output_1, output_2]).encode()).hexdigest()[:32]


def canonical(output_1: str, output_2: str) -> tuple[str, str, bool]:
    """(first, second, flipped): the outputs sorted, and whether that reversed them."""
    return (output_2, output_1, True) if output_2 < output_1 else (output_1, output_2, False)


def without_judge(cfg: AnnotatorConfig, instruction: str, input: str, output_1: str, output_2: str) -> dict | None:
    """The label of a pair that no judge is asked for, relative to (output_1, output_2): a tie (identical outputs,
    1.5) or, with probability `label_noise`, a fair coin (p_sim^ann's noise). None: the pair is to be judged.

    The coin is drawn for the canonical order and un-flipped, so a pair gets the same label whichever order its
    outputs come in, in any run, batch or judge kind."""
    if output_1 == output_2:
        return {"preference": 1.5, "status": "tie", "noised": False}
    c1, c2, flipped = canonical(output_1, output_2)
    if cfg.label_noise > 0 and unit_hash(cfg.seed, "noise", instruction, input, c1, c2) < cfg.label_noise:
        coin = 1.0 if unit_hash(cfg.seed, "coin", instruction, input, c1, c2) < 0.5 else 2.0
        return {"preference": 3.0 - coin if flipped else coin, "status": "noised", "noised": True}
    return None


def now() -> datetime:
    return datetime.now(timezone.utc)


def to_table(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=SCHEMAS[NAMESPACE])


def answer_rows(a, ahash: str, model: str, items: list, prefs, error, raw, usage, latency: float, price: float) -> list:
    """The cache rows of one request's outcome: per item (a `plan.Pending`) its preference relative to the canonical
    order (`prefs`: as shown, None when the request failed), the tokens and price split evenly between the items."""
    n, rows = len(items), []
    for k, it in enumerate(items, 1):
        shown = prefs[k - 1] if prefs is not None else None
        rows.append(
            {
                "key": it.key,
                "annotator": a.name,
                "annotator_hash": ahash,
                "model": model,
                "instruction": it.instruction,
                "input": it.input,
                "output_1": it.output_1,
                "output_2": it.output_2,
                "preference": None if shown is None else (3.0 - shown if it.swapped else shown),
                "status": "ok" if prefs is not None else "failed",
                "error": error,
                "raw_completion": raw,
                "prompt_tokens": usage[0] // n,
                "completion_tokens": usage[1] // n,
                "price_usd": price,
                "latency_s": latency,
                "created": now(),
                "prompt_format": a.prompt_format,
                "item": k,
                "items": n,
                "swapped": it.swapped,
            }
        )
    return rows


def read(store, hashes: set[str] | None = None) -> tuple[dict[str, dict], dict[str, dict]]:
    """(ok, failed): the latest ok row per key, and the latest failed row of keys without one."""
    table = store.read_rows(NAMESPACE, NAMESPACE)
    if hashes is not None and table.num_rows:
        table = table.filter(pc.is_in(table.column("annotator_hash"), value_set=pa.array(sorted(hashes), pa.string())))
    ok: dict[str, dict] = {}
    failed: dict[str, dict] = {}
    for row in table.to_pylist():
        (ok if row["status"] == "ok" else failed)[row["key"]] = row
    return ok, {k: r for k, r in failed.items() if k not in ok}


def journal_dir(store) -> Path:
    """Where runs on this machine journal rows for `store`: inside a local store, else in its local cache."""
    if isinstance(store, LocalStore):
        return store.root / "_journal" / NAMESPACE
    digest = hashlib.sha256(str(store.root).encode()).hexdigest()[:16]
    return Path(getattr(store, "cache", "~/.cache/farmflow")).expanduser() / "journal" / digest / NAMESPACE


def _from_journal(row: dict) -> dict:
    return row | {"created": datetime.fromisoformat(row["created"])}


def recover(store) -> int:
    """Commit to the row log the journaled rows of runs that died before writing them (see `journal`).

    A run killed after a chunk reached the log but before its journal was emptied leaves rows that are
    already committed: a row is recognised by its key and the moment it was answered, and skipped."""
    committed: set[tuple[str, datetime]] | None = None

    def commit(rows: list[dict]) -> int:
        nonlocal committed
        if committed is None:
            log_ = store.read_rows(NAMESPACE, NAMESPACE).select(["key", "created"]).to_pylist()
            committed = {(r["key"], r["created"]) for r in log_}
        new = [r for r in map(_from_journal, rows) if (r["key"], r["created"]) not in committed]
        if new:
            store.append_rows(NAMESPACE, to_table(new), NAMESPACE)
            committed |= {(r["key"], r["created"]) for r in new}
        return len(new)

    return journal.recover(journal_dir(store), commit)


class Writer:
    """A run's rows on their way to the log: journaled as they come, appended every `chunk_size` rows or
    `flush_s` seconds, and at `close` (on every exit path; if that append fails the journal stays for `recover`)."""

    def __init__(self, store, chunk_size: int, flush_s: float = 10.0, on_commit=None):
        """`on_commit(keys)`: called with the row keys of each chunk once it is in the row log."""
        self.store, self.chunk_size, self.flush_s, self.on_commit = store, chunk_size, flush_s, on_commit
        self.buffer: list[dict] = []
        self.since = time.monotonic()
        self.journal = journal.Journal(journal_dir(store))

    def add(self, rows: list[dict]) -> None:
        self.journal.write(rows)
        if not self.buffer:
            self.since = time.monotonic()
        self.buffer += rows
        if len(self.buffer) >= self.chunk_size or time.monotonic() - self.since >= self.flush_s:
            try:
                self.flush()
            except Exception as err:  # noqa: BLE001  (the rows stay journaled and buffered; the next flush tries again)
                log(
                    "annotate: cannot append to the row cache yet (%s: %s); will try again",
                    type(err).__name__,
                    str(err)[:160],
                )

    def flush(self) -> None:
        if self.buffer:
            self.store.append_rows(NAMESPACE, to_table(self.buffer), NAMESPACE)
            keys, self.buffer = [r["key"] for r in self.buffer], []
            self.journal.committed()
            if self.on_commit is not None:
                self.on_commit(keys)

    def close(self) -> None:
        try:
            self.flush()
        except BaseException:
            self.journal.close(keep=True)
            raise
        self.journal.close()


def reparse(store) -> dict[str, int]:
    """Parse the raw completions of failed rows again (no API calls); append the rows that now parse.

    Useful after a parser fix: the completions were paid for once and are kept.
    """
    recover(store)
    _, failed = read(store)
    fixed, still = [], 0
    for row in failed.values():
        if not row["raw_completion"] or not row["prompt_format"] or not row["items"]:
            still += 1
            continue
        try:
            shown = prompts.parse_raw(row["prompt_format"], row["items"], row["raw_completion"])[row["item"] - 1]
        except prompts.ParseError:
            still += 1
            continue
        fixed.append(
            row
            | {
                "preference": 3.0 - shown if row["swapped"] else shown,
                "status": "ok",
                "error": None,
                "prompt_tokens": 0,
                "completion_tokens": 0,
                "price_usd": 0.0,
                "latency_s": 0.0,
                "created": now(),
            }
        )
    if fixed:
        store.append_rows(NAMESPACE, to_table(fixed), NAMESPACE)
    return {"failed_rows": len(failed), "reparsed": len(fixed), "still_failed": still}

"""One labeler's way through a list of pairs: what is labeled, the pair to show next, label, undo.

Every label and undo is committed to the store before the call returns (`labels.append`), so closing the page
loses nothing; the session also keeps the latest row per pair in memory, so a click does not reread the log.
"""

from __future__ import annotations

import threading

from farmflow.labeling.labels import append, current, pair_key, pressed_row, shown, tombstone


class Session:
    """`labeler`'s labels of `pairs` (pairs with the same content are one pair: they share a row key)."""

    def __init__(self, store, pairs: list[dict], labeler: str):
        self.store, self.labeler = store, labeler
        self.pairs: dict[str, dict] = {}
        for pair in pairs:
            self.pairs.setdefault(pair_key(labeler, pair), pair)
        self.keys = list(self.pairs)
        self.rows = {k: r for k, r in current(store, labeler).items() if k in self.pairs}
        self.lock = threading.Lock()

    def labeled(self, key: str) -> bool:
        row = self.rows.get(key)
        return row is not None and row["status"] == "ok"

    def next_index(self) -> int | None:
        """The first pair (in the list's order) this labeler has not labeled; None when all are."""
        return next((i for i, k in enumerate(self.keys) if not self.labeled(k)), None)

    def state(self) -> dict:
        """What the page shows: progress and the next pair, its outputs in this labeler's order."""
        index = self.next_index()
        pair = None
        if index is not None:
            key = self.keys[index]
            first, second = shown(self.labeler, self.pairs[key])
            p = self.pairs[key]
            pair = {"key": key, "instruction": p["instruction"], "input": p["input"], "first": first, "second": second}
        done = sum(self.labeled(k) for k in self.keys)
        return {
            "labeler": self.labeler,
            "total": len(self.keys),
            "done": done,
            "index": index,
            "pair": pair,
            "can_undo": done > 0,
        }

    def label(self, key: str, pressed: str) -> dict:
        """Record `pressed` (1, 2 or t, in the order shown) for the pair `key`; the new state."""
        if key not in self.pairs:
            raise ValueError(f"no pair with key {key!r} in this list")
        pair = self.pairs[key]
        row = pressed_row(self.labeler, pair, pressed)
        with self.lock:
            append(self.store, [row])
            self.rows[key] = row
        return self.state()

    def undo(self) -> dict:
        """Take back this labeler's most recent label in force among these pairs (a tombstone row); the new state."""
        with self.lock:
            given = [self.rows[k] for k in self.keys if self.labeled(k)]
            if given:
                row = tombstone(max(given, key=lambda r: r["created"]))
                append(self.store, [row])
                self.rows[row["key"]] = row
        return self.state()

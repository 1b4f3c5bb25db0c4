"""Which pairs an annotation run asks, and which of several concurrent runs asks each one.

`plan` gives each row its annotator (a seeded hash of instruction and input), the order its
outputs are shown in (a seeded hash of the pair) and its row key; ties and label-noised pairs
are settled without a judge, and pairs already in the row cache are not asked again.

`settle` makes concurrent runs on one store (two `farmflow annotate` at once, two flows, two
machines on one bucket) ask each pair once. Before asking, a run takes a lease per row key
(`farmflow.storage.leases`, ``_leases/annotations/<key>``); then it reads the row cache again,
so a pair answered between its first look and its lease is not asked. Pairs leased by another
live run are not asked: the run waits until that run's answers reach the row cache and takes
them from there. A lease is released once the chunk holding its row is in the row cache (the
`cache.Writer` says when), so whoever finds a lease free finds the answer too. A run that dies
frees its leases (at once on its machine, after the lease TTL elsewhere); its journal is
recovered first (`cache.recover`, same machine), so a waiter asks only what the dead run never
answered. A pair whose answer failed in the other run is asked again by the waiter.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import farmflow.annotators.cache as cache
import farmflow.annotators.prompts as prompts
from farmflow.annotators.oracle import unit_hash
from farmflow.config import AnnotatorConfig
from farmflow.progress import log
from farmflow.storage.leases import Leases

LEASES = "annotations"


@dataclass
class Pending:
    """One pair to ask: outputs in canonical order, `swapped` = canonical output_2 shown first."""

    key: str
    instruction: str
    input: str
    output_1: str
    output_2: str
    swapped: bool

    def shown(self) -> prompts.Item:
        first, second = (self.output_2, self.output_1) if self.swapped else (self.output_1, self.output_2)
        return prompts.Item(self.instruction, self.input, first, second)


Todo = dict[int, dict[str, Pending]]
"""Annotator index → row key → pair to ask (deduplicated)."""


def assign(cfg: AnnotatorConfig, instruction: str, input: str, pool: list) -> int:
    return int(unit_hash(cfg.seed, "assign", instruction, input) * len(pool))


def plan(rows: list[dict], cfg: AnnotatorConfig, hashes: list[str], ok: dict[str, dict]) -> tuple[list[dict], Todo]:
    """(one entry per row: annotator, flipped, swapped, and the label or the row key; the pairs to ask)."""
    pool = cfg.api_pool
    entries: list[dict] = []
    todo: Todo = defaultdict(dict)
    for row in rows:
        ins, inp, o1, o2 = row["instruction"], row.get("input") or "", row["output_1"], row["output_2"]
        i = assign(cfg, ins, inp, pool)
        c1, c2, flipped = cache.canonical(o1, o2)
        swapped_canon = unit_hash(cfg.seed, "order", ins, inp, c1, c2) < 0.5
        entry = {"annotator": pool[i].name, "i": i, "flipped": flipped, "swapped": swapped_canon != flipped}
        entry["noised"] = False
        settled = cache.without_judge(cfg, ins, inp, o1, o2)
        if settled:
            entry |= settled
        else:
            key = cache.row_key(hashes[i], ins, inp, c1, c2)
            entry["key"] = key
            if key not in ok:
                todo[i][key] = Pending(key, ins, inp, c1, c2, swapped_canon)
        entries.append(entry)
    return entries, dict(todo)


class Claims:
    """A run's leases on row keys."""

    def __init__(self, store):
        self.store, self.leases = store, Leases(store)

    def claim(self, keys: list[str]) -> set[str]:
        """The keys of `keys` this run holds now (the others are leased by a live run)."""
        got = self.leases.acquire_many([f"{LEASES}/{k}" for k in keys])
        return {n.split("/", 1)[1] for n in got}

    def may_claim(self, key: str) -> bool:
        """Whether asking for `key`'s lease can succeed: no live holder known."""
        holder = self.leases.holders.get(f"{LEASES}/{key}")
        return holder is None or not self.leases.alive(holder)

    def release(self, keys) -> None:
        self.leases.release([f"{LEASES}/{k}" for k in keys])

    def close(self) -> None:
        self.leases.close()


def settle(
    todo: Todo,
    store,
    hashes: list[str],
    ask: Callable[[Todo, Claims | None], bool],
    progress: Callable[[int], None] | None = None,
) -> dict[str, dict]:
    """Get every pair of `todo` asked exactly once across the runs on `store`: ``ask(batch, claims)`` for the pairs
    this run claims (False: the run stopped, at an error or the budget), the others waited for in the row cache.
    Returns the rows other runs answered (key → cache row)."""
    if store is None:
        ask(todo, None)
        return {}
    claims = Claims(store)
    others: dict[str, dict] = {}
    waiting = {i: dict(p) for i, p in todo.items() if p}
    said, poll = False, min(1.0, claims.leases.ttl / 4)
    try:
        while waiting:
            keys = [k for p in waiting.values() for k in p]
            mine = claims.claim([k for k in keys if claims.may_claim(k)])
            cache.recover(store)  # what a run that died (its leases just taken over) journaled on this machine
            fresh, _ = cache.read(store, set(hashes))
            done = {k: fresh[k] for k in keys if k in fresh}
            claims.release(mine & set(done))
            others |= done
            if progress and done:
                progress(len(done))
            batch = {i: {k: p for k, p in pend.items() if k in mine and k not in done} for i, pend in waiting.items()}
            left = {
                i: {k: p for k, p in pend.items() if k not in mine and k not in done} for i, pend in waiting.items()
            }
            waiting = {i: p for i, p in left.items() if p}
            if any(batch.values()):
                go_on = ask({i: p for i, p in batch.items() if p}, claims)
                claims.release([k for p in batch.values() for k in p])  # unsent ones: nothing to wait for
                if not go_on:
                    break
            if waiting:
                if not said:
                    n = sum(len(p) for p in waiting.values())
                    log("annotate: %d pairs are being asked by another run; waiting for its answers", n)
                    said = True
                time.sleep(poll)
    finally:
        claims.close()
    return others

"""Leases in the store: one run does a piece of work while the others wait for its result.

Two runs on one store that need the same stage key, or the same annotation pair, would
otherwise both compute it (and pay for it). A lease says who is doing it; every other run
waits for the result to be committed instead of doing the work again.

Layout (under ``_leases/``, in the store itself, so it works across machines on S3):

* ``owners/<owner>.json``: a run's heartbeat ``{host, pid, beat, ttl_s}``, rewritten every
  ``ttl_s / 4`` seconds by a daemon thread while the run holds leases;
* ``<name>/<generation>.json``: ``{owner, at}``, created with the store's `_create` (a
  hard link locally, a conditional PUT with ``If-None-Match: *`` on S3), so of two runs
  creating the same generation exactly one succeeds, whatever the timing.

A lease is held by the owner of its highest generation while that owner is alive: its
heartbeat is younger than its TTL and, on the same machine (host and PID namespace), its
process exists. So a run killed with SIGKILL blocks nobody: on its machine its leases are
free at once, elsewhere after the TTL (``$FARMFLOW_LEASE_TTL_S``, default 60 s; clocks
must agree to well within it). A run takes a lease over from a dead owner by creating the
next generation; releasing deletes its own generation.

A lease only decides who works; the result is still committed the usual way (first commit
wins), so even a run that lost its lease while stalled can never make a result wrong,
at most make one computed twice.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from farmflow.progress import log

TTL_ENV = "FARMFLOW_LEASE_TTL_S"
DEFAULT_TTL_S = 60.0
T = TypeVar("T")


def machine() -> str:
    """This machine as far as process ids go: host name and PID namespace (containers have their own)."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{socket.gethostname()}:{ns}"


MACHINE = machine()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def ttl_s() -> float:
    raw = os.environ.get(TTL_ENV)
    try:
        value = float(raw) if raw else DEFAULT_TTL_S
        assert value > 0
    except (ValueError, AssertionError):
        raise ValueError(f"${TTL_ENV}: expected a positive number of seconds, got {raw!r}") from None
    return value


class Leases:
    """One run's leases in `store` (see the module docstring); `close` releases them all."""

    def __init__(self, store, ttl: float | None = None):
        self.store, self.ttl = store, ttl or ttl_s()
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.held: dict[str, int] = {}
        self.holders: dict[str, str] = {}
        """Lease name → the live owner that held it when `try_acquire` last found it taken."""
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.memo: dict[str, tuple[float, bool]] = {}

    # ------------------------------------------------------------------ paths
    def _dir(self, name: str) -> str:
        if not name or any(part in ("", ".", "..", "owners") for part in name.split("/")):
            raise ValueError(f"invalid lease name {name!r}")
        return self.store._p("_leases", name)

    def _owner_path(self, owner: str) -> str:
        return self.store._p("_leases", "owners", f"{owner}.json")

    # ------------------------------------------------------------------ heartbeat
    def _beat(self) -> None:
        body = {"host": MACHINE, "pid": os.getpid(), "beat": time.time(), "ttl_s": self.ttl}
        with self.store._io():
            self.store._write_atomic(self._owner_path(self.owner), json.dumps(body).encode())

    def _start(self) -> None:
        with self.lock:
            if self.thread is not None:
                return
            self._beat()
            self.thread = threading.Thread(target=self._beating, name="farmflow-lease-heartbeat", daemon=True)
            self.thread.start()

    def _beating(self) -> None:
        while not self.stop.wait(self.ttl / 4):
            try:
                self._beat()
            except Exception as err:  # noqa: BLE001 - the store may be back at the next beat
                log("leases: heartbeat not written (%s); trying again", type(err).__name__)

    def alive(self, owner: str) -> bool:
        """Whether `owner`'s heartbeat is fresh (and, on this machine, its process exists); asked at most every
        half second per owner."""
        if owner == self.owner:
            return True
        now = time.monotonic()
        if owner in self.memo and now - self.memo[owner][0] < 0.5:
            return self.memo[owner][1]
        try:
            with self.store._io():
                info = json.loads(self.store.fs.cat_file(self._owner_path(owner)))
            same = info.get("host") == MACHINE
            ok = time.time() - float(info["beat"]) < float(info.get("ttl_s") or self.ttl)
            ok = ok and (not same or pid_alive(int(info["pid"])))
        except FileNotFoundError:
            ok = False  # closed (its leases released) or never written: nobody to wait for
        except (ValueError, KeyError, TypeError):
            ok = False  # a heartbeat cut short: its writer died mid-write
        self.memo[owner] = (now, ok)
        return ok

    # ------------------------------------------------------------------ leases
    def _top(self, name: str) -> tuple[int, dict | None] | None:
        """(highest generation, its content; None if it vanished meanwhile), or None without any."""
        with self.store._io():
            try:
                paths = sorted(self.store.fs.glob(f"{self._dir(name)}/*.json"))
            except FileNotFoundError:  # a local lease folder removed by its last holder while it was listed
                paths = []
            if not paths:
                return None
            gen = int(paths[-1].rsplit("/", 1)[1].split(".")[0])
            try:
                return gen, json.loads(self.store.fs.cat_file(paths[-1]))
            except FileNotFoundError:
                return gen, None
            except ValueError:
                return gen, {"owner": ""}  # unreadable: its writer is gone

    def _take(self, name: str, gen: int) -> bool:
        body = json.dumps({"owner": self.owner, "at": time.time()}).encode()
        with self.store._io():
            if not self.store._create(f"{self._dir(name)}/{gen:010d}.json", body):
                return False
        self.held[name] = gen
        for old in range(max(0, gen - 2), gen):  # the dead owners' generations: best effort
            self._delete(name, old)
        return True

    def _delete(self, name: str, gen: int) -> None:
        try:
            with self.store._io():
                self.store.fs.rm_file(f"{self._dir(name)}/{gen:010d}.json")
        except Exception:  # noqa: BLE001 - best effort (see `release`)
            pass
        if isinstance(self.store.root, Path):  # a local store: no empty folder per lease left behind
            try:
                os.rmdir(self._dir(name))
            except OSError:
                pass

    def try_acquire(self, name: str) -> bool:
        """Hold lease `name` now (True), or False while a live run holds it."""
        if name in self.held:
            return True
        self.holders.pop(name, None)
        self._start()
        gen = 0
        for _ in range(8):  # each round either takes the lease, finds a live holder, or lost a race to one
            if self._take(name, gen):
                return True
            top = self._top(name)
            if top is None:
                gen = 0
                continue
            gen, info = top
            if info is None:
                continue
            if info.get("owner") == self.owner:
                self.held[name] = gen
                return True
            if self.alive(str(info.get("owner"))):
                self.holders[name] = str(info.get("owner"))
                return False
            gen += 1
        return False

    def acquire_many(self, names: list[str], threads: int = 8) -> set[str]:
        """The names of `names` whose leases this run holds now (several at once: each is one request on S3)."""
        if not names:
            return set()
        self._start()
        with ThreadPoolExecutor(min(threads, len(names))) as pool:
            got = list(pool.map(self.try_acquire, names))
        return {n for n, ok in zip(names, got) if ok}

    def release(self, names: list[str] | str) -> None:
        """Give up leases (one bulk delete on S3)."""
        names = [names] if isinstance(names, str) else list(names)
        gens = {name: self.held.pop(name) for name in names if name in self.held}
        if not gens:
            return
        if isinstance(self.store.root, Path):
            for name, gen in gens.items():
                self._delete(name, gen)
            return
        try:
            with self.store._io():
                self.store.fs.rm([f"{self._dir(name)}/{gen:010d}.json" for name, gen in gens.items()])
        except Exception:  # noqa: BLE001 - best effort: once this run closes, its heartbeat goes and its leases with it
            pass

    def close(self) -> None:
        """Release every lease and stop the heartbeat (its file goes too: nobody waits for a closed run)."""
        self.release(list(self.held))
        self.stop.set()
        if self.thread is not None:
            self.thread.join(timeout=5)
            try:
                with self.store._io():
                    self.store.fs.rm_file(self._owner_path(self.owner))
            except Exception:  # noqa: BLE001 - a heartbeat left behind goes stale after the TTL
                pass


@contextmanager
def single_flight(leases: Leases, name: str, ready: Callable[[], T | None], what: str) -> Iterator[T | None]:
    """Yields what `ready()` finds once it finds it, or None when this run holds lease `name` and is to do the
    work itself (the lease is released when the block exits). While another live run holds the lease, waits."""
    waited = time.monotonic()
    said = False
    while True:
        found = ready()
        if found is not None:
            yield found
            return
        if leases.try_acquire(name):
            try:
                yield ready()  # committed between the look above and the lease: nothing left to do
            finally:
                leases.release(name)
            return
        if not said:
            log("%s: another run is computing it; waiting for its result", what)
            said = True
        time.sleep(min(2.0, leases.ttl / 4))
        if time.monotonic() - waited > 600:
            log("%s: still waiting for another run (%.0f s so far)", what, time.monotonic() - waited)
            waited = time.monotonic()

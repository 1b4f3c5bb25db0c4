"""Progress of long stages: a tqdm bar on a terminal, lines in the logs everywhere else.

A terminal shows a tqdm bar (rate, time left). Where nobody watches one (a Prefect worker, CI,
`make demo > log`), and inside a Prefect flow or task run even with a bar, a stage logs a line
every `FARMFLOW_PROGRESS_EVERY_S` seconds (default 30; 0 turns them off) with the count, the
speed, the time left and the latest values the loop reports (loss, reward, ...), and one line
at the end with the count and the speed. Inside a flow or task run the lines go to the run's
Prefect logs (the UI shows them); outside one to the `farmflow` logger.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

from tqdm.auto import tqdm

logger = logging.getLogger("farmflow")


def log(msg: str, *args: Any) -> None:
    """Log at INFO through Prefect inside a flow or task run, through the `farmflow` logger outside one."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    try:
        get_run_logger().info(msg, *args)
    except MissingContextError:
        logger.info(msg, *args)


def in_prefect_run() -> bool:
    """Inside a Prefect flow or task run (whose logs the UI shows)."""
    from prefect.context import FlowRunContext, TaskRunContext

    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def _rate(speed: float) -> str:
    """A speed with one decimal, or two significant digits below 0.05 (a slow step still shows its rate)."""
    return f"{speed:.1f}" if speed >= 0.05 or speed == 0 else f"{speed:.2g}"


def _clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


class Progress:
    """What a stage's loop updates: `update(n)` (or the bar itself, ``bar(n)``) after each batch, `skip(n)` for units
    it had no work for (cached, repeated), `set_postfix(loss=...)` for its latest values."""

    def __init__(self, desc: str, total: int, unit: str, initial: int, show: bool, every_s: float) -> None:
        self.desc, self.total, self.unit, self.initial, self.n = desc, total, unit, initial, initial
        self.bar = (
            tqdm(total=total, initial=initial, desc=desc, unit=unit, dynamic_ncols=True, leave=False) if show else None
        )
        self.every_s, self.postfix = every_s, ""
        self.start = self.last = time.perf_counter()
        self.to_run_logs = show and in_prefect_run()  # a bar on the terminal, and lines for the run's Prefect logs

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
            if not self.to_run_logs:
                return
        now = time.perf_counter()
        if self.every_s > 0 and now - self.last >= self.every_s and self.n < self.total:
            self.last = now
            speed = (self.n - self.initial) / max(now - self.start, 1e-9)
            left = f", {_clock((self.total - self.n) / speed)} left" if speed > 0 else ""
            log(
                "%s: %d/%d %ss (%.0f%%), %s %ss/s%s%s",
                self.desc,
                self.n,
                self.total,
                self.unit,
                100 * self.n / max(self.total, 1),
                _rate(speed),
                self.unit,
                left,
                self.postfix,
            )

    __call__ = update

    def skip(self, n: int) -> None:
        """Count `n` units done without work: they move the bar but not the rate (as `initial` does)."""
        self.initial += n
        self.update(n)

    def set_postfix(self, **values: Any) -> None:
        if self.bar is not None:
            self.bar.set_postfix(**values)
        self.postfix = "".join(f", {k} {v}" for k, v in values.items())

    def close(self) -> float:
        """Close the bar; the seconds since the start."""
        if self.bar is not None:
            self.bar.close()
        return time.perf_counter() - self.start


@contextmanager
def progress(desc: str, total: int, unit: str = "it", initial: int = 0) -> Iterator[Progress]:
    """Progress of `total` `unit`s (`initial` already done, e.g. when resuming from a checkpoint).

    A tqdm bar when stderr is a terminal or FARMFLOW_PROGRESS=1, else periodic log lines (module
    doc); on exit one log line with the count worked through (not `initial` or skipped units), the seconds and the
    speed either way.
    """
    show = sys.stderr.isatty() or os.environ.get("FARMFLOW_PROGRESS") == "1"
    raw = os.environ.get("FARMFLOW_PROGRESS_EVERY_S", "30")
    try:
        every_s = float(raw)
    except ValueError:
        raise ValueError(
            f"FARMFLOW_PROGRESS_EVERY_S must be a number of seconds (0: no periodic lines), got {raw!r}"
        ) from None
    bar = Progress(desc, total, unit, initial, show, every_s)
    try:
        yield bar
    finally:
        secs = bar.close()
        done = bar.n - bar.initial
        log("%s: %d %ss in %.1fs (%s %ss/s)", desc, done, unit, secs, _rate(done / max(secs, 1e-9)), unit)

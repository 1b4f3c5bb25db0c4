"""Request rate limits of the API annotators, shared by everything that uses the same limit name.

With a Prefect server (PREFECT_API_URL) the limit is Prefect's global concurrency limit with
slot decay, so every flow and worker using that name shares it; without one, a limiter
shared within the process spaces requests evenly.
"""

from __future__ import annotations

import asyncio
import threading
import time

from farmflow.config import AnnotatorConfig
from farmflow.progress import log


class LocalLimiter:
    """Requests evenly spaced at `per_minute`, shared by every caller in the process."""

    def __init__(self, per_minute: float):
        self.interval, self.next, self.lock = 60.0 / per_minute, 0.0, threading.Lock()

    async def wait(self) -> None:
        with self.lock:
            now = time.monotonic()
            slot = max(now, self.next)
            self.next = slot + self.interval
        if slot > now:
            await asyncio.sleep(slot - now)


LIMITERS: dict[tuple[str, float], LocalLimiter] = {}
"""(limit name, requests per minute) -> the process-wide limiter."""
_LIMITERS_LOCK = threading.Lock()


def _prefect_api_configured() -> bool:
    from prefect.settings import get_current_settings

    return bool(get_current_settings().api.url)


async def _prefect_limiter(name: str, per_minute: float):
    """Prefect's `rate_limit` on a global concurrency limit with slot decay, created if missing."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.asyncio import rate_limit
    from prefect.exceptions import ObjectNotFound

    async with get_client() as client:
        try:
            await client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            per_s = per_minute / 60.0
            await client.create_global_concurrency_limit(
                GlobalConcurrencyLimitCreate(name=name, limit=max(1, int(per_s)), slot_decay_per_second=per_s)
            )
            log("created Prefect rate limit %r: %.3g requests/s", name, per_s)

    async def wait() -> None:
        await rate_limit(name, occupy=1, strict=True)

    return wait


async def make_limiter(cfg: AnnotatorConfig):
    """An async `wait()` per request: Prefect's global limit with a server, a process-wide one otherwise."""
    if cfg.requests_per_minute is None:

        async def unlimited() -> None:
            return None

        return unlimited
    if _prefect_api_configured():
        return await _prefect_limiter(cfg.rate_limit_name, cfg.requests_per_minute)
    with _LIMITERS_LOCK:
        key = (cfg.rate_limit_name, cfg.requests_per_minute)
        limiter = LIMITERS.setdefault(key, LocalLimiter(cfg.requests_per_minute))
    return limiter.wait


__all__ = ["LIMITERS", "LocalLimiter", "make_limiter"]

"""The run's spending cap (`max_cost_usd`), reserved before each request is sent.

A request's cost is only known from its reply, so counting after replies lets every request
in flight pass the cap. Instead each request first reserves an upper estimate, its prompt
(about 4 characters a token) plus its whole completion token cap at the model's price, and
the reply's usage replaces the reservation. A request that does not fit waits while others
are in flight (their replies usually cost less than reserved) and is not sent once nothing is
in flight and it still does not fit. So a run spends at most the cap, give or take the
prompt estimate's error, and stops less than one request's estimate short of it.
"""

from __future__ import annotations

import asyncio
import math

from farmflow.config import ModelPrice

CHARS_PER_TOKEN = 4


def prompt_tokens_estimate(messages: list[dict]) -> int:
    return math.ceil(sum(len(m.get("content") or "") for m in messages) / CHARS_PER_TOKEN)


def cost(price: ModelPrice | None, prompt_tokens: int, completion_tokens: int) -> float:
    if price is None:
        return 0.0
    return (prompt_tokens * price.prompt_usd_per_mtok + completion_tokens * price.completion_usd_per_mtok) / 1e6


class Budget:
    """Reservations against `cap` USD (None: no cap, every reservation succeeds at once)."""

    def __init__(self, cap: float | None):
        self.cap = cap
        self.spent = 0.0
        self.reserved = 0.0
        self.in_flight = 0
        self.exhausted = False  # a request did not fit with nothing in flight: send nothing more
        self._changed = asyncio.Condition()

    async def reserve(self, estimate: float) -> bool:
        """Hold `estimate` USD for one request; False when it can never fit (the cap is reached)."""
        async with self._changed:
            while True:
                if self.exhausted:
                    return False
                if self.cap is None or self.spent + self.reserved + estimate <= self.cap:
                    self.reserved += estimate
                    self.in_flight += 1
                    return True
                if self.in_flight == 0:
                    self.exhausted = True
                    self._changed.notify_all()
                    return False
                await self._changed.wait()

    async def settle(self, estimate: float, actual: float) -> None:
        """Replace a reservation by what the request cost (0 when it failed before being billed)."""
        async with self._changed:
            self.reserved = max(0.0, self.reserved - estimate)
            self.in_flight -= 1
            self.spent += actual
            self._changed.notify_all()


__all__ = ["Budget", "cost", "prompt_tokens_estimate"]

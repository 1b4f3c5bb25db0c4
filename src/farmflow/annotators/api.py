"""API annotators: LLM judges on any OpenAI-compatible endpoint, through `openai.AsyncOpenAI`.

`annotate_api(rows, cfg, store)` labels pairs with a pool of API annotators:

1. ties (identical outputs) are 1.5 and label-noised pairs a fair coin: neither is sent;
2. every other pair gets its annotator (seeded hash of instruction + input) and the order
   its outputs are shown in (seeded hash of the pair), and is looked up in the row cache;
3. the pairs not in the cache are claimed in the store, so concurrent runs ask each pair once
   (`plan.settle`: a pair another live run is asking is waited for in the row cache); the
   pairs this run claimed are grouped per annotator into requests of `batch_size`
   numbered items and sent, at most `max_in_flight` at once, under the rate limit, with
   the pool's `served_model` as the model name when set. The first request to each
   endpoint and model goes alone, one after another (once per process), so a bad key, a
   model the endpoint does not serve or an unreachable endpoint gives one clear error
   instead of a burst. The SDK retries 408/429/5xx, timeouts and connection errors
   (`max_retries`, honoring Retry-After) and no other 4xx (`failures`). A reply that cannot
   be read (a completion that does not parse, a body that is not JSON) is asked again
   once. Any other failure of a request, whatever raised it, fails that request's rows
   with the reason (`failures.describe`), the raw completion kept for `reparse`;
4. each answer is journaled on local disk as it arrives and appended to the row cache
   every `chunk_size` pairs or 10 s and whenever the run ends (`journal`), so a killed run
   re-asks only the requests that were in flight;
5. each request reserves its estimated cost before it is sent (`budget`): the run spends at
   most `max_cost_usd` and stops within one request's cost of it; what is done is kept.

The API key comes from the environment variable `api_key_env` or the Prefect Secret block
`api_key_secret`; it is never logged, stored, or put into an exception message.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import farmflow.annotators.budget as budget
import farmflow.annotators.cache as cache
import farmflow.annotators.failures as failures
import farmflow.annotators.plan as planning
import farmflow.annotators.prompts as prompts
from farmflow.annotators.ratelimit import make_limiter
from farmflow.config import AnnotatorConfig, ApiAnnotatorConfig
from farmflow.progress import log

if TYPE_CHECKING:
    import openai


class AnnotationError(RuntimeError):
    """The endpoint cannot be used at all (unreachable, bad key, unknown model): one clear message.

    `judged` holds the per-row results of the run so far (as `annotate_api` returns them) when
    the error stopped a run, so a caller can still write what was judged and a summary.
    """

    def __init__(self, message: str, judged: list[dict] | None = None, stats: RunStats | None = None):
        super().__init__(message)
        self.judged, self.stats = judged, stats


@dataclass
class RunStats:
    requests: int = 0
    reasks: int = 0
    judged: int = 0
    failed: int = 0
    unsent: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    seconds: float = 0.0
    stopped: str | None = None
    errors: Counter = field(default_factory=Counter)

    def add(self, other: RunStats) -> None:
        """Count `other` (a later batch of the same run) in."""
        for name in ("requests", "reasks", "judged", "failed", "unsent", "prompt_tokens", "completion_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.cost_usd, self.seconds = self.cost_usd + other.cost_usd, self.seconds + other.seconds
        self.stopped = self.stopped or other.stopped
        self.errors.update(other.errors)


# ----------------------------------------------------------------------------- secrets
def api_key(cfg: AnnotatorConfig) -> str:
    """The API key from the Prefect Secret block or the environment; the message never contains it."""
    if cfg.api_key_secret:
        from prefect.blocks.system import Secret

        try:
            value = Secret.load(cfg.api_key_secret).get()
        except Exception as err:  # noqa: BLE001  (block missing, no Prefect API...)
            raise AnnotationError(
                f"annotation.api_key_secret: cannot load Prefect Secret block {cfg.api_key_secret!r} "
                f"({type(err).__name__})"
            ) from None
        if isinstance(value, dict):  # a JSON Secret: the key is its api_key field
            value = value.get("api_key")
        if not isinstance(value, str) or not value:
            raise AnnotationError(
                f"annotation.api_key_secret: Prefect Secret block {cfg.api_key_secret!r} must hold the key as a string "
                "(or JSON with an api_key field)"
            )
        return value
    value = os.environ.get(cfg.api_key_env)
    if not value:
        raise AnnotationError(
            f"annotation.api_key_env: environment variable {cfg.api_key_env} is not set (the API annotators' key)"
        )
    return value


# ----------------------------------------------------------------------------- the run
Outcome = tuple  # (preferences or None, error or None, raw completion, [prompt, completion tokens], seconds)


class _Run:
    def __init__(self, cfg: AnnotatorConfig, store, key: str, limiter, progress=None, claims=None):
        self.cfg, self.store, self.key, self.limiter, self.progress = cfg, store, key, limiter, progress
        self.sem = asyncio.Semaphore(cfg.max_in_flight)
        self.budget = budget.Budget(cfg.max_cost_usd)
        self.stats = RunStats()
        self.results: dict[str, dict] = {}
        release = claims.release if claims is not None else None  # a pair's lease goes once its row is in the cache
        self.writer = cache.Writer(store, cfg.chunk_size, on_commit=release) if store is not None else None
        self.fatal: str | None = None
        self.clients: dict[str, openai.AsyncOpenAI] = {}

    def client(self, base_url: str) -> openai.AsyncOpenAI:
        if base_url not in self.clients:
            import openai  # here, not at the top: every stage process imports this module, few ask an API (~1 s)

            http = openai.DefaultAsyncHttpxClient(event_hooks={"response": [failures.no_retry_on_client_errors]})
            self.clients[base_url] = openai.AsyncOpenAI(
                base_url=base_url,
                api_key=self.key,
                http_client=http,
                max_retries=self.cfg.max_retries,
                timeout=self.cfg.timeout_s,
            )
        return self.clients[base_url]

    def model(self, a: ApiAnnotatorConfig) -> str:
        return cache.asked_model(a, self.cfg)

    def record(self, a: ApiAnnotatorConfig, ahash: str, items: list[planning.Pending], outcome: Outcome) -> None:
        prefs, error, raw, usage, latency = outcome
        n, model = len(items), self.model(a)
        price = budget.cost(self.cfg.prices.get(model), *usage) / n
        rows = cache.answer_rows(a, ahash, model, items, prefs, error, raw, usage, latency, price)
        if self.writer is not None:
            self.writer.add(rows)
        self.results |= {r["key"]: r for r in rows}
        if prefs is None:
            self.stats.failed += n
            self.stats.errors[error.split(":")[0] if error else "error"] += n
        else:
            self.stats.judged += n
        if self.progress:
            self.progress(n)

    async def ask(self, a: ApiAnnotatorConfig, base_url: str, ahash: str, items: list[planning.Pending]) -> None:
        async with self.sem:
            try:
                outcome = await self._attempts(a, base_url, items)
            except Exception as err:  # noqa: BLE001  (whatever raised, this request fails and the run goes on)
                reason = f"error: {type(err).__name__}: {failures.one_line(str(err), self.key, 160)}"
                outcome = (None, reason, None, [0, 0], 0.0)
            if outcome is None:  # not sent: a fatal error or the budget
                self.stats.unsent += len(items)
                return
            self.record(a, ahash, items, outcome)

    async def _attempts(self, a: ApiAnnotatorConfig, base_url: str, items: list[planning.Pending]) -> Outcome | None:
        """Send one request (again once if its reply cannot be read); None when it was not sent."""
        model = self.model(a)
        request = chat_request(a, model, items)
        estimate = budget.cost(
            self.cfg.prices.get(model), budget.prompt_tokens_estimate(request["messages"]), request["max_tokens"]
        )
        usage, raw, error, start = [0, 0], None, "", time.perf_counter()

        def failed(reason: str) -> Outcome:
            return None, reason, raw, usage, time.perf_counter() - start

        for attempt in (0, 1):
            if self.fatal or not await self.budget.reserve(estimate):
                stop = "the run stopped" if self.fatal else "max_cost_usd reached"
                return None if attempt == 0 else failed(f"{error} (not re-asked: {stop})")
            await self.limiter()
            self.stats.requests += 1
            try:
                resp = await self.client(base_url).chat.completions.create(**request)
            except Exception as err:  # noqa: BLE001  (SDK errors, and anything else a reply can raise)
                await self.budget.settle(estimate, 0.0)
                failure = failures.describe(
                    err,
                    secret=self.key,
                    base_url=base_url,
                    annotator=a.name,
                    model=model,
                    key_source=self._key_source(),
                    timeout_s=self.cfg.timeout_s,
                )
                if failure.fatal:
                    self.fatal = self.fatal or failure.message
                    return None
                error, reask = failure.message, failure.reask
            else:
                spent = self._count_usage(model, resp, usage)
                await self.budget.settle(estimate, estimate if spent is None else spent)
                try:
                    text, top = failures.read_reply(resp, base_url, self.key)
                except failures.BadReply as err:
                    return failed(str(err))
                raw = prompts.raw_completion(a.prompt_format, text, top)
                try:
                    prefs = prompts.parse(a.prompt_format, len(items), text, top)
                    return prefs, None, raw, usage, time.perf_counter() - start
                except prompts.ParseError as err:
                    error, reask = f"parse: {err}", True
            if not reask:
                return failed(error)
            if attempt == 0:
                self.stats.reasks += 1
        return failed(f"{error} (after one re-ask)")

    def _count_usage(self, model: str, resp: object, usage: list[int]) -> float | None:
        """Add a reply's token counts to the request's and the run's; its cost, None without usage."""
        u = getattr(resp, "usage", None)
        if u is None:
            return None
        prompt, completion = int(getattr(u, "prompt_tokens", 0) or 0), int(getattr(u, "completion_tokens", 0) or 0)
        usage[0] += prompt
        usage[1] += completion
        self.stats.prompt_tokens += prompt
        self.stats.completion_tokens += completion
        cost = budget.cost(self.cfg.prices.get(model), prompt, completion)
        self.stats.cost_usd += cost
        return cost

    def _key_source(self) -> str:
        return f"Prefect Secret {self.cfg.api_key_secret!r}" if self.cfg.api_key_secret else f"${self.cfg.api_key_env}"

    async def run(self, requests: list[tuple[ApiAnnotatorConfig, str, str, list[planning.Pending]]]) -> None:
        start = time.perf_counter()
        try:
            # the first request to each endpoint and model not yet seen working in this process goes
            # alone, one after another: a bad key, model or endpoint fails once, not max_in_flight times
            firsts: dict[tuple, tuple] = {}
            for r in requests:
                firsts.setdefault((r[1], self.model(r[0])), r)
            probes = [r for k, r in firsts.items() if self._verified(k) not in _VERIFIED]
            for r in probes:
                await self.ask(*r)
                if self.fatal is None:
                    _VERIFIED.add(self._verified((r[1], self.model(r[0]))))
            rest = [r for r in requests if not any(r is p for p in probes)]
            rest.sort(key=lambda r: r[3][0].key)  # interleave annotators; deterministic order
            await asyncio.gather(*(self.ask(*r) for r in rest))
        finally:
            await self._close(time.perf_counter() - start)

    async def _close(self, seconds: float) -> None:
        """On every exit (done, error, cancelled): the last rows to the row cache, the clients closed."""
        try:
            if self.writer is not None:
                self.writer.close()
        finally:
            for c in self.clients.values():
                await c.close()
            self.stats.seconds = seconds
            self.stats.stopped = self.fatal or ("budget" if self.budget.exhausted else None)

    def _verified(self, endpoint_model: tuple) -> tuple:
        return (*endpoint_model, hashlib.sha256(self.key.encode()).hexdigest()[:16])


_VERIFIED: set[tuple] = set()
"""(base_url, model, key digest) that answered in this process: later runs skip the lone first request."""


def chat_request(a: ApiAnnotatorConfig, model: str, items: list[planning.Pending]) -> dict:
    """The chat-completion parameters for one request: only what OpenAI-compatible servers accept."""
    messages = prompts.render([it.shown() for it in items], a.prompt_format, a.style)
    request: dict = {
        "model": model,
        "messages": messages,
        "temperature": a.temperature,
        "max_tokens": cache.max_tokens(a),
    }
    if a.prompt_format == "logprobs":  # servers without log-probabilities ignore these: the text is parsed then
        request |= {"logprobs": True, "top_logprobs": 5}
    if a.logit_bias:  # never empty, and floats only: some servers (transformers serve) fail on either
        request["logit_bias"] = {k: float(v) for k, v in a.logit_bias.items()}
    return request


def _run_coro(factory):
    """asyncio.run, also from inside a running event loop (then in a helper thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(factory())).result()


def annotate_api(
    rows: list[dict], cfg: AnnotatorConfig, store, progress: Callable[[int], None] | None = None
) -> tuple[list[dict], RunStats]:
    """Judge `rows` (instruction, input, output_1, output_2) with the API pool in `cfg`.

    `progress(n)`: called as pairs settle, first for those the cache, ties and label noise
    settle, then for each answered or failed request.

    Returns one dict per row (annotator, preference relative to the row's output_1/output_2
    or None when failed/unsent, noised, swapped, status, error, price_usd) and the run's stats.
    """
    pool = cfg.api_pool
    urls = [cache.resolve_base_url(a, cfg) for a in pool]
    hashes = [cache.annotator_hash(a, u, cfg.served_model) for a, u in zip(pool, urls)]
    if store is not None:
        recovered = cache.recover(store)
        if recovered:
            log("annotate: %d rows of an interrupted run recovered from its journal", recovered)
    ok, _ = cache.read(store, set(hashes)) if store is not None else ({}, {})
    plan, todo = planning.plan(rows, cfg, hashes, ok)

    stats = RunStats()
    results: dict[str, dict] = {}
    if progress:
        progress(len(plan) - sum(len(p) for p in todo.values()))  # settled without a request
    if todo:
        secret = api_key(cfg)
        cached = sum(1 for e in plan if e.get("key") in ok)
        log("annotate: %d pairs to ask (%d cached)", sum(len(p) for p in todo.values()), cached)

        def ask(batch: planning.Todo, claims) -> bool:
            requests = []
            for i, pending in sorted(batch.items()):
                items, b = list(pending.values()), pool[i].batch_size
                requests += [(pool[i], urls[i], hashes[i], items[j : j + b]) for j in range(0, len(items), b)]
            log("annotate: %d pairs in %d requests", sum(len(p) for p in batch.values()), len(requests))

            async def main() -> _Run:
                run = _Run(cfg, store, secret, await make_limiter(cfg), progress, claims)
                await run.run(requests)
                return run

            run = _run_coro(main)
            stats.add(run.stats)
            results.update(run.results)
            return run.stats.stopped is None

        ok |= planning.settle(todo, store, set(hashes), ask, progress)  # + what concurrent runs answered
        reasons = ", ".join(f"{k}: {v}" for k, v in stats.errors.most_common())
        log(
            "annotate: %d requests (%d re-asks), %d judged, %d failed%s, %d not sent, $%.4f, %.1fs",
            stats.requests,
            stats.reasks,
            stats.judged,
            stats.failed,
            f" ({reasons})" if reasons else "",
            stats.unsent,
            stats.cost_usd,
            stats.seconds,
        )

    stopped_by_error = stats.stopped not in (None, "budget")
    unsent = "not sent: the run stopped at an error" if stopped_by_error else "not sent: max_cost_usd reached"
    out = []
    for e in plan:
        if "key" in e:
            hit = results.get(e["key"]) or ok.get(e["key"])
            if hit is None:
                e |= {"preference": None, "status": "unsent", "error": unsent}
            else:
                p = hit["preference"]
                e |= {
                    "preference": None if p is None else (3.0 - p if e["flipped"] else p),
                    "status": hit["status"],
                    "error": hit["error"],
                    "price_usd": hit["price_usd"] if e["key"] in results else 0.0,
                    "cached": e["key"] not in results,
                }
        out.append(e)
    if stopped_by_error:
        raise AnnotationError(f"{stats.stopped} ({stats.judged} pairs judged and cached before the error)", out, stats)
    return out, stats


__all__ = ["AnnotationError", "RunStats", "annotate_api", "api_key", "make_limiter"]

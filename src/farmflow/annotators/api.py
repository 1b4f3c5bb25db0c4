"""API annotators: LLM judges on any OpenAI-compatible endpoint, through `openai.AsyncOpenAI`.

`annotate_api(rows, cfg, store)` labels pairs with a pool of API annotators:

1. ties (identical outputs) are 1.5 and label-noised pairs a fair coin: neither is sent;
2. every other pair gets its annotator (seeded hash of instruction + input) and the order
   its outputs are shown in (seeded hash of the pair), and is looked up in the row cache;
3. the pairs not in the cache are grouped per annotator into requests of `batch_size`
   numbered items and sent, at most `max_in_flight` at once, under the rate limit. The
   first request to each endpoint and model goes alone (once per process), so a bad key,
   a wrong model or an unreachable endpoint gives one clear error instead of a burst. The SDK
   retries 408/409/429/5xx, timeouts and connection errors (`max_retries`, honoring
   Retry-After); a completion that does not parse is asked again once; what still fails
   is stored as failed with its reason and raw completion;
4. judged rows are appended to the cache every `chunk_size` pairs, so a killed run
   loses at most one chunk plus the requests in flight;
5. once the run has spent `max_cost_usd`, no new request is sent; what is done is kept.

The API key comes from the environment variable `api_key_env` or the Prefect Secret block
`api_key_secret`; it is never logged, stored, or put into an exception message.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import os
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable

import openai
from openai.types.chat import ChatCompletion

from farmflow.annotators import cache, prompts
from farmflow.annotators.oracle import unit_hash
from farmflow.config import AnnotatorConfig, ApiAnnotatorConfig
from farmflow.progress import log


class AnnotationError(RuntimeError):
    """The endpoint cannot be used at all (unreachable, bad key, unknown model): one clear message."""


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


# ----------------------------------------------------------------------------- secrets
def api_key(cfg: AnnotatorConfig) -> str:
    """The API key from the Prefect Secret block or the environment; the message never contains it."""
    if cfg.api_key_secret:
        from prefect.blocks.system import Secret

        try:
            value = Secret.load(cfg.api_key_secret).get()
        except Exception as err:  # noqa: BLE001  (block missing, no Prefect API...)
            raise AnnotationError(f"annotation.api_key_secret: cannot load Prefect Secret block {cfg.api_key_secret!r} ({type(err).__name__})") from None
        if isinstance(value, dict):  # a JSON Secret: the key is its api_key field
            value = value.get("api_key")
        if not isinstance(value, str) or not value:
            raise AnnotationError(f"annotation.api_key_secret: Prefect Secret block {cfg.api_key_secret!r} must hold the key as a string "
                                  "(or JSON with an api_key field)")
        return value
    value = os.environ.get(cfg.api_key_env)
    if not value:
        raise AnnotationError(f"annotation.api_key_env: environment variable {cfg.api_key_env} is not set (the API annotators' key)")
    return value


def scrub(text: str, secret: str) -> str:
    return text.replace(secret, "***") if secret else text


# ----------------------------------------------------------------------------- rate limits
class _LocalLimiter:
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


_LIMITERS: dict[tuple[str, float], _LocalLimiter] = {}
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
        limiter = _LIMITERS.setdefault((cfg.rate_limit_name, cfg.requests_per_minute), _LocalLimiter(cfg.requests_per_minute))
    return limiter.wait


# ----------------------------------------------------------------------------- the run
class _Run:
    def __init__(self, cfg: AnnotatorConfig, store, key: str, limiter, progress: Callable[[int], None] | None = None):
        self.cfg, self.store, self.key, self.limiter, self.progress = cfg, store, key, limiter, progress
        self.sem = asyncio.Semaphore(cfg.max_in_flight)
        self.stats = RunStats()
        self.results: dict[str, dict] = {}
        self.buffer: list[dict] = []
        self.fatal: str | None = None
        self.clients: dict[str, openai.AsyncOpenAI] = {}

    def client(self, base_url: str) -> openai.AsyncOpenAI:
        if base_url not in self.clients:
            self.clients[base_url] = openai.AsyncOpenAI(
                base_url=base_url, api_key=self.key, max_retries=self.cfg.max_retries, timeout=self.cfg.timeout_s
            )
        return self.clients[base_url]

    def price(self, model: str, prompt_tokens: int, completion_tokens: int) -> float:
        p = self.cfg.prices.get(model)
        if p is None:
            return 0.0
        return (prompt_tokens * p.prompt_usd_per_mtok + completion_tokens * p.completion_usd_per_mtok) / 1e6

    def flush(self, force: bool = False) -> None:
        if self.store is not None and self.buffer and (force or len(self.buffer) >= self.cfg.chunk_size):
            rows, self.buffer = self.buffer, []
            self.store.append_rows(cache.NAMESPACE, cache.to_table(rows), cache.NAMESPACE)

    def record(self, a: ApiAnnotatorConfig, ahash: str, items: list[Pending], prefs: list[float] | None, error: str | None,
               raw: str | None, usage: tuple[int, int], latency: float) -> None:
        n = len(items)
        price = self.price(a.model, *usage) / n
        for k, it in enumerate(items, 1):
            shown = prefs[k - 1] if prefs is not None else None
            row = {
                "key": it.key, "annotator": a.name, "annotator_hash": ahash, "model": a.model, "instruction": it.instruction,
                "input": it.input, "output_1": it.output_1, "output_2": it.output_2,
                "preference": None if shown is None else (3.0 - shown if it.swapped else shown),
                "status": "ok" if prefs is not None else "failed", "error": error, "raw_completion": raw,
                "prompt_tokens": usage[0] // n, "completion_tokens": usage[1] // n, "price_usd": price, "latency_s": latency,
                "created": cache.now(), "prompt_format": a.prompt_format, "item": k, "items": n, "swapped": it.swapped,
            }
            self.results[it.key] = row
            self.buffer.append(row)
        if self.progress:
            self.progress(n)
        if prefs is None:
            self.stats.failed += n
            self.stats.errors[error.split(":")[0] if error else "error"] += n
        else:
            self.stats.judged += n
        self.flush()

    def _stop_reason(self) -> str | None:
        if self.fatal:
            return self.fatal
        if self.cfg.max_cost_usd is not None and self.stats.cost_usd >= self.cfg.max_cost_usd:
            return "budget"
        return None

    async def ask(self, a: ApiAnnotatorConfig, base_url: str, ahash: str, items: list[Pending]) -> None:
        async with self.sem:
            if self._stop_reason():
                self.stats.unsent += len(items)
                return
            await self.limiter()
            messages = prompts.render([it.shown() for it in items], a.prompt_format, a.style)
            extra: dict = {}
            if a.prompt_format == "logprobs":
                extra |= {"logprobs": True, "top_logprobs": 5}
            if a.logit_bias:
                extra["logit_bias"] = a.logit_bias
            usage, raw, start = [0, 0], None, time.perf_counter()
            for attempt in (0, 1):
                try:
                    self.stats.requests += 1
                    resp = await self.client(base_url).chat.completions.create(
                        model=a.model, messages=messages, temperature=a.temperature, max_tokens=cache.max_tokens(a), **extra
                    )
                except openai.APIError as err:
                    error = self._classify(err, a, base_url)
                    if error is None:  # fatal: already recorded in self.fatal
                        self.stats.unsent += len(items)
                        return
                    self.record(a, ahash, items, None, error, raw, tuple(usage), time.perf_counter() - start)
                    return
                if not isinstance(resp, ChatCompletion):  # e.g. HTTP 200 with a web page: base_url is not an API
                    reply = scrub(str(resp), self.key)[:80]
                    self.record(a, ahash, items, None, f"bad_response: not a chat completion from {scrub(base_url, self.key)} "
                                f"(got {type(resp).__name__} {reply!r})", raw, tuple(usage), time.perf_counter() - start)
                    return
                try:
                    text, top = self._account(a, resp, usage)
                except (AttributeError, IndexError, TypeError, ValueError) as err:  # a chat completion with the wrong fields
                    self.record(a, ahash, items, None, f"bad_response: {type(err).__name__}: {scrub(str(err), self.key)[:120]}",
                                raw, tuple(usage), time.perf_counter() - start)
                    return
                raw = prompts.raw_completion(a.prompt_format, text, top)
                try:
                    prefs = prompts.parse(a.prompt_format, len(items), text, top)
                except prompts.ParseError as err:
                    if attempt == 0:
                        self.stats.reasks += 1
                        continue
                    self.record(a, ahash, items, None, f"parse: {err} (after one re-ask)", raw, tuple(usage), time.perf_counter() - start)
                    return
                self.record(a, ahash, items, prefs, None, raw, tuple(usage), time.perf_counter() - start)
                return

    def _account(self, a: ApiAnnotatorConfig, resp: ChatCompletion, usage: list[int]) -> tuple[str, list[tuple[str, float]] | None]:
        """Count a reply's tokens and cost; its text and, for the logprobs format, the first token's top log-probs."""
        if resp.usage is not None:
            prompt, completion = resp.usage.prompt_tokens or 0, resp.usage.completion_tokens or 0
            usage[0] += prompt
            usage[1] += completion
            self.stats.prompt_tokens += prompt
            self.stats.completion_tokens += completion
            self.stats.cost_usd += self.price(a.model, prompt, completion)
        choice = resp.choices[0] if resp.choices else None
        text = (choice.message.content if choice and choice.message else None) or ""
        top = None
        if choice is not None and choice.logprobs is not None and choice.logprobs.content:
            top = [(t.token, t.logprob) for t in choice.logprobs.content[0].top_logprobs or []]
        return text, top

    def _classify(self, err: openai.APIError, a: ApiAnnotatorConfig, base_url: str) -> str | None:
        """A per-request failure reason, or None after recording a fatal error (stop sending)."""
        retries = f"after {self.cfg.max_retries} retries"
        if isinstance(err, openai.APITimeoutError):
            return f"timeout: no answer within {self.cfg.timeout_s:g}s, {retries}"
        where = f"endpoint {base_url}, annotator {a.name!r}, model {a.model!r}"
        if isinstance(err, openai.APIConnectionError):
            fatal = f"cannot connect to {where} ({retries}); is the server running and base_url right?"
        elif isinstance(err, openai.AuthenticationError):
            fatal = f"the API key was rejected (HTTP 401) by {where}; check {self._key_source()}"
        elif isinstance(err, openai.PermissionDeniedError):
            fatal = f"permission denied (HTTP 403) by {where}; check {self._key_source()}"
        elif isinstance(err, openai.NotFoundError):
            fatal = f"HTTP 404 from {where}: unknown model or wrong base_url"
        elif isinstance(err, openai.RateLimitError):
            return f"rate_limited: HTTP 429 {retries}"
        elif isinstance(err, openai.APIStatusError):
            return f"http_{err.status_code}: {scrub(str(err.message), self.key)[:200]} ({retries})"
        else:
            return f"error: {type(err).__name__}"
        if self.fatal is None:
            self.fatal = scrub(fatal, self.key)
        return None

    def _key_source(self) -> str:
        return f"Prefect Secret {self.cfg.api_key_secret!r}" if self.cfg.api_key_secret else f"${self.cfg.api_key_env}"

    async def run(self, requests: list[tuple[ApiAnnotatorConfig, str, str, list[Pending]]]) -> None:
        start = time.perf_counter()
        try:
            # the first request to each endpoint and model not yet seen working in this process goes
            # alone: a bad key, model or endpoint fails once, not max_in_flight times
            firsts: dict[tuple, tuple] = {}
            for r in requests:
                firsts.setdefault((r[1], r[0].model), r)
            probes = [r for k, r in firsts.items() if self._verified(k) not in _VERIFIED]
            await asyncio.gather(*(self.ask(*r) for r in probes))
            for r in probes:
                if self.fatal is None:
                    _VERIFIED.add(self._verified((r[1], r[0].model)))
            rest = [r for r in requests if not any(r is p for p in probes)]
            rest.sort(key=lambda r: r[3][0].key)  # interleave annotators; deterministic order
            await asyncio.gather(*(self.ask(*r) for r in rest))
        finally:
            self.flush(force=True)
            for c in self.clients.values():
                await c.close()
            self.stats.seconds = time.perf_counter() - start
            self.stats.stopped = self._stop_reason()

    def _verified(self, endpoint_model: tuple) -> tuple:
        return (*endpoint_model, hashlib.sha256(self.key.encode()).hexdigest()[:16])


_VERIFIED: set[tuple] = set()
"""(base_url, model, key digest) that answered in this process: later runs skip the lone first request."""


def _run_coro(factory):
    """asyncio.run, also from inside a running event loop (then in a helper thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(factory())).result()


def assign(cfg: AnnotatorConfig, instruction: str, input: str, pool: list) -> int:
    return int(unit_hash(cfg.seed, "assign", instruction, input) * len(pool))


def annotate_api(rows: list[dict], cfg: AnnotatorConfig, store,
                 progress: Callable[[int], None] | None = None) -> tuple[list[dict], RunStats]:
    """Judge `rows` (instruction, input, output_1, output_2) with the API pool in `cfg`.

    `progress(n)`: called as pairs settle, first for those the cache, ties and label noise
    settle, then for each answered or failed request.

    Returns one dict per row (annotator, preference relative to the row's output_1/output_2
    or None when failed/unsent, noised, swapped, status, error, price_usd) and the run's stats.
    """
    pool = cfg.api_pool
    urls = [cache.resolve_base_url(a, cfg) for a in pool]
    hashes = [cache.annotator_hash(a, u) for a, u in zip(pool, urls)]
    ok, _ = cache.read(store, set(hashes)) if store is not None else ({}, {})

    plan: list[dict] = []
    todo: dict[int, dict[str, Pending]] = defaultdict(dict)  # annotator index -> key -> pending (deduplicated)
    for row in rows:
        ins, inp, o1, o2 = row["instruction"], row.get("input") or "", row["output_1"], row["output_2"]
        i = assign(cfg, ins, inp, pool)
        c1, c2, flipped = cache.canonical(o1, o2)
        swapped_canon = unit_hash(cfg.seed, "order", ins, inp, c1, c2) < 0.5
        entry = {"annotator": pool[i].name, "i": i, "flipped": flipped, "swapped": swapped_canon != flipped, "noised": False}
        if o1 == o2:
            entry |= {"preference": 1.5, "status": "tie"}
        elif cfg.label_noise > 0 and unit_hash(cfg.seed, "noise", ins, inp, c1, c2) < cfg.label_noise:
            coin = 1.0 if unit_hash(cfg.seed, "coin", ins, inp, c1, c2) < 0.5 else 2.0  # for (c1, c2): un-flip it
            entry |= {"preference": 3.0 - coin if flipped else coin, "status": "noised", "noised": True}
        else:
            key = cache.row_key(hashes[i], ins, inp, c1, c2)
            entry["key"] = key
            if key not in ok:
                todo[i][key] = Pending(key, ins, inp, c1, c2, swapped_canon)
        plan.append(entry)

    stats = RunStats()
    results: dict[str, dict] = {}
    if progress:
        progress(len(plan) - sum(len(p) for p in todo.values()))  # settled without a request
    if todo:
        secret = api_key(cfg)
        requests = []
        for i, pending in sorted(todo.items()):
            items = list(pending.values())
            b = pool[i].batch_size
            requests += [(pool[i], urls[i], hashes[i], items[j:j + b]) for j in range(0, len(items), b)]
        n_pairs = sum(len(p) for p in todo.values())
        log("annotate: %d pairs to ask in %d requests (%d cached)", n_pairs, len(requests), sum(1 for e in plan if e.get("key") in ok))

        async def main() -> _Run:
            run = _Run(cfg, store, secret, await make_limiter(cfg), progress)
            await run.run(requests)
            return run

        run = _run_coro(main)
        stats, results = run.stats, run.results
        if run.fatal:
            raise AnnotationError(run.fatal + f" ({stats.judged} pairs judged and cached before the error)")
        log("annotate: %d requests (%d re-asks), %d judged, %d failed, %d not sent, $%.4f, %.1fs",
            stats.requests, stats.reasks, stats.judged, stats.failed, stats.unsent, stats.cost_usd, stats.seconds)

    out = []
    for e in plan:
        if "key" in e:
            hit = results.get(e["key"]) or ok.get(e["key"])
            if hit is None:
                e |= {"preference": None, "status": "unsent", "error": "not sent: max_cost_usd reached"}
            else:
                p = hit["preference"]
                e |= {"preference": None if p is None else (3.0 - p if e["flipped"] else p), "status": hit["status"],
                      "error": hit["error"], "price_usd": hit["price_usd"] if e["key"] in results else 0.0,
                      "cached": e["key"] not in results}
        out.append(e)
    return out, stats


__all__ = ["AnnotationError", "Pending", "RunStats", "annotate_api", "api_key", "make_limiter"]

"""A loopback judge: an OpenAI-compatible chat-completions server that judges with the oracle pool.

It reads our own prompts back (`prompts.parse_prompt`), recovers each synthetic task from
its instruction and input (`oracle.task_from_text`), and answers in the requested format
(choice lines, a JSON array, or one token with log-probabilities) as the oracle pool
would: the model name picks one oracle annotator, P(b) comes from the gold reward plus
that annotator's biases. Instructions that are not synthetic tasks get gold 0 for both
outputs, so only the biases (length, lists, position) decide. Temperature 0 answers the
more likely choice; otherwise the choice is drawn with a hash of the request content, so
the same question always gets the same answer.

For tests and benchmarks: fixed latency, an optional API key (401 otherwise), an optional
model list (404 otherwise) and fault injection. With probability `fault_rate` (a seeded
generator) a request gets a fault, the kinds in `faults` taking turns, so a run with at
least that many faults sees every kind:

* ``429``: HTTP 429 with a Retry-After header; ``500``: HTTP 500;
* ``400``: HTTP 400 refusing the request (its context is too long); ``409``: HTTP 409, a
  conflict (neither is worth retrying);
* ``timeout``: the answer is held for `timeout_sleep_s` (longer than the client waits);
* ``garbage``: text that answers nothing; ``truncated``: the right answer cut in half;
* ``wrong_count``: one answer too few (or one too many for a single item);
* ``html``: HTTP 200 with an HTML page, as a web UI answers when base_url points at it;
* ``truncated_body``: HTTP 200, Content-Type application/json, the JSON body cut in half
  (a proxy or server that dropped the rest of the reply).

Like some real servers (transformers serve fails on them), it refuses a ``logit_bias`` that
is empty or holds integers (HTTP 400), and counts requests without ``max_tokens``.

`stats` counts requests, status codes, faults, tokens and how often each pair was
answered, so tests can check that nothing was asked or paid for twice; `models` counts the
model names asked for.

Run it with ``farmflow judge-server`` or, in-process, ``with JudgeServer(JudgeConfig()) as url: ...``.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import threading
import time
from collections import Counter
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, Field

from farmflow.annotators.oracle import OracleAnnotator, sigmoid, task_from_text, unit_hash
from farmflow.annotators.prompts import Item, parse_prompt
from farmflow.config import AnnotatorConfig, OracleAnnotatorConfig
from farmflow.data.synthetic import task_to_json

FAULTS = ("429", "500", "400", "409", "timeout", "garbage", "truncated", "wrong_count", "html", "truncated_body")


class JudgeConfig(BaseModel):
    latency_s: float = Field(0.0, ge=0, description="Seconds every answer takes.")
    fault_rate: float = Field(0.0, ge=0, le=1, description="Probability that a request gets a fault.")
    faults: list[str] = Field(
        default_factory=lambda: list(FAULTS), description=f"Fault kinds to draw from: {', '.join(FAULTS)}."
    )
    retry_after_s: float = Field(1.0, ge=0, description="Retry-After of injected 429s.")
    timeout_sleep_s: float = Field(30.0, ge=0, description="How long an injected timeout holds the answer.")
    api_key: str | None = Field(
        None, description="Require 'Authorization: Bearer <key>' (401 otherwise); None: any key."
    )
    models: list[str] | None = Field(None, description="Known model names (404 otherwise); None: any model.")
    seed: int = Field(0, description="Seed of the fault draws and of the judgement draws.")
    pool: list[OracleAnnotatorConfig] = Field(
        default_factory=lambda: AnnotatorConfig().pool, description="Oracle annotators; the model name picks one."
    )


def _error(status: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": None}}, status_code=status, headers=headers
    )


class JudgeState:
    """The server's configuration and counters (read them from tests while it runs)."""

    def __init__(self, config: JudgeConfig):
        self.config = config
        self.oracles = [OracleAnnotator(c) for c in config.pool]
        self.rng = random.Random(config.seed)
        self.stats: Counter[str] = Counter()
        self.pairs: Counter[tuple] = Counter()  # (instruction, input, first, second) -> answered with 200
        self.models: Counter[str] = Counter()  # model name -> requests asking for it
        self.lock = threading.Lock()
        self.in_flight = 0
        self.faults_drawn = 0

    def oracle_for(self, model: str) -> OracleAnnotator:
        return self.oracles[int(unit_hash("model", model) * len(self.oracles))]

    def p_second(self, model: str, item: Item) -> float:
        task = task_from_text(item.instruction, item.input)
        row = {"task": task_to_json(task) if task else None, "instruction": item.instruction, "input": item.input}
        oracle = self.oracle_for(model)
        if item.first == item.second:
            return 0.5
        if task is None:  # unknown task: gold 0 for both outputs, only the biases decide
            logit = oracle.bias_logit(item.first, item.second)
        else:
            logit = oracle.logit_second(row, item.first, item.second)
        return sigmoid(logit)

    def choose(self, model: str, temperature: float, item: Item, p: float) -> str:
        if temperature == 0:
            return "b" if p > 0.5 else "a"
        u = unit_hash(self.config.seed, "judge", model, item.instruction, item.input, item.first, item.second)
        return "b" if u < p else "a"


def _explain(choice: str, p: float) -> str:
    sure = "clearly" if abs(p - 0.5) > 0.3 else "slightly"
    return f"Output ({choice}) follows the instruction {sure} better."


def _answer(fmt: str, letters: list[str], ps: list[float]) -> str:
    if fmt == "json":
        return json.dumps(
            [
                {"item": k, "explanation": _explain(c, p), "a_is_better": c == "a"}
                for k, (c, p) in enumerate(zip(letters, ps), 1)
            ]
        )
    if fmt == "logprobs":
        return letters[0]
    return "\n".join(f"[{k}] ({c})" for k, c in enumerate(letters, 1))


def build_app(state: JudgeState) -> FastAPI:
    app = FastAPI(title="farmflow judge server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.judge = state

    @app.get("/v1/models")
    async def models() -> dict:
        names = state.config.models or ["farmflow-judge"]
        return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "farmflow"} for m in names]}

    @app.get("/stats")
    async def stats() -> dict:
        return dict(state.stats) | {
            "distinct_pairs": len(state.pairs),
            "max_answers_per_pair": max(state.pairs.values(), default=0),
        }

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        with state.lock:  # requests being answered now, and the most at once (stats "max_in_flight")
            state.in_flight += 1
            state.stats["max_in_flight"] = max(state.stats["max_in_flight"], state.in_flight)
        try:
            return await _chat(request)
        finally:
            with state.lock:
                state.in_flight -= 1

    async def _chat(request: Request) -> Any:
        cfg = state.config
        with state.lock:
            state.stats["requests"] += 1
        if cfg.api_key is not None and request.headers.get("authorization") != f"Bearer {cfg.api_key}":
            state.stats["status_401"] += 1
            given = request.headers.get("authorization", "").removeprefix("Bearer ")
            # the key is echoed, as some servers do: the client must scrub it from its messages
            return _error(401, f"Incorrect API key provided: {given}.", "invalid_request_error")
        try:
            body = await request.json()
            model, messages = body["model"], body["messages"]
            fmt, items = parse_prompt(messages)
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            state.stats["status_400"] += 1
            return _error(400, f"cannot read the request: {err}", "invalid_request_error")
        bias = body.get("logit_bias")
        floats = isinstance(bias, dict) and bool(bias) and all(isinstance(v, float) for v in bias.values())
        if bias is not None and not floats:
            state.stats["status_400"] += 1
            return _error(
                400, "logit_bias must map token ids to float biases (and not be empty)", "invalid_request_error"
            )
        if body.get("max_tokens") is None:
            state.stats["no_max_tokens"] += 1
        with state.lock:
            state.models[model] += 1
        if cfg.models is not None and model not in cfg.models:
            state.stats["status_404"] += 1
            return _error(404, f"The model '{model}' does not exist.", "invalid_request_error")

        fault = None
        with state.lock:
            if cfg.fault_rate and state.rng.random() < cfg.fault_rate and cfg.faults:
                fault = cfg.faults[state.faults_drawn % len(cfg.faults)]
                state.faults_drawn += 1
        if fault:
            state.stats[f"fault_{fault}"] += 1
        await asyncio.sleep(cfg.latency_s)
        if fault == "429":
            state.stats["status_429"] += 1
            return _error(
                429, "Rate limit reached, slow down.", "rate_limit_error", {"retry-after": str(cfg.retry_after_s)}
            )
        if fault == "500":
            state.stats["status_500"] += 1
            return _error(500, "The server had an error while processing your request.", "server_error")
        if fault == "400":
            state.stats["status_400"] += 1
            return _error(
                400,
                "This model's maximum context length is 4096 tokens; your messages resulted in 5120 tokens.",
                "invalid_request_error",
            )
        if fault == "409":
            state.stats["status_409"] += 1
            return _error(409, "Another request with the same idempotency key is in progress.", "conflict_error")
        if fault == "timeout":
            await asyncio.sleep(cfg.timeout_sleep_s)
            if await request.is_disconnected():  # the client gave up: nothing answered, nothing billed
                state.stats["abandoned"] += 1
                return _error(408, "Request timed out.", "timeout")
        if fault == "html":
            state.stats["status_200_html"] += 1
            return HTMLResponse("<!doctype html><html><head><title>Dashboard</title></head><body>Sign in</body></html>")

        temperature = float(body.get("temperature", 1.0) if body.get("temperature") is not None else 1.0)
        ps = [state.p_second(model, it) for it in items]
        if fmt == "logprobs" and body.get("logit_bias"):  # token ids: code points of 'a' (97) and 'b' (98)
            bias = {int(k): float(v) for k, v in body["logit_bias"].items()}
            la = math.log(max(1 - ps[0], 1e-12)) + bias.get(97, 0.0)
            lb = math.log(max(ps[0], 1e-12)) + bias.get(98, 0.0)
            ps = [1.0 / (1.0 + math.exp(la - lb))]
        letters = [state.choose(model, temperature, it, p) for it, p in zip(items, ps)]
        content = _answer(fmt, letters, ps)
        if fault == "garbage":
            content = "Both outputs have their merits; it really depends on what you are looking for."
        elif fault == "truncated":
            content = content[: len(content) // 2]
        elif fault == "wrong_count":
            k = len(items) + 1 if len(items) == 1 else len(items) - 1
            content = _answer("choice" if fmt == "logprobs" else fmt, (letters * 2)[:k], (ps * 2)[:k])

        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": content},
            "finish_reason": "stop",
            "logprobs": None,
        }
        if body.get("logprobs") and fmt == "logprobs" and fault is None:
            top = [
                {"token": "a", "logprob": math.log(max(1 - ps[0], 1e-12)), "bytes": None},
                {"token": "b", "logprob": math.log(max(ps[0], 1e-12)), "bytes": None},
            ]
            first = next(t for t in top if t["token"] == content)
            choice["logprobs"] = {
                "content": [first | {"top_logprobs": top[: int(body.get("top_logprobs") or 2)]}],
                "refusal": None,
            }
        prompt_tokens = sum(len(m.get("content") or "") for m in messages) // 4
        completion_tokens = len(content) // 4 + 1
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        reply = {
            "id": f"chatcmpl-{state.stats['requests']}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": usage,
        }
        if fault == "truncated_body":  # the client gets half of the JSON: nothing it can read (not counted as answered)
            data = json.dumps(reply).encode()
            state.stats["status_200_truncated"] += 1
            return Response(data[: len(data) // 2], media_type="application/json")
        with state.lock:
            state.stats["status_200"] += 1
            state.stats["prompt_tokens"] += prompt_tokens
            state.stats["completion_tokens"] += completion_tokens
            state.stats["items_answered"] += len(items)
            for it in items:
                state.pairs[(it.instruction, it.input, it.first, it.second)] += 1
        return JSONResponse(reply)

    return app


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) whose accepted connections send small answers at once."""
    # proto must be IPPROTO_TCP: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say
    # so, and with Nagle on, every answer on a kept-alive connection waited ~40 ms for the
    # client's delayed ACK. TCP_NODELAY on the listening socket is inherited by accepted ones.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def serve(config: JudgeConfig, host: str = "127.0.0.1", port: int = 8787, ready=None) -> None:
    """Run the server in this thread until interrupted; `ready(url)` is called once it listens."""
    import uvicorn

    sock = listening_socket(host, port)
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(JudgeState(config)),
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
            lifespan="off",
        )
    )
    url = f"http://{host}:{sock.getsockname()[1]}/v1"

    async def run() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if ready is not None and server.started:
            ready(url)
        await task

    asyncio.run(run())


class JudgeServer:
    """``with JudgeServer(JudgeConfig(...)) as url:`` the server on a free loopback port, in a thread.

    `state` gives the live configuration and counters.
    """

    def __init__(self, config: JudgeConfig | None = None, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        self.state = JudgeState(config or JudgeConfig())
        self._sock = listening_socket(host, port)
        self.url = f"http://{host}:{self._sock.getsockname()[1]}/v1"
        self._server = uvicorn.Server(
            uvicorn.Config(
                build_app(self.state),
                log_level="warning",
                access_log=False,
                timeout_graceful_shutdown=1,
                lifespan="off",
            )
        )
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> str:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the judge server did not start")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


__all__ = ["FAULTS", "JudgeConfig", "JudgeServer", "JudgeState", "build_app", "serve"]

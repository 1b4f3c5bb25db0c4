"""A fault-injecting proxy on loopback, in a thread: HTTP/1.1 in front of an API, or plain TCP in front of a server.

HTTP mode (`FaultProxy`) reads each request on a kept-alive connection and, with probability `rate` (a seeded
generator), injects one fault, the kinds in `faults` taking turns:

* before the upstream sees the request (nothing is paid): ``429`` with Retry-After, ``500``, ``reset`` (the
  connection is reset instead of answered), ``slow`` (the request waits `slow_s` and is then forwarded);
* after the upstream answered (the answer was paid, the client never gets it): ``garbage`` (HTTP 200, the
  completion's text replaced by prose that answers nothing), ``truncated_json`` (HTTP 200, the JSON body cut in half,
  Content-Length matching the cut), ``reset_after`` (the connection is reset instead of relaying the answer).

`counts` says how often each was injected, `paid_lost` how many pairs the faults after forwarding threw away the
judge's paid answer to (a client has to ask those again: re-paying them is the fault's doing, not the client's).

TCP mode (`TcpProxy`) relays bytes both ways; `down()` resets every open connection and each new one until `up()`
(an S3 endpoint that vanishes for a while and comes back with its data).
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
import threading
from collections import Counter
from urllib.parse import urlsplit

import httpx

BEFORE = ("429", "500", "reset", "slow")
AFTER = ("garbage", "truncated_json", "reset_after")
FAULTS = BEFORE + AFTER
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests", 500: "Internal Server Error"}


def _abort(writer: asyncio.StreamWriter) -> None:
    """Reset the connection (RST, not FIN): what a crashed server or a dropped route looks like to the client."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class _Loop:
    """An asyncio loop in a daemon thread serving one listening socket."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=type(self).__name__, daemon=True)
        self.server: asyncio.base_events.Server | None = None
        self.port = 0

    def start(self, handler) -> int:
        self.thread.start()

        async def listen():
            self.server = await asyncio.start_server(handler, "127.0.0.1", 0)
            return self.server.sockets[0].getsockname()[1]

        self.port = asyncio.run_coroutine_threadsafe(listen(), self.loop).result(10)
        return self.port

    def stop(self) -> None:
        async def close():
            if self.server is not None:
                self.server.close()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


class FaultProxy(_Loop):
    """``with FaultProxy("http://127.0.0.1:PORT/v1", rate=0.2) as url:`` (module doc)."""

    def __init__(self, upstream: str, rate: float, faults: tuple[str, ...] = FAULTS, seed: int = 0, slow_s=2.0):
        super().__init__()
        parts = urlsplit(upstream)
        self.origin, self.path = f"{parts.scheme}://{parts.netloc}", parts.path
        self.rate, self.faults, self.slow_s = rate, faults, slow_s
        self.rng = random.Random(seed)
        self.turn = 0
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()

    def __enter__(self) -> str:
        self.client = httpx.AsyncClient(base_url=self.origin, timeout=120)
        port = self.start(self._serve)
        return f"http://127.0.0.1:{port}{self.path}"

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.client.aclose(), self.loop).result(10)
        self.stop()

    @property
    def paid_lost(self) -> int:
        return self.counts["destroyed_pairs"]

    def _draw(self) -> str | None:
        with self.lock:
            self.counts["requests"] += 1
            if self.rng.random() >= self.rate:
                return None
            fault = self.faults[self.turn % len(self.faults)]
            self.turn += 1
            self.counts[fault] += 1
            return fault

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
                size = int({k.lower(): v for k, v in headers.items()}.get("content-length", 0))
                body = await reader.readexactly(size) if size else b""
                if not await self._answer(method, target, headers, body, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            if not writer.transport.is_closing():
                writer.close()

    async def _answer(self, method, target, headers, body, writer) -> bool:
        """Answer one request; False when the connection is gone (reset)."""
        fault = self._draw() if method == "POST" else None
        if fault == "reset":
            _abort(writer)
            return False
        if fault in ("429", "500"):
            status = int(fault)
            error = {"error": {"message": "injected by the chaos proxy", "type": "chaos", "code": fault}}
            extra = {"Retry-After": "1"} if status == 429 else {}
            await self._reply(writer, status, json.dumps(error).encode(), "application/json", extra)
            return True
        if fault == "slow":
            await asyncio.sleep(self.slow_s)
        keep = {k: v for k, v in headers.items() if k.lower() not in ("host", "content-length", "connection")}
        upstream = await self.client.request(method, target, headers=keep, content=body)
        data, kind = upstream.content, upstream.headers.get("content-type", "application/json")
        if fault in AFTER and upstream.status_code == 200:
            with self.lock:
                self.counts["destroyed_pairs"] += _pairs_in(body)
        if fault == "reset_after":
            _abort(writer)
            return False
        if fault == "garbage" and upstream.status_code == 200:
            reply = json.loads(data)
            for choice in reply.get("choices", []):
                choice["message"] = {"role": "assistant", "content": "I would rather talk about the weather."}
                choice.pop("logprobs", None)
            data = json.dumps(reply).encode()
        if fault == "truncated_json":
            data = data[: len(data) // 2]
        await self._reply(writer, upstream.status_code, data, kind)
        return True

    async def _reply(self, writer, status: int, data: bytes, kind: str, extra: dict | None = None) -> None:
        head = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}", f"Content-Type: {kind}"]
        head += [f"Content-Length: {len(data)}", *(f"{k}: {v}" for k, v in (extra or {}).items())]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        await writer.drain()


def _pairs_in(body: bytes) -> int:
    """How many pairs a judging request asks about (1 when it is not one of farmflow's prompts)."""
    from farmflow.annotators.prompts import parse_prompt

    try:
        return max(1, len(parse_prompt(json.loads(body)["messages"])[1]))
    except Exception:  # noqa: BLE001 - any other request counts once
        return 1


class TcpProxy(_Loop):
    """``with TcpProxy(port) as url:`` relays bytes to 127.0.0.1:port; `down()` / `up()` (module doc)."""

    def __init__(self, upstream_port: int):
        super().__init__()
        self.upstream_port = upstream_port
        self.is_down = False
        self.open: set[asyncio.StreamWriter] = set()
        self.refused = 0

    def __enter__(self) -> str:
        return f"http://127.0.0.1:{self.start(self._serve)}"

    def __exit__(self, *exc) -> None:
        self.stop()

    def down(self) -> None:
        def reset_all():
            self.is_down = True
            for w in list(self.open):
                _abort(w)

        self.loop.call_soon_threadsafe(reset_all)

    def up(self) -> None:
        self.loop.call_soon_threadsafe(setattr, self, "is_down", False)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.is_down:
            self.refused += 1
            _abort(writer)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            _abort(writer)
            return
        self.open.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                if not dst.transport.is_closing():
                    dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self.open.difference_update((writer, up_writer))

"""What went wrong with one API request, in one line: its kind, the server's own words, and whether to stop.

The openai SDK retries transient failures itself (408, 429, 5xx, timeouts, dropped
connections; `max_retries`, honoring Retry-After). `no_retry_on_client_errors` makes it
leave every other 4xx alone: a 400, 404 or 409 says the request itself is wrong, and asking
again only multiplies the error. `describe` turns any exception raised while asking into a
`Failure`:

* ``fatal`` (the run stops sending): the key is rejected (401/403), the model is not served
  (404, or a 400 whose body names the model as unknown), the endpoint cannot be reached;
* otherwise one failed request, whose rows are stored as failed with this reason. Its
  ``kind`` (the reason's first word: ``http_400``, ``timeout``, ``bad_response``...) is what
  run summaries count.

Every message carries the server's response body (whitespace collapsed, trimmed, the API key
scrubbed) and says how often the SDK retried, read from the retry-count header it sends.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import openai

BODY_CHARS = 300
"""The most characters of a server's response body an error message shows."""

_UNKNOWN_MODEL = re.compile(
    r"does not exist|not found|unknown|no such|not served|pinned|invalid model|model_not_found|not available"
    r"|not supported",
    re.I,
)


@dataclass(frozen=True)
class Failure:
    kind: str  # the reason's first word, e.g. http_400, timeout, bad_response
    message: str  # one line: "<kind>: <what happened>"
    fatal: bool = False  # no request to this endpoint can succeed: stop sending
    reask: bool = False  # the reply arrived but could not be read: worth asking once more


class BadReply(ValueError):
    """A reply that arrived but is not a usable chat completion (the message is its failure reason)."""


def scrub(text: str, secret: str) -> str:
    return text.replace(secret, "***") if secret else text


def one_line(text: str, secret: str, limit: int = BODY_CHARS) -> str:
    """`text` on one line, at most `limit` characters, without the secret."""
    flat = " ".join(scrub(text, secret).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


async def no_retry_on_client_errors(response) -> None:
    """httpx response hook: a 4xx other than 408/429 gets ``x-should-retry: false``, which the SDK obeys."""
    if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
        response.headers["x-should-retry"] = "false"


def retries_taken(err: BaseException) -> int | None:
    """How many times the SDK retried before giving up (its x-stainless-retry-count request header)."""
    request = getattr(err, "request", None)
    try:
        return int(request.headers.get("x-stainless-retry-count"))  # type: ignore[union-attr]
    except (AttributeError, TypeError, ValueError):
        return None


def _retried(err: BaseException) -> str:
    n = retries_taken(err)
    if n is None:
        return "retries unknown"
    return "not retried" if n == 0 else f"after {n} retr{'y' if n == 1 else 'ies'}"


def response_body(err: openai.APIStatusError, secret: str) -> str:
    """The server's reply to a failed request, as it sent it (JSON re-serialized compactly)."""
    try:
        text = err.response.text
    except Exception:  # noqa: BLE001  (a streamed or closed body: fall back to what the SDK parsed)
        text = ""
    if not text and err.body is not None:
        text = err.body if isinstance(err.body, str) else json.dumps(err.body)
    return one_line(text, secret) if text.strip() else "(empty body)"


def names_unknown_model(body: str, model: str) -> bool:
    """A 400/404 body that names the requested model as one the endpoint does not serve."""
    return model in body and bool(_UNKNOWN_MODEL.search(body))


def describe(
    err: BaseException, *, secret: str, base_url: str, annotator: str, model: str, key_source: str, timeout_s: float
) -> Failure:
    """The `Failure` behind any exception raised by one request (SDK errors and anything else)."""
    import openai  # loaded already: the error came from it (imported here, as in `api`, to keep imports cheap)

    where = f"endpoint {scrub(base_url, secret)}, annotator {annotator!r}, model {model!r}"
    if isinstance(err, openai.APITimeoutError):
        return Failure("timeout", f"timeout: no answer within {timeout_s:g}s ({_retried(err)})")
    if isinstance(err, openai.APIConnectionError):
        return Failure(
            "connection",
            f"cannot connect to {where} ({_retried(err)}); is the server running and base_url right?",
            fatal=True,
        )
    if isinstance(err, openai.APIStatusError):
        status, body = err.status_code, response_body(err, secret)
        said = f"the server said: {body}"
        if status == 401:
            return Failure(
                "http_401", f"the API key was rejected (HTTP 401) by {where}; check {key_source}; {said}", fatal=True
            )
        if status == 403:
            return Failure(
                "http_403", f"permission denied (HTTP 403) by {where}; check {key_source}; {said}", fatal=True
            )
        if status in (400, 404) and (status == 404 or names_unknown_model(body, model)):
            return Failure(
                f"http_{status}",
                f"HTTP {status} from {where}: the endpoint does not serve model {model!r} "
                f"(or base_url is wrong); {said}. If it serves one fixed model, set annotation.served_model "
                "to its name (farmflow annotate --served-model NAME)",
                fatal=True,
            )
        if status == 429:
            return Failure("rate_limited", f"rate_limited: HTTP 429 ({_retried(err)}); {said}")
        return Failure(f"http_{status}", f"http_{status}: {said} ({_retried(err)})")
    if isinstance(err, openai.APIError):
        return Failure("error", f"error: {type(err).__name__}: {one_line(str(err), secret, 160)}")
    # not an SDK error class: e.g. json.JSONDecodeError from a 200 reply whose JSON body was cut short
    return Failure(
        "bad_response",
        f"bad_response: unreadable reply from {scrub(base_url, secret)} "
        f"({type(err).__name__}: {one_line(str(err), secret, 160)})",
        reask=True,
    )


def read_reply(resp: object, base_url: str, secret: str) -> tuple[str, list[tuple[str, float]] | None]:
    """A reply's text and, when it has them, the first token's top log-probabilities; `BadReply` if it has none."""
    from openai.types.chat import ChatCompletion

    if not isinstance(resp, ChatCompletion):  # e.g. HTTP 200 with a web page: base_url is not an API
        raise BadReply(
            f"bad_response: not a chat completion from {scrub(base_url, secret)} "
            f"(got {type(resp).__name__} {one_line(str(resp), secret, 80)!r})"
        )
    try:
        choice = resp.choices[0] if resp.choices else None
        text = (choice.message.content if choice and choice.message else None) or ""
        top = None
        if choice is not None and choice.logprobs is not None and choice.logprobs.content:
            top = [(t.token, t.logprob) for t in choice.logprobs.content[0].top_logprobs or []]
    except (AttributeError, IndexError, TypeError, ValueError) as err:  # a chat completion with the wrong fields
        raise BadReply(f"bad_response: {type(err).__name__}: {one_line(str(err), secret, 120)}") from None
    return text, top


__all__ = [
    "BODY_CHARS",
    "BadReply",
    "Failure",
    "describe",
    "names_unknown_model",
    "no_retry_on_client_errors",
    "one_line",
    "read_reply",
    "response_body",
    "retries_taken",
    "scrub",
]

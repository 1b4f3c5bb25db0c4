"""The labeling page's web server: one HTML page (``page.html``) and a three-call JSON API, with Starlette and
uvicorn (both come with Prefect), on 127.0.0.1.

* ``GET /api/state?labeler=NAME``: progress and the next pair to label, its outputs in the labeler's order;
* ``POST /api/label`` ``{"labeler", "key", "label": "1" | "2" | "t"}``: record a label, answer the new state;
* ``POST /api/undo`` ``{"labeler"}``: take back the labeler's last label, answer the new state.

The labeler is the page's ``?labeler=`` parameter, else the server's ``--labeler``: one server can serve several
labelers, each with a `Session` of their own. A bad request answers 400 with ``{"error": one line}``, a store
that cannot be written 503.
"""

from __future__ import annotations

import threading
from importlib.resources import files

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse
from starlette.routing import Route

from farmflow.labeling.labels import annotator
from farmflow.labeling.session import Session
from farmflow.storage import StoreError

HOST = "127.0.0.1"


def page() -> str:
    return files("farmflow.labeling").joinpath("page.html").read_text(encoding="utf-8")


def make_app(store, pairs: list[dict], labeler: str) -> Starlette:
    """The labeling app over `pairs`, writing to `store`; `labeler` is the default labeler."""
    annotator(labeler)
    sessions: dict[str, Session] = {}
    lock = threading.Lock()

    def session(name: str | None) -> Session:
        name = name or labeler
        annotator(name)
        with lock:
            if name not in sessions:
                sessions[name] = Session(store, pairs, name)
            return sessions[name]

    async def index(request: Request) -> HTMLResponse:
        return HTMLResponse(page())

    def answer(work) -> JSONResponse:
        try:
            return JSONResponse(work())
        except ValueError as err:
            return JSONResponse({"error": str(err)}, status_code=400)
        except (StoreError, OSError) as err:  # the label was not saved: the page says so and keeps the pair
            return JSONResponse({"error": f"cannot write to the store: {err}"}, status_code=503)

    async def body(request: Request) -> dict:
        try:
            data = await request.json()
        except ValueError:
            data = None
        return data if isinstance(data, dict) else {}

    async def state(request: Request) -> JSONResponse:
        return answer(lambda: session(request.query_params.get("labeler")).state())

    async def label(request: Request) -> JSONResponse:
        data = await body(request)
        return answer(lambda: session(data.get("labeler")).label(str(data.get("key")), str(data.get("label"))))

    async def undo(request: Request) -> JSONResponse:
        data = await body(request)
        return answer(lambda: session(data.get("labeler")).undo())

    return Starlette(
        routes=[
            Route("/", index),
            Route("/api/state", state),
            Route("/api/label", label, methods=["POST"]),
            Route("/api/undo", undo, methods=["POST"]),
        ]
    )


def serve(store, pairs: list[dict], labeler: str, port: int) -> None:
    """Serve the labeling page on 127.0.0.1:`port` until interrupted."""
    import uvicorn

    uvicorn.run(make_app(store, pairs, labeler), host=HOST, port=port, log_level="warning")

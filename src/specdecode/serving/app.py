"""The FastAPI app: OpenAI-compatible routes over one ``Scheduler`` (the engine thread).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream with ``"stream": true``),
``GET /v1/models``, ``GET /v1/speculation`` (what the server offers and is doing), ``GET /health``,
``GET /metrics`` (Prometheus), and the page at ``GET /`` (``static/``; the page and /health need no key).
The handlers' work is ``server.Server``'s; the settings are ``config.ServerConfig``; the middleware (``middleware``)
is wired here, in ``create_app``, and nowhere else.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from .config import ServerConfig
from .hosts import HostCheck
from .middleware import Guard, error_response
from .openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorResponse,
    SpeculationState,
    validation_message,
)
from .server import ClientGone, Server
from .stalls import StalledReaderCut

__all__ = ["Server", "ServerConfig", "create_app"]
log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"


ERROR_MEANINGS = {
    400: "A field the server cannot take or honour (``param`` names it).",
    401: "A missing or wrong API key (when the server has one).",
    404: "A model this server does not serve.",
    413: "A body larger than the server's limit (max_body_bytes).",
    500: "Generation failed.",
    "default": "Any other error (e.g. 405 for a wrong method, with an Allow header).",
}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses``: these statuses and any other error, each with OpenAI's error body."""
    return {s: {"model": ErrorResponse, "description": ERROR_MEANINGS[s]} for s in (*statuses, "default")}


GENERATION_RESPONSES = {
    200: {
        "description": "The answer; with ``stream``, server-sent events (``data: <chunk>``, last ``data: [DONE]``).",
        "content": {  # one event's schema, as FastAPI documents its own event streams
            "text/event-stream": {
                "itemSchema": {
                    "type": "object",
                    "properties": {"data": {"type": "string", "description": "A chunk as JSON, or [DONE]."}},
                    "required": ["data"],
                }
            }
        },
    },
    **_errors(400, 401, 404, 413, 500),
}


METRICS_RESPONSE = {
    "description": "Prometheus' text format.",
    "content": {"text/plain": {"schema": {"type": "string"}}},
}


def create_app(config: ServerConfig | Server) -> FastAPI:
    """The FastAPI app. Given a config, the model loads when the app starts (in each Ray replica)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server = config if isinstance(config, Server) else Server(config)
        server.scheduler.start()
        app.state.server = server
        try:
            yield
        finally:
            server.scheduler.stop()
            server.save_history()

    settings = config.config if isinstance(config, Server) else config
    app = FastAPI(title="specdecode", summary="OpenAI-compatible speculative decoding server", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(_: HTTPRequest, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: HTTPRequest, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: HTTPRequest, exc: StarletteHTTPException) -> JSONResponse:
        response = error_response(exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})  # 405's Allow: the methods the route takes
        return response

    @app.exception_handler(Exception)
    async def server_error(_: HTTPRequest, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(500, f"internal error: {type(exc).__name__}")

    @app.get("/health", responses={503: {"description": "The engine thread has stopped."}})
    async def health(request: HTTPRequest) -> JSONResponse:
        alive = request.app.state.server.scheduler.alive
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/v1/models", responses=_errors(401))
    async def models(request: HTTPRequest) -> dict[str, Any]:
        server: Server = request.app.state.server
        card = {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "specdecode"}
        if server.window is not None:
            card["max_model_len"] = server.window
        return {"object": "list", "data": [card]}

    @app.get("/metrics", response_class=Response, responses={200: METRICS_RESPONSE, **_errors(401)})
    async def metrics(request: HTTPRequest) -> Response:
        return Response(request.app.state.server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/speculation", response_model=SpeculationState, responses=_errors(401))
    async def speculation(request: HTTPRequest) -> dict[str, Any]:
        """What the server offers (proposers, defaults) and what the engine is doing now."""
        return request.app.state.server.speculation_state()

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    app.mount("/static", StaticFiles(directory=STATIC, check_dir=False), name="static")

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: HTTPRequest) -> Response:
        return await _answer(request, body)

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: HTTPRequest) -> Response:
        return await _answer(request, body)

    app.add_middleware(Guard, api_key=settings.api_key, max_body_bytes=settings.max_body_bytes)
    app.add_middleware(StalledReaderCut)  # a client that stops reading its stream is cut (stalls.py)
    app.add_middleware(HostCheck, bound=settings.host, allowed=settings.allowed_hosts)  # first: DNS rebinding
    return app


async def _answer(request: HTTPRequest, body: CompletionRequest | ChatCompletionRequest) -> Response:
    try:
        return await request.app.state.server.respond(body, request)
    except ClientGone:
        return Response(status_code=499)

"""The HTTP door: an OpenAI-compatible API (FastAPI on uvicorn) onto the one Scheduler, the second door beside the
ROS node (docs/http.md).

Door(cfg, logger).start() binds http.host:http.port and serves from a thread of its own; until serve(scheduler,
engine) it answers 503 (loading, or whatever `pause(reason)` said), so the ROS node can run it beside its ROS
interfaces and `spec-edge http` alone. Every request is a scheduler Job: refused at submit (400 invalid, 429 busy,
503 unavailable, each with the scheduler's message, the ROS door's words), or streamed / answered when it ends. A
client that goes away cancels its job (checked every POLL_S): waiting, it leaves the queue at once
(Scheduler.withdraw); running, its slot frees before the next decode call. Refusals name the fields as the client
named them (schema.in_openai_words); /metrics counts every outcome, a client gone included.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import socket
import threading
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from spec_edge import config as cfgmod
from spec_edge.http import schema
from spec_edge.http.metrics import Metrics
from spec_edge.runtime.requests import RequestError
from spec_edge.runtime.scheduler import Job, Outcome, Scheduler

POLL_S = 0.02           # how often a waiting request looks at its job and its client
LOADING = "the model is loading; retry shortly"
STATUS = {"invalid": (400, "invalid_request_error"), "busy": (429, "rate_limit_error"),
          "unavailable": (503, "service_unavailable"), "": (500, "server_error")}


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.code, self.param = status, kind, message, code, param

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=headers)


def refusal(outcome: Outcome) -> ApiError:
    """The error of a job that did not succeed (no file path or traceback: a failed engine says where to look)."""
    reason = outcome.refusal or ("unavailable" if outcome.finish_reason == "cancelled" else "")  # the node stopped
    status, kind = STATUS[reason]
    message = outcome.message
    if status == 500 and not message.startswith("timed out"):
        message = "generation failed; the server's log has the details"
    return ApiError(status, kind, message, code=reason or outcome.finish_reason or None)


def body_error(err: RequestValidationError) -> ApiError:
    """The 400 of a body that is not the JSON object an endpoint takes: where the JSON breaks (line, column), that
    it must be an object, or which field is wrong (param: that field, and only then)."""
    first = err.errors()[0]
    path = list(first["loc"])[1:] if first["loc"] and first["loc"][0] == "body" else list(first["loc"])
    if first["type"] == "json_invalid":
        doc, at = str(err.body), int(path[0]) if path else 0
        line, column = doc.count("\n", 0, at) + 1, at - doc.rfind("\n", 0, at)
        reason = first.get("ctx", {}).get("error", "")
        return ApiError(400, "invalid_request_error", f"the body is not valid JSON (line {line}, column {column})"
                        + (f": {reason[0].lower() + reason[1:]}" if reason else ""), "invalid_json")
    if not path:
        what = "the body is empty" if first["type"] == "missing" else "the body must be a JSON object"
        return ApiError(400, "invalid_request_error", f"{what}: send a JSON object of the request's fields "
                        "(Content-Type: application/json)", "invalid_body")
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".")
    message = ("unknown field: this server takes OpenAI's fields and its own (docs/http.md)"
               if first["type"] == "extra_forbidden" else first["msg"])
    return ApiError(400, "invalid_request_error", f"{where}: {message}", "invalid_field", where)


class BodyLimit:
    """ASGI middleware: a body past limit bytes (as declared or as read) raises HTTPException 413 where the endpoint
    reads it (Starlette's own limit answers in plain text, not in OpenAI's shape)."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = int(dict(scope["headers"]).get(b"content-length", b"0") or 0)
        seen = 0

        async def limited():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if max(seen, declared) > self.limit:
                raise HTTPException(413)
            return message

        await self.app(scope, limited, send)


def check_binding(cfg: cfgmod.HttpSection) -> None:
    """Refuse a reachable address without an api_key (ConfigError saying what to set)."""
    try:
        loopback = cfg.host == "localhost" or ipaddress.ip_address(cfg.host).is_loopback
    except ValueError:
        loopback = False
    if not loopback and not cfg.api_key:
        raise cfgmod.ConfigError(
            f"http.host={cfg.host} is reachable from other machines and http.api_key is empty: anyone who reaches "
            f"port {cfg.port} could run the model. Set http.api_key (clients send it as `Authorization: Bearer "
            f"<key>`), or bind http.host: 127.0.0.1")


class Door:
    """The HTTP door; see the module docstring."""

    def __init__(self, cfg: cfgmod.Config, logger: Any):
        self.cfg, self.logger = cfg, logger
        self.model = cfg.runtime.profile    # the model id /v1/models lists and requests name
        self.metrics = Metrics()
        self.in_flight = 0
        self.scheduler: Scheduler | None = None
        self.unavailable = LOADING
        self.app = self._make_app()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port = cfg.http.port           # the bound port (http.port 0: the one the OS chose)

    # -- life ---------------------------------------------------------------------------------

    def serve(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def pause(self, reason: str) -> None:
        """Answer 503 with reason until serve() again (the node inactive, shutting down)."""
        self.unavailable = reason
        self.scheduler = None

    def start(self) -> "Door":
        """Bind (OSError / ConfigError here, in the caller's thread) and serve on a thread."""
        import uvicorn

        check_binding(self.cfg.http)
        host = self.cfg.http.host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, self.cfg.http.port))
        except OSError as err:
            sock.close()
            raise cfgmod.ConfigError(f"the HTTP door cannot bind http.host={host} http.port={self.cfg.http.port}: "
                                     f"{err.strerror}; pick another http.port (0: any free one)") from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, timeout_graceful_shutdown=1,
                                lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, name="spec_edge-http",
                                        daemon=True)
        self._thread.start()
        while not self._server.started and self._thread.is_alive():
            self._thread.join(0.01)
        self.logger.info(f"HTTP door on http://{host}:{self.port}/v1 (model {self.model})")
        return self

    def stop(self, timeout: float = 3.0) -> None:
        self.pause("the server is shutting down")
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout)
            self._server = None

    # -- the app ------------------------------------------------------------------------------

    def _make_app(self) -> FastAPI:
        def authorize(request: Request) -> None:
            """Every path but /health needs the key when there is one (a dependency, not an http middleware:
            Starlette's BaseHTTPMiddleware hides a client's disconnect from the endpoint)."""
            key = self.cfg.http.api_key
            if key and request.url.path != "/health":
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                    self.metrics.count("unauthorized")
                    raise ApiError(401, "invalid_request_error", "missing or wrong API key: send "
                                   "`Authorization: Bearer <http.api_key>`", "invalid_api_key")

        # /docs and /openapi.json as routes of their own: FastAPI's built-in ones skip the app's dependencies
        # (they answered without the key)
        app = FastAPI(title="spec_edge", docs_url=None, redoc_url=None, openapi_url=None,
                      dependencies=[Depends(authorize)])
        app.add_middleware(BodyLimit, limit=self.cfg.http.max_body_bytes)

        @app.exception_handler(ApiError)
        async def api_error(request: Request, err: ApiError):
            return err.response()

        @app.exception_handler(HTTPException)
        async def http_error(request: Request, err: HTTPException):
            if err.status_code == 413:
                self.metrics.count("too_large")
                return ApiError(413, "invalid_request_error", f"the request body is larger than "
                                f"http.max_body_bytes={self.cfg.http.max_body_bytes}", "body_too_large").response()
            self.metrics.count("not_found" if err.status_code == 404 else "invalid")
            return ApiError(err.status_code, "invalid_request_error", str(err.detail)).response()

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, err: RequestValidationError):
            self.metrics.count("invalid")
            return body_error(err).response()

        @app.get("/openapi.json", include_in_schema=False)
        async def openapi():
            return JSONResponse(app.openapi())

        @app.get("/docs", include_in_schema=False)
        async def docs():
            return get_swagger_ui_html(openapi_url="/openapi.json", title="spec_edge")

        @app.get("/health")
        async def health():
            if self.scheduler is None:
                return ApiError(503, "service_unavailable", self.unavailable, "unavailable").response()
            return {"status": "ok", "model": self.model}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": self.model, "object": "model", "created": 0,
                                                "owned_by": "spec_edge"}]}

        @app.get("/metrics")
        async def metrics():
            scheduler = self.scheduler
            info = scheduler.decoder.info() if scheduler else {}
            text = self.metrics.render(scheduler.queue_depth if scheduler else 0, self.in_flight,
                                       scheduler.capacity if scheduler else 0, info.get("suffix_store"),
                                       info.get("remote"), info.get("image_encoder"))
            return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

        @app.post("/v1/chat/completions")
        async def chat(body: schema.ChatBody, request: Request):
            return await self._generate(body, request)

        @app.post("/v1/completions")
        async def completions(body: schema.CompletionBody, request: Request):
            return await self._generate(body, request)

        return app

    # -- one request ----------------------------------------------------------------------------

    async def _generate(self, body: schema.ChatBody | schema.CompletionBody, request: Request):
        if body.model not in (None, self.model):
            self.metrics.count("not_found")
            raise ApiError(404, "invalid_request_error", f"model {body.model!r} is not served here; this server "
                           f"serves {self.model!r} (GET /v1/models)", "model_not_found", "model")
        scheduler = self.scheduler
        if scheduler is None:
            self.metrics.count("unavailable")
            raise ApiError(503, "service_unavailable", self.unavailable, "unavailable")
        try:
            engine_request = body.request()
        except RequestError as err:
            self.metrics.count("invalid")
            raise ApiError(400, "invalid_request_error", str(err), "invalid") from None
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[str] = asyncio.Queue()
        cancelled = threading.Event()

        def on_text(delta: str, n_tokens: int) -> None:
            try:
                loop.call_soon_threadsafe(deltas.put_nowait, delta)
            except RuntimeError:  # the door's loop is gone (shutting down): the job is being cancelled
                cancelled.set()

        job = Job(engine_request, on_text=on_text if body.stream else None, cancel_requested=cancelled.is_set)
        self.in_flight += 1
        if not await run_in_threadpool(scheduler.submit, job):  # the checks tokenize, compile grammars: off the loop
            self.in_flight -= 1
            self.metrics.count(job.outcome.refusal)
            error = refusal(job.outcome)
            if job.outcome.refusal == "invalid":  # the engine's words name the ROS fields: the client's names
                error.message, error.param = schema.in_openai_words(body, error.message)
            raise error
        rid, created = schema.new_id(body)
        head = schema.envelope(body, rid, created, self.model)

        def piece(token_id: int) -> str:
            return scheduler.front.detokenize([token_id])

        if not body.stream:
            try:
                while not job.done.is_set():
                    await asyncio.sleep(POLL_S)
                    if await request.is_disconnected():  # no one to answer: the job leaves the queue now
                        cancelled.set()
                        scheduler.withdraw()
                        self.metrics.count("disconnected")
                        return PlainTextResponse("", status_code=499)  # never read: the connection is gone
            finally:
                self.in_flight -= 1
            return self._answer(body, job.outcome, head, piece)

        def leave() -> None:  # once, from the stream's end or the response's (a client gone before it began)
            if not cancelled.is_set():
                cancelled.set()
                self.in_flight -= 1
                if not job.done.is_set():  # the client went away first
                    scheduler.withdraw()
                    self.metrics.count("disconnected")

        async def events():
            sent = ""
            try:
                yield _sse(head | {"choices": [schema.choice(body, None, "", piece)]} if isinstance(body, schema.ChatBody)
                           else None)
                while not job.done.is_set():
                    try:
                        delta = await asyncio.wait_for(deltas.get(), POLL_S)
                    except asyncio.TimeoutError:
                        if await request.is_disconnected():  # (a stream learns it otherwise only at a send)
                            return
                        continue
                    sent += delta
                    yield _sse(head | {"choices": [schema.choice(body, None, delta, piece)]})
                outcome = job.outcome
                self._count(outcome)
                if not outcome.success:
                    yield _sse(json.loads(refusal(outcome).response().body))
                else:
                    last = head | {"choices": [schema.choice(body, outcome, outcome.text[len(sent):], piece)],
                                   "spec_edge": schema.ours(outcome)}
                    yield _sse(last)
                    if body.stream_options is not None and body.stream_options.include_usage:
                        yield _sse(head | {"choices": [], "usage": schema.usage(outcome)})
                yield "data: [DONE]\n\n"
            finally:  # the client went away (the task cancelled) or the stream ended
                leave()

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                 background=BackgroundTask(leave))

    def _count(self, outcome: Outcome) -> None:
        kind = "success" if outcome.success and outcome.finish_reason != "cancelled" else (
            "cancelled" if outcome.success else outcome.refusal or "error")
        self.metrics.count(kind, outcome.stats, outcome.num_tokens)

    def _answer(self, body, outcome: Outcome, head: dict, piece) -> JSONResponse:
        self._count(outcome)
        if not outcome.success:
            raise refusal(outcome)
        return JSONResponse(head | {"choices": [schema.choice(body, outcome, outcome.text, piece)],
                                    "usage": schema.usage(outcome), "spec_edge": schema.ours(outcome)})


def _sse(event: dict | None) -> str:
    return "" if event is None else f"data: {json.dumps(event, allow_nan=False)}\n\n"


def run(cfg: cfgmod.Config, progress: Any, on_signal: Any = lambda: None) -> int:
    """`spec-edge http`: the door alone (no ROS), answering 503 while the engine loads, until SIGINT / SIGTERM
    (on_signal() is called first: the CLI starts its exit watchdog). Returns for the process to end at once (the
    CLI's exit_process): the worker and the door's thread are not waited for beyond a moment and the engine is not
    closed (a close while a decode call still runs would abort; the OS frees it all)."""
    import logging
    import signal

    from spec_edge import artifacts

    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    logger = logging.getLogger("http")
    door = Door(cfg, logger).start()
    scheduler = None
    stop = threading.Event()

    def signalled(signum, frame) -> None:
        if not stop.is_set():
            on_signal()
        stop.set()

    try:
        scheduler = Scheduler(artifacts.engine(cfg, progress), cfg, logger)  # built first where missing, then loaded
        if cfg.serve.warm_system_prompt:
            progress(f"[http] warmed the cache with the system prompt: {scheduler.warm()} tokens")
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signalled)
        door.serve(scheduler)
        progress(f"[http] serving {door.model} on http://{cfg.http.host}:{door.port}/v1")
        stop.wait()
    finally:
        door.pause("the server is shutting down")
        if scheduler is not None:
            scheduler.stop(0.5)  # refuses what waits, cancels what runs
        door.stop(timeout=0.5)
    return 0

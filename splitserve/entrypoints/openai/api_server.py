"""The OpenAI-compatible HTTP server: `splitserve serve [MODEL]`.

`build_app(engine, args)` makes the FastAPI app (tests and embedders can call it directly);
`run_server(args)` loads the engine and runs it under uvicorn. On SIGTERM/SIGINT the server drains:
it stops accepting connections, answers new requests on open connections with 503, lets in-flight
requests finish for up to --drain-timeout seconds, aborts what is left, then exits with status 0.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import secrets
import signal
import threading
from importlib import resources

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitserve import __version__
from splitserve.engine.async_engine import AsyncLLMEngine
from splitserve.engine_args import EngineArgs
from splitserve.entrypoints.openai.body_limit import DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from splitserve.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                                    DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
                                                    TokenizeRequest)
from splitserve.entrypoints.openai.server_args import ServerArgs
from splitserve.entrypoints.openai.serving import OpenAIServing, overloaded
from splitserve.metrics import ServerMetrics
from splitserve.multimodal.media import MediaPolicy

logger = logging.getLogger(__name__)

_DRAIN_GRACE_S = 3.0
# After the engine core process is lost, /health answers 503 this long before the server exits.
_CORE_LOST_GRACE_S = 2.0


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _validation_error(exc: RequestValidationError) -> APIError:
    """Pydantic's errors as one 400: FastAPI's default 422 is not what OpenAI clients expect."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    parts, param = [], None
    for err in errors[:3]:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        if err.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON ({err.get('ctx', {}).get('error', err.get('msg'))})")
            param = None
        else:
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    if len(errors) > 3:
        parts.append(f"and {len(errors) - 3} more")
    return APIError(400, "; ".join(parts), param=param)


def _chat_page() -> str:
    return resources.files("splitserve.entrypoints.openai").joinpath("chat_page.html").read_text("utf-8")


def build_app(engine, args: argparse.Namespace | None = None) -> FastAPI:
    """`engine` is an LLMEngine (wrapped here) or an AsyncLLMEngine."""
    api_key = getattr(args, "api_key", None)
    if isinstance(engine, AsyncLLMEngine):
        async_engine = engine
    else:
        async_engine = AsyncLLMEngine(engine, max_queued_requests=getattr(args, "max_queued_requests", None))
    llm = async_engine.engine
    model_name = llm.model_name
    metrics = ServerMetrics(model_name, lambda: async_engine.stats)
    async_engine.on_output = metrics.on_output
    source = getattr(llm, "source", None)
    serving = OpenAIServing(async_engine, model_name, getattr(source, "path", None))
    serving.media_policy = MediaPolicy.from_args(args)  # image sources: --allowed-*, --limit-mm-per-prompt
    page = _chat_page()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        await async_engine.shutdown()

    app = FastAPI(title="splitserve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(BodySizeLimit, max_bytes=getattr(args, "max_request_body_bytes", None) or DEFAULT_MAX_BODY_BYTES)
    app.state.engine = async_engine
    app.state.metrics = metrics
    app.state.draining = False

    drain_timeout = getattr(args, "drain_timeout", None)

    def end_drain() -> None:
        n = async_engine.abort_all()
        if n:
            logger.warning("drain timeout (%ss) reached: aborted %d request(s)", drain_timeout, n)

    def begin_drain(reason: str = "shutdown") -> None:
        """Called from the signal handler: only flag-setting and thread-safe loop calls here."""
        if app.state.draining:
            return
        app.state.draining = True
        logger.info("%s: draining %d in-flight request(s) for up to %ss", reason, async_engine.num_in_flight,
                    drain_timeout)
        loop = async_engine.loop
        if drain_timeout is not None and loop is not None:
            # Abort what is still running when the drain time is up, so those streams end with
            # finish_reason "abort" and [DONE] rather than being cut mid-response by uvicorn.
            loop.call_soon_threadsafe(loop.call_later, drain_timeout, end_drain)
    app.state.begin_drain = begin_drain

    # -- errors: always the OpenAI shape ------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(exc.status_code, str(exc.detail), type=kind,
                                        headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return _error_response(APIError(500, "internal server error", type="internal_server_error",
                                        code="internal_error"))

    # -- guards -------------------------------------------------------------------------------
    async def require_key(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key; send `Authorization: Bearer <key>`",
                           type="authentication_error", code="invalid_api_key")

    async def accepting() -> None:
        if app.state.draining:
            raise overloaded("the server is shutting down")
        if async_engine.dead_error is not None:
            raise overloaded(f"the engine has stopped: {async_engine.dead_error}")

    api = APIRouter(dependencies=[Depends(require_key)])

    @api.get("/v1/models")
    async def models() -> dict:
        card = ModelCard(id=model_name, root=serving.model_root, max_model_len=serving.max_model_len,
                         quantization=serving.quantization)
        return ModelList(data=[card]).model_dump()

    @api.post("/v1/completions", dependencies=[Depends(accepting)])
    async def completions(body: CompletionRequest, request: Request):
        return await serving.create_completion(body, request)

    @api.post("/v1/chat/completions", dependencies=[Depends(accepting)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.create_chat_completion(body, request)

    @api.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return await serving.tokenize(body)  # off the event loop when the text is large

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        serving.check_model(body.model)
        vocab = llm.config.model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}), got {bad[:5]}", param="tokens")
        return DetokenizeResponse(prompt=serving.tokenizer.decode(body.tokens)).model_dump()

    app.include_router(api)

    # -- open endpoints -----------------------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if app.state.draining:
            return _error_response(overloaded("the server is shutting down"))
        if async_engine.dead_error is not None:
            return _error_response(overloaded(f"the engine has stopped: {async_engine.dead_error}"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/", response_class=HTMLResponse)
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(page)

    return app


def _make_server(config, on_signal):
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn already stops accepting and waits for open connections on a signal (bounded by
        timeout_graceful_shutdown). Two changes: the app learns it is draining (new requests on
        open connections get 503, /health turns 503), and the signal is not re-raised after the
        drain, so a SIGTERM ends in a clean exit status 0 instead of death by signal."""

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            original = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, handler in original.items():
                    signal.signal(s, handler)

        def handle_exit(self, sig, frame) -> None:
            on_signal(f"received {signal.Signals(sig).name}")
            super().handle_exit(sig, frame)

    return DrainingServer(config)


def run_server(args: argparse.Namespace) -> int:
    """Starts the engine core in its own process, then serves HTTP here until a signal (exit 0) or
    the loss of the core process (exit 1, after answering 503 for a moment so probes see why)."""
    import uvicorn

    ServerArgs.from_namespace(args)  # checks the server's flags (ValueError naming the flag)
    engine = AsyncLLMEngine.launch(EngineArgs.from_namespace(args), max_queued_requests=args.max_queued_requests,
                                   stream_interval=args.stream_interval)
    app = build_app(engine, args)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=not args.disable_access_log, lifespan="on",
                            # uvicorn's own cut-off is only the fallback: ours (at drain_timeout)
                            # ends the remaining streams cleanly, given this grace to flush them.
                            timeout_graceful_shutdown=args.drain_timeout + _DRAIN_GRACE_S)
    server = _make_server(config, app.state.begin_drain)
    core_lost = False

    def on_core_lost() -> None:
        nonlocal core_lost
        core_lost = True
        loop = asyncio.get_running_loop()
        loop.call_later(_CORE_LOST_GRACE_S, setattr, server, "should_exit", True)
    engine.on_core_lost = on_core_lost
    logger.info("serving %s on http://%s:%d (chat page at /)", engine.engine.model_name, args.host, args.port)
    try:
        server.run()
    finally:
        if not engine.closed:  # the server never started (port in use): stop the core too
            asyncio.run(engine.shutdown())
    if core_lost:
        logger.error("the engine core process is gone; exiting with status 1")
        return 1
    return 0 if server.started else 1

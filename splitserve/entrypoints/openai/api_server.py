"""The OpenAI-compatible HTTP server: `splitserve serve [MODEL]`.

`build_app(engine, args)` makes the FastAPI app (tests and embedders can call it directly);
`run_server(args)` binds the port (so a port in use is reported at once), loads the engine, and runs
it under uvicorn on that socket. On SIGTERM/SIGINT the server drains:
it stops accepting connections, answers new requests on open connections with 503, lets in-flight
requests finish for up to --drain-timeout seconds, aborts what is left, then exits with status 0.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import errno
import gc
import logging
import secrets
import signal
import socket
import threading
from importlib import resources

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from splitserve import __version__
from splitserve.ttft_trace import baseline as ttft_baseline
from splitserve.engine.async_engine import AsyncLLMEngine
from splitserve.engine.args import EngineArgs
from splitserve.entrypoints.openai.body_limit import DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from splitserve.entrypoints.openai.http10 import http_protocol
from splitserve.entrypoints.openai.protocol import (APIError, LoadLoRAAdapterRequest, ChatCompletionRequest, CompletionRequest,
                                                    DetokenizeRequest, DetokenizeResponse, ModelCard, ModelList,
                                                    TokenizeRequest)
from splitserve.entrypoints.openai.server_args import ServerArgs
from splitserve.entrypoints.openai.serving import OpenAIServing, overloaded
from splitserve.metrics import ServerMetrics, StatsLogger
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
    cfg = llm.config
    cache_info = {"block_size": str(cfg.cache.block_size),
                  "num_gpu_blocks": str(llm.kv_capacity_tokens // cfg.cache.block_size),
                  "enable_prefix_caching": str(cfg.cache.enable_prefix_caching),
                  "gpu_memory_utilization": str(cfg.cache.gpu_memory_utilization),
                  "cache_dtype": str(getattr(cfg.cache, "kv_cache_dtype", None) or getattr(cfg.cache, "cache_dtype", None)
                                     or "auto")}
    metrics = ServerMetrics(model_name, lambda: async_engine.stats, cfg.model.max_model_len, cache_info,
                            compat=getattr(args, "metrics_compat", None),
                            replica_stats=lambda: [r.stats for r in async_engine.replicas])
    async_engine.on_output = metrics.on_output
    async_engine.on_step_tokens = metrics.on_step_tokens
    stats_logger = None if getattr(args, "disable_log_stats", True) else StatsLogger(metrics, lambda: async_engine.stats)
    source = getattr(llm, "source", None)
    serving = OpenAIServing(async_engine, model_name, getattr(source, "path", None),
                            log_requests=bool(getattr(args, "enable_log_requests", False)),
                            tool_parser=getattr(args, "tool_call_parser", None)
                            if getattr(args, "enable_auto_tool_choice", False) else None)
    serving.media_policy = MediaPolicy.from_args(args)  # image sources: --allowed-*, --limit-mm-per-prompt
    page = _chat_page()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        stats_task = asyncio.create_task(stats_logger.run()) if stats_logger is not None else None
        yield
        if stats_task is not None:
            stats_task.cancel()
        await async_engine.shutdown()

    docs = not getattr(args, "disable_fastapi_docs", False)
    app = FastAPI(title="splitserve", version=__version__, lifespan=lifespan,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)
    app.add_middleware(BodySizeLimit, max_bytes=getattr(args, "max_request_body_bytes", None) or DEFAULT_MAX_BODY_BYTES)
    # Added last, so it runs first: a preflight (OPTIONS) or a 413 still carries the CORS headers a
    # browser needs to read it. The defaults are vLLM's: any origin, method and header.
    app.add_middleware(CORSMiddleware, allow_origins=getattr(args, "allowed_origins", None) or ["*"],
                       allow_methods=getattr(args, "allowed_methods", None) or ["*"],
                       allow_headers=getattr(args, "allowed_headers", None) or ["*"],
                       allow_credentials=bool(getattr(args, "allow_credentials", False)))
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

    def model_card(name: str) -> ModelCard:
        lora = serving.loras.get(name) if serving.loras is not None else None
        if lora is not None:  # a LoRA adapter: its directory, and the base model as its parent
            return ModelCard(id=name, root=lora.lora_path, max_model_len=serving.max_model_len,
                             parent=serving.model_name)
        return ModelCard(id=name, root=serving.model_root, max_model_len=serving.max_model_len,
                         quantization=serving.quantization)

    @api.get("/v1/models")
    async def models() -> dict:
        names = serving.served_model_names + serving.lora_names()
        return ModelList(data=[model_card(n) for n in names]).model_dump()

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        serving.check_model(model_id)  # 404 in the OpenAI shape for a name this server does not serve
        return model_card(model_id).model_dump()

    serving.on_lora_request = metrics.on_lora_request
    serving.metrics = metrics
    add_lora_routes(api, serving)

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
        if len(async_engine.replicas) > 1:  # data parallel: healthy while one replica serves
            replicas = async_engine.replica_health()
            up = any(r["status"] == "ok" for r in replicas)
            return JSONResponse({"status": "ok" if up else "unavailable", "replicas": replicas},
                                status_code=200 if up else 503)
        return Response(status_code=200)

    # SageMaker's health probe (vLLM answers it the same way as /health), by GET or POST.
    @app.get("/ping")
    async def ping() -> Response:
        return await health()

    @app.post("/ping")
    async def ping_post() -> Response:
        return await health()

    @app.get("/load")
    async def load() -> dict:
        """vLLM's load report: the requests in flight (a router's least-loaded choice)."""
        return {"server_load": async_engine.num_in_flight}

    @app.get("/get_load")
    async def get_load() -> dict:
        """SGLang's load report, which vllm-router polls (every few seconds) for its least-load choices;
        without it, a prefill/decode router sees every decode server at load 0 (DESIGN.md, "Router")."""
        return {"load": async_engine.num_in_flight}

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        return Response(status_code=204)  # browsers ask for it with every page; nothing to show

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


def add_lora_routes(api: APIRouter, serving: OpenAIServing) -> None:
    """vLLM's runtime adapter endpoints (with --allow-runtime-lora); the answers are vLLM's texts."""

    def refuse(e: Exception):
        if isinstance(e, PermissionError):
            raise APIError(404 if "is off" in str(e) or "not enabled" in str(e) else 400, str(e),
                           param="lora_path") from None
        raise APIError(400, str(e), param="lora_path") from None

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        if serving.loras is None or not serving.loras.enabled:
            raise APIError(404, "LoRA is not enabled on this server (--enable-lora)", param="lora_name")
        try:  # reads the adapter's config and tensor shapes (small files), not its weights
            await serving._off_loop(1 << 20, serving.loras.add_at_runtime, body.lora_name, body.lora_path or "")
        except (ValueError, PermissionError) as e:
            refuse(e)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        if serving.loras is None or not serving.loras.enabled:
            raise APIError(404, "LoRA is not enabled on this server (--enable-lora)", param="lora_name")
        try:
            serving.loras.remove(body.lora_name)
        except PermissionError as e:
            refuse(e)
        except KeyError:
            raise APIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                           code="model_not_found") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


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


def bind_socket(host: str, port: int) -> socket.socket:
    """Binds the server's address now, before the model loads, so that a port in use is reported at
    once rather than after minutes of loading. Not listening yet: until the engine is ready, a
    client is refused at once instead of waiting in the backlog."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: {e.strerror}") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart may reuse it at once
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = "the port is in use (another server?); stop it or choose another --port" \
            if e.errno == errno.EADDRINUSE else e.strerror
        raise ValueError(f"cannot listen on {host}:{port}: {why}") from None
    return sock


def run_server(args: argparse.Namespace) -> int:
    """Binds the port, starts the engine core in its own process, then serves HTTP here until a signal
    (exit 0) or the loss of the core process (exit 1, after answering 503 for a moment so probes see why)."""
    import uvicorn

    from splitserve.entrypoints.chat_template import load_chat_template

    # Checks the server's flags (ValueError naming the flag) and normalizes them (CORS lists given as JSON).
    server_args = ServerArgs.from_namespace(args)
    for f in dataclasses.fields(server_args):
        setattr(args, f.name, getattr(server_args, f.name))
    chat_template = load_chat_template(args.chat_template)
    sock = bind_socket(args.host, args.port)
    port = sock.getsockname()[1]
    logger.info("bound %s:%d; loading the model", args.host, port)
    try:
        engine = AsyncLLMEngine.launch(EngineArgs.from_namespace(args), max_queued_requests=args.max_queued_requests,
                                       stream_interval=args.stream_interval)
    except BaseException:
        sock.close()
        raise
    if chat_template is not None:
        engine.engine.tokenizer.chat_template = chat_template
    app = build_app(engine, args)
    config = uvicorn.Config(app, host=args.host, port=port, log_level=args.log_level,
                            access_log=not args.disable_access_log, lifespan="on", http=http_protocol(),
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
    names = ", ".join(engine.engine.served_model_names)
    # Start-up leaves ~240k long-lived objects here (torch, transformers, the tokenizer, FastAPI): a
    # full collection while serving walks them all, stalling the event loop, and with it every
    # stream's next event, for ~50-200 ms. Out of the collector's view they cost nothing.
    if not ttft_baseline():  # (off only to measure before and after: ttft_trace.py)
        gc.collect()
        gc.freeze()
    logger.info("serving %s on http://%s:%d (chat page at /, API docs at /docs)", names, args.host, port)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        if not engine.closed:  # the server never started: stop the core too
            asyncio.run(engine.shutdown())
    if core_lost:
        logger.error("the engine core process is gone; exiting with status 1")
        return 1
    return 0 if server.started else 1

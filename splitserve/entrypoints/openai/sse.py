"""Server-sent event streams of the completion and chat endpoints: the event format, and the response
that carries them, which ends its requests however it ends."""
from __future__ import annotations

import logging
from typing import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from splitserve.engine.async_engine import EngineRequestError, EngineShutdownError
from splitserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Characters that JSON leaves raw inside strings but that line splitters built on str.splitlines
# (httpx's aiter_lines among them) take for line breaks, cutting an event in two. Escaped, the JSON
# is the same. (The C0 ones, like \x1c or \x0b, are always escaped by the JSON encoder.)
_LINE_BREAK_ESCAPES = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: str) -> str:
    """One server-sent event carrying a JSON payload, on a single line for every line splitter."""
    return f"data: {payload.translate(_LINE_BREAK_ESCAPES)}\n\n"


class _EndingStreamingResponse(StreamingResponse):
    """Calls `on_exit` however the response ends. The body generator's own `finally` does not cover a
    client that leaves before the generator first runs: Starlette then cancels the sending task
    before it starts, and a generator never started has no `finally` to run."""

    def __init__(self, content, on_exit: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self._on_exit = on_exit

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_exit()


def event_stream_response(body: AsyncIterator[str], abort: Callable[[], None]) -> StreamingResponse:
    """`body`'s events as a text/event-stream response; `abort` ends its requests when the response
    ends early (the client left, or the body failed), so none runs on for nobody."""
    async def guarded() -> AsyncIterator[str]:
        try:
            async for chunk in body:
                yield chunk
        except Exception as e:
            # Headers are out already: report in-band, then end the stream properly, so the
            # client sees an error event and [DONE] rather than a connection cut mid-body.
            if isinstance(e, EngineShutdownError):
                err = ErrorInfo(message=str(e), type="service_unavailable", code="service_unavailable")
            elif isinstance(e, EngineRequestError):
                err = ErrorInfo(message=str(e), type="internal_server_error", code="internal_error")
            else:
                logger.exception("streaming response failed")
                err = ErrorInfo(message="internal server error", type="internal_server_error",
                                code="internal_error")
            yield sse(ErrorResponse(error=err).model_dump_json())
            yield sse("[DONE]")
        finally:
            abort()  # the client went away (cancelled) or we failed: free the blocks
    return _EndingStreamingResponse(guarded(), abort, media_type="text/event-stream", headers=SSE_HEADERS)

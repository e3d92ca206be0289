"""A cap on the size of request bodies (HTTP 413), enforced before the app parses anything.

Without it a client can make the server buffer and JSON-parse a body of any size. The cap is checked
twice: against a declared Content-Length at once (nothing is read), and against the bytes actually
received, which also covers chunked uploads that declare no length. The body, once within the cap, is
handed to the app as one message; later messages (the client's disconnect) pass through untouched, so
handlers still see a client that goes away.
"""
from __future__ import annotations

import json

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024  # room for long token-id prompts and data-URL images


def _error(status: int, message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()


class BodySizeLimit:
    """Pure ASGI middleware (no Starlette request objects), so it adds no cost past the body read."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    return await self._reject(send, 400, "invalid Content-Length header", "invalid_header")
        if declared is not None and declared > self.max_bytes:
            return await self._reject_too_large(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                return await self._reject_too_large(send)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject_too_large(self, send) -> None:
        await self._reject(send, 413, f"the request body exceeds the server's limit of {self.max_bytes} bytes "
                                      f"(--max-request-body-bytes)", "request_too_large")

    @staticmethod
    async def _reject(send, status: int, message: str, code: str) -> None:
        body = _error(status, message, code)
        # Close the connection: the rest of an oversized body is never read, so it cannot be reused.
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

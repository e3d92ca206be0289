"""Caps on request bodies, enforced before the app parses anything: size (HTTP 413) and JSON nesting
depth (HTTP 400).

Without the size cap a client can make the server buffer and JSON-parse a body of any size. The cap is
checked twice: against a declared Content-Length at once (nothing is read), and against the bytes
actually received, which also covers chunked uploads that declare no length. The body, once within the
cap, is handed to the app as one message; later messages (the client's disconnect) pass through
untouched, so handlers still see a client that goes away.

Without the depth cap a body nested ~1000 levels deep parses, then crashes whatever walks it
recursively (pydantic, our validators, a chat template) with RecursionError: a 500. Every recursive
walk downstream is safe once the depth is bounded, so the bound is checked here, once, on the raw
bytes, by code that does not recurse.
"""
from __future__ import annotations

import json

import numpy as np

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024  # room for long token-id prompts and data-URL images
# Arrays/objects nested deeper than this are refused. Far above any real request (a tools schema is
# rarely 10 deep) and far below Python's recursion limit (1000), which every walk must stay under.
MAX_JSON_DEPTH = 64

# One bytes.translate deletes every byte but the brackets and turns those into int8 steps: +1 for an
# opening bracket, -1 (0xff) for a closing one.
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_TO_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_CHUNK = 1 << 20  # brackets per cumulative sum: bounds the scan's memory on a body of brackets


def json_too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text `body` nests arrays/objects more than `limit` deep.

    Exact for valid JSON; for invalid JSON the answer does not matter (the parser refuses the body
    either way). Runs in C and numpy, never recursing, so it can run on the event loop: a few ms for
    an ordinary body of 32 MB, ~0.15 s for 32 MB of brackets (json.loads of those takes seconds)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False  # most bodies: too few brackets to nest that deep, wherever they are
    encoding = json.detect_encoding(body)  # what json.loads would decode it as
    if encoding not in ("utf-8", "utf-8-sig"):
        # In UTF-16/32 a quote or bracket byte can be half of another character: scan it as UTF-8.
        try:
            body = body.decode(encoding, "surrogatepass").encode("utf-8", "surrogatepass")
        except UnicodeError:
            return False  # json.loads fails on it too
    # Brackets inside strings do not nest. Drop escaped backslashes, then escaped quotes (both occur
    # only inside strings in valid JSON; a run of backslashes pairs up from its start, as
    # bytes.replace scans), so every remaining quote delimits a string; then keep what lies outside.
    if b"\\" in body:
        body = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(body.split(b'"')[0::2])
    steps = np.frombuffer(outside.translate(_TO_STEPS, _NOT_BRACKETS), np.int8)
    depth = 0
    for start in range(0, len(steps), _CHUNK):
        levels = np.cumsum(steps[start:start + _CHUNK], dtype=np.int32) + depth
        if levels.max() > limit:
            return True
        depth = int(levels[-1])
    return False


def _error(status: int, message: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()


class BodySizeLimit:
    """The size cap, then the depth cap, on every HTTP body. Pure ASGI middleware (no Starlette
    request objects), so it adds no cost past the body read and one scan of it."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BODY_BYTES, max_depth: int = MAX_JSON_DEPTH):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.app = app
        self.max_bytes = max_bytes
        self.max_depth = max_depth

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
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._reject_too_large(send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if json_too_deep(body, self.max_depth):
            return await self._reject(send, 400, f"the request body nests arrays/objects more than "
                                                 f"{self.max_depth} levels deep", "nesting_too_deep", close=False)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject_too_large(self, send) -> None:
        await self._reject(send, 413, f"the request body exceeds the server's limit of {self.max_bytes} bytes "
                                      f"(--max-request-body-bytes)", "request_too_large")

    @staticmethod
    async def _reject(send, status: int, message: str, code: str, close: bool = True) -> None:
        body = _error(status, message, code)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if close:  # the rest of an oversized body is never read, so the connection cannot be reused
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

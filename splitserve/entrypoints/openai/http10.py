"""HTTP/1.0 framing for uvicorn's httptools protocol.

HTTP/1.0 has no chunked transfer coding: a response of unknown length must be sent unframed and ended
by closing the connection. uvicorn's h11 protocol does that, but its httptools protocol (the faster
one, which `http="auto"` picks whenever httptools is installed) answers an HTTP/1.0 client with
`transfer-encoding: chunked` for every response without a Content-Length, i.e. every stream. A proxy
speaking HTTP/1.0 to us (nginx's default `proxy_http_version 1.0`) then passes the chunk sizes on to
its client as part of the body.

`http_protocol()` is what the server gives uvicorn: the httptools protocol with one change for
HTTP/1.0 requests. It relies on two attributes of uvicorn's response cycle; if those ever change, the
h11 protocol (correct, slower) is used instead.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def _unframed(app, cycle):
    """`app` whose responses without a declared length go out unframed on `cycle`, an HTTP/1.0
    request's httptools cycle. The connection then closes after the body (httptools never keeps an
    HTTP/1.0 connection alive), which is what ends the body for the client."""

    async def wrapped(scope, receive, send):
        unframed = False

        async def send_unframed(message):
            nonlocal unframed
            if message["type"] == "http.response.start":
                names = {name.lower() for name, _ in message.get("headers", [])}
                unframed = (b"content-length" not in names and b"transfer-encoding" not in names
                            and scope["method"] != "HEAD" and message["status"] not in (204, 304))
                if unframed:
                    # "Not chunked" before the headers are written keeps httptools from adding the
                    # chunked coding; the body is then written as it comes.
                    cycle.chunked_encoding = False
            elif unframed and message["type"] == "http.response.body":
                # Its length check (for a declared Content-Length) sees each piece as the whole rest.
                cycle.expected_content_length = len(message.get("body", b""))
            await send(message)

        await app(scope, receive, send_unframed)

    return wrapped


def _make_protocol():
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

    probe = RequestResponseCycle.__init__.__code__.co_names
    if not (hasattr(HttpToolsProtocol, "_start_asgi_task")
            and {"chunked_encoding", "expected_content_length"} <= set(probe)):
        return None

    class Http10HttpToolsProtocol(HttpToolsProtocol):
        # Every request, pipelined or not, starts here with its cycle and the app.
        def _start_asgi_task(self, cycle, app):
            if cycle.scope.get("http_version") == "1.0":
                app = _unframed(app, cycle)
            super()._start_asgi_task(cycle, app)

    return Http10HttpToolsProtocol


def http_protocol():
    """The `http` argument for uvicorn.Config: a protocol class, or "h11"."""
    try:
        protocol = _make_protocol()
    except ImportError:  # no httptools: uvicorn's h11 protocol frames HTTP/1.0 correctly itself
        return "h11"
    if protocol is None:
        logger.warning("this uvicorn's httptools protocol is not the one splitserve adapts for HTTP/1.0 "
                       "clients; using the h11 protocol")
        return "h11"
    return protocol

"""The HTTP server's own options (`splitserve serve`), generated into flags like the engine's.

Kept apart from api_server.py so that building the CLI's parser (and `--help`) imports no web stack.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from splitserve.arg_utils import CliOptions, option
from splitserve.entrypoints.openai.body_limit import DEFAULT_MAX_BODY_BYTES

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass
class ServerArgs(CliOptions):
    host: str = option("127.0.0.1", help="address to bind")
    port: int = option(8000, help="port to bind")
    # Read when the parser is built or the object made, not at import: tests set it per process.
    # Its value is never printed in --help.
    api_key: str | None = option(
        default_factory=lambda: os.environ.get("SPLITSERVE_API_KEY"),
        default_text="$SPLITSERVE_API_KEY, else no key",
        help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize")
    max_queued_requests: int | None = option(
        None, default_text="no limit", help="answer 503 once this many requests wait for the engine")
    max_request_body_bytes: int = option(
        DEFAULT_MAX_BODY_BYTES, help="answer 413 to a request body larger than this")
    drain_timeout: float = option(30.0, help="seconds to let in-flight requests finish after SIGTERM")
    log_level: str = option("info", choices=LOG_LEVELS, help="uvicorn's log level")
    disable_access_log: bool = option(False, help="do not log each HTTP request")
    stream_interval: int = option(
        1, metavar="N", help="stream a running request's tokens in events of N (a request's last event may hold fewer)")

    def __post_init__(self) -> None:
        # Flag names in the messages: these objects are made from the command line.
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got {self.max_queued_requests}")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"--max-request-body-bytes must be >= 1, got {self.max_request_body_bytes}")
        if self.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {self.drain_timeout}")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")

    @classmethod
    def cli_title(cls) -> str:
        return "server options"

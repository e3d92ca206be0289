"""The HTTP server's own options (`splitserve serve`), generated into flags like the engine's.

Kept apart from api_server.py so that building the CLI's parser (and `--help`) imports no web stack.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from splitserve.arg_utils import CliOptions, option
from splitserve.entrypoints.openai.body_limit import DEFAULT_MAX_BODY_BYTES

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
METRICS_COMPAT = ("vllm",)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral")  # tool_parsers.PARSERS, without importing it


def _api_key_from_env() -> str | None:
    return os.environ.get("SPLITSERVE_API_KEY") or os.environ.get("VLLM_API_KEY") or None


def _json_list(name: str, values: list[str]) -> list[str]:
    """vLLM takes these lists as one JSON array (`--allowed-origins '["http://a"]'`); a plain list of
    words (`--allowed-origins http://a http://b`) works too."""
    if len(values) == 1 and values[0].lstrip().startswith("["):
        try:
            parsed = json.loads(values[0])
        except ValueError as e:
            raise ValueError(f"{name}: not a JSON array of strings: {e}") from None
        if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
            raise ValueError(f"{name}: not a JSON array of strings: {values[0]}")
        return parsed
    return list(values)


@dataclass
class ServerArgs(CliOptions):
    host: str = option("127.0.0.1", help="address to bind")
    port: int = option(8000, help="port to bind")
    # Read when the parser is built or the object made, not at import: tests set it per process.
    # Its value is never printed in --help.
    api_key: str | None = option(
        default_factory=_api_key_from_env,
        default_text="$SPLITSERVE_API_KEY, else $VLLM_API_KEY, else no key",
        help="require `Authorization: Bearer KEY` on /v1/*, /tokenize and /detokenize")
    max_queued_requests: int | None = option(
        None, default_text="no limit", help="answer 503 once this many requests wait for the engine")
    max_request_body_bytes: int = option(
        DEFAULT_MAX_BODY_BYTES, help="answer 413 to a request body larger than this")
    drain_timeout: float = option(30.0, help="seconds to let in-flight requests finish after SIGTERM")
    log_level: str = option("info", choices=LOG_LEVELS, aliases=("--uvicorn-log-level",),
                            help="uvicorn's log level (also as --uvicorn-log-level)")
    disable_access_log: bool = option(False, aliases=("--disable-uvicorn-access-log",),
                                      help="do not log each HTTP request (also as --disable-uvicorn-access-log)")
    enable_log_requests: bool = option(
        False, negative_aliases=("--disable-log-requests",),
        help="log each request's id, prompt length and sampling parameters (never its text)")
    disable_log_stats: bool = option(False, help="no periodic line of throughput, running/waiting and KV usage")
    chat_template: str | None = option(
        None, metavar="FILE|TEMPLATE", default_text="the tokenizer's",
        help="a Jinja chat template, as a file or inline, instead of the tokenizer's")
    allowed_origins: list[str] = option(
        default_factory=lambda: ["*"], help="CORS: origins a browser may call from (a JSON array or words)")
    allowed_methods: list[str] = option(
        default_factory=lambda: ["*"], help="CORS: allowed HTTP methods (a JSON array or words)")
    allowed_headers: list[str] = option(
        default_factory=lambda: ["*"], help="CORS: allowed request headers (a JSON array or words)")
    allow_credentials: bool = option(False, help="CORS: allow cookies and credentials")
    disable_fastapi_docs: bool = option(False, help="no /docs, /redoc and /openapi.json")
    enable_server_load_tracking: bool = option(
        False, help="accepted for vLLM's command lines: /load always answers here")
    metrics_compat: str | None = option(
        None, choices=METRICS_COMPAT, default_text="none",
        help="vllm: /metrics also answers every splitserve: metric under its vllm: name (dashboards)")
    enable_auto_tool_choice: bool = option(
        False, help='let the model choose to call tools (tool_choice "auto"); needs --tool-call-parser')
    tool_call_parser: str | None = option(
        None, choices=TOOL_CALL_PARSERS, default_text="none",
        help="the tool-call format the model writes, read out of its answers for tool_choice auto")
    stream_interval: int = option(
        1, metavar="N", help="stream a running request's tokens in events of N (a request's last event may hold fewer)")

    def __post_init__(self) -> None:
        # Flag names in the messages: these objects are made from the command line.
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            setattr(self, name, _json_list(f"--{name.replace('_', '-')}", getattr(self, name)))
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got {self.max_queued_requests}")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"--max-request-body-bytes must be >= 1, got {self.max_request_body_bytes}")
        if self.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {self.drain_timeout}")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser "
                             f"({', '.join(TOOL_CALL_PARSERS)})")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")

    @classmethod
    def cli_title(cls) -> str:
        return "server options"

"""`splitserve router`: start vLLM's Rust router (`vllm-router`) in front of splitserve servers.

Why a launcher and not a router of our own: `vllm-router` already does what the issue asks, measured
against two `splitserve serve` processes (DESIGN.md, "Router"): cache-aware routing on an approximate
prefix tree that yields to load, least-load, round robin; health checks that drop a dead worker and take
it back when it answers again; SSE passed through chunk by chunk; Prometheus metrics; and vLLM's
prefill/decode protocol (`kv_transfer_params`). `sglang-router` does the first part as well but speaks
SGLang's bootstrap protocol for prefill/decode, not vLLM's.

This module maps splitserve's few flags onto vllm-router's, with defaults chosen for a small fleet
(health checks every few seconds rather than every minute), and replaces this process with the router
(`os.execv`), so the PID a caller holds is the router's and signals reach it directly. Any flag not
known here is handed to vllm-router unchanged (it rejects what it does not know).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys

# splitserve's policy names → vllm-router's. In plain mode `least_load` is vllm-router's cache_aware
# with its thresholds set so that load always decides (LEAST_LOAD_FLAGS): its power_of_two, measured
# (tests/router/), does not see the router's own streams in flight and follows the workers' /get_load,
# polled every 5 s, so a burst lands on one worker. In prefill/decode mode those thresholds would also
# switch off the prefill side's prefix affinity, so there decode's least_load is power_of_two (the API
# server answers /get_load for it).
POLICIES = {"cache_aware": "cache_aware", "least_load": "power_of_two", "round_robin": "round_robin"}
# A prefix match never beats the threshold (rates are ≤ 1.0), and any difference in load is an imbalance:
# every request goes to a worker with the fewest requests in flight through the router.
LEAST_LOAD_FLAGS = ["--cache-threshold", "1.0", "--balance-abs-threshold", "0", "--balance-rel-threshold", "1.0"]
ROUTER_MODULE = "vllm_router.launch_router"
INSTALL_HINT = "`splitserve router` runs vLLM's router: pip install 'splitserve[router]' (the vllm-router package)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="splitserve router",
        description="One OpenAI-compatible endpoint in front of many servers (vLLM's Rust router, vllm-router). "
                    "Flags not listed here are passed to vllm-router as they are (see `vllm-router --help`).")
    p.add_argument("--worker-urls", nargs="+", default=[], metavar="URL",
                   help="the servers to route to, e.g. http://127.0.0.1:8001 http://127.0.0.1:8002")
    p.add_argument("--policy", choices=sorted(POLICIES), default="cache_aware",
                   help="cache_aware: prefix affinity over the request text, yielding to load when the workers "
                        "are out of balance; least_load: fewest requests in flight; round_robin (default: cache_aware)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port to bind (default: 30000)")
    p.add_argument("--metrics-port", type=int, default=29000,
                   help="port of the router's own Prometheus /metrics (default: 29000)")
    p.add_argument("--health-check-interval-s", type=int, default=5,
                   help="seconds between health checks of each worker's /health; a worker that fails "
                        "--health-failure-threshold checks in a row is taken out, one that passes again is "
                        "taken back (default: 5)")
    p.add_argument("--health-failure-threshold", type=int, default=2,
                   help="failed health checks in a row that take a worker out (default: 2)")
    p.add_argument("--pd", action="store_true",
                   help="prefill/decode disaggregation with vLLM's protocol: each request goes to a --prefill "
                        "server with max_tokens=1 and kv_transfer_params.do_remote_decode, then to a --decode "
                        "server with the kv_transfer_params the prefill returned; the answer streams from decode")
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill servers (with --pd)")
    p.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode servers (with --pd)")
    p.add_argument("--prefill-policy", choices=sorted(POLICIES), default="cache_aware",
                   help="how a prefill server is chosen (default: cache_aware, prefix affinity)")
    p.add_argument("--decode-policy", choices=sorted(POLICIES), default="least_load",
                   help="how a decode server is chosen (default: least_load)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    p.add_argument("--print-command", action="store_true",
                   help="print the vllm-router command line and exit, starting nothing")
    return p


def policy_for(policy: str, urls: list[str]) -> str:
    """vllm-router's policy for a pool. Its power-of-two refuses a pool of one worker; with one worker
    every policy picks the same one, so least_load becomes round_robin there."""
    if policy == "least_load" and len(urls) == 1:
        return "round_robin"
    return POLICIES[policy]


def _check_urls(flag: str, urls: list[str]) -> None:
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{flag}: {url!r} is not an http:// or https:// URL")
    if len(set(urls)) != len(urls):
        raise ValueError(f"{flag}: a URL is given twice")


def router_argv(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """vllm-router's command-line arguments for splitserve's (a ValueError for a bad combination)."""
    if args.pd:
        if not args.prefill or not args.decode:
            raise ValueError("--pd needs at least one --prefill URL and one --decode URL")
        if args.worker_urls:
            raise ValueError("--worker-urls is for the plain mode; with --pd give --prefill and --decode")
        _check_urls("--prefill", args.prefill)
        _check_urls("--decode", args.decode)
    else:
        if args.prefill or args.decode:
            raise ValueError("--prefill / --decode need --pd")
        if not args.worker_urls:
            raise ValueError("give the servers to route to: --worker-urls URL [URL ...]")
        _check_urls("--worker-urls", args.worker_urls)
    if args.metrics_port == args.port:
        raise ValueError(f"--metrics-port must differ from --port ({args.port})")
    if args.health_check_interval_s < 1 or args.health_failure_threshold < 1:
        raise ValueError("--health-check-interval-s and --health-failure-threshold must be at least 1")

    argv = ["--host", args.host, "--port", str(args.port),
            "--prometheus-host", args.host, "--prometheus-port", str(args.metrics_port),
            "--health-check-interval-secs", str(args.health_check_interval_s),
            "--health-failure-threshold", str(args.health_failure_threshold),
            # one good check brings a worker back (vllm-router's default asks for two)
            "--health-success-threshold", "1",
            # at start the router waits until a worker answers; look every second, not every 30 s
            "--worker-startup-check-interval", "1",
            "--log-level", args.log_level]
    if args.pd:
        argv += ["--vllm-pd-disaggregation",
                 "--prefill-policy", policy_for(args.prefill_policy, args.prefill),
                 "--decode-policy", policy_for(args.decode_policy, args.decode)]
        for url in args.prefill:  # vllm-router takes `--prefill URL [BOOTSTRAP_PORT]` once per server
            argv += ["--prefill", url]
        for url in args.decode:
            argv += ["--decode", url]
    else:
        policy = policy_for(args.policy, args.worker_urls)
        if policy == "power_of_two":
            argv += ["--policy", "cache_aware", *LEAST_LOAD_FLAGS]
        else:
            argv += ["--policy", policy]
        argv += ["--worker-urls", *args.worker_urls]
    return argv + extra


def check_ports_free(host: str, ports: list[int]) -> None:
    """A port already taken is a one-line error here, not a Rust panic with a backtrace after the exec."""
    for port in ports:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                raise ValueError(f"cannot bind {host}:{port}: {e.strerror}") from None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        command = [sys.executable, "-m", ROUTER_MODULE, *router_argv(args, extra)]
    except ValueError as e:
        print(f"splitserve router: error: {e}", file=sys.stderr)
        return 2
    if args.print_command:
        print(" ".join(command))
        return 0
    try:
        check_ports_free(args.host, [args.port, args.metrics_port])
    except ValueError as e:
        print(f"splitserve router: error: {e}", file=sys.stderr)
        return 2
    if importlib.util.find_spec("vllm_router") is None:
        print(f"splitserve router: error: {INSTALL_HINT}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command)  # does not return: this process becomes the router
    return 0  # pragma: no cover

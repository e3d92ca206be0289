"""`splitserve router`'s flags → vllm-router's command line (no process started)."""
from __future__ import annotations

import pytest

from splitserve.entrypoints.router import launcher


def argv_for(*flags: str) -> list[str]:
    args, extra = launcher.build_parser().parse_known_args(list(flags))
    return launcher.router_argv(args, extra)


def value_after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("ours, theirs", [("cache_aware", "cache_aware"), ("round_robin", "round_robin")])
def test_policies_map_onto_vllm_routers(ours, theirs):
    argv = argv_for("--worker-urls", "http://a:1", "http://b:2", "--policy", ours)
    assert value_after(argv, "--policy") == theirs and "--cache-threshold" not in argv
    assert argv[argv.index("--worker-urls") + 1: argv.index("--worker-urls") + 3] == ["http://a:1", "http://b:2"]


def test_least_load_is_cache_aware_where_load_always_decides():
    argv = argv_for("--worker-urls", "http://a:1", "http://b:2", "--policy", "least_load")
    assert value_after(argv, "--policy") == "cache_aware"
    assert value_after(argv, "--cache-threshold") == "1.0"           # no prefix match ever wins
    assert value_after(argv, "--balance-abs-threshold") == "0"       # any load difference rebalances
    assert value_after(argv, "--balance-rel-threshold") == "1.0"
    # one worker: nothing to balance
    assert value_after(argv_for("--worker-urls", "http://a:1", "--policy", "least_load"), "--policy") == "round_robin"


def test_defaults_check_health_often_and_serve_metrics_on_their_own_port():
    argv = argv_for("--worker-urls", "http://a:1", "--port", "8000")
    assert value_after(argv, "--policy") == "cache_aware"
    assert value_after(argv, "--port") == "8000" and value_after(argv, "--prometheus-port") == "29000"
    assert value_after(argv, "--health-check-interval-secs") == "5"
    assert value_after(argv, "--health-success-threshold") == "1"
    assert value_after(argv, "--worker-startup-check-interval") == "1"
    assert "--vllm-pd-disaggregation" not in argv


def test_unknown_flags_go_to_vllm_router_unchanged():
    argv = argv_for("--worker-urls", "http://a:1", "--cache-threshold", "0.5", "--disable-retries")
    assert argv[-3:] == ["--cache-threshold", "0.5", "--disable-retries"]


def test_pd_mode_names_each_server_and_picks_prefill_by_prefix_decode_by_load():
    argv = argv_for("--pd", "--prefill", "http://p1:1", "http://p2:2", "--decode", "http://d1:3")
    assert "--vllm-pd-disaggregation" in argv and "--worker-urls" not in argv
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--prefill"] == ["http://p1:1", "http://p2:2"]
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--decode"] == ["http://d1:3"]
    assert value_after(argv, "--prefill-policy") == "cache_aware"
    assert value_after(argv, "--decode-policy") == "round_robin"  # one decode server: nothing to compare
    argv = argv_for("--pd", "--prefill", "http://p1:1", "--decode", "http://d1:3", "http://d2:4")
    assert value_after(argv, "--decode-policy") == "power_of_two"


@pytest.mark.parametrize("flags, message", [
    ((), "--worker-urls URL"),
    (("--worker-urls", "a:1"), "not an http"),
    (("--worker-urls", "http://a:1", "http://a:1"), "given twice"),
    (("--pd", "--prefill", "http://p:1"), "at least one --prefill URL and one --decode URL"),
    (("--pd", "--prefill", "http://p:1", "--decode", "http://d:1", "--worker-urls", "http://w:1"), "plain mode"),
    (("--worker-urls", "http://a:1", "--decode", "http://d:1"), "need --pd"),
    (("--worker-urls", "http://a:1", "--port", "9", "--metrics-port", "9"), "must differ"),
])
def test_bad_flags_are_one_clear_error(flags, message):
    with pytest.raises(ValueError, match=message):
        argv_for(*flags)


def test_cli_reports_errors_in_one_line_and_prints_the_command(capsys):
    from splitserve.entrypoints.cli import main
    assert main(["router"]) == 2
    assert "--worker-urls" in capsys.readouterr().err
    assert main(["router", "--worker-urls", "http://a:1", "--print-command"]) == 0
    out = capsys.readouterr().out
    assert "-m vllm_router.launch_router" in out and "--worker-urls http://a:1" in out


def test_a_port_in_use_is_refused_before_the_router_starts(capsys):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        assert launcher.main(["--worker-urls", "http://a:1", "--port", str(busy)]) == 2
    assert f"cannot bind 127.0.0.1:{busy}" in capsys.readouterr().err


def test_the_router_package_imports_nothing_of_the_engine():
    import ast
    from pathlib import Path
    for path in Path(launcher.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("splitserve"), f"{path.name} imports {node.module}"
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("splitserve") for a in node.names), path.name

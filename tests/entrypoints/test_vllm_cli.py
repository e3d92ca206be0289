"""vLLM's command-line spellings: the options splitserve shares with vLLM parse as vLLM's do, and the
ones it lacks end in one line naming the flag (exit 2), not argparse's usage dump. CPU, no model."""
from __future__ import annotations

import argparse
import logging

import pytest

from splitserve.engine.args import EngineArgs
from splitserve.entrypoints import cli
from splitserve.entrypoints.openai.server_args import ServerArgs
from splitserve.engine.vllm_flags import VLLM_FLAGS, find_unsupported


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def engine_args(argv: list[str]) -> EngineArgs:
    return EngineArgs.from_namespace(serve_parser().parse_args(argv))


def server_args(argv: list[str]) -> ServerArgs:
    return ServerArgs.from_namespace(serve_parser().parse_args(argv))


def test_model_as_positional_or_option():
    assert engine_args(["/m"]).model == "/m"
    assert engine_args(["--model", "/m"]).model == "/m"
    assert engine_args(["--model=/m"]).model == "/m"
    assert engine_args(["/m", "--model", "/m"]).model == "/m"  # the same twice is fine
    assert engine_args([]).model is None
    with pytest.raises(ValueError, match="model given twice"):
        engine_args(["/a", "--model", "/b"])


def test_served_model_name_takes_several_names_and_leaves_the_model():
    a = engine_args(["/path/to/model", "--served-model-name", "a", "b"])
    assert a.model == "/path/to/model" and a.served_model_name == ["a", "b"]
    a = engine_args(["--served-model-name", "a", "b", "--model", "/path/to/model"])
    assert a.model == "/path/to/model" and a.served_model_name == ["a", "b"]
    assert engine_args(["m", "--served-model-name", "x"]).served_model_name == ["x"]
    assert EngineArgs(served_model_name="x").served_model_name == ["x"]  # LLM(served_model_name="x")
    assert engine_args(["m"]).served_model_name is None


@pytest.mark.parametrize("argv, field, value", [
    (["--dtype", "half"], "dtype", "half"),
    (["--dtype", "float"], "dtype", "float"),
    (["--seed", "7"], "seed", 7),
    (["--tokenizer", "/tok"], "tokenizer", "/tok"),
    (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
    (["--enable-prefix-caching"], "enable_prefix_caching", True),
    (["--generation-config", "vllm"], "generation_config", "vllm"),
    (["--override-generation-config", '{"temperature": 0.5}'], "override_generation_config", '{"temperature": 0.5}'),
    (["--num-gpu-blocks-override", "64"], "num_blocks", 64),
])
def test_engine_flags_with_vllm_names(argv, field, value):
    assert getattr(engine_args(argv), field) == value


@pytest.mark.parametrize("argv, field, value", [
    (["--uvicorn-log-level", "warning"], "log_level", "warning"),
    (["--uvicorn-log-level", "trace"], "log_level", "trace"),
    (["--disable-uvicorn-access-log"], "disable_access_log", True),
    (["--disable-log-requests"], "enable_log_requests", False),
    (["--enable-log-requests"], "enable_log_requests", True),
    (["--disable-log-stats"], "disable_log_stats", True),
    (["--chat-template", "/t.jinja"], "chat_template", "/t.jinja"),
    (["--allowed-origins", '["http://a.example", "http://b.example"]'], "allowed_origins",
     ["http://a.example", "http://b.example"]),
    (["--allowed-origins", "http://a.example", "http://b.example"], "allowed_origins",
     ["http://a.example", "http://b.example"]),
    (["--allowed-methods", '["GET"]'], "allowed_methods", ["GET"]),
    (["--allowed-headers", '["X-A"]'], "allowed_headers", ["X-A"]),
    (["--allow-credentials"], "allow_credentials", True),
    (["--metrics-compat", "vllm"], "metrics_compat", "vllm"),
    (["--disable-fastapi-docs"], "disable_fastapi_docs", True),
])
def test_server_flags_with_vllm_names(argv, field, value):
    assert getattr(server_args(argv), field) == value


def test_cors_defaults_are_vllms_and_bad_json_is_refused():
    a = server_args([])
    assert (a.allowed_origins, a.allowed_methods, a.allowed_headers, a.allow_credentials) == (["*"], ["*"], ["*"], False)
    with pytest.raises(ValueError, match="--allowed-origins: not a JSON array"):
        server_args(["--allowed-origins", '["http://a", 3]'])
    with pytest.raises(ValueError, match="--allowed-origins: not a JSON array"):
        server_args(["--allowed-origins", "[not json"])


@pytest.mark.parametrize("env", [{"SPLITSERVE_API_KEY": "k1"}, {"VLLM_API_KEY": "k2"},
                                 {"SPLITSERVE_API_KEY": "k1", "VLLM_API_KEY": "k2"}])
def test_api_key_from_either_environment_variable(env, monkeypatch):
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    parser = serve_parser()
    expected = env.get("SPLITSERVE_API_KEY") or env["VLLM_API_KEY"]  # splitserve's own name first
    assert ServerArgs.from_namespace(parser.parse_args([])).api_key == expected
    assert ServerArgs.from_namespace(parser.parse_args(["--api-key", "flag"])).api_key == "flag"
    assert expected not in parser.format_help()


def test_version(capsys):
    from splitserve import __version__
    for argv in (["--version"], ["serve", "--version"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0
        assert capsys.readouterr().out.strip() == f"splitserve {__version__}"


@pytest.mark.parametrize("argv, flag", [
    (["serve", "m", "--data-parallel-rank", "2"], "--data-parallel-rank"),
    (["serve", "m", "-dpl", "2"], "-dpl"),
    (["serve", "m", "--trust-remote-code"], "--trust-remote-code"),
    (["serve", "m", "--max-logprobs=5"], "--max-logprobs"),
    (["serve", "m", "--no-enable-chunked-prefill"], "--no-enable-chunked-prefill"),
    (["serve", "m", "--max-model-len", "64", "--kv-events-config", "{}"], "--kv-events-config"),
    (["generate", "--prompt", "x", "--enable-expert-parallel"], "--enable-expert-parallel"),
    (["bench", "throughput", "m", "--enable-eplb"], "--enable-eplb"),
])
def test_unsupported_vllm_flag_is_one_line_and_exit_2(argv, flag, capsys):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert lines == [f"splitserve {' '.join(a for a in argv[:2] if a in ('serve', 'generate', 'bench', 'throughput'))}: "
                     f"error: {flag} is a vLLM option splitserve does not support"], err


def test_unknown_non_vllm_flag_still_gets_argparses_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "m", "--no-such-flag-anywhere"])
    assert e.value.code == 2
    assert "unrecognized arguments: --no-such-flag-anywhere" in capsys.readouterr().err


def test_no_vllm_flag_that_splitserve_has_is_reported():
    """The table holds vLLM's flags, supported or not: each one the serve parser knows parses."""
    parser = serve_parser()
    known = set(parser._option_string_actions) & VLLM_FLAGS
    assert {"--model", "--served-model-name", "--max-model-len", "--gpu-memory-utilization", "--seed",
            "--enable-prefix-caching", "--chat-template", "--generation-config", "--api-key", "--dtype",
            "--tokenizer", "--allowed-origins", "--uvicorn-log-level", "--disable-log-requests"} <= known
    for flag in known:
        assert find_unsupported(cli.build_parser(), ["serve", "m", flag]) is None, flag


def test_a_vllm_keyword_of_llm_names_it():
    from splitserve.engine.llm import LLM
    with pytest.raises(TypeError, match="data_parallel_rank is a vLLM option splitserve does not support"):
        LLM("/no/such/model", data_parallel_rank=2)


def test_device_cuda_without_a_gpu_is_one_line(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cli.main(["generate", "--prompt", "x", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --device cuda: no CUDA GPU is visible") and "\n" not in err, err


def test_httpx_request_lines_are_not_logged():
    """The bench client sends thousands of requests; httpx logs each one at INFO unless told not to."""
    logging.getLogger("httpx").setLevel(logging.NOTSET)
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert logging.getLogger("httpx").getEffectiveLevel() == logging.WARNING


def test_every_option_has_help_and_a_default_in_generate_and_chat():
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in ("generate", "chat"):
        for action in sub.choices[name]._actions:
            if action.option_strings and action.dest not in ("help", "prompt") and action.default is not argparse.SUPPRESS:
                assert action.help and "default" in action.help, (name, action.dest)

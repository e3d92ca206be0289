"""The options generated from EngineArgs / ServerArgs / MediaArgs: flags, help, defaults, round trips,
the `--no-` forms, the old spellings, and the offline API's keyword check. CPU only, no model."""
from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import typing

import pytest

from splitserve.arg_utils import CliOptions, _base_type, flag_name, option
from splitserve.engine.args import EngineArgs
from splitserve.entrypoints import cli
from splitserve.entrypoints.openai.server_args import ServerArgs
from splitserve.multimodal.media import MediaArgs, MediaPolicy

ALL = (EngineArgs, ServerArgs, MediaArgs)


def serve_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def parse_serve(argv: list[str]) -> argparse.Namespace:
    return serve_parser().parse_args(argv)


def action_for(parser: argparse.ArgumentParser, name: str) -> argparse.Action:
    return next(a for a in parser._actions if a.dest == name and a.default is not argparse.SUPPRESS)


def other_value(cls, f: dataclasses.Field):
    """A value of the field's type that differs from its default, and the argv that sets it."""
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    kind, is_list = _base_type(typing.get_type_hints(cls)[f.name])
    flag = flag_name(f.name)
    if kind is bool:
        value = not default if default is not None else False
        return value, [flag if value else "--no-" + flag[2:]]
    if f.metadata["choices"]:
        value = next(c for c in f.metadata["choices"] if c != default)
    elif is_list:
        value = ["a.example", "b.example"]
        return value, [flag, *value]
    elif kind is int:
        value = (default or 0) + 3
    elif kind is float:
        value = 0.25 if default != 0.25 else 0.5
    else:
        value = f"some-{f.name}"
    argv = [str(value)] if f.metadata["positional"] else [flag, str(value)]
    return value, argv


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_every_field_is_an_option_with_help_and_default(cls):
    parser = serve_parser()
    text = parser.format_help()
    for f in dataclasses.fields(cls):
        action = action_for(parser, f.name)
        assert f.metadata["help"].strip(), f.name
        help_text = action.help % {"default": action.default}
        assert f.metadata["help"] in help_text and "(default: " in help_text, (f.name, help_text)
        shown = f.metadata["positional"] and f.name or flag_name(f.name)
        assert shown in action.option_strings or action.dest == shown, f.name
        assert shown in text, f.name


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_defaults_parse_to_the_dataclass_defaults(cls, monkeypatch):
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    assert cls.from_namespace(parse_serve([])) == cls()


# A field that is valid only together with others: its round trip sets them too.
# (field, value): the flag is given as str(value).
HOSTS = (("nnodes", 2), ("master_port", 29500), ("tensor_parallel_size", 2))
NEEDS = {"enable_auto_tool_choice": (("tool_call_parser", "hermes"),),
         "nnodes": HOSTS[1:], "node_rank": HOSTS}
# Values other than other_value's, where that one cannot be valid (the ranks must divide over the hosts).
VALUES = {"nnodes": 2, "node_rank": 1}


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_each_field_round_trips(cls):
    flags, positional, expected = [], [], {}
    for f in dataclasses.fields(cls):
        value, argv = other_value(cls, f)
        if f.name in VALUES:
            value, argv = VALUES[f.name], [flag_name(f.name), str(VALUES[f.name])]
        extra = {}
        for dep, dep_value in NEEDS.get(f.name, ()):
            extra[dep] = dep_value
        dep_argv = [a for dep, v in extra.items() for a in (f"--{dep.replace('_', '-')}", str(v))]
        got = cls.from_namespace(parse_serve(argv + dep_argv))
        assert getattr(got, f.name) == value, (f.name, argv)
        assert got == dataclasses.replace(cls(), **{f.name: value}, **extra), f.name
        (positional if f.metadata["positional"] else flags).extend(argv)
        expected[f.name] = value
    # All at once (the positional first: a list option would take what follows it as its values).
    assert cls.from_namespace(parse_serve(positional + flags)) == cls(**expected)


def test_boolean_no_forms_and_the_old_spelling():
    def caching(argv):
        return EngineArgs.from_namespace(parse_serve(argv)).enable_prefix_caching
    assert caching([]) is True
    assert caching(["--no-enable-prefix-caching"]) is False
    assert caching(["--no-prefix-caching"]) is False  # the spelling before the generator
    assert caching(["--no-prefix-caching", "--enable-prefix-caching"]) is True  # last one wins

    def async_sched(argv):
        return EngineArgs.from_namespace(parse_serve(argv)).async_scheduling
    assert async_sched([]) is None  # undecided: the engine picks (on with CUDA)
    assert async_sched(["--async-scheduling"]) is True
    assert async_sched(["--no-async-scheduling"]) is False

    # A switch that is off by default has no --no- form.
    with pytest.raises(SystemExit):
        parse_serve(["--no-enforce-eager"])


def test_flags_that_tests_and_benchmarks_use_still_parse():
    argv = ["cfg-dir", "--max-model-len", "2048", "--max-num-seqs", "8", "--disable-access-log",
            "--max-queued-requests", "3", "--drain-timeout", "5", "--served-model-name", "m", "--host", "0.0.0.0",
            "--port", "8011", "--api-key", "k", "--limit-mm-per-prompt", "image=2",
            "--allowed-local-media-path", "/tmp", "--max-request-body-bytes", "1000", "--random-weights",
            "--dtype", "bfloat16", "--num-blocks", "64", "--enforce-eager", "--device", "cpu", "--block-size", "32",
            "--max-num-batched-tokens", "512", "--no-prefix-caching", "--attention-backend", "torch_ref",
            "--gpu-memory-utilization", "0.5", "--log-level", "debug", "--stream-interval", "4",
            "--media-fetch-timeout", "2", "--allowed-media-domains", "a.example"]
    ns = parse_serve(argv)
    assert EngineArgs.from_namespace(ns) == EngineArgs(
        model="cfg-dir", dtype="bfloat16", device="cpu", max_model_len=2048, max_num_seqs=8,
        max_num_batched_tokens=512, block_size=32, num_blocks=64, gpu_memory_utilization=0.5,
        enable_prefix_caching=False, attention_backend="torch_ref", enforce_eager=True, random_weights=True,
        served_model_name="m")
    assert ServerArgs.from_namespace(ns) == ServerArgs(
        host="0.0.0.0", port=8011, api_key="k", max_queued_requests=3, max_request_body_bytes=1000,
        drain_timeout=5.0, log_level="debug", disable_access_log=True, stream_interval=4)
    policy = MediaPolicy.from_args(ns)
    assert policy.limit_per_prompt == 2 and policy.allowed_media_domains == ("a.example",)
    assert policy.fetch_timeout_s == 2.0


def test_bad_choice_is_refused():
    with pytest.raises(SystemExit):
        parse_serve(["--dtype", "int4"])
    with pytest.raises(SystemExit):
        parse_serve(["--max-num-seqs", "many"])
    with pytest.raises(SystemExit):
        parse_serve(["--kv-cache-dtype", "fp8_e5m2"])


@pytest.mark.parametrize("value", ["fp8", "fp8_e4m3", "auto"])
def test_kv_cache_dtype_parses(value):
    assert EngineArgs.from_namespace(parse_serve(["--kv-cache-dtype", value])).kv_cache_dtype == value
    assert EngineArgs.from_namespace(parse_serve([])).kv_cache_dtype == "auto"


@pytest.mark.parametrize("value", ["fp8_e5m2", "int8", "bfloat16", ""])
def test_unsupported_kv_cache_dtype_is_a_clear_error(value):
    from splitserve import LLM
    from splitserve.config import CacheConfig
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, fp8, fp8_e4m3, got"):
        LLM("/no/such/model", kv_cache_dtype=value)  # refused before the model is looked up
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, fp8, fp8_e4m3"):
        CacheConfig(kv_cache_dtype=value)


@pytest.mark.parametrize("argv, message", [
    (["--max-queued-requests", "0"], "--max-queued-requests must be >= 1"),
    (["--max-request-body-bytes", "0"], "--max-request-body-bytes must be >= 1"),
    (["--drain-timeout", "-1"], "--drain-timeout must be >= 0"),
    (["--stream-interval", "0"], "--stream-interval must be >= 1"),
    (["--port", "70000"], "--port must be in"),
])
def test_server_args_are_checked(argv, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs.from_namespace(parse_serve(argv))


def test_api_key_comes_from_the_environment_and_is_never_printed(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_API_KEY", "sekrit-123")
    parser = serve_parser()
    assert ServerArgs.from_namespace(parser.parse_args([])).api_key == "sekrit-123"
    assert ServerArgs().api_key == "sekrit-123"
    assert ServerArgs.from_namespace(parser.parse_args(["--api-key", "other"])).api_key == "other"
    assert "sekrit-123" not in parser.format_help()
    assert "$SPLITSERVE_API_KEY" in parser.format_help()


def test_media_policy_defaults_without_args():
    assert MediaPolicy.from_args(None) == MediaPolicy.from_args(parse_serve([]))


def test_serve_help_exits_0_and_lists_the_options(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--stream-interval", "--enable-prefix-caching", "--no-enable-prefix-caching",
                 "--no-prefix-caching", "--max-model-len", "--api-key", "--limit-mm-per-prompt"):
        assert flag in out, flag
    assert "(default: 8192)" in out  # --max-num-batched-tokens


def test_serve_help_needs_no_web_stack():
    """Building the parser imports the options only: `--help` stays fast and the server module is
    not imported to parse flags (that import once closed a cycle back into the CLI)."""
    code = ("import sys; from splitserve.entrypoints import cli; cli.build_parser(); "
            "bad = [m for m in ('fastapi', 'torch', 'splitserve.entrypoints.openai.api_server') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_bench_throughput_and_generate_take_the_engine_options():
    parser = cli.build_parser()
    ns = parser.parse_args(["bench", "throughput", "cfg", "--random-weights", "--no-prefix-caching",
                            "--input-len", "8", "--seed", "3"])
    # --seed is the engine's seed there too (and the prompts' seed of the benchmark)
    assert EngineArgs.from_namespace(ns) == EngineArgs(model="cfg", random_weights=True,
                                                       enable_prefix_caching=False, seed=3)
    ns = parser.parse_args(["generate", "--prompt", "hi", "--cpu-kv-cache-gib", "0.5"])
    assert EngineArgs.from_namespace(ns).cpu_kv_cache_gib == 0.5


def test_unknown_llm_keyword_names_it_and_the_valid_ones():
    from splitserve.engine.llm import LLM
    # The check comes before any model is resolved: a bad path would otherwise be the error.
    with pytest.raises(TypeError) as e:
        LLM("/no/such/model", blok_size=16)
    msg = str(e.value)
    assert "LLM()" in msg and "'blok_size'" in msg and "did you mean 'block_size'" in msg
    for f in dataclasses.fields(EngineArgs):
        assert f.name in msg
    with pytest.raises(TypeError, match="unknown keyword arguments 'foo', 'bar'"):
        EngineArgs.from_kwargs("LLM()", foo=1, bar=2)
    assert EngineArgs.from_kwargs("LLM()", model="m", num_blocks=4) == EngineArgs(model="m", num_blocks=4)


def test_a_field_without_help_is_refused():
    @dataclasses.dataclass
    class Bad(CliOptions):
        fine: int = option(1, help="documented")
        undocumented: int = 2
    with pytest.raises(TypeError, match="Bad.undocumented"):
        Bad.add_cli_args(argparse.ArgumentParser())


def test_help_with_a_percent_sign_is_escaped():
    @dataclasses.dataclass
    class Pct(CliOptions):
        share: float = option(0.9, help="use 90% of it")
    p = argparse.ArgumentParser()
    Pct.add_cli_args(p)
    assert "use 90% of it (default: 0.9)" in " ".join(p.format_help().split())


def test_quantization_flag_takes_vllm_names():
    assert EngineArgs.from_namespace(parse_serve([])).quantization is None  # from the checkpoint
    assert EngineArgs.from_namespace(parse_serve(["--quantization", "fp8"])).quantization == "fp8"
    assert EngineArgs.from_namespace(parse_serve(["--quantization", "compressed-tensors"])).quantization == \
        "compressed-tensors"
    with pytest.raises(SystemExit):
        parse_serve(["--quantization", "int3"])
    assert "--quantization" in serve_parser().format_help()

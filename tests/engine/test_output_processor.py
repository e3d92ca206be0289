"""The front's output processor on a character tokenizer (token id = character code): stop strings
found across tokens and held back while they may still match, n > 1 fan-in, the stream interval,
aborts and a failing sample failing its siblings. Exact outputs."""
import pytest

from splitserve.protocol.core_messages import EngineCoreOutput
from splitserve.engine.output_processor import OutputProcessor, RequestState
from splitserve.sampling_params import SamplingParams


class CharTokenizer:
    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0))


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def make(params: SamplingParams, request_id: str = "r", stream_interval: int = 1, stream: bool = True):
    proc = OutputProcessor(CharTokenizer(), stream_interval)
    proc.add_request(RequestState(request_id, "p", ids("p"), params, (0,), 0.0, proc.tokenizer, stream))
    return proc


def feed(proc, seq_id: str, text: str, finish: str | None = None):
    """One core output per character; returns every (outputs, drop) pair."""
    results = []
    for i, c in enumerate(text):
        last = i == len(text) - 1
        results.append(proc.process([EngineCoreOutput(seq_id, [ord(c)], finish_reason=finish if last else None)], 1.0))
    return results


def test_a_stop_string_across_tokens_is_held_back_then_cut():
    proc = make(SamplingParams(stop=["END"], max_tokens=50))
    results = feed(proc, "r", "abcENxEND!")
    deltas = [o[0].outputs[0].delta_text if o else None for o, _ in results]
    # "E" and "EN" might begin the stop string: held back (len("END") - 1 = 2 characters) until they cannot
    assert "".join(d for d in deltas if d) == "abcENx"
    final, drop = results[8]  # the token that completes "END"
    assert final[0].finished and final[0].outputs[0].finish_reason == "stop"
    assert final[0].outputs[0].stop_reason == "END" and final[0].outputs[0].text == "abcENx"
    assert drop == {"stop": ["r"]}  # the core must drop the sequence
    assert results[9] == ([], {})  # a late token of an ended request is ignored
    assert not proc.has_unfinished()


def test_include_stop_str_and_every_token_is_an_event():
    proc = make(SamplingParams(stop=["xy"], include_stop_str_in_output=True, max_tokens=50))
    results = feed(proc, "r", "abxy")
    # one output per token, even where the text is held back (delta_text empty)
    assert [len(o) for o, _ in results] == [1, 1, 1, 1]
    assert [o[0].outputs[0].delta_token_ids for o, _ in results] == [[97], [98], [120], [121]]
    assert results[-1][0][0].outputs[0].text == "abxy"


def test_n_samples_fan_in_and_the_request_ends_when_all_do():
    proc = make(SamplingParams(n=2, max_tokens=3, seed=7))
    out, _ = proc.process([EngineCoreOutput("r#0", [ord("a")]), EngineCoreOutput("r#1", [ord("x")])], 1.0)
    assert len(out) == 1 and [o.text for o in out[0].outputs] == ["a", "x"]
    out, _ = proc.process([EngineCoreOutput("r#0", [ord("b")], finish_reason="length")], 2.0)
    assert not out[0].finished and out[0].outputs[0].finish_reason == "length"
    out, _ = proc.process([EngineCoreOutput("r#1", [ord("y")], finish_reason="stop", stop_reason=5)], 3.0)
    assert out[0].finished and [(o.text, o.finish_reason) for o in out[0].outputs] == [("ab", "length"), ("xy", "stop")]
    assert out[0].first_token_time == 1.0


def test_stream_interval_coalesces_but_the_end_is_never_held():
    proc = make(SamplingParams(max_tokens=50), stream_interval=3)
    results = feed(proc, "r", "abcdefg", finish="length")
    emitted = [o[0].outputs[0].delta_text for o, _ in results if o]
    assert emitted == ["abc", "def", "g"]


def test_offline_requests_report_only_their_end():
    proc = make(SamplingParams(max_tokens=50), stream=False)
    results = feed(proc, "r", "abc", finish="length")
    assert [len(o) for o, _ in results] == [0, 0, 1] and results[-1][0][0].outputs[0].text == "abc"


def test_an_error_in_one_sample_fails_its_siblings():
    proc = make(SamplingParams(n=3, max_tokens=5))
    out, drop = proc.process([EngineCoreOutput("r#1", [], finish_reason="error")], 1.0)
    assert out[0].finished and {o.finish_reason for o in out[0].outputs} == {"error"}
    assert drop == {"abort": ["r#0", "r#2"]}


def test_abort_ends_the_request_and_names_its_sequences():
    proc = make(SamplingParams(n=2, max_tokens=5))
    proc.process([EngineCoreOutput("r#0", [ord("a")])], 1.0)
    final, seq_ids = proc.abort("r")
    assert final.finished and [o.finish_reason for o in final.outputs] == ["abort", "abort"]
    assert seq_ids == ["r#0", "r#1"] and proc.abort("r") == (None, [])


def test_duplicate_ids_and_bad_interval_are_refused():
    proc = make(SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        proc.add_request(RequestState("r", None, [1], SamplingParams(), (), 0.0, proc.tokenizer))
    with pytest.raises(ValueError, match="stream_interval"):
        OutputProcessor(CharTokenizer(), 0)

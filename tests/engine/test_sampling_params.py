import pytest

from splitserve.sampling_params import SamplingParams


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("frequency_penalty", -2.5),
    ("max_tokens", 0), ("min_tokens", -1), ("logprobs", 21), ("stop", [""]), ("stop_token_ids", [-1]),
    ("seed", "x"),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_over_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=3)


def test_normalisation_and_children():
    p = SamplingParams(stop="x", top_k=-1, seed=10, n=3, temperature=0.7)
    assert p.stop == ["x"] and p.top_k == 0 and not p.greedy
    kids = [p.for_child(i) for i in range(3)]
    assert [k.seed for k in kids] == [10, 11, 12] and all(k.n == 1 for k in kids)
    assert SamplingParams(temperature=0).greedy


def test_validated_once_from_the_front_to_the_worker(monkeypatch):
    """A request's params are checked where they are built; the front's changes, the n=2 fan-out, the
    core's decoding of the request and the worker's decoding of the step message check nothing again."""
    import msgspec

    from splitserve.protocol.core_messages import AddRequests, Codec, FrontToCore
    from splitserve.protocol.sched_output import NewRequestData, SchedulerOutput
    from splitserve.sampling_params import StructuredOutputsParams
    from tests.engine.test_async_engine import FakeFront

    calls = []
    for cls, name in ((SamplingParams, "_validate"), (StructuredOutputsParams, "_check")):
        original = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, _f=original, _n=cls.__name__: (calls.append(_n), _f(self))[1])
    params = SamplingParams(n=2, seed=7, temperature=0.5, max_tokens=4, stop_token_ids=[3, 5000],
                            bad_words=["ab"], structured_outputs={"regex": "a+"})
    assert calls == ["StructuredOutputsParams", "SamplingParams"]
    front = FakeFront(8)
    front.world_size, front.loras = 1, None
    _, sent = front.new_request("r", [1, 2, 3], params)
    core_side = Codec(FrontToCore).decode(Codec(FrontToCore).encode(AddRequests(sent))).requests
    step = SchedulerOutput(new_requests=[NewRequestData(r.request_id, r.prompt_token_ids, r.sampling_params, [0])
                                         for r in core_side])
    worker_side = Codec(SchedulerOutput).decode(msgspec.msgpack.encode(step)).new_requests
    assert calls == ["StructuredOutputsParams", "SamplingParams"]  # still the one check of each
    got = [w.sampling_params for w in worker_side]
    assert [(p.n, p.seed, p.stop_token_ids, p.structured_outputs.regex) for p in got] == [(1, 7, [3], "a+"),
                                                                                         (1, 8, [3], "a+")]


def test_errors_carry_their_field():
    """The field of a failed check is data on the error (no message parsing), and survives pickling."""
    import pickle

    from splitserve.sampling_params import SamplingParamsError
    for fields, param in [({"temperature": -1}, "temperature"), ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
                          ({"logit_bias": {"x": 1}}, "logit_bias"), ({"bad_words": [""]}, "bad_words"),
                          ({"structured_outputs": {}}, "structured_outputs")]:
        with pytest.raises(SamplingParamsError) as info:
            SamplingParams(**fields)
        assert info.value.param == param
    err = pickle.loads(pickle.dumps(SamplingParamsError("top_p", "bad top_p")))
    assert (type(err), err.param, str(err)) == (SamplingParamsError, "top_p", "bad top_p")
    p = SamplingParams(temperature=0.5)
    with pytest.raises(SamplingParamsError):  # replace_valid is for changes known to keep params valid;
        SamplingParams(**{**p.__dict__, "temperature": -1})  # a plain rebuild still checks
    assert p.replace_valid(seed=3).seed == 3 and p.seed is None

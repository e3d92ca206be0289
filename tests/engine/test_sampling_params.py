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

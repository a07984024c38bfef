import pytest

from jaxinfer.sampling_params import SamplingParams


def test_defaults():
    sp = SamplingParams()
    assert (sp.n, sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (1, 16, 1.0, 1.0, -1, 0.0)
    assert sp.stop == [] and sp.stop_token_ids == [] and sp.logit_bias is None and sp.logprobs is None
    assert sp.skip_special_tokens and not sp.ignore_eos and sp.spec_decode is None
    assert not sp.greedy and not sp.has_penalties


def test_normalisation():
    sp = SamplingParams(stop="###", stop_token_ids=(3, 4), logit_bias={"12": 5, 7: -100}, temperature=0)
    assert sp.stop == ["###"] and sp.stop_list() == ["###"] and sp.stop_token_ids == [3, 4]
    assert sp.logit_bias == {12: 5.0, 7: -100.0}
    assert sp.greedy
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(repetition_penalty=1.1).has_penalties


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 1.5), ("best_of", 0), ("max_tokens", 0), ("max_tokens", 2.0), ("min_tokens", -1),
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 2.5), ("min_p", 1.5), ("seed", 1.0), ("seed", "7"),
    ("stop", 3), ("stop", [""]), ("stop", ["a", 1]), ("stop_token_ids", [-1]), ("stop_token_ids", "12"),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0.0),
    ("logprobs", 21), ("logprobs", -1), ("logit_bias", {1: 101}), ("logit_bias", {"x": 1}),
    ("logit_bias", [1, 2]), ("ignore_eos", 1), ("skip_special_tokens", None), ("spec_decode", "yes"),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field if field != "logit_bias" else "logit_bias"):
        SamplingParams(**{field: value})


def test_cross_field_checks():
    with pytest.raises(ValueError, match="min_tokens=5 must be <= max_tokens=4"):
        SamplingParams(min_tokens=5, max_tokens=4)
    with pytest.raises(ValueError, match="best_of=1"):
        SamplingParams(n=2, best_of=1)
    SamplingParams(n=2, best_of=3, min_tokens=5, max_tokens=None, top_k=0, logprobs=0)


"""SamplingParams: defaults, normalisation, and errors that name field, value and range."""

import dataclasses

import pytest

from servelab.samplers import SAMPLING_EPS, SamplingParams


def test_defaults_leave_the_distribution_untouched():
    params = SamplingParams()
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (1.0, -1, 1.0, 0.0)
    assert not params.uses_penalties and not params.is_greedy
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=SAMPLING_EPS / 2).is_greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).is_greedy


def test_sequences_are_normalised_to_tuples_and_frozen():
    params = SamplingParams(stop="###", stop_token_ids=[5, 6], allowed_token_ids=[1], logit_bias={"7": 1})
    assert params.stop == ("###",)
    assert params.stop_token_ids == (5, 6)
    assert params.allowed_token_ids == (1,)
    assert params.logit_bias == {7: 1.0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"temperature": -0.1}, r"temperature=-0.1 must be in \[0.0, 3.40\d*e\+38\]"),
        ({"temperature": float("inf")}, r"temperature=inf must be"),
        ({"temperature": float("nan")}, r"temperature=nan must be"),
        ({"temperature": 1e39}, r"temperature=1e\+39 must be in \[0.0, 3.40"),
        ({"top_k": 0}, r"top_k=0 is invalid; valid: -1 \(disabled\) or >= 1"),
        ({"top_k": -2}, r"top_k=-2 must be >= -1"),
        ({"top_p": 0.0}, r"top_p=0.0 is invalid; valid: in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p=1.5 must be in \[0.0, 1.0\]"),
        ({"min_p": -0.01}, r"min_p=-0.01 must be in \[0.0, 1.0\]"),
        ({"min_p": 1.01}, r"min_p=1.01 must be"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty=0.0 is invalid; valid: finite and > 0"),
        ({"frequency_penalty": 2.5}, r"frequency_penalty=2.5 must be in \[-2.0, 2.0\]"),
        ({"presence_penalty": -2.1}, r"presence_penalty=-2.1 must be in \[-2.0, 2.0\]"),
        ({"seed": -1}, r"seed=-1 must be in \[0, 18446744073709551615\]"),
        ({"max_tokens": 0}, r"max_tokens=0 must be a positive integer \(>= 1\)"),
        ({"min_tokens": -1}, r"min_tokens=-1 must be >= 0"),
        ({"min_tokens": 5, "max_tokens": 4}, r"min_tokens = 5 exceeds max_tokens = 4"),
        ({"stop": ["ok", ""]}, r"stop\[1\] is an empty string"),
        ({"stop_token_ids": [3, -1]}, r"stop_token_ids\[1\]=-1 must be >= 0"),
        ({"logprobs": -1}, r"logprobs=-1 must be >= 0"),
        ({"logit_bias": {-3: 1.0}}, r"logit_bias key -3 is negative"),
        ({"logit_bias": {3: 101.0}}, r"logit_bias\[3\]=101.0 must be in \[-100.0, 100.0\]"),
        ({"allowed_token_ids": []}, r"allowed_token_ids is empty"),
        ({"allowed_token_ids": [-4]}, r"allowed_token_ids\[0\]=-4 must be >= 0"),
        ({"bad_words": [""]}, r"bad_words\[0\] is an empty string"),
        ({"bad_words_token_ids": [[1], []]}, r"bad_words_token_ids\[1\] is empty"),
        ({"bad_words_token_ids": [[1, -2]]}, r"bad_words_token_ids\[0\]\[1\]=-2 must be >= 0"),
    ],
)
def test_invalid_values_raise_value_error_naming_field_value_and_range(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"temperature": "hot"}, r"temperature must be a number, got str"),
        ({"temperature": True}, r"temperature must be a number, got bool"),
        ({"top_k": 2.0}, r"top_k must be an int, got float"),
        ({"seed": 1.5}, r"seed must be an int"),
        ({"stop": [1]}, r"stop\[0\] must be a str"),
        ({"stop_token_ids": "12"}, r"stop_token_ids must be a sequence of ints"),
        ({"ignore_eos": 1}, r"ignore_eos must be a bool"),
        ({"logit_bias": [1, 2]}, r"logit_bias must be a mapping"),
        ({"logit_bias": {1.5: 1.0}}, r"logit_bias key 1.5 must be an int"),
        ({"bad_words": "word"}, r"bad_words must be a sequence of strings"),
        ({"extra_args": 3}, r"extra_args must be a mapping"),
    ],
)
def test_wrong_types_raise_type_error(kwargs, pattern):
    with pytest.raises(TypeError, match=pattern):
        SamplingParams(**kwargs)


def test_validate_token_ids_against_vocab():
    SamplingParams(stop_token_ids=[9], logit_bias={9: 1.0}).validate_token_ids(10)
    for kwargs, field in [
        ({"stop_token_ids": [10]}, "stop_token_ids"),
        ({"logit_bias": {12: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [3, 10]}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[1, 11]]}, r"bad_words_token_ids\[0\]"),
    ]:
        with pytest.raises(ValueError, match=rf"{field} holds token id \d+, outside the vocabulary; valid: \[0, 10\)"):
            SamplingParams(**kwargs).validate_token_ids(10)
    with pytest.raises(ValueError, match="vocab_size"):
        SamplingParams().validate_token_ids(0)


def test_stop_token_ids_include_eos_unless_ignored():
    params = SamplingParams(stop_token_ids=[4])
    assert params.all_stop_token_ids(2) == (4, 2)
    assert params.all_stop_token_ids(None) == (4,)
    assert SamplingParams(stop_token_ids=[4], ignore_eos=True).all_stop_token_ids(2) == (4,)
    assert SamplingParams(stop_token_ids=[2]).all_stop_token_ids(2) == (2,)


def test_resolve_bad_words_encodes_with_and_without_leading_space():
    vocab = {"bad": [7], " bad": [3, 7], "worse": [8, 9], " worse": [8, 9]}
    params = SamplingParams(bad_words=["bad", "worse"], bad_words_token_ids=[[1]])
    resolved = params.resolve_bad_words(lambda text: vocab[text])
    assert resolved.bad_words_token_ids == ((1,), (7,), (3, 7), (8, 9))
    assert params.bad_words_token_ids == ((1,),)  # the original is untouched

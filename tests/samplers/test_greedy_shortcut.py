"""``Sampler.greedy_tokens`` (the all-plain-greedy shortcut) against ``Sampler.forward``."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.samplers import Sampler, SamplingMetadata, SamplingParams
from servelab.samplers.sampler import is_plain_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def _forward(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams]):
    metadata = SamplingMetadata.from_requests(params, [()] * len(params), [()] * len(params), logits.shape[1])
    return sampler.forward(logits, metadata)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.integers(1, 40), seed=st.integers(0, 2**31 - 1),
       specials=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 39),
                                   st.sampled_from([float("nan"), float("inf"), float("-inf")])), max_size=4),
       all_masked=st.booleans(), ties=st.booleans())
def test_shortcut_equals_forward(rows, vocab, seed, specials, all_masked, ties):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    if ties:  # repeated maxima: the first index wins on both paths
        logits = logits.round()
    for r, c, value in specials:
        if r < rows and c < vocab:
            logits[r, c] = value
    if all_masked:
        logits[0] = float("-inf")
    sampler = Sampler()
    params = [GREEDY] * rows
    out = _forward(sampler, logits.clone(), params)
    tokens = sampler.greedy_tokens(logits.clone(), params)
    if out.errors:
        assert tokens is None  # forward reports those rows; the shortcut never hides them
    else:
        assert tokens == out.sampled_token_ids.tolist()


def test_shortcut_declines_what_it_cannot_do():
    logits = torch.randn(2, 10)

    class Noop:
        argmax_invariant = False

        def apply(self, logits, metadata):
            return logits

    class Logged(Sampler):
        def forward(self, logits, metadata):
            return super().forward(logits, metadata)

    assert Sampler().greedy_tokens(logits, [GREEDY, GREEDY]) is not None
    assert Sampler(logits_processors=[Noop()]).greedy_tokens(logits, [GREEDY, GREEDY]) is None
    assert Logged().greedy_tokens(logits, [GREEDY, GREEDY]) is None
    patched = Sampler()
    patched.forward = lambda logits, metadata: None
    assert patched.greedy_tokens(logits, [GREEDY, GREEDY]) is None
    assert Sampler().greedy_tokens(logits.double(), [GREEDY, GREEDY]) is None
    assert Sampler().greedy_tokens(logits, [GREEDY]) is None
    for change in (dict(temperature=0.5), dict(logprobs=1), dict(min_tokens=1), dict(logit_bias={1: 2.0}),
                   dict(allowed_token_ids=(1, 2)), dict(bad_words_token_ids=((3,),)), dict(repetition_penalty=1.1),
                   dict(frequency_penalty=0.5), dict(presence_penalty=0.5)):
        other = dataclasses.replace(GREEDY, **change)
        assert not is_plain_greedy(other), change
        assert Sampler().greedy_tokens(logits, [GREEDY, other]) is None, change
    assert is_plain_greedy(dataclasses.replace(GREEDY, seed=3, stop_token_ids=(1,), ignore_eos=True))

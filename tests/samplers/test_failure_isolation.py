"""Bad requests fail alone: validate_for_model at add time, SamplerOutput.errors at sampling time."""

import pytest
import torch

from servelab.reference import rejection_sample as reference_rejection_sample
from servelab.samplers import (
    Sampler,
    SamplingMetadata,
    SamplingParams,
    get_verifier,
    rejection_sample,
    typical_acceptance_sample,
    verify_tree_greedy,
    verify_tree_stochastic,
)

VOCAB = 12


def metadata(params, outputs=None, vocab_size=VOCAB):
    outputs = outputs or [[] for _ in params]
    return SamplingMetadata.from_requests(params, [[1, 2]] * len(params), outputs, vocab_size)


# --- add time: SamplingParams.validate_for_model --------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"logprobs": 1000}, r"logprobs = 1000 exceeds max_logprobs = 20; valid: None or \[0, 12\]"),
        ({"logprobs": 15}, r"logprobs = 15 exceeds vocab_size = 12"),
        ({"stop_token_ids": [12]}, r"stop_token_ids holds token id 12, outside the vocabulary"),
        ({"allowed_token_ids": [5], "bad_words_token_ids": [[5]]}, r"allowed_token_ids and bad_words_token_ids "
                                                                   r"leave no token"),
        ({"bad_words_token_ids": [[t] for t in range(VOCAB)]}, r"leave no token"),
        ({"allowed_token_ids": [3], "stop_token_ids": [3], "min_tokens": 2}, r"min_tokens = 2 masks every allowed"),
    ],
)
def test_validate_for_model_names_the_field(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs).validate_for_model(VOCAB, max_logprobs=20)


def test_validate_for_model_accepts_what_can_be_sampled():
    for kwargs in [{}, {"logprobs": 12}, {"top_k": 2**40}, {"allowed_token_ids": [5, 6], "bad_words_token_ids": [[5]]},
                   {"bad_words_token_ids": [[t] for t in range(VOCAB - 1)]}, {"bad_words_token_ids": [[5, 5]]},
                   {"allowed_token_ids": [3], "stop_token_ids": [3]}]:
        SamplingParams(**kwargs).validate_for_model(VOCAB, max_logprobs=20)
    # EOS counts as a stop token for min_tokens unless ignore_eos.
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(allowed_token_ids=[4], min_tokens=1).validate_for_model(VOCAB, max_logprobs=0, eos_token_id=4)
    SamplingParams(allowed_token_ids=[4], min_tokens=1, ignore_eos=True).validate_for_model(
        VOCAB, max_logprobs=0, eos_token_id=4)
    with pytest.raises(TypeError, match="max_logprobs must be an int"):
        SamplingParams().validate_for_model(VOCAB, max_logprobs=None)


def test_temperature_that_overflows_float32_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"temperature=1e\+39 must be in \[0.0, 3.40"):
        SamplingParams(temperature=1e39)
    # The largest float32 temperature is handled exactly: a uniform draw over the unmasked tokens.
    params = SamplingParams(temperature=3.4e38, allowed_token_ids=[2, 7], seed=1)
    logits = torch.randn(1, VOCAB) * 50
    tokens = {int(Sampler(backend="torch")(logits, metadata([params], [[0] * n])).sampled_token_ids[0])
              for n in range(40)}
    assert tokens == {2, 7}


def test_huge_top_k_is_clamped_and_samples_like_no_top_k():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    huge = SamplingParams(top_k=2**40, seed=3)
    off = SamplingParams(top_k=-1, seed=3)
    meta = metadata([huge, off])
    assert meta.top_k is None  # nothing to filter: the int32 tensor is not even built
    out = Sampler(backend="torch")(logits, meta).sampled_token_ids
    assert out[0] == Sampler(backend="torch")(logits[:1], metadata([off])).sampled_token_ids[0]
    mixed = metadata([huge, SamplingParams(top_k=3, seed=3)])
    assert mixed.top_k.tolist() == [VOCAB, 3] and mixed.top_k.dtype == torch.int32


# --- sampling time: SamplerOutput.errors ------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_unsampleable_rows_get_minus_one_and_a_message_the_others_are_sampled(backend):
    params = [
        SamplingParams(temperature=0.0),  # greedy, fine
        SamplingParams(allowed_token_ids=[5], bad_words_token_ids=[[5]], seed=1),  # all masked (bypassing add time)
        SamplingParams(seed=2),  # NaN logits
        SamplingParams(seed=3, logprobs=2),  # fine, random
        SamplingParams(temperature=0.0),  # +inf logit
    ]
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[2, 4] = float("nan")
    logits[4, 1] = float("inf")
    out = Sampler(backend=backend)(logits, metadata(params))
    assert out.sampled_token_ids.tolist()[1:3] == [-1, -1] and out.sampled_token_ids[4] == -1
    assert sorted(out.errors) == [1, 2, 4]
    assert "every token is masked" in out.errors[1]
    assert "NaN" in out.errors[2] and "+inf" in out.errors[4]
    assert out.sampled_token_ids[0] == logits[0].argmax()
    assert 0 <= out.sampled_token_ids[3] < VOCAB
    assert out.logprobs.token_ids[:, 0].tolist() == out.sampled_token_ids.tolist()
    healthy = Sampler(backend=backend)(logits[3:4], metadata(params[3:4]))
    assert healthy.sampled_token_ids[0] == out.sampled_token_ids[3] and not healthy.errors


def test_a_processor_that_masks_everything_for_one_row_fails_only_that_row():
    class MaskRowZero:
        argmax_invariant = True  # runs after temperature: random rows only

        def apply(self, logits, metadata):
            logits = logits.clone()
            logits[0] = float("-inf")
            return logits

    params = [SamplingParams(seed=1), SamplingParams(seed=2)]
    out = Sampler([MaskRowZero()], backend="torch")(torch.zeros(2, VOCAB), metadata(params))
    assert out.sampled_token_ids[0] == -1 and 0 <= out.sampled_token_ids[1] < VOCAB
    assert list(out.errors) == [0]


def test_compute_probs_marks_unsampleable_rows_nan_and_reports_them():
    params = [SamplingParams(allowed_token_ids=[5], bad_words_token_ids=[[5]]), SamplingParams()]
    sampler = Sampler(backend="torch")
    probs, errors = sampler.compute_probs_and_errors(torch.zeros(2, VOCAB), metadata(params))
    assert list(errors) == [0] and torch.isnan(probs[0]).all()
    assert torch.allclose(probs[1], torch.full((VOCAB,), 1 / VOCAB))
    assert torch.equal(sampler.compute_probs(torch.zeros(2, VOCAB), metadata(params)).isnan(), probs.isnan())


# --- verifiers refuse broken probabilities -------------------------------------------------


def _bad_probabilities():
    good = torch.full((3, 4), 0.25)
    nan, negative, zero, inf = good.clone(), good.clone(), good.clone(), good.clone()
    nan[1, 2] = float("nan")
    negative[2, 0] = -0.5
    zero[0] = 0.0
    inf[1, 1] = float("inf")
    return [(nan, "NaN in row 1"), (negative, r"-0.5 \(negative\) in row 2"), (zero, "row 0 has no positive mass"),
            (inf, "inf in row 1")]


@pytest.mark.parametrize(("target", "message"), _bad_probabilities())
def test_chain_verifiers_refuse_nan_negative_and_empty_target_rows(target, message):
    drafts, counts = torch.tensor([1, 2]), [2]
    for verify in (lambda: rejection_sample(drafts, counts, target, backend="torch"),
                   lambda: rejection_sample(drafts, counts, target, backend="triton"),
                   lambda: reference_rejection_sample(drafts, counts, target),
                   lambda: typical_acceptance_sample(drafts, counts, target)):
        with pytest.raises(ValueError, match=f"target_probs holds|target_probs row"):
            verify()
        with pytest.raises(ValueError, match=message):
            verify()
    for name in ("rejection", "typical", "tree"):
        with pytest.raises(ValueError, match=message):
            get_verifier(name).verify(drafts, counts, target, None, greedy=torch.tensor([False]), generators=[None])
    bad_row = target[~(target == 0.25).all(dim=-1)][0]
    draft = torch.stack([torch.full((4,), 0.25), bad_row])  # the problem moves to draft_probs row 1
    with pytest.raises(ValueError, match=r"draft_probs (holds .* in row 1|row 1 has no positive mass)"):
        rejection_sample(drafts, counts, torch.full((3, 4), 0.25), draft, backend="torch")


def test_tree_verifiers_refuse_bad_rows_of_present_nodes_only():
    tokens = torch.tensor([[1, -1]])
    parents = torch.tensor([-1, 0])
    target = torch.full((1, 3, 4), 0.25)
    target[0, 2] = float("nan")  # the absent node's row: never read, not checked
    verify_tree_greedy(tokens, parents, target)
    verify_tree_stochastic(tokens, parents, target)
    target[0, 1, 0] = -1.0
    for verify in (verify_tree_greedy, verify_tree_stochastic):
        with pytest.raises(ValueError, match=r"target_probs holds -1.0 \(negative\) in row \[0, 1\]"):
            verify(tokens, parents, target)

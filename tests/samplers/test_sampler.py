"""The Sampler end to end: mixed batches, seeded determinism, logprobs, backends, distribution."""

import pytest
import torch
from sampling_stats import assert_distributed_as

from servelab.samplers import Sampler, SamplingMetadata, SamplingParams

BACKENDS = ["torch", "triton"]  # triton runs under TRITON_INTERPRET=1 (tests/conftest.py)


def build(params, outputs, vocab_size, prompts=None):
    prompts = prompts if prompts is not None else [[0] for _ in params]
    return SamplingMetadata.from_requests(params, prompts, outputs, vocab_size)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_greedy_and_random_rows_in_one_call(backend):
    torch.manual_seed(0)
    vocab_size = 40
    logits = torch.randn(4, vocab_size) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=1),
              SamplingParams(temperature=1e-6), SamplingParams(top_p=0.5, min_p=0.01)]
    out = Sampler(backend=backend)(logits, build(params, [[]] * 4, vocab_size)).sampled_token_ids
    argmax = logits.argmax(dim=-1)
    assert out.dtype == torch.int64 and out.shape == (4,)
    assert out[:3].tolist() == argmax[:3].tolist()  # greedy, top_k=1, and temperature < 1e-5 rows
    probs = torch.softmax(logits[3], dim=-1)
    assert probs[out[3]] >= 0.01 * probs.max()  # min-p respected


def test_all_greedy_batch_consumes_no_randomness():
    logits = torch.randn(3, 10)
    md = build([SamplingParams(temperature=0)] * 3, [[]] * 3, 10)
    torch.manual_seed(5)
    Sampler()(logits, md)
    after_sampling = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after_sampling, torch.rand(3))


def run_steps(sampler, target_params, companions, vocab_size, steps, position):
    """Decode ``steps`` tokens for one seeded request sitting in row ``position`` among companions.

    Logits depend only on the request's own history (a fake model), so any
    difference in its tokens could only come from the batch composition.
    """
    history = []
    for step in range(steps):
        params = list(companions)
        params.insert(position, target_params)
        outputs = [[(7 * step + row) % vocab_size] for row in range(len(companions))]
        outputs.insert(position, history)
        gen = torch.Generator().manual_seed(1000 + len(history))
        own_logits = torch.randn(vocab_size, generator=gen)
        logits = torch.randn(len(params), vocab_size)  # unrelated rows for the companions
        logits[position] = own_logits
        token = sampler(logits, build(params, outputs, vocab_size)).sampled_token_ids[position].item()
        history = history + [token]
    return history


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_request_depends_only_on_its_seed_and_history(backend):
    sampler = Sampler(backend=backend)
    vocab_size = 64
    target = SamplingParams(temperature=1.3, top_k=40, seed=1234)
    others = [SamplingParams(seed=99), SamplingParams(), SamplingParams(temperature=0), SamplingParams(top_p=0.9)]
    alone = run_steps(sampler, target, [], vocab_size, steps=6, position=0)
    middle = run_steps(sampler, target, others[:3], vocab_size, steps=6, position=1)
    last = run_steps(sampler, target, others[::-1], vocab_size, steps=6, position=4)
    assert alone == middle == last
    other_seed = run_steps(sampler, SamplingParams(temperature=1.3, top_k=40, seed=1235), [], vocab_size, 6, 0)
    assert other_seed != alone  # the seed matters (probability of a clash ~ 1e-9)


def test_seeded_rows_agree_across_backends():
    vocab_size = 200
    logits = torch.randn(3, vocab_size)
    params = [SamplingParams(seed=s, top_p=0.8, top_k=50, min_p=0.01) for s in (1, 2, 3)]
    md = build(params, [[1], [2, 3], []], vocab_size)
    results = [Sampler(backend=b)(logits, md).sampled_token_ids for b in BACKENDS]
    assert torch.equal(results[0], results[1])


def test_logprobs_come_from_the_raw_distribution_with_rank():
    torch.manual_seed(3)
    vocab_size = 12
    logits = torch.randn(2, vocab_size, dtype=torch.float16)
    params = [SamplingParams(temperature=0, logprobs=3, presence_penalty=2.0),
              SamplingParams(temperature=0.5, logprobs=1, top_k=4)]
    md = build(params, [[int(logits[0].argmax())], []], vocab_size)
    out = Sampler()(logits, md)
    raw = torch.log_softmax(logits.float(), dim=-1)
    lp = out.logprobs
    assert lp.token_ids.shape == (2, 4) and lp.logprobs.shape == (2, 4)
    sampled = out.sampled_token_ids
    assert lp.token_ids[:, 0].tolist() == sampled.tolist()
    torch.testing.assert_close(lp.logprobs[:, 0], raw.gather(1, sampled[:, None]).squeeze(1), rtol=0, atol=0)
    top = raw.topk(3, dim=-1)
    assert lp.token_ids[:, 1:].tolist() == top.indices.tolist()
    expected_rank = (raw > raw.gather(1, sampled[:, None])).sum(dim=1) + 1
    assert lp.sampled_token_ranks.tolist() == expected_rank.tolist()
    assert lp.sampled_token_ranks[0].item() > 1  # the penalty moved greedy off the raw argmax
    assert lp.for_request(1, 1) == list(zip(lp.token_ids[1, :2].tolist(), lp.logprobs[1, :2].tolist()))
    with pytest.raises(ValueError, match="num_logprobs = 4"):
        lp.for_request(1, 4)


def test_sampler_distribution_after_temperature_top_k_top_p_min_p():
    """Sampler (torch backend) over many identical rows: samples follow the filtered, tempered softmax."""
    vocab_size, num_rows = 10, 60_000
    base = torch.tensor([2.0, 1.6, 1.5, 1.0, 0.7, 0.2, -0.5, -1.0, -3.0, -4.0])
    params = SamplingParams(temperature=0.8, top_k=7, top_p=0.9, min_p=0.05)
    md = build([params] * num_rows, [[]] * num_rows, vocab_size)
    sampled = Sampler(backend="torch")(base.expand(num_rows, -1), md).sampled_token_ids
    # Expected, by hand: temper, keep top 7, drop p < 0.05 p_max, then the top-p set of what is left.
    probs = torch.softmax(base.double() / 0.8, dim=-1)
    keep = torch.zeros(vocab_size, dtype=torch.bool)
    keep[:7] = True
    keep &= probs >= 0.05 * probs.max()
    renorm = torch.where(keep, probs, 0.0) / torch.where(keep, probs, 0.0).sum()
    mass_above = torch.cumsum(renorm, 0) - renorm  # logits are sorted descending
    keep &= mass_above < 0.9
    expected = torch.where(keep, probs, 0.0)
    assert int(keep.sum()) == 5  # the filters bite: a wrong order or threshold changes this set
    wrong = torch.where(torch.arange(vocab_size) < 6, probs, 0.0)  # one token too many
    assert_distributed_as(sampled, expected / expected.sum(), wrong=wrong / wrong.sum(), label="sampler")
    # compute_probs (what rejection_sample takes as target_probs) is that same distribution.
    single = build([params], [[]], vocab_size)
    probs_out = Sampler().compute_probs(base[None], single)[0].double()
    torch.testing.assert_close(probs_out, expected / expected.sum(), rtol=1e-5, atol=1e-6)

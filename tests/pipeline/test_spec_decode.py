"""Speculative decoding end to end: acceptance metrics, the draft-model
drafter's incremental cache, reproducible seeded sampling with drafts."""

from dataclasses import replace

import pytest
import torch
from pipeline_helpers import assert_no_leaks, hf_greedy, random_prompts

from servelab import Pipeline
from servelab.samplers import SamplingParams
from servelab.samplers.drafters import DraftModelDrafter, DraftRequest, NgramDrafter

GREEDY = SamplingParams(temperature=0.0, max_tokens=20)


def test_a_draft_model_identical_to_the_target_is_always_accepted(tiny):
    prompts = random_prompts([3, 12, 30], seed=5)
    want = hf_greedy(tiny["llama"], prompts, 20)
    pipe = Pipeline.from_pretrained(tiny["llama"], drafter=tiny["llama"], num_speculative_tokens=4)
    outs = pipe.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == want
    m = pipe.last_run_metrics
    assert m.acceptance_rate == 1.0
    assert m.acceptance_by_position == [1.0] * 4
    assert m.mean_accepted_per_step > 2.0
    plain = Pipeline.from_pretrained(tiny["llama"])
    plain.generate(prompts, GREEDY)
    assert m.num_steps < plain.last_run_metrics.num_steps / 2  # up to 5 tokens per step instead of 1
    assert_no_leaks(pipe)


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_acceptance_counts_agree_with_the_requests(tiny, drafter):
    prompts = random_prompts([5, 18, 33, 9], seed=6)
    pipe = Pipeline.from_pretrained(tiny["qwen2"], drafter=tiny["draft"] if drafter == "draft" else "ngram",
                                    num_speculative_tokens=3)
    outs = pipe.generate(prompts, GREEDY)
    m = pipe.last_run_metrics
    assert m.num_draft_tokens == sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert m.num_accepted_tokens == sum(o.metrics.num_accepted_tokens for o in outs)
    assert m.acceptance_rate == pytest.approx(m.num_accepted_tokens / m.num_draft_tokens)
    assert 1 <= len(m.acceptance_by_position) <= 3
    assert all(0.0 <= a <= 1.0 for a in m.acceptance_by_position)
    # Every step emits accepted drafts + 1 per verified request: tokens add up.
    assert m.output_tokens == sum(len(o.token_ids) for o in outs)
    assert_no_leaks(pipe)


def test_ngram_drafts_are_accepted_on_repetitive_output(tiny):
    """Greedy decoding of a random model falls into loops; n-gram lookup then predicts them."""
    prompts = random_prompts([4, 8], seed=2)
    pipe = Pipeline.from_pretrained(tiny["llama"], drafter="ngram", num_speculative_tokens=3)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outs = pipe.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in Pipeline.from_pretrained(tiny["llama"]).generate(
        prompts, params)]
    assert all(len(o.token_ids) == 64 for o in outs)
    assert pipe.last_run_metrics.acceptance_rate > 0.2


def test_draft_model_proposals_are_its_greedy_continuation(tiny):
    drafter = DraftModelDrafter.from_pretrained(tiny["draft"], block_size=4)
    for prompt in random_prompts([1, 7, 22], seed=8):
        want = hf_greedy(tiny["draft"], [prompt], 5)[0]
        got = drafter.propose(prompt, 5)
        stop = want.index(2) + 1 if 2 in want else len(want)  # HF stops at EOS; the drafter does not
        assert got[:stop] == want[:stop]
    assert drafter.num_free_blocks == drafter.num_blocks - 1


def test_draft_model_cache_survives_rejections(tiny):
    """Proposals from the per-request cache (kept across steps, stale after a
    rejected draft) equal proposals computed from scratch."""
    stateful = DraftModelDrafter.from_pretrained(tiny["draft"], block_size=4, num_blocks=64)
    fresh = DraftModelDrafter.from_pretrained(tiny["draft"], block_size=4, num_blocks=64)
    history = random_prompts([9], seed=9)[0]
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        drafts = stateful.propose_for_requests([DraftRequest("r", history, 4)])[0].token_ids
        assert drafts == fresh.propose(history, 4)
        accepted = int(torch.randint(0, 5, (), generator=gen))
        # accept some drafts, then a token the draft did not propose (a rejection or a bonus)
        history = history + drafts[:accepted] + [int(torch.randint(3, 500, (), generator=gen))]
    stateful.release("r")
    assert stateful.num_free_blocks == stateful.num_blocks - 1


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_seeded_random_sampling_with_drafts_is_reproducible(tiny, drafter):
    prompts = random_prompts([6, 15, 27], seed=10)
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=16) for i in range(3)]
    runs = []
    for _ in range(2):
        pipe = Pipeline.from_pretrained(tiny["llama"], drafter=tiny["draft"] if drafter == "draft" else "ngram",
                                        num_speculative_tokens=3)
        runs.append([o.token_ids for o in pipe.generate(prompts, params)])
        assert_no_leaks(pipe)
    assert runs[0] == runs[1]
    assert all(len(r) > 0 for r in runs[0])


def test_drafter_and_k_come_together(tiny):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Pipeline.from_pretrained(tiny["llama"], drafter="ngram")
    with pytest.raises(ValueError, match="drafter"):
        Pipeline.from_pretrained(tiny["llama"], num_speculative_tokens=2)
    with pytest.raises(ValueError, match="not a checkpoint folder with a config.json"):
        Pipeline.from_pretrained(tiny["llama"], drafter="/nonexistent/folder", num_speculative_tokens=2)
    pipe = Pipeline.from_pretrained(tiny["llama"], drafter=NgramDrafter(min_n=1, max_n=2), num_speculative_tokens=2)
    assert isinstance(pipe.drafter, NgramDrafter)


@torch.no_grad()
def _exact_distribution(path, prompt, temperature, top_k, depth):
    """P(first `depth` tokens) under temperature + top-k, from transformers' logits."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, local_files_only=True).eval()
    probs = {(): 1.0}
    for _ in range(depth):
        grown = {}
        for seq, p in probs.items():
            logits = hf(torch.tensor([prompt + list(seq)])).logits[0, -1] / temperature
            top = logits.topk(top_k)
            for token, q in zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()):
                grown[seq + (token,)] = p * q
        probs = grown
    return probs


class WarmDrafter(DraftModelDrafter):
    """A draft model that samples hotter and wider than the target (T 1.6, top-4)."""

    @staticmethod
    def _draft_probs(logits, params):
        return DraftModelDrafter._draft_probs(logits, replace(params, temperature=1.6, top_k=4))


@pytest.mark.parametrize("drafter", [None, "warm", "target"])
def test_random_sampling_with_drafts_keeps_the_target_distribution(tiny, drafter):
    """Rejection sampling inside the pipeline is exact: the first 3 tokens,
    sampled with temperature 0.8 and top-k 2 (8 outcomes), follow the target's
    distribution (chi-square, fixed seeds) with and without speculative decoding.
    A drafter sampling hotter and wider than the target is accepted sometimes
    and rejected sometimes, so acceptance, residual and bonus paths all run;
    the target as its own draft (same filtering: q = p) is always accepted."""
    prompt = random_prompts([6], seed=14)[0]
    exact = _exact_distribution(tiny["llama"], prompt, 0.8, 2, 3)
    kwargs = {}
    if drafter == "warm":
        kwargs = dict(drafter=WarmDrafter.from_pretrained(tiny["llama"]), num_speculative_tokens=2)
    elif drafter == "target":
        kwargs = dict(drafter=tiny["llama"], num_speculative_tokens=2)
    pipe = Pipeline.from_pretrained(tiny["llama"], seed=5, **kwargs)
    n = 600
    outs = pipe.generate([prompt] * n, SamplingParams(temperature=0.8, top_k=2, max_tokens=3, ignore_eos=True))
    counts = {seq: 0 for seq in exact}
    for o in outs:
        counts[tuple(o.token_ids)] += 1  # KeyError: a token outside the top-2
    chi2 = sum((counts[s] - n * p) ** 2 / (n * p) for s, p in exact.items())
    assert chi2 < 24.32, (chi2, counts, exact)  # 7 degrees of freedom, p = 0.001
    m = pipe.last_run_metrics
    if drafter == "warm":
        assert 0.2 < m.acceptance_rate < 0.9
    elif drafter == "target":
        assert m.acceptance_rate == 1.0
    assert_no_leaks(pipe)


def test_logprobs_with_drafts_match_plain_decoding(tiny):
    prompts = random_prompts([5, 21], seed=16)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    plain = Pipeline.from_pretrained(tiny["llama"]).generate(prompts, params)
    spec = Pipeline.from_pretrained(tiny["llama"], drafter=tiny["llama"], num_speculative_tokens=3).generate(
        prompts, params)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids and len(a.logprobs) == len(b.logprobs) == len(a.token_ids)
        for ea, eb in zip(a.logprobs, b.logprobs):
            assert [t for t, _ in ea] == [t for t, _ in eb]
            assert [lp for _, lp in ea] == pytest.approx([lp for _, lp in eb], abs=1e-4)

"""Prompt logprobs have vLLM's semantics: the same entries as vLLM's own gather and output assembly.

For random logits (ties included) and prompt tokens, servelab's collector and
``render_prompt_logprobs`` must give what vLLM's ``Sampler.gather_logprobs`` +
``append_logprobs_for_next_position`` give: per position the same token ids,
logprobs and ranks, and ``None`` first. Skipped without vLLM.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from vllm.logprobs import append_logprobs_for_next_position, create_prompt_logprobs  # noqa: E402
from vllm.v1.sample.sampler import Sampler as VllmSampler  # noqa: E402

from servelab.pipeline.prompt_logprobs import PromptLogprobsCollector, render_prompt_logprobs  # noqa: E402


class _Identity:
    """``compute_logits`` returns the 'hidden states' themselves: the test hands in logits."""

    @staticmethod
    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class _State:
    req_id = "r"


@settings(max_examples=40)
@given(length=st.integers(1, 9), vocab=st.integers(2, 12), k=st.integers(-1, 5), seed=st.integers(0, 2**16),
       ties=st.booleans())
def test_same_entries_as_vllm(length, vocab, k, seed, ties):
    gen = torch.Generator().manual_seed(seed)
    k = min(k, vocab)
    prompt = torch.randint(0, vocab, (length,), generator=gen).tolist()
    logits = torch.randn(length, vocab, generator=gen)
    if ties:
        logits = logits.round()  # many equal logits: ranks count ties as ahead
    collector = PromptLogprobsCollector()
    collector.add("r", k, prompt)
    collector.collect(_Identity(), [(_State(), 0, length)], logits, [length])
    ours = render_prompt_logprobs(collector.finished["r"])

    theirs = create_prompt_logprobs(False)
    if length > 1:
        scores = torch.log_softmax(logits[:-1], dim=-1)
        num = vocab if k == -1 else k
        tensors = VllmSampler.gather_logprobs(scores, num, torch.tensor(prompt[1:], dtype=torch.int64))
        for pos in range(length - 1):
            ids = tensors.logprob_token_ids[pos].tolist()
            append_logprobs_for_next_position(theirs, ids, tensors.logprobs[pos].tolist(), [None] * len(ids),
                                              int(tensors.selected_token_ranks[pos]), k)
    assert len(ours) == len(theirs) == length and ours[0] is None and theirs[0] is None
    for mine, vllm_entry in zip(ours[1:], theirs[1:]):
        assert [(t, lp.rank) for t, lp in mine.items()] == [(t, lp.rank) for t, lp in vllm_entry.items()]
        for t, lp in vllm_entry.items():
            assert abs(mine[t].logprob - lp.logprob) < 1e-6

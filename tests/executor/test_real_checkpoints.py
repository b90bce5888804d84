"""Tensor parallelism on trained checkpoints, opt-in (worker processes load SmolLM2-135M, Gemma 3 270M).

SmolLM2-135M has 9 query heads and 3 KV heads: TP=3 gives each rank 3 query heads and one
KV head, its MLP a third of 1536 units and its vocabulary a third of 49152 rows. Greedy
outputs must equal one process's, token for token, with prefix caching and n-gram
speculation on. Runs when ``SERVELAB_FETCH_REAL_CHECKPOINT=1`` (as the other real-checkpoint
tests; it fetches the checkpoint once if needed).
"""

from __future__ import annotations

import os

import pytest

from servelab import Pipeline, SamplingParams
from servelab.models import hub

pytestmark = pytest.mark.skipif(os.environ.get("SERVELAB_FETCH_REAL_CHECKPOINT") != "1",
                                reason="set SERVELAB_FETCH_REAL_CHECKPOINT=1 to run TP=3 on SmolLM2-135M")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "A paged KV cache stores",
           "The capital of France is a city that"]


def test_smollm2_tp3_is_token_exact():
    path = hub.fetch_smollm2() if not hub.is_fetched() else hub.smollm2_path()
    settings = dict(enable_prefix_caching=True, drafter="ngram", num_speculative_tokens=3, num_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = [o.token_ids for o in Pipeline.from_pretrained(path, **settings).generate(PROMPTS, params)]
    with Pipeline.from_pretrained(path, tensor_parallel_size=3, **settings) as pipe:
        assert [o.token_ids for o in pipe.generate(PROMPTS, params)] == expected


def test_gemma3_270m_tp2_replicates_its_one_kv_head_token_exact():
    """Gemma 3 270M: 4 query heads, 1 KV head: at TP=2 each rank holds 2 query heads and a copy
    of the KV head (vLLM's rule); one uniform KV-cache group (the sliding windows as masks)."""
    path = hub.fetch_gemma3_270m() if not hub.is_gemma3_fetched() else hub.gemma3_path()
    settings = dict(kv_cache_groups="uniform", enable_prefix_caching=True, drafter="ngram",
                    num_speculative_tokens=2, num_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=16)
    expected = [o.token_ids for o in Pipeline.from_pretrained(path, **settings).generate(PROMPTS, params)]
    with Pipeline.from_pretrained(path, tensor_parallel_size=2, **settings) as pipe:
        assert [o.token_ids for o in pipe.generate(PROMPTS, params)] == expected

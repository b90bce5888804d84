"""Swapping pieces through the public API: verifiers by name and by object,
and every reference as a drop-in for its fast twin (issue 9)."""

import pytest
import torch
from pipeline_helpers import assert_no_leaks, random_prompts

import servelab.reference as ref
from servelab import Pipeline, SamplingParams
from servelab.blocks import KVCacheManager
from servelab.models import kv_cache_spec, load_model, load_tokenizer
from servelab.samplers import Sampler
from servelab.samplers.verifiers import RejectionVerifier

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# Repetitive prompts: n-gram drafts get proposed, accepted and rejected.
PROMPTS = [p * 3 for p in random_prompts([5, 7, 4], seed=41)] + random_prompts([19], seed=42)


@pytest.fixture(scope="module")
def plain_greedy(tiny):
    return [o.token_ids for o in Pipeline.from_pretrained(tiny["llama"]).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("name", ["rejection", "typical", "tree"])
def test_verifier_by_name(tiny, plain_greedy, name):
    pipe = Pipeline.from_pretrained(tiny["llama"], drafter="ngram", num_speculative_tokens=3, verifier=name)
    assert pipe.verifier.name == name and pipe.runner.verifier is pipe.verifier
    outs = pipe.generate(PROMPTS, GREEDY)
    if name == "typical":  # Medusa's rule accepts likely-enough drafts, even for greedy requests: not exact
        assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in outs)
        assert [o.token_ids[0] for o in outs] == [t[0] for t in plain_greedy]  # the first token is never a draft
    else:  # greedy verification is exact
        assert [o.token_ids for o in outs] == plain_greedy
    assert pipe.last_run_metrics.num_draft_tokens > 0
    assert_no_leaks(pipe)


def test_a_user_verifier_plugs_in(tiny, plain_greedy):
    class LongestArgmaxPrefix:  # accept drafts while they are the target's argmax; then the argmax
        name = "argmax-prefix"

        def verify(self, draft_token_ids, num_draft_tokens, target_probs, draft_probs, *, greedy, generators):
            out = torch.full((len(num_draft_tokens), max(num_draft_tokens) + 1), -1, dtype=torch.int64)
            start = row = 0
            for i, k in enumerate(num_draft_tokens):
                best, drafts = target_probs[row:row + k + 1].argmax(-1), draft_token_ids[start:start + k]
                n = 0
                while n < k and drafts[n] == best[n]:
                    n += 1
                out[i, :n], out[i, n] = drafts[:n], best[n]
                start, row = start + k, row + k + 1
            return out

    mine = LongestArgmaxPrefix()
    pipe = Pipeline.from_pretrained(tiny["llama"], drafter="ngram", num_speculative_tokens=3, verifier=mine)
    assert pipe.verifier is mine and pipe.runner.verifier is mine
    assert [o.token_ids for o in pipe.generate(PROMPTS, GREEDY)] == plain_greedy
    assert pipe.last_run_metrics.num_accepted_tokens > 0


# The reference pool hands out ints, the fast one KVCacheBlock objects: each
# pairs with its own manager, so "blocks" swaps the two together.
PIECES = ("blocks", "attention", "sampler", "verifier")


def _pipeline(path, pieces, num_blocks=48, block_size=4):
    """A pipeline whose listed pieces are the references (the rest fast)."""
    model, _ = load_model(path)
    spec = kv_cache_spec(model, block_size)
    if "blocks" in pieces:
        manager = ref.KVCacheManager(spec, num_blocks, True, max_model_len=128,
                                     block_pool=ref.BlockPool(num_blocks, True))
    else:
        manager = KVCacheManager(spec, num_blocks, True, max_model_len=128)
    return Pipeline(
        model, load_tokenizer(path), kv_cache_manager=manager,
        attention_backend="torch" if "attention" in pieces else "sdpa",  # "torch": the reference ops
        sampler=Sampler(backend="torch") if "sampler" in pieces else Sampler(),
        verifier=RejectionVerifier(backend="torch") if "verifier" in pieces else "rejection",
        drafter="ngram", num_speculative_tokens=2, max_num_seqs=3, max_num_batched_tokens=24)


@pytest.mark.parametrize("pieces", [(p,) for p in PIECES] + [PIECES], ids=[*PIECES, "all"])
def test_every_reference_is_a_drop_in(tiny, plain_greedy, pieces):
    """Greedy outputs identical to the fast path, through preemption (a small
    pool), chunked prefill, prefix hits and draft verification; no leaked block."""
    pipe = _pipeline(tiny["llama"], pieces)
    outs = pipe.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain_greedy
    again = pipe.generate(PROMPTS[:2], GREEDY)  # the second time round: prefix hits
    assert [o.token_ids for o in again] == plain_greedy[:2]
    assert pipe.last_run_metrics.prefix_cache_hit_rate > 0
    assert_no_leaks(pipe)

"""Prompt logprobs (``SamplingParams(prompt_logprobs=k)``) against transformers' logits.

Reference: transformers' forward over the whole prompt, ``log_softmax``, then
per position the prompt token's logprob and rank (``#{t: lp_t >= lp_token}``)
and the top k. Held within 1e-4 on the tiny model (float32) under one
forward, chunked prefill and prefix caching (whose hits such a request must
skip), and on the real SmolLM2 checkpoint when it is cached. The pipeline
stops at float32 (KV-cache dtypes), so the float64 check is the collector's
own: random prompts in random chunks against a plain per-position loop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab import Pipeline, SamplingParams
from servelab.models import build_tiny_model
from servelab.pipeline.prompt_logprobs import PromptLogprobsCollector, gather_prompt_logprobs, render_prompt_logprobs

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama")


def hf_prompt_logprobs(path, prompt: list[int], dtype=torch.float32) -> torch.Tensor:
    """transformers' logprobs ``[len(prompt) - 1, V]``: row j is the distribution of prompt token j + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="eager",
                                                 local_files_only=True).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.to(torch.float64), dim=-1)


def check_against(reference: torch.Tensor, prompt: list[int], got: list, k: int, tol: float = TOL) -> float:
    """Assert ``got`` (an output's prompt_logprobs) matches ``reference``; return the max abs error."""
    assert len(got) == len(prompt) and got[0] is None
    worst = 0.0
    for j, entry in enumerate(got[1:]):
        row, token = reference[j], prompt[j + 1]
        assert token in entry
        expected_rank = int((row >= row[token]).sum())
        # a rank may differ by ties within the tolerance only
        assert abs(entry[token].rank - expected_rank) <= int((row - row[token]).abs().le(tol).sum())
        worst = max(worst, abs(entry[token].logprob - float(row[token])))
        top = row.topk(k).values.tolist() if k else []
        others = sorted((lp.logprob for t, lp in entry.items() if lp.rank <= k), reverse=True)
        assert len(entry) in (k, k + 1) and len(others) >= k - 1
        for want, have in zip(top, others):
            worst = max(worst, abs(want - have))
    assert worst <= tol, worst
    return worst


def test_gather_matches_a_plain_loop():
    """The vectorised gather against a per-row Python loop (float64, ties included)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 50, generator=gen, dtype=torch.float64)
    logits[3, :10] = logits[3, 10]  # ties
    targets = torch.randint(0, 50, (7,), generator=gen)
    targets[3] = 10
    lp, ranks, top_ids, top_lp = gather_prompt_logprobs(logits, targets, 4)
    for r in range(7):
        row = torch.log_softmax(logits[r], dim=0)
        assert lp[r] == row[targets[r]]
        assert ranks[r] == sum(1 for v in row.tolist() if v >= row[targets[r]].item())
        assert top_lp[r].tolist() == sorted(row.tolist(), reverse=True)[:4]
        assert row[top_ids[r]].tolist() == top_lp[r].tolist()


@pytest.mark.parametrize("settings", [
    {},
    {"max_num_batched_tokens": 8, "block_size": 4},  # chunked prefill: 4 chunks of the 27-token prompt
    {"drafter": "ngram", "num_speculative_tokens": 2, "max_num_batched_tokens": 16},  # drafts after the prompt
], ids=["one-forward", "chunked", "speculative"])
def test_tiny_model_matches_transformers(tiny, settings, one_torch_thread):
    pipe = Pipeline.from_pretrained(tiny, **settings)
    prompts = [list(range(3, 30)), [5, 9, 11, 4, 4, 4, 7]]
    outs = pipe.generate(prompts, [SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=3),
                                   SamplingParams(temperature=0, max_tokens=6)])
    check_against(hf_prompt_logprobs(tiny, prompts[0]), prompts[0], outs[0].prompt_logprobs, 3)
    assert outs[1].prompt_logprobs is None  # only requests that ask pay for it


class _Float64Head:
    """A model stand-in: ``compute_logits`` is a float64 linear head."""

    def __init__(self, hidden: int, vocab: int, seed: int) -> None:
        self.weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight.T


@dataclass
class _State:
    req_id: str


@settings(max_examples=25)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=4), chunk=st.integers(1, 9),
       asks=st.lists(st.sampled_from([None, 0, 2, -1]), min_size=4, max_size=4), rows=st.integers(1, 5),
       seed=st.integers(0, 2**16))
def test_collector_against_a_plain_loop_float64(lengths, chunk, asks, rows, seed):
    """Random prompts prefilled in random chunks, several per forward, in float64: every entry equals
    log_softmax of its own position's logits, computed one position at a time."""
    import servelab.pipeline.prompt_logprobs as module

    gen = torch.Generator().manual_seed(seed)
    vocab, width = 11, 6
    head = _Float64Head(width, vocab, seed)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    hidden_all = [torch.randn(n, width, generator=gen, dtype=torch.float64) for n in lengths]
    collector = PromptLogprobsCollector()
    for i, prompt in enumerate(prompts):
        collector.add(f"r{i}", asks[i], prompt)
    saved, module.CHUNK_ROWS = module.CHUNK_ROWS, rows
    try:
        done = [0] * len(prompts)
        while any(d < len(p) for d, p in zip(done, prompts)):
            batch, parts, ends = [], [], []
            for i, prompt in enumerate(prompts):
                if done[i] < len(prompt):
                    n = min(chunk, len(prompt) - done[i])
                    batch.append((_State(f"r{i}"), done[i], n))
                    parts.append(hidden_all[i][done[i]:done[i] + n])
                    ends.append(sum(len(x) for x in parts))
                    done[i] += n
            collector.collect(head, batch, torch.cat(parts), ends)
    finally:
        module.CHUNK_ROWS = saved
    assert not collector.pending
    for i, prompt in enumerate(prompts):
        if asks[i] is None:
            assert f"r{i}" not in collector.finished
            continue
        got = render_prompt_logprobs(collector.finished[f"r{i}"])
        assert len(got) == len(prompt) and got[0] is None
        k = vocab if asks[i] == -1 else asks[i]
        for j in range(1, len(prompt)):
            row = torch.log_softmax(head.compute_logits(hidden_all[i][j - 1]), dim=0)
            token = prompt[j]
            assert abs(got[j][token].logprob - row[token].item()) < 1e-12  # float64 GEMM blocking only
            assert got[j][token].rank == int((row >= row[token]).sum())
            top = sorted(((v, t) for t, v in enumerate(row.tolist())), reverse=True)[:k]
            assert {t for _, t in top} | {token} == set(got[j])


def test_prefix_cache_hits_are_skipped(tiny, one_torch_thread):
    """A second request with the same prompt would hit the cache; asking for prompt logprobs it must not."""
    pipe = Pipeline.from_pretrained(tiny, enable_prefix_caching=True, block_size=4)
    prompt = list(range(100, 133))
    first = pipe.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    again = pipe.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    assert again.metrics.num_cached_tokens == 0
    check_against(hf_prompt_logprobs(tiny, prompt), prompt, again.prompt_logprobs, 2)
    plain = pipe.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0]
    assert plain.metrics.num_cached_tokens > 0 and plain.token_ids == first.token_ids


def test_edge_cases_and_validation(tiny, one_torch_thread):
    pipe = Pipeline.from_pretrained(tiny, max_logprobs=512)  # -1 (the vocabulary) needs max_logprobs >= V
    one, full = pipe.generate([[7], [7, 8, 9]], [SamplingParams(max_tokens=1, prompt_logprobs=1),
                                                 SamplingParams(max_tokens=1, prompt_logprobs=-1)])
    assert one.prompt_logprobs == [None]
    assert len(full.prompt_logprobs[1]) == pipe.vocab_size
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-2)
    with pytest.raises(TypeError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=1.5)
    default = Pipeline.from_pretrained(tiny)  # max_logprobs = 20
    for k in (21, -1):
        too_many = default.generate([[7, 8]], SamplingParams(max_tokens=1, prompt_logprobs=k))[0]
        assert too_many.finish_reason == "error" and f"prompt_logprobs = {k} exceeds max_logprobs" in too_many.error


@pytest.mark.skipif(os.environ.get("SERVELAB_FETCH_REAL_CHECKPOINT") != "1",
                    reason="set SERVELAB_FETCH_REAL_CHECKPOINT=1 to run on the real SmolLM2 checkpoint")
def test_real_checkpoint_matches_transformers(one_torch_thread):
    from servelab.models import hub

    path = hub.fetch_smollm2() if not hub.is_fetched() else hub.smollm2_path()
    pipe = Pipeline.from_pretrained(path, max_num_batched_tokens=16)  # chunked: 16-token chunks
    prompt = pipe.tokenizer.encode("The capital of France is Paris. The capital of Italy is Rome, and")
    out = pipe.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5))[0]
    err = check_against(hf_prompt_logprobs(path, prompt), prompt, out.prompt_logprobs, 5)
    print(f"prompt logprobs max abs error vs transformers (SmolLM2, float32): {err:.2e}")


def test_no_prompt_logits_for_requests_that_do_not_ask(tiny, one_torch_thread):
    """compute_logits sees only sampled rows unless a request asks (then also its P - 1 prompt rows)."""
    pipe = Pipeline.from_pretrained(tiny)
    seen: list[int] = []
    original = pipe.model.compute_logits

    def spy(hidden):
        seen.append(hidden.shape[0])
        return original(hidden)

    pipe.model.compute_logits = spy
    prompts = [list(range(3, 23)), list(range(30, 45))]
    pipe.generate(prompts, SamplingParams(temperature=0, max_tokens=3))
    assert sum(seen) == 2 * 3  # one row per sampled token
    seen.clear()
    pipe.generate(prompts, [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1),
                            SamplingParams(temperature=0, max_tokens=3)])
    assert sum(seen) == 2 * 3 + len(prompts[0]) - 1


def test_preemption_and_recompute_keep_them_exact(tiny, one_torch_thread):
    """A pool too small for both requests: they are preempted and recomputed (mid-prefill too); every
    prompt position is still there, equal to transformers'."""
    pipe = Pipeline.from_pretrained(tiny, block_size=4, num_blocks=12, max_num_batched_tokens=8,
                                    enable_prefix_caching=True)
    prompts = [list(range(200, 222)), list(range(300, 321))]
    outs = pipe.generate(prompts, SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1))
    assert pipe.last_run_metrics.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.finish_reason == "length"
        check_against(hf_prompt_logprobs(tiny, prompt), prompt, out.prompt_logprobs, 1)
    assert pipe.kv_cache_manager.num_free_blocks == pipe.num_blocks - 1

"""Token trees end to end: greedy output unchanged with tree drafting, on every
attention backend, with every tree-capable verifier, under preemption and
prefix caching; the accepted branch's KV is compacted (an oracle drafter that
always hides the right continuation in a later branch proves it)."""

import pytest
import torch
from pipeline_helpers import assert_no_leaks, random_prompts

from servelab import Pipeline
from servelab.samplers import SamplingParams
from servelab.samplers.drafters import Drafter, DraftModelDrafter, DraftProposal, DraftTree, LayerSkipDrafter
from servelab.samplers.verifiers import get_verifier

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


class HiddenBranchDrafter(Drafter):
    """Knows each request's greedy continuation and proposes a tree whose *first*
    branch is wrong and whose second branch is right (parents interleaved, so the
    accepted nodes are never at the chain's slots)."""

    def __init__(self, continuations: dict[tuple, list[int]], vocab_size: int, depth: int = 3):
        self.continuations, self.vocab_size, self.depth = continuations, vocab_size, depth

    def propose_with_probs(self, token_ids, k):
        history = list(token_ids)
        for prompt, full in self.continuations.items():
            if history[: len(prompt)] == list(prompt):
                done = len(history) - len(prompt)
                right = full[done: done + self.depth]
                break
        else:
            return DraftProposal([])
        if not right:
            return DraftProposal([])
        wrong = [(t + 1) % self.vocab_size for t in right]
        # Nodes: w0 r0 w1 r1 w2 r2 ... (w_j under w_{j-1}, r_j under r_{j-1}).
        tokens, parents = [], []
        for j, (w, r) in enumerate(zip(wrong, right)):
            tokens += [w, r]
            parents += [-1, -1] if j == 0 else [2 * j - 2, 2 * j - 1]
        tree = DraftTree(tuple(tokens[:k]), tuple(parents[:k]))
        return DraftProposal.from_tree(tree)


def _greedy(path, prompts, **options):
    pipe = Pipeline.from_pretrained(path, **options)
    return [o.token_ids for o in pipe.generate(prompts, GREEDY)], pipe


@pytest.mark.parametrize("backend", ["torch", "sdpa"])
@pytest.mark.parametrize("verifier", ["tree", "rejection"])
def test_hidden_branch_is_accepted_and_compacted(tiny, backend, verifier, monkeypatch):
    prompts = random_prompts([5, 13, 21], seed=3)
    want, _ = _greedy(tiny["llama"], prompts, attention_backend=backend)
    drafter = HiddenBranchDrafter({tuple(p): w for p, w in zip(prompts, want)}, 512)
    moved = []
    from servelab.pipeline.tree_steps import TreeSteps

    original = TreeSteps._compact_kv
    monkeypatch.setattr(TreeSteps, "_compact_kv", lambda self, state, nodes: (moved.append(nodes),
                                                                               original(self, state, nodes)))
    got, pipe = _greedy(tiny["llama"], prompts, attention_backend=backend, drafter=drafter,
                        num_speculative_tokens=6, verifier=verifier)
    assert got == want
    m = pipe.last_run_metrics
    assert m.mean_accepted_per_step > 2.0  # the right branch (3 deep) is taken nearly every step
    assert any(nodes and nodes != list(range(len(nodes))) for nodes in moved)  # KV really moved
    assert_no_leaks(pipe)


def test_without_compaction_the_output_breaks(tiny, monkeypatch):
    """The test above can fail: skipping the KV move corrupts later tokens."""
    prompts = random_prompts([5, 13, 21], seed=3)
    want, _ = _greedy(tiny["llama"], prompts, attention_backend="sdpa")
    drafter = HiddenBranchDrafter({tuple(p): w for p, w in zip(prompts, want)}, 512)
    from servelab.pipeline.tree_steps import TreeSteps

    monkeypatch.setattr(TreeSteps, "_compact_kv", lambda self, state, nodes: None)
    got, _ = _greedy(tiny["llama"], prompts, attention_backend="sdpa", drafter=drafter, num_speculative_tokens=6)
    assert got != want


@pytest.mark.parametrize("drafter", ["ngram_tree", "ngram"])
@pytest.mark.parametrize("verifier", ["tree", "rejection"])
def test_greedy_unchanged_under_preemption_and_prefix_caching(tiny, drafter, verifier):
    shared = random_prompts([20], seed=11)[0]
    prompts = [shared + p for p in random_prompts([3, 9, 4, 12, 6, 2], seed=12)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = [o.token_ids for o in Pipeline.from_pretrained(tiny["llama"]).generate(prompts, params)]
    pipe = Pipeline.from_pretrained(tiny["llama"], drafter=drafter, num_speculative_tokens=8, verifier=verifier,
                                    num_blocks=24, block_size=4, enable_prefix_caching=True)
    outs = pipe.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    m = pipe.last_run_metrics
    assert m.num_preemptions > 0 and m.prefix_cache_hit_rate > 0
    assert_no_leaks(pipe)


def test_penalties_see_each_nodes_own_path(tiny):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.4)
    prompts = random_prompts([6, 17], seed=4)
    want = [o.token_ids for o in Pipeline.from_pretrained(tiny["llama"]).generate(prompts, params)]
    for drafter in ("ngram_tree", "ngram"):
        pipe = Pipeline.from_pretrained(tiny["llama"], drafter=drafter, num_speculative_tokens=8, verifier="tree")
        assert [o.token_ids for o in pipe.generate(prompts, params)] == want


def test_a_verifier_without_verify_trees_gets_the_first_branch(tiny):
    class ChainOnly:
        name = "chain-only"

        def __init__(self):
            self.inner, self.calls = get_verifier("rejection"), []

        def verify(self, draft_token_ids, num_draft_tokens, *args, **kwargs):
            self.calls.append(list(num_draft_tokens))
            return self.inner.verify(draft_token_ids, num_draft_tokens, *args, **kwargs)

    prompts = random_prompts([5, 13], seed=3)
    want, _ = _greedy(tiny["llama"], prompts)
    verifier = ChainOnly()
    drafter = HiddenBranchDrafter({tuple(p): w for p, w in zip(prompts, want)}, 512)
    got, pipe = _greedy(tiny["llama"], prompts, drafter=drafter, num_speculative_tokens=6, verifier=verifier)
    assert got == want and verifier.calls
    assert pipe.last_run_metrics.acceptance_rate == 0.0  # the first branch is the wrong one


def test_sampled_requests_run_with_trees(tiny):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=7)
    prompts = random_prompts([5, 13], seed=3)
    runs = []
    for _ in range(2):
        pipe = Pipeline.from_pretrained(tiny["llama"], drafter="ngram_tree", num_speculative_tokens=6,
                                        verifier="tree")
        runs.append([o.token_ids for o in pipe.generate(prompts, params)])
        assert_no_leaks(pipe)
    assert runs[0] == runs[1]  # seeded: reproducible with trees too
    assert torch.is_tensor(torch.tensor(runs[0][0]))


def test_triton_backend_runs_trees(tiny):
    """The Triton kernel's tree mask end to end (under the interpreter: one short request)."""
    pytest.importorskip("triton")
    from servelab.attention import get_attention_backend

    prompts = random_prompts([6], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in Pipeline.from_pretrained(tiny["llama"], attention_backend="torch").generate(
        prompts, params)]
    if get_attention_backend("triton").device_problem(torch.device("cpu")) is not None:
        pytest.skip("Triton cannot run on CPU tensors here (TRITON_INTERPRET unset)")
    drafter = HiddenBranchDrafter({tuple(prompts[0]): want[0]}, 512, depth=2)
    pipe = Pipeline.from_pretrained(tiny["llama"], attention_backend="triton", drafter=drafter,
                                    num_speculative_tokens=4, verifier="tree")
    assert [o.token_ids for o in pipe.generate(prompts, params)] == want
    assert pipe.last_run_metrics.num_accepted_tokens >= 2  # a hidden second branch was taken


DRAFTERS = {
    "ngram_tree": lambda tiny: "ngram_tree",
    "layer_skip-chain": lambda tiny: LayerSkipDrafter(1),
    "layer_skip-static": lambda tiny: LayerSkipDrafter(1, tree="static", tree_width=3),
    "layer_skip-dynamic": lambda tiny: LayerSkipDrafter(1, tree="dynamic"),
    "draft_model-static": lambda tiny: DraftModelDrafter.from_pretrained(tiny["draft"], tree="static"),
    "draft_model-dynamic": lambda tiny: DraftModelDrafter.from_pretrained(tiny["draft"], tree="dynamic",
                                                                          tree_width=3),
}


@pytest.mark.parametrize("verifier", ["tree", "rejection"])
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_every_tree_drafter_keeps_greedy_output(tiny, drafter, verifier):
    prompts = random_prompts([4, 11, 26], seed=21)
    want, _ = _greedy(tiny["llama"], prompts)
    got, pipe = _greedy(tiny["llama"], prompts, drafter=DRAFTERS[drafter](tiny), num_speculative_tokens=6,
                        verifier=verifier, num_blocks=40, block_size=4)
    assert got == want
    assert pipe.last_run_metrics.num_draft_tokens > 0
    assert_no_leaks(pipe)


def test_layer_skip_is_a_view_of_the_target(tiny):
    pipe = Pipeline.from_pretrained(tiny["llama"], drafter="layer_skip", num_speculative_tokens=3)
    drafter, target = pipe.drafter, pipe.model
    assert isinstance(drafter, LayerSkipDrafter) and drafter.num_layers == len(target.model.layers) // 2
    assert drafter.model.model.layers[0] is target.model.layers[0]  # shared weights, nothing copied
    assert len(drafter.model.model.layers) == drafter.num_layers and drafter.model.lm_head_weight is \
        target.lm_head_weight
    assert len(target.model.layers) == target.config.num_hidden_layers  # the target is untouched
    with pytest.raises(ValueError, match="num_layers"):
        LayerSkipDrafter(num_layers=len(target.model.layers), model=target)
    with pytest.raises(RuntimeError, match="no target model"):
        LayerSkipDrafter(1).propose_for_requests([])


def test_structured_outputs_mask_each_tree_slot_by_its_own_path(tiny):
    """Grammar-constrained greedy requests: identical output with trees, and the right branch (hidden
    behind a wrong one the grammar may forbid) is still found: each slot is masked along its own path."""
    pytest.importorskip("xgrammar")
    from servelab import StructuredOutputsParams

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    constraints = [StructuredOutputsParams(json=schema), StructuredOutputsParams(regex=r"[a-c]{2}-[0-9]{3}")]
    prompts = ["The cache line was", "A block table maps"]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=c) for c in constraints]
    plain = Pipeline.from_pretrained(tiny["llama"]).generate(prompts, params)
    tok = Pipeline.from_pretrained(tiny["llama"]).tokenizer
    drafter = HiddenBranchDrafter({tuple(tok.encode(p)): o.token_ids for p, o in zip(prompts, plain)}, 512)
    for d in (drafter, "ngram_tree"):
        pipe = Pipeline.from_pretrained(tiny["llama"], drafter=d, num_speculative_tokens=6, verifier="tree")
        outs = pipe.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        assert all(o.finish_reason == "stop" for o in outs)
        if d is drafter:
            assert pipe.last_run_metrics.num_accepted_tokens > 0


def test_the_scheduler_cuts_trees_to_a_prefix_of_nodes(tiny):
    """A token budget smaller than the trees: the scheduler keeps each tree's first nodes
    (parents precede children, so that is a tree) and output stays exact."""
    prompts = random_prompts([5, 13, 21, 8], seed=3)
    want, _ = _greedy(tiny["llama"], prompts)
    drafter = HiddenBranchDrafter({tuple(p): w for p, w in zip(prompts, want)}, 512)
    got, pipe = _greedy(tiny["llama"], prompts, drafter=drafter, num_speculative_tokens=6, verifier="tree",
                        max_num_batched_tokens=32, long_prefill_token_threshold=0)
    assert got == want
    assert pipe.last_run_metrics.num_accepted_tokens > 0
    assert_no_leaks(pipe)


def test_a_malformed_tree_fails_only_its_request(tiny):
    prompts = random_prompts([4, 5, 6, 7], seed=8)
    bad = {tuple(prompts[1]), tuple(prompts[3])}

    class BadTree(Drafter):
        def propose_with_probs(self, token_ids, k):
            if any(tuple(token_ids[: len(p)]) == p for p in bad):
                return DraftProposal([1], parents=[3])  # a parent that does not precede its node
            return DraftProposal([1, 2][:k], parents=[-1, -1][:k])

    pipe = Pipeline.from_pretrained(tiny["llama"], drafter=BadTree(), num_speculative_tokens=3, verifier="tree")
    outs = pipe.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    failed = [o for o in outs if o.finish_reason == "error"]
    assert [o.finish_reason == "error" for o in outs] == [False, True, False, True]
    assert all("parents" in o.error for o in failed)
    assert_no_leaks(pipe)


def test_logprobs_come_from_each_emitted_tokens_own_slot(tiny):
    prompts = random_prompts([5, 13], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    plain = Pipeline.from_pretrained(tiny["llama"]).generate(prompts, params)
    drafter = HiddenBranchDrafter({tuple(p): o.token_ids for p, o in zip(prompts, plain)}, 512)
    pipe = Pipeline.from_pretrained(tiny["llama"], drafter=drafter, num_speculative_tokens=6, verifier="tree")
    outs = pipe.generate(prompts, params)
    assert pipe.last_run_metrics.num_accepted_tokens > 0
    for got, want in zip(outs, plain):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs):
            assert [t for t, _ in a] == [t for t, _ in b]
            assert [lp for _, lp in a] == pytest.approx([lp for _, lp in b], abs=1e-4)


def test_sliding_window_models_get_first_branches(tiny):
    """Mistral's window counts slots, not tree depths: its trees are verified as their first branch."""
    prompts = random_prompts([5, 30], seed=3)
    want, _ = _greedy(tiny["mistral"], prompts)
    drafter = HiddenBranchDrafter({tuple(p): w for p, w in zip(prompts, want)}, 512)
    got, pipe = _greedy(tiny["mistral"], prompts, drafter=drafter, num_speculative_tokens=6, verifier="tree")
    assert got == want
    assert pipe.last_run_metrics.num_accepted_tokens == 0  # the first branch is the wrong one

"""Expert parallelism on the multiproc executor: two worker processes over gloo, each holding half of
every sparse layer's experts (dispatch: none, tokens are replicated in the TP group; combine: one
all-reduce), greedy outputs token-identical to one process with prefix caching, n-gram speculation and
preemption. Refusals come before any process
starts: an EP size that does not divide the experts, expert parallelism on a dense model."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from servelab import Pipeline, SamplingParams
from servelab.models import build_tiny_model
from servelab.moe.experts import fused_experts_cpu
from servelab.moe.parallel import check_expert_parallel

SETTINGS = dict(enable_prefix_caching=True, drafter="ngram", num_speculative_tokens=2, block_size=4, num_blocks=40)
PROMPTS = ["The expert router sends tokens", "Experts share the load", "The expert router picks two"] * 2
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):  # shared expert + a dense layer: every kind of MLP under TP
    return build_tiny_model(tmp_path_factory.mktemp("ep") / "qwen2-moe", arch="qwen2_moe", num_hidden_layers=3,
                            mlp_only_layers=[1])


def test_ep2_is_token_identical_to_one_process(qwen2_moe):
    single = Pipeline.from_pretrained(qwen2_moe, **SETTINGS)
    expected = [o.token_ids for o in single.generate(PROMPTS, GREEDY)]
    assert single.last_run_metrics.num_preemptions > 0
    # One start (each spawns two workers importing torch: ~30 s here). Attention and the dense layer are
    # tensor-parallel too, and shard_model leaves the expert parameters to the EP step (which plain TP=2,
    # experts replicated, relies on as well).
    with Pipeline.from_pretrained(qwen2_moe, tensor_parallel_size=2, enable_expert_parallel=True, **SETTINGS) as pipe:
        outs = pipe.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == expected
        assert all(s["comm_s"] > 0 for s in pipe.executor.comm_stats())
    assert multiprocessing.active_children() == []


def test_refusals_before_any_process(qwen2_moe, tmp_path):
    odd = build_tiny_model(tmp_path / "six", arch="qwen3_moe", num_experts=6, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="expert-parallel size 4 .* does not divide the model's 6 experts"):
        check_expert_parallel(6, 4)
    with pytest.raises(ValueError, match="does not divide the model's 6 experts"):
        Pipeline.from_pretrained(odd, tensor_parallel_size=4, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        Pipeline.from_pretrained(build_tiny_model(tmp_path / "dense"), tensor_parallel_size=2,
                                 enable_expert_parallel=True)
    assert multiprocessing.active_children() == []


def test_a_rank_sums_only_its_experts():
    """Two ranks' partial outputs (the other rank's pairs as -1) add up to the whole layer's."""
    gen = torch.Generator().manual_seed(0)
    x, w13, w2 = torch.randn(7, 16, generator=gen), torch.randn(8, 24, 16, generator=gen), torch.randn(8, 16, 12,
                                                                                                     generator=gen)
    ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(7)])
    weights = torch.rand(7, 3, generator=gen)
    parts = []
    for start in (0, 4):
        local = torch.where((ids >= start) & (ids < start + 4), ids - start, -1)
        parts.append(fused_experts_cpu(x, w13[start:start + 4], w2[start:start + 4], weights, local))
    torch.testing.assert_close(parts[0] + parts[1], fused_experts_cpu(x, w13, w2, weights, ids))


class _FakeGroup:
    """A 2-rank group seen from one rank: all_reduce records its calls (and adds nothing)."""

    def __init__(self, rank: int) -> None:
        self.size, self.rank_in_group, self.calls = 2, rank, 0

    def all_reduce(self, tensor):
        self.calls += 1
        return tensor


def test_the_step_keeps_this_ranks_experts(qwen2_moe):
    from types import SimpleNamespace

    from servelab.config import PipelineConfig
    from servelab.models import load_model
    from servelab.moe import moe_blocks
    from servelab.moe.parallel import shard_experts
    from servelab.pipeline.setup import MODEL_STEPS

    step = next(s for s in MODEL_STEPS if s.target == "servelab.moe.parallel:shard_experts")
    assert step.active(PipelineConfig.from_kwargs(tensor_parallel_size=2, enable_expert_parallel=True))
    assert not step.active(PipelineConfig.from_kwargs(tensor_parallel_size=2))
    whole, _ = load_model(qwen2_moe)
    model, _ = load_model(qwen2_moe)
    group = _FakeGroup(rank=1)
    shard_experts(model, None, parallel_state=SimpleNamespace(ep=group))
    for (_, mine), (_, full) in zip(moe_blocks(model), moe_blocks(whole)):
        assert mine.experts.ep_range == (4, 4)
        assert torch.equal(mine.experts.gate_up_proj, full.experts.gate_up_proj[4:])
        x = torch.randn(5, model.config.hidden_size)
        weights, ids = full.route(x)
        local = torch.where(ids >= 4, ids - 4, -1)
        want = fused_experts_cpu(x, full.experts.gate_up_proj[4:], full.experts.down_proj[4:], weights, local)
        torch.testing.assert_close(mine.experts(x, weights, ids), want)
    assert group.calls == len(moe_blocks(model))

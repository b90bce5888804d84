"""A servelab logits processor driven through vLLM v1's logits-processor interface on CPU tensors.

The bridged class is built by vLLM's own ``build_logitsprocs`` (which sorts processors by
``is_argmax_invariant()``), fed the persistent batch through ``BatchUpdate`` (add, remove, swap,
move, as vLLM's input batch reports them), and its ``apply`` output is checked against the servelab
processor on servelab metadata for the same rows, and the greedy token against servelab's ``Sampler``
with that processor. Skipped without vLLM.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from vllm.sampling_params import SamplingParams as VllmParams  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality, build_logitsprocs  # noqa: E402

from servelab.integrations.vllm import make_logits_processor_cls  # noqa: E402
from servelab.integrations.vllm.harness import build_scheduler  # noqa: E402
from servelab.integrations.vllm.logits import to_servelab_params  # noqa: E402
from servelab.samplers import Sampler  # noqa: E402
from servelab.samplers.metadata import SamplingMetadata  # noqa: E402

V = 64


class BanTokens:
    """Bans ``extra_args["ban"]`` and, after 2 outputs, the last output token (can change the argmax)."""

    argmax_invariant = False

    def apply(self, logits, metadata):
        out = logits.clone()
        for row, params in enumerate(metadata.params):
            banned = list((params.extra_args or {}).get("ban", ()))
            history = metadata.output_token_id_lists[row]
            if len(history) >= 2:
                banned.append(history[-1])
            if banned:
                out[row, banned] = float("-inf")
        return out


class KeepTopHalf:
    """Masks the lower half of each row's logits: never changes the argmax."""

    argmax_invariant = True

    def apply(self, logits, metadata):
        threshold = logits.median(dim=-1, keepdim=True).values
        return logits.masked_fill(logits < threshold, float("-inf"))


@pytest.fixture(scope="module")
def vllm_config():
    return build_scheduler().vllm_config


def test_vllm_sorts_the_bridged_classes_by_argmax_invariance(vllm_config):
    ban, top = make_logits_processor_cls(BanTokens), make_logits_processor_cls(KeepTopHalf())
    procs = build_logitsprocs(vllm_config, torch.device("cpu"), False, False, custom_logitsprocs=[ban, top])
    assert any(isinstance(p, ban) for p in procs.non_argmax_invariant)
    assert any(isinstance(p, top) for p in procs.argmax_invariant)
    assert ban.__name__ == "ServelabBanTokens"
    with pytest.raises(TypeError, match="apply"):
        make_logits_processor_cls(object())


def servelab_rows(rows):
    params = [to_servelab_params(p) for p, _, _ in rows]
    return SamplingMetadata.from_requests(params, [pr for _, pr, _ in rows], [list(o) for _, _, o in rows], V)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), bans=st.lists(st.lists(st.integers(0, V - 1), max_size=3), min_size=2,
                                                     max_size=5))
def test_apply_matches_servelab_and_greedy_matches_the_sampler(vllm_config, seed, bans):
    gen = torch.Generator().manual_seed(seed)
    cls = make_logits_processor_cls(BanTokens)
    proc = cls(vllm_config, torch.device("cpu"), False)
    # the persistent batch: params, prompt, a live output list per row
    rows = [(VllmParams(temperature=0.0, extra_args={"ban": b} if b else None), [1, 2, 3],
             torch.randint(0, V, (i % 4,), generator=gen).tolist()) for i, b in enumerate(bans)]
    proc.update_state(BatchUpdate(len(rows), [], [(i, *r) for i, r in enumerate(rows)], []))
    n = len(rows)

    def check(current):
        logits = torch.randn(len(current), V, generator=gen)
        got = proc.apply(logits.clone())
        want = BanTokens().apply(logits, servelab_rows(current))
        assert torch.equal(got, want)
        greedy = Sampler([BanTokens()]).forward(logits, servelab_rows(current)).sampled_token_ids
        assert torch.equal(got.argmax(-1), greedy)

    check(rows)
    rows[0][2].append(int(torch.randint(0, V, (1,), generator=gen)))  # outputs grow in place, as in vLLM
    rows[0][2].append(5)
    check(rows)
    # swap the first and last rows, then remove the last one (vLLM's condense: move last -> hole)
    proc.update_state(BatchUpdate(n, [], [], [(0, n - 1, MoveDirectionality.SWAP)]))
    rows[0], rows[-1] = rows[-1], rows[0]
    check(rows)
    proc.update_state(BatchUpdate(n - 1, [0], [], [(n - 1, 0, MoveDirectionality.UNIDIRECTIONAL)]))
    rows[0] = rows.pop()
    check(rows)


def test_argmax_invariant_processor_never_changes_the_greedy_token(vllm_config):
    cls = make_logits_processor_cls(KeepTopHalf())
    proc = cls(vllm_config, torch.device("cpu"), False)
    assert proc.is_argmax_invariant() is True
    rows = [(VllmParams(temperature=0.7, top_k=0), [4], []) for _ in range(3)]
    proc.update_state(BatchUpdate(3, [], [(i, *r) for i, r in enumerate(rows)], []))
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    got = proc.apply(logits.clone())
    assert torch.equal(got, KeepTopHalf().apply(logits, servelab_rows(rows)))
    assert torch.equal(got.argmax(-1), logits.argmax(-1))
    assert to_servelab_params(rows[0][0]).top_k == -1  # vLLM's top_k=0 means off


def test_bridged_processor_classes_pickle_by_value():
    import pickle

    from servelab.samplers.processors import LogitBiasProcessor

    cls = make_logits_processor_cls(LogitBiasProcessor)
    clone = pickle.loads(pickle.dumps(cls))
    assert clone.__name__ == "ServelabLogitBiasProcessor" and clone._servelab_spec[0] is LogitBiasProcessor

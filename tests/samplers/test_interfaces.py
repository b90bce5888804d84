"""The sampling-side seams: protocols, registries, a user-written verifier, drafters, backends."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from servelab.samplers import (
    DraftModelDrafter,
    DraftProposal,
    DraftRequest,
    Drafter,
    NgramDrafter,
    RejectionVerifier,
    Sampler,
    SamplerProtocol,
    SamplingMetadata,
    SamplingParams,
    TreeVerifier,
    TypicalAcceptanceVerifier,
    Verifier,
    available_drafters,
    available_sampling_backends,
    available_verifiers,
    get_drafter,
    get_sampling_backend,
    get_verifier,
    register_drafter,
    register_sampling_backend,
    register_verifier,
)
from servelab.samplers.drafters import check_proposals
from servelab.samplers.interfaces import LogitsProcessor
from servelab.samplers.verifiers import check_verifier_output

REPO = Path(__file__).resolve().parents[2]


def test_built_ins_implement_the_protocols():
    assert isinstance(Sampler(), SamplerProtocol)
    for name, cls in (("rejection", RejectionVerifier), ("typical", TypicalAcceptanceVerifier), ("tree", TreeVerifier)):
        verifier = get_verifier(name)
        assert isinstance(verifier, cls) and isinstance(verifier, Verifier) and verifier.name == name
    assert available_verifiers() == ["rejection", "tree", "typical"]
    assert get_verifier("typical", posterior_threshold=0.2).posterior_threshold == 0.2
    assert isinstance(get_drafter("ngram"), NgramDrafter) and get_drafter("ngram", max_n=5).max_n == 5
    assert available_drafters() == ["draft_model", "ngram"]
    assert available_sampling_backends() == ["auto", "torch", "triton"]
    assert isinstance(Sampler().argmax_changing[0], LogitsProcessor)


def test_a_user_written_verifier_plugs_in_through_the_public_api():
    class AcceptWhileArgmax:  # greedy-only: accept drafts while they are the target's argmax
        name = "argmax"

        def verify(self, draft_token_ids, num_draft_tokens, target_probs, draft_probs, *, greedy, generators):
            rows, start, width = [], 0, max(num_draft_tokens, default=0) + 1
            for i, k in enumerate(num_draft_tokens):
                best = target_probs[start + i: start + i + k + 1].argmax(-1).tolist()
                drafts = draft_token_ids[start: start + k].tolist()
                n = next((j for j in range(k) if drafts[j] != best[j]), k)
                rows.append(drafts[:n] + [best[n]] + [-1] * (width - n - 1))
                start += k
            return torch.tensor(rows, dtype=torch.int64).view(-1, width)

    mine = AcceptWhileArgmax()
    assert get_verifier(mine) is mine  # an object is accepted as it is
    register_verifier("argmax", AcceptWhileArgmax)
    try:
        target = torch.softmax(torch.randn(6, 9, generator=torch.Generator().manual_seed(0)) * 3, dim=-1)
        drafts = torch.tensor([int(target[0].argmax()), 0, int(target[3].argmax()), 1])
        kwargs = dict(greedy=torch.tensor([True, True]), generators=[None, None])
        out = get_verifier("argmax").verify(drafts, [2, 2], target, None, **kwargs)
        assert torch.equal(out, get_verifier("rejection").verify(drafts, [2, 2], target, None, **kwargs))
        check_verifier_output(out, [2, 2], 9)
        with pytest.raises(ValueError, match="verifier 'argmax' is already registered; pass override=True"):
            register_verifier("argmax", AcceptWhileArgmax)
        register_verifier("argmax", mine, override=True)
        assert get_verifier("argmax") is mine
    finally:
        from servelab.samplers.verifiers.registry import _VERIFIERS

        _VERIFIERS._entries.pop("argmax", None)


def test_registry_errors_name_what_is_known():
    with pytest.raises(ValueError, match="unknown verifier 'medusa'; known: 'rejection', 'tree', 'typical'"):
        get_verifier("medusa")
    with pytest.raises(TypeError, match=r"Verifier: it lacks name, verify\(\)"):
        get_verifier(object())
    with pytest.raises(ValueError, match="verifier 'typical' is already registered"):
        register_verifier("typical", TypicalAcceptanceVerifier)
    with pytest.raises(ValueError, match="unknown drafter 'eagle'; known: 'draft_model', 'ngram'; or a draft-model"):
        get_drafter("eagle")
    with pytest.raises(TypeError, match="lacks propose_for_requests, release"):
        get_drafter(object())
    with pytest.raises(ValueError, match="drafter 'ngram' is already registered"):
        register_drafter("ngram", NgramDrafter)
    with pytest.raises(ValueError, match="unknown sampling backend 'cuda'; known: 'auto', 'torch', 'triton'"):
        get_sampling_backend("cuda")
    with pytest.raises(ValueError, match="'auto' is reserved"):
        register_sampling_backend("auto", get_sampling_backend("torch"))
    with pytest.raises(TypeError, match="lacks top_k_top_p_sample, rejection_sample"):
        Sampler(backend=object())


def test_a_user_sampling_backend_by_object_and_by_name():
    torch_ops = get_sampling_backend("torch")
    calls = []

    class Counting:
        name = "counting"

        def top_k_top_p_sample(self, *args, **kwargs):
            calls.append("sample")
            return torch_ops.top_k_top_p_sample(*args, **kwargs)

        def rejection_sample(self, *args, **kwargs):
            calls.append("reject")
            return torch_ops.rejection_sample(*args, **kwargs)

    params = [SamplingParams(seed=1, top_k=3)]
    meta = SamplingMetadata.from_requests(params, [[1]], [[]], 10)
    logits = torch.randn(1, 10)
    expected = Sampler(backend="torch")(logits, meta).sampled_token_ids
    assert torch.equal(Sampler(backend=Counting())(logits, meta).sampled_token_ids, expected)
    register_sampling_backend("counting", Counting())
    try:
        assert torch.equal(Sampler(backend="counting")(logits, meta).sampled_token_ids, expected)
        RejectionVerifier(backend="counting").verify(torch.tensor([1]), [1], torch.full((2, 10), 0.1), None,
                                                      greedy=torch.tensor([True]), generators=[None])
    finally:
        from servelab.samplers.backends import _BACKENDS

        _BACKENDS._entries.pop("counting", None)
    assert calls == ["sample", "sample", "reject"]


def test_drafter_abc_defaults_and_proposal_checks():
    class Echo(Drafter):
        def propose_with_probs(self, token_ids, k):
            return DraftProposal(list(token_ids[-k:]) if k else [])

    echo = Echo()
    requests = [DraftRequest("a", [1, 2, 3], 2, SamplingParams()), DraftRequest("b", [4], 0)]
    assert echo.propose_for_requests(requests) == [DraftProposal([2, 3]), DraftProposal([])]
    assert echo.release("a") is None  # nothing to forget by default
    assert get_drafter(echo) is echo
    assert check_proposals(requests, echo.propose_for_requests(requests), vocab_size=5)
    for bad, pattern in [([DraftProposal([1, 2, 3]), DraftProposal([])], "3 tokens for request 'a'"),
                         ([DraftProposal([9]), DraftProposal([])], "token 9 for request 'a'"),
                         ([DraftProposal([1])], "1 proposals for 2 requests"),
                         ([[1], DraftProposal([])], "returned list for request 'a'"),
                         ([DraftProposal([1], torch.ones(2, 5)), DraftProposal([])], r"shape \(2, 5\)")]:
        with pytest.raises((ValueError, TypeError), match=pattern):
            check_proposals(requests, bad, vocab_size=5)
    register_drafter("echo", echo)
    try:
        assert get_drafter("echo") is echo
        with pytest.raises(TypeError, match="ready-made object; it takes no options"):
            get_drafter("echo", k=3)
    finally:
        from servelab.samplers.drafters.base import _DRAFTERS

        _DRAFTERS._entries.pop("echo", None)


def test_a_checkpoint_folder_means_the_draft_model_drafter(tmp_path):
    from servelab.models.tiny import build_tiny_model

    with pytest.raises(ValueError, match="not a checkpoint folder with a config.json"):
        get_drafter(str(tmp_path))
    folder = build_tiny_model(tmp_path / "draft", tokenizer_vocab_size=300, num_hidden_layers=1)
    drafter = get_drafter(str(folder), block_size=4)
    assert isinstance(drafter, DraftModelDrafter) and drafter.block_size == 4
    assert isinstance(get_drafter(folder), DraftModelDrafter)  # a Path too
    drafter.allocate(16)
    proposals = drafter.propose_for_requests([DraftRequest("r", [5, 6, 7], 3, SamplingParams(temperature=0))])
    assert len(proposals[0].token_ids) == 3 and proposals[0].probs is None
    free = drafter.num_free_blocks
    drafter.release("r")
    assert drafter.num_free_blocks > free == drafter.num_free_blocks - 2
    # A draft model that raises mid-proposal leaves no half-written cache behind.
    drafter.propose_for_requests([DraftRequest("r", [5, 6, 7], 3, None)])
    forward = drafter.model.forward
    drafter.model.forward = lambda *args, **kwargs: (_ for _ in ()).throw(KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        drafter.propose_for_requests([DraftRequest("r", [5, 6, 7, 1], 3, None), DraftRequest("s", [2, 3], 2)])
    assert drafter.num_free_blocks == 15 and not drafter._states
    drafter.model.forward = forward
    again = drafter.propose_for_requests([DraftRequest("r", [5, 6, 7], 3, None)])
    assert again[0].token_ids == proposals[0].token_ids


def test_fast_paths_never_import_the_references():
    """Importing and running the sampler, the three verifiers and the drafters loads no servelab.reference module
    (the "torch" sampling backend is the reference by design, so the sampler runs on a custom backend here)."""
    code = """
import sys, torch
from servelab.samplers import SamplingParams, SamplingMetadata, Sampler, get_verifier, get_drafter
import servelab.samplers.drafters, servelab.samplers.verifiers, servelab.samplers.interfaces
for name in ("typical", "tree"):
    get_verifier(name).verify(torch.tensor([1]), [1], torch.full((2, 4), 0.25), None,
                              greedy=torch.tensor([False]), generators=[None])
meta = SamplingMetadata.from_requests([SamplingParams(temperature=0)], [[1]], [[]], 4)
Sampler().compute_probs(torch.randn(1, 4), meta); Sampler()(torch.randn(1, 4), meta)
get_drafter("ngram").propose_for_requests([])
loaded = sorted(m for m in sys.modules if m.startswith("servelab.reference"))
assert not loaded, loaded
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_no_module_of_the_sampling_side_imports_the_references():
    import ast

    files = [*REPO.glob("servelab/samplers/**/*.py"), *REPO.glob("servelab/_internal/sampling_*.py"),
             REPO / "servelab/_internal/draft_layout.py", REPO / "servelab/kernels/sampling.py",
             REPO / "servelab/kernels/rejection_sample.py", REPO / "servelab/kernels/_sampling_common.py"]
    offenders = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n.startswith("servelab.reference")]
    assert not offenders

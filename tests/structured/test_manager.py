"""StructuredOutputManager: compile cache, per-position masks with drafts, rollback, errors."""

from __future__ import annotations

import importlib
import json
import sys

import pytest
import torch

from servelab.models import build_tiny_model, load_tokenizer
from servelab.samplers.structured import (
    StructuredOutputManager,
    StructuredOutputsParams,
    available_grammar_backends,
    get_grammar_backend,
    register_grammar_backend,
    unpack_bitmask,
)

pytest.importorskip("xgrammar")
VOCAB = 512


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama"))


def ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def allowed(bitmask, row):
    return set(unpack_bitmask(bitmask[row:row + 1], VOCAB).nonzero()[:, 1].tolist())


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{bad")
    with pytest.raises(ValueError, match="non-empty list"):
        StructuredOutputsParams(choice="yes")
    assert StructuredOutputsParams(json={"type": "integer"}).key == ("json", '{"type": "integer"}')


@pytest.mark.parametrize("params, match", [
    (StructuredOutputsParams(regex="[a-"), "regex= does not compile: .*Unclosed"),
    (StructuredOutputsParams(json={"type": "objectx"}), "json= does not compile"),
    (StructuredOutputsParams(grammar="root ::= "), "grammar= does not compile"),
])
def test_bad_grammar_fails_with_compiler_message_and_leaves_nothing(tokenizer, params, match):
    manager = StructuredOutputManager(tokenizer, VOCAB, [tokenizer.eos_token_id])
    with pytest.raises(ValueError, match=match):
        manager.add_request("r", params)
    assert "r" not in manager and len(manager) == 0


def test_compilation_is_cached_per_constraint(tokenizer):
    manager = StructuredOutputManager(tokenizer, VOCAB, [tokenizer.eos_token_id])
    manager.add_request("a", StructuredOutputsParams(choice=["yes", "no"]))
    manager.add_request("b", StructuredOutputsParams(choice=["yes", "no"]))
    manager.add_request("c", StructuredOutputsParams(regex="[0-9]+"))
    assert len(manager._compiled) == 2


def test_draft_rows_follow_the_drafts_and_state_rolls_back(tokenizer):
    manager = StructuredOutputManager(tokenizer, VOCAB, [tokenizer.eos_token_id])
    manager.add_request("r", StructuredOutputsParams(regex="ab(c|d)"))
    a, b, c, z = (ids(tokenizer, ch)[0] for ch in "abcz")
    before, _ = manager.fill_bitmasks([("r", [])])
    bitmask, errors = manager.fill_bitmasks([("r", [a, b]), ("free", [z])])
    assert not errors and bitmask.shape == (5, 16)
    assert allowed(bitmask, 0) == allowed(before, 0) and a in allowed(bitmask, 0)
    assert b in allowed(bitmask, 1) and a not in allowed(bitmask, 1)
    assert c in allowed(bitmask, 2) and b not in allowed(bitmask, 2)
    assert allowed(bitmask, 3) == allowed(bitmask, 4) == set(range(VOCAB))  # the free request
    # A draft the grammar rejects: later rows copy the rejecting row.
    bitmask, _ = manager.fill_bitmasks([("r", [z, a])])
    assert allowed(bitmask, 1) == allowed(bitmask, 0) and z not in allowed(bitmask, 0)
    # Nothing was accepted for real: the state is still at the start.
    again, _ = manager.fill_bitmasks([("r", [])])
    assert torch.equal(again, before)
    assert manager.accept_tokens("r", [a, b, c]) == (3, None)
    assert manager.accept_tokens("r", [tokenizer.eos_token_id, a]) == (1, None) and manager.is_terminated("r")
    manager.rollback_tokens("r", 4)
    assert torch.equal(manager.fill_bitmasks([("r", [])])[0], before)


def test_a_forbidden_token_is_an_error_not_a_silent_token(tokenizer):
    manager = StructuredOutputManager(tokenizer, VOCAB, [tokenizer.eos_token_id])
    manager.add_request("r", StructuredOutputsParams(choice=["yes"]))
    assert "violates" in manager.accept_tokens("r", ids(tokenizer, "z"))[1]


def test_grammar_without_tokenizer_is_refused():
    manager = StructuredOutputManager(None, VOCAB)
    with pytest.raises(ValueError, match="need a tokenizer"):
        manager.add_request("r", StructuredOutputsParams(choice=["a"]))


def test_registry_and_user_backend(tokenizer):
    assert "xgrammar" in available_grammar_backends()
    with pytest.raises(ValueError, match="already registered"):
        register_grammar_backend("xgrammar", object)
    with pytest.raises(ValueError, match="known: 'xgrammar'"):
        get_grammar_backend("nope")

    class AllowAll:  # a user backend: every token allowed, never terminates
        name = "allow-all"

        def compile(self, params):
            return params.key

        def new_matcher(self, compiled):
            return self

        def fill_bitmask(self, bitmask, row):
            bitmask[row] = -1

        def accept_token(self, token_id):
            return True

        def rollback(self, num_tokens):
            pass

        def is_terminated(self):
            return False

    manager = StructuredOutputManager(tokenizer, VOCAB, backend=AllowAll())
    manager.add_request("r", StructuredOutputsParams(regex="x"))
    bitmask, _ = manager.fill_bitmasks([("r", [1])])
    assert (bitmask == -1).all()
    with pytest.raises(TypeError, match="lacks"):
        StructuredOutputManager(tokenizer, VOCAB, backend=object()).backend


def test_missing_xgrammar_names_the_extra(tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    monkeypatch.delitem(sys.modules, "servelab.samplers.structured.xgrammar_backend", raising=False)
    with pytest.raises(ImportError, match=r"servelab\[structured\]"):
        importlib.import_module("servelab.samplers.structured.xgrammar_backend")
    monkeypatch.delitem(sys.modules, "servelab.samplers.structured.xgrammar_backend", raising=False)

"""Fixtures of the KV-connector tests: tiny checkpoints (built once), a shared-prefix workload,
and the reference outputs of a pipeline without a connector."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from connector_helpers import write_gemma2  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _connectors_run_on_one_thread(one_torch_thread):
    """Tiny models: see ``one_torch_thread``."""


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(model, tokenizer) of a random tiny Llama (the model object is shared: pipelines attach to it)."""
    from servelab.models import build_tiny_model, load_model, load_tokenizer

    path = build_tiny_model(tmp_path_factory.mktemp("connectors") / "tiny", arch="llama", seed=0)
    model, _ = load_model(path)
    return model, load_tokenizer(path)


@pytest.fixture(scope="session")
def tiny_gemma2(tmp_path_factory):
    from servelab.models import load_model

    model, _ = load_model(write_gemma2(tmp_path_factory.mktemp("gemma2")))
    return model

"""Fixtures for the pipeline tests: tiny checkpoints and a draft model, built once per session."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from pipeline_helpers import ARCHS  # noqa: E402

from servelab.models import build_tiny_model  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _tiny_models_run_on_one_thread(one_torch_thread):
    """Every test here runs tiny models: see ``one_torch_thread``."""


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict[str, object]:
    """arch -> checkpoint folder; also "draft": a 1-layer Llama sharing the tokenizer."""
    root = tmp_path_factory.mktemp("pipeline_tiny")
    paths = {arch: build_tiny_model(root / arch, arch=arch, seed=0) for arch in ARCHS}
    paths["draft"] = build_tiny_model(root / "draft", arch="llama", seed=1, num_hidden_layers=1)
    return paths

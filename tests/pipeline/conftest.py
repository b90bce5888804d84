"""Fixtures for the pipeline tests: tiny checkpoints and a draft model, built once per session."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from pipeline_helpers import ARCHS  # noqa: E402

from servelab.models import build_tiny_model  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls gain nothing from threads; on a shared 2-core runner the
    thread pool's contention makes them several times slower. Restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict[str, object]:
    """arch -> checkpoint folder; also "draft": a 1-layer Llama sharing the tokenizer."""
    root = tmp_path_factory.mktemp("pipeline_tiny")
    paths = {arch: build_tiny_model(root / arch, arch=arch, seed=0) for arch in ARCHS}
    paths["draft"] = build_tiny_model(root / "draft", arch="llama", seed=1, num_hidden_layers=1)
    return paths

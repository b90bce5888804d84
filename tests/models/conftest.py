"""Fixtures for the model tests: one tiny checkpoint per architecture, built once
per session, with servelab's model and transformers' model loaded from it."""

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from model_harness import ARCHS, load_hf  # noqa: E402

from servelab.models import build_tiny_model, load_model  # noqa: E402


@dataclass
class Checkpoint:
    path: Path
    model: object  # servelab LlamaForCausalLM, float32
    config: object  # servelab ModelConfig
    hf: object  # transformers model, float32, eager attention


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls gain nothing from threads, and on a shared 2-core runner the
    thread pool's contention made them 5-10x slower. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Checkpoint]:
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for arch in ARCHS:
        path = build_tiny_model(root / arch, arch=arch, seed=0)
        model, config = load_model(path)
        out[arch] = Checkpoint(path, model, config, load_hf(path))
    return out

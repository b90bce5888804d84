"""Shared fixtures of the MoE tests: tiny random checkpoints of each registered MoE architecture."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))

# Qwen2-MoE with a dense layer (mlp_only_layers) and 3 layers: both kinds of MLP in one model.
ARCH_OVERRIDES = {"qwen2_moe": dict(num_hidden_layers=3, mlp_only_layers=[1])}


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory):
    """``moe_checkpoint(arch) -> path`` of a tiny random checkpoint, built once per arch."""
    from servelab.models import build_tiny_model

    built: dict[str, object] = {}

    def make(arch: str):
        if arch not in built:
            built[arch] = build_tiny_model(tmp_path_factory.mktemp(arch), arch=arch, **ARCH_OVERRIDES.get(arch, {}))
        return built[arch]

    return make

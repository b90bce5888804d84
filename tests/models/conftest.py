"""Fixtures for the model tests: one tiny checkpoint per architecture, built once
per session, with servelab's model and transformers' model loaded from it."""

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

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
def _tiny_models_run_on_one_thread(one_torch_thread):
    """Every test here runs tiny models: see ``one_torch_thread``."""


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Checkpoint]:
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for arch in ARCHS:
        path = build_tiny_model(root / arch, arch=arch, seed=0)
        model, config = load_model(path)
        out[arch] = Checkpoint(path, model, config, load_hf(path))
    return out


@pytest.fixture(scope="module")
def kernel_library():
    """The C CPU kernel library (RoPE, the few-row GEMM): skips only without a compiler; a
    compiler that gives no loaded library fails."""
    import shutil

    from servelab.attention import cpu_decode, cpu_kernel_build

    if shutil.which(cpu_kernel_build.compiler()) is None:
        pytest.skip("no C compiler: the torch / oneDNN forms run")
    if cpu_decode.library() is None:
        pytest.fail("a C compiler exists but the CPU kernel library did not load")

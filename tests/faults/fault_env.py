"""Shared by the fault-injection tests: one tiny checkpoint, models per attention backend,
and reference greedy outputs from a fresh pipeline (computed once per prompt)."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile

import torch

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64
GREEDY_TOKENS = 6


@functools.lru_cache(maxsize=1)
def checkpoint() -> str:
    """A tiny Llama checkpoint folder (random weights, a local BPE tokenizer)."""
    from servelab.models import build_tiny_model

    folder = tempfile.mkdtemp(prefix="servelab-faults-")
    atexit.register(shutil.rmtree, folder, True)
    return str(build_tiny_model(os.path.join(folder, "tiny"), arch="llama", seed=0))


@functools.lru_cache(maxsize=None)
def model_for(backend: str, role: str = "faulty"):
    """One model object per attention backend and role, shared by every
    pipeline of that backend (a pipeline attaches its backend to the model it
    is given). The reference pipelines get their own (``role="reference"``):
    the pipelines under test patch their model's ``forward``."""
    from servelab.models import load_model

    model, _ = load_model(checkpoint())
    return model


@functools.lru_cache(maxsize=1)
def tokenizer():
    from servelab.models import load_tokenizer

    return load_tokenizer(checkpoint())


@functools.lru_cache(maxsize=None)
def fresh_pipeline(backend: str):
    """The reference: a fresh pipeline with prefix caching off, no speculation, no user code."""
    from servelab import Pipeline

    return Pipeline(model_for(backend, "reference"), tokenizer(), block_size=BLOCK_SIZE, num_blocks=64,
                    enable_prefix_caching=False, attention_backend=backend, max_model_len=MAX_MODEL_LEN)


@functools.lru_cache(maxsize=None)
def fresh_greedy(backend: str, prompt: tuple[int, ...], max_tokens: int = GREEDY_TOKENS) -> tuple[tuple[int, ...], str]:
    """A fresh pipeline's greedy continuation of ``prompt``: (token ids, text)."""
    from servelab.samplers import SamplingParams

    pipe = fresh_pipeline(backend)
    with torch.inference_mode():
        out = pipe.generate([list(prompt)], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    assert out[0].finish_reason == "length", (out[0].finish_reason, out[0].error)
    return tuple(out[0].token_ids), out[0].text

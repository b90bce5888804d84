"""vLLM's CPU-side classes need ``VLLM_TARGET_DEVICE=cpu`` before vLLM is first imported on a
machine without CUDA (``servelab.integrations.vllm`` sets it too, but a test module may import
vLLM first)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

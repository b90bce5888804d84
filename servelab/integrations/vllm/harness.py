"""vLLM's real v1 scheduler on a CPU, built the way vLLM's own scheduler tests build it.

vLLM's ``tests/v1/core/utils.py::create_scheduler`` constructs
``vllm.v1.core.sched.scheduler.Scheduler`` from a ``VllmConfig`` (a model
config, a scheduler config, a cache config) and a ``KVCacheConfig`` with one
full-attention group, and drives it with a fake model output. On a machine
without a GPU that works when ``VLLM_TARGET_DEVICE=cpu`` is set before vLLM is
imported (:mod:`._compat` sets it when CUDA is absent) and the model folder
holds only a ``config.json`` (:data:`TINY_LLAMA_CONFIG`, written to a
temporary folder once per process; no weights and no tokenizer are read).

Used by the differential tests (tests/integrations/) and by
``servelab simulate --engine vllm``.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

from servelab.integrations.vllm._compat import require_vllm

require_vllm()

import torch  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

__all__ = ["TINY_LLAMA_CONFIG", "build_scheduler", "make_request", "model_output", "tiny_model_dir"]

TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 65536, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "attention_bias": False,
    "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "dtype": "float32",
}
"""A config-only Llama (what vLLM's ``ModelConfig`` reads to size the model); EOS is token 2."""


@functools.lru_cache(maxsize=1)
def tiny_model_dir() -> str:
    """A temporary folder holding only :data:`TINY_LLAMA_CONFIG` as ``config.json``."""
    folder = Path(tempfile.mkdtemp(prefix="servelab-vllm-tiny-llama-"))
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG, indent=1))
    return str(folder)


@functools.lru_cache(maxsize=1)
def _init_hashing() -> None:
    init_none_hash(sha256)


def build_scheduler(
    scheduler_cls: type | None = None,
    *,
    num_blocks: int = 1024,
    block_size: int = 16,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 4096,
    enable_prefix_caching: bool = True,
    long_prefill_token_threshold: int = 0,
    watermark: float = 0.0,
    policy: str = "fcfs",
    reserve_full_prompt: bool = False,
    log_stats: bool = False,
    kv_transfer_config=None,
):
    """A vLLM v1 scheduler (``scheduler_cls``, default vLLM's own ``Scheduler``) over
    ``num_blocks`` KV blocks of ``block_size`` tokens, on the CPU.

    ``policy`` is vLLM's own setting (``"fcfs"`` or ``"priority"``); a bridged
    class ignores it. ``reserve_full_prompt`` is vLLM's
    ``scheduler_reserve_full_isl`` (admit only when the whole prompt fits);
    off by default here because servelab's scheduler admits on the first
    chunk. ``num_blocks`` counts vLLM's null block (block 0), as servelab's
    pool does. ``kv_transfer_config``: a vLLM ``KVTransferConfig`` (a KV
    connector; its scheduler side runs in the scheduler).
    """
    _init_hashing()
    model_config = ModelConfig(model=tiny_model_dir(), skip_tokenizer_init=True, dtype="float32", seed=0,
                               max_model_len=max_model_len)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        is_encoder_decoder=False, enable_chunked_prefill=True,
        long_prefill_token_threshold=long_prefill_token_threshold, watermark=watermark, policy=policy,
        scheduler_reserve_full_isl=reserve_full_prompt, async_scheduling=False)
    cache_config = CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, cache_dtype="auto",
                               enable_prefix_caching=enable_prefix_caching)
    cache_config.num_gpu_blocks = num_blocks
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config,
                             kv_transfer_config=kv_transfer_config)
    kv_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=4, head_size=64,
                                                      dtype=torch.float32))])
    cls = scheduler_cls or Scheduler
    return cls(vllm_config=vllm_config, kv_cache_config=kv_config,
               structured_output_manager=StructuredOutputManager(vllm_config), block_size=block_size,
               log_stats=log_stats)


@functools.lru_cache(maxsize=8)
def _hasher(block_size: int):
    _init_hashing()
    return get_request_block_hasher(block_size, sha256)


def make_request(request_id: str, prompt_token_ids: list[int], max_tokens: int, *, arrival_time: float = 0.0,
                 priority: int = 0, client_id: str | None = None, block_size: int = 16,
                 ignore_eos: bool = True) -> Request:
    """A vLLM ``Request`` with block hashes for ``block_size``; ``client_id`` goes to
    ``sampling_params.extra_args`` (what the bridge reads for fair share)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos,
                            extra_args={"client_id": client_id} if client_id is not None else None)
    return Request(request_id, list(prompt_token_ids), params, None, arrival_time=arrival_time, priority=priority,
                   block_hasher=_hasher(block_size))


def model_output(scheduler, scheduler_output, token: int = 7) -> ModelRunnerOutput:
    """A fake model step: ``token`` for every scheduled request whose computation reached the end of
    its tokens, nothing for a partial prefill (what vLLM's model runner returns)."""
    requests = scheduler.requests
    ids = list(scheduler_output.num_scheduled_tokens)
    sampled = [[token] if requests[r].num_computed_tokens >= requests[r].num_tokens else [] for r in ids]
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=sampled)

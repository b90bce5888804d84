"""Cut a loaded model into one rank's part: tensor-parallel shards and pipeline stages.

:func:`shard_model` is the ``tensor_parallel_size`` step of
:data:`servelab.pipeline.setup.MODEL_STEPS` (run inside each worker, before
quantization and LoRA): every attention block's ``qkv_proj`` becomes a
:class:`~servelab.executor.layers.ColumnParallelLinear` of its rank's query and KV
heads (KV heads replicated when the TP size exceeds them), ``o_proj`` a
:class:`~servelab.executor.layers.RowParallelLinear` over those query heads, the
MLP's ``gate_up_proj`` column-parallel per slice and ``down_proj`` row-parallel, the
embedding vocab-parallel and the LM head vocab-parallel with an all-gather (every rank
gets the full logits and samples the same tokens). The attention modules and
``model.config`` are updated to the local head counts, so the KV cache each rank
allocates holds only its heads (the driver's block ids index every rank's pool).

:func:`split_stages` (run after :func:`shard_model`, so a stage's head is already the
rank's vocab-parallel one) keeps one pipeline stage's layers: the first stage embeds, a later
stage receives the previous stage's hidden states ``[T, hidden]`` instead
(:class:`StageInput`), a stage before the last sends its output on
(:class:`StageOutput`) instead of the final norm, and the last stage's logits are
broadcast to the other stages, whose runners then sample the same tokens. The whole
step's batch flows through the stages in order (no microbatches: with the scheduler
in one driver and one step in flight, a stage idles while the others run).

:func:`check_parallel` is every refusal, made in the driver before any process starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from servelab.executor.layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                      VocabParallelEmbedding, even_split, qkv_shard_plan, slice_shard_plan,
                                      vocab_range)
from servelab.executor.parallel_state import GroupCoordinator, ParallelState, get_parallel_state
from servelab.models.linear import Linear

__all__ = ["StageInput", "StageOutput", "check_parallel", "shard_model", "split_stages", "stage_layers"]


def _attention_blocks(model: nn.Module) -> list[Any]:
    return [m for m in model.modules() if hasattr(m, "qkv_proj") and hasattr(m, "o_proj")
            and hasattr(m, "num_kv_heads")]


def _mlp_blocks(model: nn.Module) -> list[Any]:
    # Layers only: a MoE layer's stacked expert weights are parameters named alike (its experts stay
    # whole; enable_expert_parallel splits them by expert, servelab.moe.parallel).
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and isinstance(getattr(m, "down_proj", None),
                                                                                   nn.Module)]


def check_parallel(parallel: Any, model_config: Any) -> None:
    """``ValueError`` when the model cannot be cut into ``parallel``'s grid: query heads,
    KV heads (split or replicated), the MLP width and the vocabulary per TP rank, and
    at least one layer per pipeline stage."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    cfg = model_config
    for rank in range(tp):
        qkv_shard_plan(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, tp, rank)
    even_split(cfg.intermediate_size, tp, 0, "intermediate_size")
    vocab_range(cfg.vocab_size, tp, tp - 1)
    if getattr(parallel, "enable_expert_parallel", False) and tp > 1:
        from servelab.moe.parallel import check_model_expert_parallel

        check_model_expert_parallel(cfg, tp)
    if pp > cfg.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {cfg.num_hidden_layers} layers; "
                         f"valid: 1..{cfg.num_hidden_layers}")


def shard_model(model: Any, config: Any, *, parallel_state: ParallelState | None = None, **context: Any) -> Any:
    """``model`` cut to its tensor-parallel rank's shards in place (see the module docstring);
    ``parallel_state`` defaults to the calling worker's. ``config`` is the pipeline's."""
    state = parallel_state if parallel_state is not None else get_parallel_state()
    tp = state.tp
    if tp.size != config.parallel.tensor_parallel_size:
        raise ValueError(f"this rank's tensor-parallel group has {tp.size} ranks; the config asks for "
                         f"tensor_parallel_size={config.parallel.tensor_parallel_size}")
    cfg = model.config
    local_heads = local_kv = 0
    for attn in _attention_blocks(model):
        ranges, local_heads, local_kv = qkv_shard_plan(attn.num_heads, attn.num_kv_heads, attn.head_dim, tp.size,
                                                       tp.rank_in_group)
        attn.qkv_proj = ColumnParallelLinear(attn.qkv_proj, ranges, tp_rank=tp.rank_in_group, tp_size=tp.size)
        attn.o_proj = RowParallelLinear(attn.o_proj, tp=tp, in_start=ranges[0].start, in_size=ranges[0].size)
        attn.num_heads, attn.num_kv_heads = local_heads, local_kv
        attn.q_size, attn.kv_size = local_heads * attn.head_dim, local_kv * attn.head_dim
    for mlp in _mlp_blocks(model):
        ranges = slice_shard_plan(mlp.gate_up_proj, "gate_up_proj", tp.size, tp.rank_in_group)
        start, size = even_split(mlp.down_proj.in_features, tp.size, tp.rank_in_group, "intermediate_size")
        mlp.gate_up_proj = ColumnParallelLinear(mlp.gate_up_proj, ranges, tp_rank=tp.rank_in_group,
                                                tp_size=tp.size)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, tp=tp, in_start=start, in_size=size)
        if hasattr(mlp, "intermediate_size"):
            mlp.intermediate_size = size
    _shard_vocab(model, tp)
    if local_heads:
        model.config = dataclasses.replace(cfg, num_attention_heads=local_heads, num_key_value_heads=local_kv)
    return model


def _shard_vocab(model: Any, tp: GroupCoordinator) -> None:
    """Vocab-parallel embedding and LM head (a tied head slices the embedding's full weight)."""
    head_weight = model.lm_head_weight
    pack = bool(getattr(model, "pack_weights", True))
    head = ParallelLMHead(head_weight, tp=tp, pack_weights=pack)
    model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, tp=tp)
    if getattr(model, "lm_head", None) is not None:
        model.lm_head = None
    model.parallel_lm_head = head
    object.__setattr__(model, "lm_head_gemm", head.gather)  # an instance attribute: shadows the method


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """``(first, end)`` layer indices of stage ``pp_rank``: contiguous, sizes differing by at most
    one (the earlier stages take the extra layers)."""
    base, extra = divmod(num_layers, pp_size)
    first = pp_rank * base + min(pp_rank, extra)
    return first, first + base + (1 if pp_rank < extra else 0)


class StageInput(nn.Module):
    """A later stage's embedding: receives ``[T, hidden]`` from the previous stage (``ids [T]``
    give only ``T``). ``weight`` is an empty ``[0, hidden]`` tensor of the model's dtype and
    device (what ``model.dtype`` / ``model.device`` read)."""

    pp: GroupCoordinator
    weight: torch.Tensor

    def __init__(self, pp: GroupCoordinator, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("weight", torch.empty((0, hidden_size), dtype=dtype, device=device))
        self.hidden_size = hidden_size
        object.__setattr__(self, "pp", pp)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.pp.recv_prev((input_ids.shape[0], self.hidden_size), self.weight.dtype, self.weight.device)


class StageOutput(nn.Module):
    """An earlier stage's final norm: sends ``x [T, hidden]`` to the next stage, returns it."""

    pp: GroupCoordinator

    def __init__(self, pp: GroupCoordinator) -> None:
        super().__init__()
        object.__setattr__(self, "pp", pp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.pp.send_next(x)
        return x


def split_stages(model: Any, parallel_state: ParallelState | None = None) -> Any:
    """Keep stage ``pp_rank``'s layers of ``model`` (in place; see the module docstring)."""
    from servelab.models.llama import LlamaForCausalLM

    state = parallel_state if parallel_state is not None else get_parallel_state()
    pp = state.pp
    if pp.size == 1:
        return model
    if type(model).forward is not LlamaForCausalLM.forward:
        raise ValueError(f"pipeline_parallel_size > 1 supports the Llama-family forward only; "
                         f"{type(model).__name__} has its own (an embedding scale or per-layer rotary tables)")
    cfg = model.config
    first, end = stage_layers(cfg.num_hidden_layers, pp.size, pp.rank_in_group)
    model.model.layers = nn.ModuleList(list(model.model.layers)[first:end])
    model.config = dataclasses.replace(cfg, num_hidden_layers=end - first,
                                       sliding_windows=tuple(cfg.sliding_windows[first:end]))
    dtype, device = model.dtype, model.device
    if pp.is_last and not pp.is_first and model.lm_head is None and "lm_head_gemm" not in model.__dict__:
        # a tied head reads the embedding, which this stage replaces: keep the weight as its own head
        head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        head.weight = model.model.embed_tokens.weight
        head.pack_weights = bool(getattr(model, "pack_weights", True))
        model.lm_head = head
    if not pp.is_first:
        model.model.embed_tokens = StageInput(pp, cfg.hidden_size, dtype, device)
    if not pp.is_last:
        model.model.norm = StageOutput(pp)
    own_gemm = model.lm_head_gemm
    vocab = cfg.vocab_size

    def stage_logits(hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's ``[n, vocab]`` logits (model dtype), broadcast to every stage."""
        logits = own_gemm(hidden) if pp.is_last else torch.empty((hidden.shape[0], vocab), dtype=dtype,
                                                                  device=device)
        return pp.broadcast(logits.contiguous(), pp.size - 1)

    object.__setattr__(model, "lm_head_gemm", stage_logits)
    return model


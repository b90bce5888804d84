"""Tensor-parallel layers on the :mod:`servelab.models.layer_api` interface.

A linear layer ``y = x W^T + b`` (``W [out, in]``) is split over ``tp`` ranks one of two ways:

- **column-parallel** (:class:`ColumnParallelLinear`): each rank keeps some *rows* of ``W``
  (output features) and computes its part of ``y`` with no communication. A fused layer is
  split *per output slice* (``qkv_proj``: its q rows by query heads and its k and v rows
  by KV heads; ``gate_up_proj``: its gate and its up rows), so each rank's output is
  again ``[q | k | v]`` or ``[gate | up]`` and the model code runs unchanged on it;
- **row-parallel** (:class:`RowParallelLinear`): each rank keeps some *columns* of ``W``
  (input features: exactly the heads or intermediate units the column-parallel layer
  before it produced on that rank), computes a partial ``y`` and one all-reduce sums
  the partials; the bias is added once, after the sum.

So an attention block costs one all-reduce (after ``o_proj``) and an MLP one (after
``down_proj``). **KV heads** are split when ``tp`` divides them; when ``tp`` is a multiple
of their number each KV head is *replicated* on ``tp / num_kv_heads`` consecutive ranks
(vLLM's rule: rank ``r`` holds KV head ``r // (tp / num_kv_heads)``, the one its query
heads read); any other ``tp`` is refused (:func:`qkv_shard_plan`).

The vocabulary is split too: :class:`VocabParallelEmbedding` looks up the ids of its
row range (zeros elsewhere) and all-reduces (exact: one rank contributes each row), and
:class:`ParallelLMHead` computes its vocabulary range's logits and all-gathers them
(exact: no reduction), so every rank samples from the full logits.

**References.** Each sharded layer's reference is the unsharded layer: column shards
concatenated per slice, row partials summed (:meth:`RowParallelLinear.partial` is the
rank's term without the reduction, so tests can simulate ranks in one process).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from servelab.executor.parallel_state import GroupCoordinator
from servelab.models.layer_api import OutputSlice, dense_weight, output_slices
from servelab.models.linear import Linear

__all__ = ["ColumnParallelLinear", "ParallelLMHead", "RowParallelLinear", "RowRange", "VocabParallelEmbedding",
           "even_split", "qkv_shard_plan", "vocab_range"]


@dataclass(frozen=True)
class RowRange:
    """Rows ``[start, start + size)`` of the full layer's output that one rank keeps for slice ``name``."""

    name: str
    start: int
    size: int


def even_split(total: int, parts: int, index: int, what: str) -> tuple[int, int]:
    """``(start, size)`` of part ``index`` of ``total`` split evenly into ``parts``; refuses a remainder."""
    if total % parts:
        raise ValueError(f"tensor_parallel_size={parts} does not divide {what}={total}; valid: a divisor of {total}")
    size = total // parts
    return index * size, size


def qkv_shard_plan(num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int, tp_rank: int
                   ) -> tuple[list[RowRange], int, int]:
    """Rank ``tp_rank``'s rows of a fused ``[q | k | v]`` projection.

    Returns ``(row ranges in order q, k, v; local query heads; local KV heads)``. Query heads
    must divide by ``tp_size``; KV heads are split when ``tp_size`` divides them, replicated
    when ``tp_size`` is a multiple of them, else refused (``ValueError`` naming both).
    """
    q_start, q_heads = even_split(num_heads, tp_size, tp_rank, "num_attention_heads")
    if num_kv_heads % tp_size == 0:
        kv_start, kv_heads = tp_rank * (num_kv_heads // tp_size), num_kv_heads // tp_size
    elif tp_size % num_kv_heads == 0:  # replicate: tp / num_kv_heads ranks share each KV head
        kv_start, kv_heads = tp_rank // (tp_size // num_kv_heads), 1
    else:
        raise ValueError(f"tensor_parallel_size={tp_size} neither divides num_key_value_heads={num_kv_heads} "
                         f"nor is a multiple of it (KV heads are split or replicated); valid: a divisor of "
                         f"{num_heads} that divides or is a multiple of {num_kv_heads}")
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    ranges = [RowRange("q_proj", q_start * head_dim, q_heads * head_dim),
              RowRange("k_proj", q_size + kv_start * head_dim, kv_heads * head_dim),
              RowRange("v_proj", q_size + kv_size + kv_start * head_dim, kv_heads * head_dim)]
    return ranges, q_heads, kv_heads


def slice_shard_plan(layer: nn.Module, name: str, tp_size: int, tp_rank: int) -> list[RowRange]:
    """Each output slice of ``layer`` (one when unfused) split evenly: rank ``tp_rank``'s part of each."""
    ranges = []
    for part in output_slices(layer, name):
        start, size = even_split(part.size, tp_size, tp_rank, f"{part.name} rows")
        ranges.append(RowRange(part.name, part.start + start, size))
    return ranges


def _bias_of(layer: nn.Module) -> torch.Tensor | None:
    bias = getattr(layer, "bias", None)
    return bias if isinstance(bias, torch.Tensor) else None


class ColumnParallelLinear(Linear):
    """The rows ``ranges`` of a full linear layer (a servelab :class:`~servelab.models.linear.Linear`
    of ``[in, sum(sizes)]``, so the packed CPU GEMM applies); ``x [T, in] -> [T, local_out]``.

    Attributes: ``ranges`` (the :class:`RowRange` kept, in output order), ``full_out_features``,
    ``tp_rank``, ``tp_size``; ``output_slices`` name the local rows per HF module.
    """

    def __init__(self, full: nn.Module, ranges: Sequence[RowRange], *, tp_rank: int, tp_size: int) -> None:
        weight, bias = dense_weight(full), _bias_of(full)
        local_out = sum(r.size for r in ranges)
        super().__init__(weight.shape[1], local_out, bias=bias is not None, dtype=weight.dtype,
                         device=weight.device)
        with torch.no_grad():
            self.weight.copy_(torch.cat([weight[r.start:r.start + r.size] for r in ranges]))
            if bias is not None:
                self.bias.copy_(torch.cat([bias[r.start:r.start + r.size] for r in ranges]))
        self.requires_grad_(False)
        self.pack_weights = bool(getattr(full, "pack_weights", True))
        self.ranges, self.full_out_features = tuple(ranges), weight.shape[0]
        self.tp_rank, self.tp_size = tp_rank, tp_size
        slices, start = [], 0
        for r in ranges:
            slices.append(OutputSlice(r.name, start, r.size))
            start += r.size
        object.__setattr__(self, "output_slices", tuple(slices))


class RowParallelLinear(Linear):
    """Columns ``[in_start, in_start + in_features)`` of a full layer; the partial products are
    summed over the tensor-parallel group (one all-reduce), then the bias is added once.

    ``x [T, local_in] -> [T, out]``. :meth:`partial` is this rank's term (no reduction, no bias).
    A layer replacing this one (quantization) must keep the reduction: call :meth:`reduce`.
    """

    tp: GroupCoordinator

    def __init__(self, full: nn.Module, *, tp: GroupCoordinator, in_start: int, in_size: int) -> None:
        weight, bias = dense_weight(full), _bias_of(full)
        super().__init__(in_size, weight.shape[0], bias=False, dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            self.weight.copy_(weight[:, in_start:in_start + in_size])
        self.output_bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.requires_grad_(False)
        self.pack_weights = bool(getattr(full, "pack_weights", True))
        object.__setattr__(self, "tp", tp)  # not a submodule
        self.in_start, self.full_in_features = in_start, weight.shape[1]

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, local_in]`` -> this rank's ``[T, out]`` term of the sum."""
        return super().forward(x)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partials (in place), then add the bias."""
        out = self.tp.all_reduce(partial)
        return out if self.output_bias is None else out.add_(self.output_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.partial(x))


def vocab_range(vocab_size: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """``(start, size)`` of rank ``tp_rank``'s vocabulary rows: ``ceil(V / tp)`` each, the last
    rank the rest (possibly fewer; never empty, else refused)."""
    per = -(-vocab_size // tp_size)
    start = tp_rank * per
    size = min(per, vocab_size - start)
    if size <= 0:
        raise ValueError(f"tensor_parallel_size={tp_size} leaves rank {tp_rank} no vocabulary rows "
                         f"(vocab_size={vocab_size}); valid: at most {vocab_size} ranks")
    return start, size


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + size)`` of an embedding ``[V, H]``: ids in range are looked up, the
    others give zeros, and the group's all-reduce completes every row (exact: one rank
    contributes each). ``ids [T] -> [T, H]``. ``weight`` is the local ``[size, H]`` shard."""

    tp: GroupCoordinator

    def __init__(self, full: nn.Embedding, *, tp: GroupCoordinator) -> None:
        super().__init__()
        vocab, hidden = full.weight.shape
        self.start, self.size = vocab_range(vocab, tp.size, tp.rank_in_group)
        self.weight = nn.Parameter(full.weight.detach()[self.start:self.start + self.size].clone(),
                                   requires_grad=False)
        self.num_embeddings, self.embedding_dim = vocab, hidden
        object.__setattr__(self, "tp", tp)

    def partial(self, input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the lookup (zeros for ids outside its range)."""
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.size)
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return out.masked_fill_(outside[:, None], 0.0) if out.dim() == 2 else out.masked_fill_(outside[..., None], 0.0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.partial(input_ids))


class ParallelLMHead(nn.Module):
    """This rank's vocabulary rows of the LM head ``[V, H]``; ``hidden [n, H]`` -> the full float32
    logits ``[n, V]`` (:meth:`gather`: in the model dtype): each rank's ``[n, size]`` GEMM, then an
    all-gather; ranks with fewer rows are padded to the widest and the padding dropped."""

    tp: GroupCoordinator

    def __init__(self, weight: torch.Tensor, *, tp: GroupCoordinator, pack_weights: bool = True) -> None:
        super().__init__()
        vocab, hidden = weight.shape
        self.vocab_size = vocab
        self.start, self.size = vocab_range(vocab, tp.size, tp.rank_in_group)
        self.per_rank = -(-vocab // tp.size)
        self.linear = Linear(hidden, self.size, bias=False, dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            self.linear.weight.copy_(weight.detach()[self.start:self.start + self.size])
        self.linear.requires_grad_(False)
        self.linear.pack_weights = pack_weights
        object.__setattr__(self, "tp", tp)

    def partial(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, H]`` -> this rank's ``[n, size]`` logits in the model dtype."""
        return self.linear(hidden)

    def gather(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, H]`` -> the full ``[n, V]`` logits in the model dtype (what ``lm_head_gemm`` returns)."""
        local = self.partial(hidden)
        if self.tp.size == 1:
            return local
        if self.size < self.per_rank:
            local = torch.nn.functional.pad(local, (0, self.per_rank - self.size))
        return self.tp.all_gather(local, dim=-1)[:, : self.vocab_size]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.gather(hidden).float()

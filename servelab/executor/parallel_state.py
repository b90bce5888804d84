"""The rank grid of one engine and its process groups: who talks to whom for TP, PP, DP and EP.

A replica of ``world_size = tensor_parallel_size * pipeline_parallel_size`` ranks
is laid out with tensor parallelism innermost (vLLM's layout)::

    rank = pp_rank * tp_size + tp_rank

so the ranks of one pipeline stage are contiguous (one stage's all-reduces stay
among neighbours) and pipeline group ``j`` is ``{j, j + tp, j + 2 tp, ...}``.
Data-parallel replicas are separate engines (:mod:`servelab.cluster.replicas`),
each with its own grid, so ``dp_size``/``dp_rank`` only name the replica; the
expert-parallel group is the tensor-parallel group of a stage (a MoE layer with
``enable_expert_parallel`` puts whole experts on the TP ranks instead of
splitting each expert).

:class:`GroupCoordinator` wraps one ``torch.distributed`` group with the three
collectives the sharded layers need (all-reduce, all-gather, broadcast) and the
point-to-point send/recv of pipeline stages, and it counts the seconds spent in
them (:attr:`GroupCoordinator.comm_seconds`), which is how the parallel study
splits a step into compute and communication. A group of one rank does no
communication at all (its collectives return their input), so the same layer
code runs unsharded in one process.

Backends: gloo on a CPU, NCCL on CUDA (:func:`default_backend`).

Usage (another piece, e.g. MoE expert parallelism)::

    from servelab.executor.parallel_state import ParallelState, get_parallel_state
    state = get_parallel_state()          # the calling worker's (a 1-rank state outside workers)
    state.ep.all_reduce(partial_expert_output)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

__all__ = ["GroupCoordinator", "ParallelState", "default_backend", "get_parallel_state", "init_parallel_state",
           "rank_layout", "set_parallel_state"]


def default_backend(device: torch.device | str) -> str:
    """``"nccl"`` for a CUDA device, else ``"gloo"``."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_layout(rank: int, tp_size: int, pp_size: int) -> tuple[int, int]:
    """``(tp_rank, pp_rank)`` of world ``rank`` (TP innermost)."""
    world = tp_size * pp_size
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank!r} is outside the world of {world} ranks (tp={tp_size} x pp={pp_size})")
    return rank % tp_size, rank // tp_size


@dataclass
class GroupCoordinator:
    """One process group: its world ranks, this rank's place in it, timed collectives.

    Attributes:
        ranks: world ranks of the group, in group order.
        rank_in_group: this process's index in ``ranks``.
        group: the ``torch.distributed`` group (None for a group of one rank).
        comm_seconds: wall seconds spent in this group's communication so far.
    """

    ranks: tuple[int, ...]
    rank_in_group: int
    group: Any = None
    comm_seconds: float = 0.0
    calls: int = 0

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def is_first(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last(self) -> bool:
        return self.rank_in_group == self.size - 1

    def _timed(self, start: float) -> None:
        self.comm_seconds += time.perf_counter() - start
        self.calls += 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` (any shape) over the group, in place; returns it."""
        if self.size == 1:
            return tensor
        import torch.distributed as dist

        start = time.perf_counter()
        dist.all_reduce(tensor, group=self.group)
        self._timed(start)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim`` in group order (equal shapes)."""
        if self.size == 1:
            return tensor
        import torch.distributed as dist

        start = time.perf_counter()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        out = torch.cat(parts, dim=dim)
        self._timed(start)
        return out

    def broadcast(self, tensor: torch.Tensor, src_in_group: int) -> torch.Tensor:
        """``tensor`` from the group's rank ``src_in_group`` to all (in place; same shape everywhere)."""
        if self.size == 1:
            return tensor
        import torch.distributed as dist

        start = time.perf_counter()
        dist.broadcast(tensor, src=self.ranks[src_in_group], group=self.group)
        self._timed(start)
        return tensor

    def send_next(self, tensor: torch.Tensor) -> None:
        """Send to the next rank of the group (pipeline stages)."""
        import torch.distributed as dist

        start = time.perf_counter()
        dist.send(tensor.contiguous(), dst=self.ranks[self.rank_in_group + 1], group=self.group)
        self._timed(start)

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Receive a ``shape``/``dtype`` tensor from the previous rank of the group."""
        import torch.distributed as dist

        start = time.perf_counter()
        out = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(out, src=self.ranks[self.rank_in_group - 1], group=self.group)
        self._timed(start)
        return out


@dataclass
class ParallelState:
    """This rank's place in the grid and its groups (``tp``, ``pp``, ``ep``; ``dp`` names the replica).

    ``ParallelState.single()`` is the one-process state (every group of size 1).
    """

    rank: int
    tp_size: int
    pp_size: int
    tp: GroupCoordinator
    pp: GroupCoordinator
    dp_size: int = 1
    dp_rank: int = 0
    ep: GroupCoordinator = field(default=None)  # type: ignore[assignment]  # set in __post_init__

    def __post_init__(self) -> None:
        if self.ep is None:
            self.ep = self.tp

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank_in_group

    @property
    def pp_rank(self) -> int:
        return self.pp.rank_in_group

    @property
    def is_last_rank(self) -> bool:
        """The rank whose runner output the driver reads (the last stage's last TP rank)."""
        return self.rank == self.world_size - 1

    def comm_seconds(self) -> float:
        """Seconds this rank spent in TP and PP communication so far."""
        return self.tp.comm_seconds + (self.pp.comm_seconds if self.pp is not self.tp else 0.0)

    @classmethod
    def single(cls) -> ParallelState:
        return cls(0, 1, 1, GroupCoordinator((0,), 0), GroupCoordinator((0,), 0))

    @classmethod
    def simulated(cls, rank: int, tp_size: int, pp_size: int = 1) -> ParallelState:
        """The state rank ``rank`` would have, with no process group behind it (collectives of a
        group larger than one must not be called): for building one rank's shards in-process."""
        tp_rank, pp_rank = rank_layout(rank, tp_size, pp_size)
        tp_ranks = tuple(pp_rank * tp_size + i for i in range(tp_size))
        pp_ranks = tuple(tp_rank + j * tp_size for j in range(pp_size))
        return cls(rank, tp_size, pp_size, GroupCoordinator(tp_ranks, tp_rank), GroupCoordinator(pp_ranks, pp_rank))


def init_parallel_state(rank: int, tp_size: int, pp_size: int, *, init_method: str, backend: str = "gloo",
                        timeout_s: float = 60.0, dp_size: int = 1, dp_rank: int = 0) -> ParallelState:
    """Join the world (``torch.distributed.init_process_group``) and cut it into groups.

    Every rank must call this with the same sizes; ``new_group`` is collective, so the
    groups are made in one fixed order on all ranks. ``timeout_s`` bounds how long a
    collective waits for a peer (a dead peer then raises instead of hanging forever).
    """
    import torch.distributed as dist

    world = tp_size * pp_size
    tp_rank, pp_rank = rank_layout(rank, tp_size, pp_size)
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
    tp_groups = [tuple(j * tp_size + i for i in range(tp_size)) for j in range(pp_size)]
    pp_groups = [tuple(i + j * tp_size for j in range(pp_size)) for i in range(tp_size)]
    made: dict[tuple[int, ...], Any] = {}
    for ranks in [*tp_groups, *pp_groups]:
        if len(ranks) > 1 and ranks not in made:
            # a group does not inherit the world's timeout (torch's default is 30 minutes)
            made[ranks] = dist.new_group(list(ranks), backend=backend, timeout=timeout)
    tp_ranks, pp_ranks = tp_groups[pp_rank], pp_groups[tp_rank]
    state = ParallelState(rank, tp_size, pp_size, GroupCoordinator(tp_ranks, tp_rank, made.get(tp_ranks)),
                          GroupCoordinator(pp_ranks, pp_rank, made.get(pp_ranks)), dp_size=dp_size,
                          dp_rank=dp_rank)
    set_parallel_state(state)
    return state


_STATE: ParallelState | None = None


def set_parallel_state(state: ParallelState | None) -> None:
    """Make ``state`` the calling process's (workers do this once)."""
    global _STATE
    _STATE = state


def get_parallel_state() -> ParallelState:
    """The calling process's state: a worker's grid, or the one-rank state."""
    return _STATE if _STATE is not None else ParallelState.single()

"""Per-step attention metadata and a helper that builds one step's model inputs.

One forward serves a *mixed* batch: fresh prefills, chunks of long prompts
and single-token decodes side by side. The model sees one flat token axis of
``T`` tokens; sequence ``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]``
and, as in vLLM v1, there is no prefill/decode distinction anywhere: a decode
is a sequence whose query is one token long.

Slot arithmetic (the paged KV cache): token at absolute position ``p`` of
sequence ``i`` lives in block ``block_table[i, p // block_size]`` at offset
``p % block_size``, i.e. slot ``block_id * block_size + offset``. This step's
new keys/values are written to ``slot_mapping`` (``-1`` = padding, skipped).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Sequence

import torch


@dataclass
class AttentionMetadata:
    """What every attention layer needs to read and write the paged cache this step.

    Attributes:
        slot_mapping: int64 ``[T]`` — cache slot of each new token (``-1`` skips it).
        block_table: int32 ``[num_seqs, max_blocks_per_seq]`` — block ids per
            sequence; unused entries may hold anything in range (e.g. 0, the
            null block).
        seq_lens: int32 ``[num_seqs]`` — tokens in the cache for each sequence
            *including* this step's, so ``context_len = seq_len - query_len``.
        query_start_loc: int32 ``[num_seqs + 1]`` — cumulative query lengths;
            ``query_start_loc[-1]`` must equal ``T``.
        tree_mask: None, or a :class:`~servelab.attention.TreeMask` (token
            trees being verified: the last ``tree_lens[i]`` keys of sequence
            ``i`` are tree nodes, seen only by the query rows whose ancestor
            bitmap has their bit).
    """

    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    tree_mask: Any = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def logits_indices(self) -> torch.Tensor:
        """int64 ``[num_seqs]``: the row of each sequence's last query token
        (whose logits predict the next token)."""
        return self.query_start_loc[1:].long() - 1

    def to(self, device: torch.device | str) -> "AttentionMetadata":
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        moved = {name: value if value is None else value.to(device) for name, value in moved.items()}
        return AttentionMetadata(**moved)


@dataclass
class GroupedAttentionMetadata:
    """One step's metadata for a model whose layers are in several KV-cache groups.

    Every group has its own block table and so its own ``slot_mapping`` and
    ``block_table``; ``seq_lens`` and ``query_start_loc`` are the same
    tensors in every group (one batch). Layer ``i`` reads and writes its
    cache through ``groups[layer_groups[i]]``.

    Attributes:
        groups: one :class:`AttentionMetadata` per KV-cache group.
        layer_groups: per model layer, the index of its group.
        block_sizes: per group, tokens per block (the group's cache views).
    """

    groups: tuple[AttentionMetadata, ...]
    layer_groups: tuple[int, ...]
    block_sizes: tuple[int, ...]

    # What the model reads outside attention (RoPE, checks): shared by every group.
    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.groups[0].slot_mapping

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.groups[0].seq_lens

    @property
    def query_start_loc(self) -> torch.Tensor:
        return self.groups[0].query_start_loc

    @property
    def num_seqs(self) -> int:
        return self.groups[0].num_seqs

    def logits_indices(self) -> torch.Tensor:
        return self.groups[0].logits_indices()

    def to(self, device: torch.device | str) -> "GroupedAttentionMetadata":
        return GroupedAttentionMetadata(tuple(m.to(device) for m in self.groups), self.layer_groups,
                                        self.block_sizes)


def prepare_inputs(
    token_ids: Sequence[Sequence[int]],
    num_computed_tokens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Flatten one step of a mixed batch into model inputs.

    Args:
        token_ids: per sequence, the tokens to compute *this step* (a whole
            prompt, a chunk of one, or a single decode token); none may be empty.
        num_computed_tokens: per sequence, tokens already in the KV cache
            (the new tokens sit at positions ``n, n+1, ...``).
        block_tables: per sequence, its block ids in order; must cover
            ``num_computed + len(new tokens)`` positions.
        block_size: tokens per cache block.

    Returns:
        ``(input_ids int64 [T], positions int64 [T], AttentionMetadata)``.
    """
    if not (len(token_ids) == len(num_computed_tokens) == len(block_tables)):
        raise ValueError(
            f"token_ids ({len(token_ids)}), num_computed_tokens ({len(num_computed_tokens)}) and "
            f"block_tables ({len(block_tables)}) must have one entry per sequence"
        )
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size={block_size!r} must be a positive integer")
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    starts = [0]
    for i, (new, done, table) in enumerate(zip(token_ids, num_computed_tokens, block_tables)):
        if len(new) == 0:
            raise ValueError(f"token_ids[{i}] is empty: every scheduled sequence computes >= 1 token")
        if done < 0:
            raise ValueError(f"num_computed_tokens[{i}]={done} must be >= 0")
        total = done + len(new)
        if len(table) * block_size < total:
            raise ValueError(
                f"block_tables[{i}] has {len(table)} blocks of {block_size} tokens but the sequence "
                f"needs {total} positions"
            )
        for pos in range(done, total):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        ids.extend(new)
        positions.extend(range(done, total))
        seq_lens.append(total)
        starts.append(starts[-1] + len(new))
    width = max((len(t) for t in block_tables), default=0) or 1
    table_t = torch.zeros((len(block_tables), width), dtype=torch.int32)
    for i, table in enumerate(block_tables):
        table_t[i, : len(table)] = torch.tensor(list(table), dtype=torch.int32)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_table=table_t,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
    ).to(device)
    as_long = dict(dtype=torch.int64, device=device)
    return torch.tensor(ids, **as_long), torch.tensor(positions, **as_long), metadata

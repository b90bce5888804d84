"""The draft-model drafter: a small causal LM with its own paged KV cache.

The n-gram drafter needs only the token history. A draft *model* needs more:
its own paged KV cache, kept per request across steps, so each proposal
computes only what is new. Registered as ``"draft_model"``; a checkpoint
folder given to :func:`~servelab.samplers.drafters.get_drafter` loads one.

:class:`DraftModelDrafter` — approach, kept simple and exact:

- Per request it remembers which tokens its cache holds (``cached``): the
  history it saw last time plus the drafts it fed to itself.
- On each proposal it compares ``cached`` with the request's new history. The
  history only grows while a request lives (accepted drafts, then the bonus
  or recovered token), so ``cached`` agrees with it up to the first rejected
  draft; everything from there on is stale and simply overwritten (KV slots
  of a position are rewritten when the position is recomputed). At least the
  last history token is always fed: its logits give the first draft.
- Step 0 feeds, per request, the history suffix the cache lacks (one prefill
  chunk, all requests in one forward); steps 1..k-1 feed the previous draft,
  one token per request per forward: ``k`` forwards per pipeline step.
- Greedy requests draft by argmax (no probabilities: the verifier then treats
  the draft as one-hot, and greedy verification ignores it anyway). Random
  requests sample from the draft logits under the request's temperature,
  min-p, top-k and top-p, and return those probabilities, which
  ``rejection_sample`` needs to stay exact. (Any draft distribution keeps
  rejection sampling exact; filtering like the target only raises acceptance.
  Penalties and logit bias are left to the target.)
- When the request is preempted or finished the runner calls
  :meth:`release`; a resumed request starts from an empty draft cache. When
  the draft pool runs out, the request gets no drafts this step (it decodes
  normally) rather than failing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from servelab._internal.sampling_filters import top_k_top_p_keep_mask
from servelab._internal.sampling_noise import seeded_generator
from servelab.samplers.drafters.tree_drafting import TREE_MODES, grow_trees
from servelab.samplers.interfaces import Drafter, DraftProposal, DraftRequest
from servelab.samplers.params import SamplingParams

if TYPE_CHECKING:  # servelab.models is imported lazily: it is heavy and imports nothing from here
    from servelab.models import AttentionMetadata

__all__ = ["DraftModelDrafter", "flat_step_inputs", "load_draft_model_drafter", "resolve_drafter"]

# Mixed into a request's seed so draft noise is independent of the target's.
_DRAFT_SEED_SALT = 0x0D7AF7


@dataclass
class _DraftState:
    blocks: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)  # tokens whose KV the draft cache holds, in order
    base: int = 0  # len(cached) that came from the history (the rest are self-fed drafts)


def flat_step_inputs(chunks: Sequence[Sequence[int]], starts: Sequence[int], block_rows: Sequence[Sequence[int]],
                     block_size: int, device: torch.device | str = "cpu"
                     ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Inputs of one forward from per-sequence token chunks.

    ``chunks[i]`` (non-empty) sits at positions ``starts[i] ..``; ``block_rows[i]``
    covers them. Returns ``input_ids`` int64 ``[T]``, ``positions`` int64 ``[T]``
    and the metadata (slot mapping int64 ``[T]``, block table int32
    ``[B, max_blocks]``, seq_lens / query_start_loc int32).
    """
    qlen = np.fromiter((len(c) for c in chunks), np.int64, len(chunks))
    ctx = np.asarray(starts, dtype=np.int64)
    qsl = np.zeros(len(chunks) + 1, np.int64)
    np.cumsum(qlen, out=qsl[1:])
    seq = np.repeat(np.arange(len(chunks)), qlen)
    positions = np.arange(qsl[-1]) - qsl[:-1][seq] + ctx[seq]
    width = max(len(r) for r in block_rows)
    table = np.zeros((len(chunks), width), np.int64)
    for i, row in enumerate(block_rows):
        table[i, :len(row)] = row
    slots = table[seq, positions // block_size] * block_size + positions % block_size
    from servelab.models import AttentionMetadata

    ids = [t for c in chunks for t in c]
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(slots), block_table=torch.from_numpy(table).to(torch.int32),
        seq_lens=torch.from_numpy(ctx + qlen).to(torch.int32), query_start_loc=torch.from_numpy(qsl).to(torch.int32),
    ).to(device)
    as_long = dict(dtype=torch.int64, device=device)
    return torch.tensor(ids, **as_long), torch.from_numpy(positions).to(**as_long), meta


class DraftModelDrafter(Drafter):
    """Drafts with a small causal LM that shares the target's vocabulary.

    Args:
        model: a :class:`servelab.models.LlamaForCausalLM` (the draft model).
        block_size: tokens per block of the draft's own KV cache.
        num_blocks: blocks of that cache (null block included). None: the
            pipeline sizes it (its target pool plus lookahead per request).
        tree: None (chains, the default), ``"static"`` or ``"dynamic"``: propose
            top-k token trees of at most ``k`` nodes instead
            (:mod:`~servelab.samplers.drafters.tree_drafting`).
        tree_width: children per expanded node (static: branches at the root).
        tree_depth: dynamic trees' expansion depth (default ``max(1, k // tree_width)``).

    The pipeline calls :meth:`propose_for_requests` (batched, per-request
    caches) and :meth:`release`; ``propose_with_probs`` (the ``Drafter``
    interface) drafts greedily for one history from an empty cache.
    """

    def __init__(self, model: Any, *, block_size: int = 16, num_blocks: int | None = None,
                 tree: str | None = None, tree_width: int = 2, tree_depth: int | None = None) -> None:
        self._set_tree_options(tree, tree_width, tree_depth)
        if not hasattr(model, "compute_logits") or not hasattr(model, "config"):
            raise TypeError(f"model must be a servelab LlamaForCausalLM, got {type(model).__name__}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size={block_size!r} must be a positive int")
        self.model = model
        self.vocab_size: int = model.config.vocab_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches = None
        self._free: list[int] = []
        self._states: dict[str, _DraftState] = {}
        self._tmp = 0

    def _set_tree_options(self, tree: str | None, tree_width: int, tree_depth: int | None) -> None:
        if tree is not None and tree not in TREE_MODES:
            raise ValueError(f"tree={tree!r}; valid: None (chains), {', '.join(map(repr, TREE_MODES))}")
        for name, value, low in (("tree_width", tree_width, 1), ("tree_depth", tree_depth, 1)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
                raise ValueError(f"{name}={value!r}; valid: an int >= {low}")
        self.tree, self.tree_width, self.tree_depth = tree, tree_width, tree_depth

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: Any = None, device: str | torch.device = "cpu",
                        attention: Any = "torch", block_size: int = 16, num_blocks: int | None = None,
                        **tree_options: Any) -> DraftModelDrafter:
        """Load a draft checkpoint folder (same tokenizer as the target); ``tree_options``:
        ``tree``, ``tree_width``, ``tree_depth``."""
        from servelab.models import load_model

        model, _ = load_model(path, dtype=dtype, device=device, attention=attention)
        model.check_inputs = False
        return cls(model, block_size=block_size, num_blocks=num_blocks, **tree_options)

    # ---- cache bookkeeping ----------------------------------------------------

    def allocate(self, num_blocks: int | None = None) -> None:
        """Allocate the draft KV cache (``num_blocks`` or the constructor's, else 256)."""
        if self._states:
            raise RuntimeError("cannot resize the draft cache while requests hold draft blocks")
        from servelab.models import allocate_kv_caches

        self.num_blocks = num_blocks or self.num_blocks or 256
        self.kv_caches = allocate_kv_caches(self.model, self.num_blocks, self.block_size)
        self._free = list(range(self.num_blocks - 1, 0, -1))  # pop() hands out low ids first; 0 is null

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def release(self, req_id: str) -> None:
        """Forget a request and return its draft blocks (idempotent)."""
        state = self._states.pop(req_id, None)
        if state is not None:
            self._free.extend(reversed(state.blocks))

    def _reserve(self, state: _DraftState, num_positions: int) -> bool:
        need = -(-num_positions // self.block_size) - len(state.blocks)
        if need > len(self._free):
            return False
        for _ in range(need):
            state.blocks.append(self._free.pop())
        return True

    # ---- drafting ---------------------------------------------------------------

    @torch.inference_mode()
    def propose_for_requests(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        """Up to ``k`` drafts for each request, all requests batched per forward.

        Returns one :class:`DraftProposal` per request: ``probs`` float32
        ``[len(token_ids), vocab]`` for random requests, None for greedy ones.
        If the draft model raises (or is interrupted), the requests of this
        call lose their draft caches (they restart from empty ones next time:
        a cache must never claim tokens whose KV was not written) and the
        exception propagates; the runner fails those requests only.
        """
        if self.kv_caches is None:
            self.allocate()
        out = [DraftProposal([]) for _ in requests]
        active = self._admit(requests)
        if not active:
            return out
        try:
            if self.tree is not None:
                return self._propose_trees(active, out)
            drafts, probs = self._run(active)
        except BaseException:
            for _, req, *_ in active:
                self.release(req.req_id)
            raise
        for i, req, state, history, _ in active:
            state.base = len(history)
            out[i] = DraftProposal(drafts[i], torch.stack(probs[i]) if probs[i] else None)
        return out

    def _admit(self, requests: Sequence[DraftRequest]) -> list[tuple[int, DraftRequest, _DraftState, list[int], int]]:
        """Per drafting request: (index, request, state, history, first position to feed); blocks reserved."""
        active = []
        for i, req in enumerate(requests):
            history = list(req.token_ids)
            if req.k <= 0 or not history or max(history) >= self.vocab_size:
                continue  # (a target-only token id: this draft model cannot read it)
            state = self._states.setdefault(req.req_id, _DraftState())
            # Valid prefix: the history part of the cache always agrees; self-fed
            # drafts agree up to the first one the target rejected.
            valid = min(state.base, len(history))
            cached = state.cached
            while valid < len(cached) and valid < len(history) and cached[valid] == history[valid]:
                valid += 1
            valid = min(valid, len(history) - 1)  # feed >= 1 token: its logits give the first draft
            # KV is written for positions 0 .. len(history) + k - 2 (the last draft is never fed);
            # a tree feeds at most k nodes after the history.
            if not self._reserve(state, len(history) + req.k - (self.tree is None)):
                self.release(req.req_id)
                continue
            del cached[valid:]
            active.append((i, req, state, history, valid))
        return active

    def forward_chunks(self, chunks: Sequence[Sequence[int]], starts: Sequence[int],
                       block_rows: Sequence[Sequence[int]], *, positions: Sequence[int] | None = None,
                       tree_mask: Any = None) -> torch.Tensor:
        """One draft forward; fp32 logits ``[T, vocab]`` of every fed token (``positions``:
        RoPE positions overriding the slot positions; ``tree_mask``: a TreeMask)."""
        device = self.model.device
        ids, slot_positions, meta = flat_step_inputs(chunks, starts, block_rows, self.block_size, device)
        if tree_mask is not None:
            meta.tree_mask = tree_mask.to(device)
        rope = slot_positions if positions is None else torch.tensor(positions, dtype=torch.int64, device=device)
        return self.model.compute_logits(self.model(ids, rope, self.kv_caches, meta))

    def _propose_trees(self, active: list, out: list[DraftProposal]) -> list[DraftProposal]:
        """Top-k trees (:mod:`~servelab.samplers.drafters.tree_drafting`); the tree nodes' KV is dropped."""
        chunks = [history[valid:] for _, _, _, history, valid in active]
        starts = [len(state.cached) for _, _, state, _, _ in active]
        for (_, _, state, _, _), chunk in zip(active, chunks):
            state.cached.extend(chunk)
        logits = self.forward_chunks(chunks, starts, [state.blocks for _, _, state, _, _ in active])
        last = torch.tensor([len(c) for c in chunks]).cumsum(0) - 1
        trees = grow_trees(self, active, logits[last.to(logits.device)], self.tree, self.tree_width, self.tree_depth)
        for i, _, state, history, _ in active:
            state.base = len(history)
            out[i] = DraftProposal.from_tree(trees[i])
        return out

    def _run(self, active: list[tuple[int, DraftRequest, _DraftState, list[int], int]]
             ) -> tuple[dict[int, list[int]], dict[int, list[torch.Tensor]]]:
        """``k`` batched forwards: step 0 feeds each history's uncached suffix, later steps the last draft."""
        drafts: dict[int, list[int]] = {i: [] for i, *_ in active}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i, *_ in active}
        device = self.model.device
        for j in range(max(req.k for _, req, *_ in active)):
            step = [a for a in active if a[1].k > j]
            chunks, starts = [], []
            for i, req, state, history, valid in step:
                chunk = history[valid:] if j == 0 else [drafts[i][-1]]
                starts.append(len(state.cached))
                chunks.append(chunk)
                state.cached.extend(chunk)
            ids, pos, meta = flat_step_inputs(chunks, starts, [a[2].blocks for a in step], self.block_size, device)
            hidden = self.model(ids, pos, self.kv_caches, meta)
            logits = self.model.compute_logits(hidden[meta.logits_indices()])  # [len(step), vocab] fp32
            tokens = logits.argmax(dim=-1).tolist()
            for row, (i, req, state, history, _) in enumerate(step):
                params = req.params
                if params is not None and not params.is_greedy:
                    p = self._draft_probs(logits[row], params)
                    gen = None
                    if params.seed is not None:
                        gen = seeded_generator(params.seed ^ _DRAFT_SEED_SALT, len(history) + j, p.device)
                    tokens[row] = int(torch.multinomial(p, 1, generator=gen))
                    probs[i].append(p)
                drafts[i].append(tokens[row])
        return drafts, probs

    @staticmethod
    def _draft_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """float32 ``[vocab]``: softmax of ``logits / T`` over what min-p / top-k / top-p keep."""
        scaled = (logits.float() / params.temperature)[None]
        as_row = dict(device=scaled.device)
        keep = top_k_top_p_keep_mask(
            scaled, torch.tensor([params.top_k], **as_row) if params.top_k > 0 else None,
            torch.tensor([params.top_p], **as_row) if params.top_p < 1.0 else None,
            torch.tensor([params.min_p], **as_row) if params.min_p > 0.0 else None)
        return torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)[0]

    def propose_with_probs(self, token_ids: Sequence[int], k: int) -> DraftProposal:
        """Greedy drafts for one history, from an empty cache (stateless use)."""
        self._tmp += 1
        rid = f"__draft_tmp_{self._tmp}"
        try:
            return self.propose_for_requests([DraftRequest(rid, token_ids, k)])[0]
        finally:
            self.release(rid)


def load_draft_model_drafter(path: str | os.PathLike, *, dtype: Any = None, device: Any = "cpu",
                             attention: Any = "torch", block_size: int = 16,
                             num_blocks: int | None = None, **tree_options: Any) -> DraftModelDrafter:
    """The ``"draft_model"`` registry entry: a :class:`DraftModelDrafter` from a checkpoint folder
    (``tree_options``: ``tree`` None / ``"static"`` / ``"dynamic"``, ``tree_width``, ``tree_depth``)."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"drafter path {str(path)!r} is not a checkpoint folder with a config.json; valid: a "
                         "draft-model folder (same tokenizer as the target)")
    return DraftModelDrafter.from_pretrained(folder, dtype=dtype, device=device, attention=attention,
                                             block_size=block_size, num_blocks=num_blocks, **tree_options)


# Older spellings of "ngram" accepted by resolve_drafter.
_NGRAM_ALIASES = ("ngram", "n-gram", "prompt_lookup")


def resolve_drafter(drafter: Any, *, dtype: Any = None, device: Any = "cpu", attention: Any = "torch",
                    block_size: int = 16) -> Drafter | None:
    """``None`` | a registered name | a draft checkpoint folder | a drafter object -> a drafter (or None).

    The model options (``dtype``, ``device``, ``attention``, ``block_size``)
    apply to a draft checkpoint only; names are built with their defaults.
    """
    from servelab.samplers.drafters.base import get_drafter

    if drafter is None:
        return None
    if isinstance(drafter, str) and drafter.lower() in _NGRAM_ALIASES:
        return get_drafter("ngram")
    if isinstance(drafter, os.PathLike) or (isinstance(drafter, str) and drafter != "draft_model"
                                            and (os.sep in drafter or Path(drafter).is_dir())):
        return get_drafter("draft_model", path=drafter, dtype=dtype, device=device, attention=attention,
                           block_size=block_size)
    if isinstance(drafter, str):
        return get_drafter(drafter)
    if isinstance(drafter, (bytes, int, float)) or drafter is True or drafter is False:
        raise TypeError(f"drafter must be None, a name, a checkpoint path or a Drafter, got {type(drafter).__name__}")
    return get_drafter(drafter)

"""The model runner: one ``SchedulerOutput`` in, one ``ModelRunnerOutput`` out.

State that persists across steps (the "persistent batch", as in vLLM v1's
``InputBatch``), updated incrementally from each ``SchedulerOutput``:

- per request a :class:`CachedRequestState`: its token ids (prompt + output,
  no drafts), sampling params, prompt length, and its row in
- one block table ``[max_reqs, max_blocks_per_req]`` int32, whose rows are
  appended to as the scheduler hands out blocks (new blocks only), replaced
  when a preempted request resumes, and recycled when a request ends. A
  sliding window's released blocks (``SchedulerOutput`` does not report
  releases) become the null block 0 in the row before each step
  (:func:`null_released_blocks`, the manager's rule), so a block another
  request owns by now is never named by this one's table.

Each step then builds, vectorised over the batch (numpy on the host):

- ``input_ids`` int64 ``[T]``: token ``p`` of each request for its scheduled
  positions ``c .. c+n-1``, drafts past the known tokens;
- ``positions`` int64 ``[T]``; ``slot_mapping`` int64 ``[T]`` =
  ``row[p // block_size] * block_size + p % block_size``;
- ``block_table`` int32 ``[B, max_blocks_this_step]`` (rows of the persistent
  table), ``seq_lens = c + n``, ``query_start_loc`` int32 ``[B + 1]``.

A model whose layers are in several KV-cache groups (Gemma 2's sliding and
full layers) runs on :class:`~servelab.pipeline.hybrid.HybridModelRunner`,
which overrides only the table handling and :meth:`ModelRunner._attention_metadata`
(one table and one metadata per group); this class is the single-group path.

Logits are computed only where a token is sampled: the last scheduled
position of each request whose computation reaches its last known token (a
chunked prefill still short of the end samples nothing), or, when drafts are
being verified, the position before each draft and the bonus position.
Requests that ask for prompt logprobs also get logits for their scheduled
prompt positions (:mod:`servelab.pipeline.prompt_logprobs`; nothing is
computed for the others).

Sampling (:mod:`servelab.pipeline.sampling_steps`): requests without drafts
go through ``Sampler.forward`` with a ``SamplingMetadata`` built for this
step. Requests with drafts are verified by the pipeline's ``Verifier``
(``verifier.verify``, default rejection sampling) against
``Sampler.compute_probs`` (one metadata row per verified position, the
history extended by the drafts before it, so penalties and min_tokens see
what each position would have seen); greedy requests are verified greedily.
Then the drafter proposes the next drafts from the new history
(``drafter.propose_for_requests``), and everything goes back to the
scheduler as ``ModelRunnerOutput``. User code that raises, or returns
something unusable, fails only the requests it was called for
(``ModelRunnerOutput.errors``; see :mod:`servelab.pipeline.sampling_steps`).

With a KV connector (``kv_connector=``), every step — even one that computes
nothing — runs the connector's worker side around the forward: metadata
bound, ``handle_preemptions``, ``start_load_kv``, ``wait_for_layer_load`` per
layer, the forward, ``save_kv_layer`` per layer, ``wait_for_save``, and
``get_finished``, whose result goes to the scheduler in
``ModelRunnerOutput.kv_connector_output`` (see :mod:`servelab.connectors`).

A step that fails or is interrupted outside that (the model forward) is
undone with :meth:`ModelRunner.rollback`: the step's requests lose their
rows, and come back in a later ``SchedulerOutput`` as resumed or new.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from servelab.models import AttentionMetadata
from servelab.pipeline.prompt_logprobs import PromptLogprobsCollector
from servelab.pipeline.sampling_steps import release_quietly
from servelab.pipeline.tree_steps import TreeSteps
from servelab.samplers import Sampler, SamplerProtocol, SamplingMetadata, SamplingParams
from servelab.samplers.draft_tree import DraftTree
from servelab.samplers.interfaces import Drafter, Verifier
from servelab.samplers.structured import StructuredOutputManager, apply_token_bitmask
from servelab.samplers.verifiers import get_verifier
from servelab.scheduling import ModelRunnerOutput, SchedulerOutput


@dataclass(slots=True)
class CachedRequestState:
    """What the runner remembers about one request between steps."""

    req_id: str
    token_ids: list[int]
    """Prompt + output tokens the scheduler knows (drafts excluded)."""
    num_prompt_tokens: int
    params: SamplingParams
    row: int = -1
    """Row of the persistent block table; -1 while preempted."""
    num_blocks: int = 0
    group_blocks: list[int] | None = None
    """Blocks in each KV-cache group's row (:class:`~servelab.pipeline.hybrid.HybridModelRunner`)."""
    draft_probs: torch.Tensor | None = None
    """Draft distributions ``[k, draft_vocab]`` of the drafts proposed last step (draft model)."""
    draft_tree: DraftTree | None = None
    """The token tree of the drafts proposed last step (None: a chain); see :mod:`~servelab.pipeline.tree_steps`."""
    stop_ids: frozenset[int] = field(default_factory=frozenset)


def null_released_blocks(table: np.ndarray, rows: np.ndarray, first: np.ndarray, window: int,
                         block_size: int) -> None:
    """Null block (0) in ``table`` int32 ``[max_reqs, width]`` at rows ``rows`` ``[B]``
    for every block wholly before the window of each request's first position
    this step, ``first`` ``[B]`` (its computed tokens): the blocks a sliding
    window's manager released when it scheduled the step, which another
    request may own and fill (NaN, inf) by now."""
    dead = (first - window + 1) // block_size  # [B] leading dead blocks per request
    width = int(dead.max()) if len(dead) else 0
    if width > 0:
        head = table[rows, :width]
        table[rows, :width] = np.where(np.arange(width) < dead[:, None], 0, head)


class ModelRunner(TreeSteps):
    """Runs the model for the scheduler.

    Args:
        model: a :class:`servelab.models.LlamaForCausalLM` (any object with its
            ``forward``, ``compute_logits``, ``config.vocab_size``, ``device``).
        kv_caches: the paged caches, per layer ``(key_cache, value_cache)``
            (or :class:`~servelab.blocks.KVCacheBuffers`).
        block_size: tokens per block (the KV cache manager's).
        max_model_len: longest sequence; sizes block-table rows.
        sampler: default ``Sampler()``; called through ``forward`` and
            ``compute_probs`` only.
        drafter: None, or a ``Drafter``; called through
            ``propose_for_requests`` and ``release`` only.
        verifier: a ``Verifier`` (``verify``) or a registered name; default
            ``"rejection"`` (see :func:`servelab.samplers.verifiers.get_verifier`).
        num_speculative_tokens: drafts proposed per request and step.
        max_num_reqs: initial block-table rows (grows when needed).
        eos_token_id: the model's EOS (for min_tokens masking).
        structured: a :class:`~servelab.samplers.structured.StructuredOutputManager`
            holding the grammars of constrained requests: their logits rows are
            masked before sampling (drafts included) and their matchers advance
            by the emitted tokens.
        kv_connector: None, or a :class:`~servelab.connectors.KVConnector`
            whose worker side runs around each forward.
    """

    def __init__(self, model: Any, kv_caches: Any, block_size: int, *, max_model_len: int,
                 sampler: SamplerProtocol | None = None, drafter: Drafter | None = None,
                 verifier: Verifier | str = "rejection",
                 num_speculative_tokens: int = 0, max_num_reqs: int = 64, eos_token_id: int | None = None,
                 structured: StructuredOutputManager | None = None, kv_connector: Any = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sampler: SamplerProtocol = sampler if sampler is not None else Sampler()
        self.drafter: Drafter | None = drafter
        self.verifier = get_verifier(verifier)
        self.structured: StructuredOutputManager | None = structured
        self._grammar_advanced: dict[str, int] = {}  # tokens each matcher accepted in the last execute
        """Grammars of constrained requests (structured outputs); None: no request may carry one."""
        self.num_speculative_tokens = num_speculative_tokens if drafter is not None else 0
        self.eos_token_id = eos_token_id
        self.vocab_size: int = model.config.vocab_size
        self.device = model.device
        self.block_table = torch.zeros((max(max_num_reqs, 1), -(-max_model_len // block_size)), dtype=torch.int32)
        self._bt = self.block_table.numpy()  # shares memory: numpy writes, torch reads
        self._free_rows = list(range(self.block_table.shape[0] - 1, -1, -1))
        self.requests: dict[str, CachedRequestState] = {}
        self.sliding_window: int | None = None
        """The window of a single sliding-window KV spec (the pipeline sets it): released blocks are nulled."""
        self.last_verification: list[tuple[int, int]] = []
        """(drafts verified, drafts accepted) per request verified in the last step."""
        self.kv_connector = kv_connector
        self.prompt_logprobs = PromptLogprobsCollector()
        """Prompt logprobs of requests that ask (:mod:`servelab.pipeline.prompt_logprobs`)."""
        self.lora: Any = None
        """Per-request LoRA adapters (:class:`servelab.lora.serving.LoRAServing`; the pipeline sets it)."""

    # ---- persistent state -------------------------------------------------

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self.block_table
            self.block_table = torch.zeros((2 * old.shape[0], old.shape[1]), dtype=torch.int32)
            self.block_table[: old.shape[0]] = old
            self._bt = self.block_table.numpy()
            self._free_rows = list(range(2 * old.shape[0] - 1, old.shape[0] - 1, -1))
        return self._free_rows.pop()

    def _set_blocks(self, state: CachedRequestState, block_ids: tuple[list[int], ...], append: bool) -> None:
        """Write a request's block ids into its block-table row (or append to it).
        ``block_ids``: one list per KV-cache group, exactly one here; ``()``: nothing new."""
        if len(block_ids) > 1:
            raise RuntimeError(f"request {state.req_id!r}: block ids for {len(block_ids)} KV-cache groups reached a "
                               "single-group model runner; a hybrid manager needs the hybrid runner")
        ids = block_ids[0] if block_ids else []
        start = state.num_blocks if append else 0
        if start + len(ids) > self._bt.shape[1]:
            grown = torch.zeros((self._bt.shape[0], start + len(ids)), dtype=torch.int32)
            grown[:, : self._bt.shape[1]] = self.block_table
            self.block_table, self._bt = grown, grown.numpy()
        if ids:
            self._bt[state.row, start:start + len(ids)] = ids
        state.num_blocks = start + len(ids)

    def _detach(self, req_id: str) -> CachedRequestState | None:
        """Free a request's row and draft state; keep what a resume needs."""
        state = self.requests.get(req_id)
        if state is not None and state.row >= 0:
            self._free_rows.append(state.row)
            state.row, state.num_blocks, state.draft_probs, state.draft_tree = -1, 0, None, None
        if self.lora is not None:  # not running: its adapter's pin is released
            self.lora.detach(req_id)
        if self.drafter is not None:
            release_quietly(self.drafter.release, req_id)
        return state

    def remove_request(self, req_id: str) -> None:
        """Forget a finished request (idempotent). The pipeline calls it as soon
        as a request ends, so nothing lingers until the next step."""
        self._detach(req_id)
        self.requests.pop(req_id, None)
        self.prompt_logprobs.discard(req_id)
        if self.lora is not None:
            self.lora.release(req_id)

    def rollback(self, so: SchedulerOutput) -> None:
        """Undo what a failed or interrupted :meth:`execute` of ``so`` did: every
        scheduled request loses its row and draft state (the scheduler's
        ``rollback_step`` sends them back to the waiting queue; they return
        as resumed, or as new if this was their first step)."""
        for rid in so.finished_req_ids:
            self.remove_request(rid)
        for rid in [*so.preempted_req_ids, *(rid for rid, _, _ in so.iter_scheduled())]:
            self._detach(rid)
        self.last_verification = []
        if self.kv_connector is not None:
            self.kv_connector.clear_connector_metadata()
        for rid, num_tokens in self._grammar_advanced.items():  # the scheduler never saw those tokens
            self.structured.rollback_tokens(rid, num_tokens)
        self._grammar_advanced = {}

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.remove_request(rid)
        for rid in so.preempted_req_ids:
            self._detach(rid)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            eos = () if self.eos_token_id is None else (self.eos_token_id,)
            state = CachedRequestState(new.req_id, list(new.prompt_token_ids), len(new.prompt_token_ids), params,
                                       stop_ids=frozenset(params.stop_token_ids) | (
                                           frozenset() if params.ignore_eos else frozenset(eos)))
            state.row = self._take_row()
            self._set_blocks(state, new.block_ids, append=False)
            self.requests[new.req_id] = state
            self.prompt_logprobs.add(new.req_id, getattr(params, "prompt_logprobs", None), new.prompt_token_ids)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self.requests[rid]
            if cached.resumed[i]:
                if state.row < 0:
                    state.row = self._take_row()
                state.token_ids = list(cached.resumed_token_ids[rid])
                state.draft_probs, state.draft_tree = None, None
                self._set_blocks(state, cached.new_block_ids[i], append=False)
            elif cached.new_block_ids[i]:
                self._set_blocks(state, cached.new_block_ids[i], append=True)

    # ---- structured outputs ------------------------------------------------------

    def _apply_grammars(self, batch, plain: list[int], verify: list[tuple[int, int]], spec: dict[str, list[int]],
                        logits: torch.Tensor, errors: dict[str, str]) -> None:
        """Mask ``logits`` (fp32 ``[R, V]``: plain rows, then each verified request's
        ``d + 1`` rows) with every constrained request's grammar, before sampling."""
        rows = [(batch[i][0].req_id, ()) for i in plain]
        any_tree = False
        for i, d in verify:
            state = batch[i][0]
            tree = self._scheduled_tree(state, d)
            if tree is None:
                rows.append((state.req_id, spec[state.req_id][:d]))
            else:  # one entry per tree slot (its path); only each entry's last row is kept
                rows += self._tree_grammar_rows(state.req_id, tree)
                any_tree = True
        bitmask, grammar_errors = self.structured.fill_bitmasks(rows)
        if bitmask is not None and any_tree:
            slot_rows, start = [], 0
            for i in plain:
                slot_rows.append(start)
                start += 1
            for i, d in verify:
                tree = self._scheduled_tree(batch[i][0], d)
                if tree is None:
                    slot_rows += range(start, start + d + 1)
                    start += d + 1
                else:
                    tree_rows = self._tree_grammar_rows(batch[i][0].req_id, tree)
                    slot_rows += [start + r for r in self._tree_bitmask_rows(tree_rows)]
                    start += sum(len(path) + 1 for _, path in tree_rows)
            bitmask = bitmask[torch.tensor(slot_rows)]
        if bitmask is not None:
            apply_token_bitmask(logits, bitmask.to(logits.device))
        errors.update(grammar_errors)

    def _advance_grammars(self, batch, sampled: list[list[int]], errors: dict[str, str]) -> None:
        """Advance each constrained request's matcher by the tokens it emitted this step."""
        for (state, _, _), toks in zip(batch, sampled):
            if toks and state.req_id not in errors and state.req_id in self.structured:
                accepted, problem = self.structured.accept_tokens(state.req_id, toks)
                self._grammar_advanced[state.req_id] = accepted  # undone by rollback() if the step is
                if problem is not None:                          # rolled back
                    errors[state.req_id] = problem

    # ---- one step -------------------------------------------------------------

    def _prepare(self, so: SchedulerOutput, batch: list[tuple[CachedRequestState, int, int]]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Model inputs for ``batch`` (state, computed, scheduled), and each request's end row (host list).

        Host work is a handful of numpy calls on ``[B]`` / ``[T]`` int64 arrays
        (a step is ~100 us of it on a CPU); a step where every request
        schedules one token (plain decode) skips the ragged expansion.
        """
        spec = so.scheduled_spec_decode_tokens
        ids: list[int] = []
        num = len(batch)
        rows, ctx, qlen = [0] * num, [0] * num, [0] * num
        for i, (state, c, n) in enumerate(batch):
            toks = state.token_ids
            end = c + n
            if end <= len(toks):
                ids += toks[c:end]
            else:  # past the known tokens: the drafts being verified
                ids += toks[c:]
                ids += spec[state.req_id][: end - len(toks)]
            rows[i], ctx[i], qlen[i] = state.row, c, n
        ctx_a = np.array(ctx, np.int64)
        if len(ids) == num:  # one token per request: token i is request i's, at position ctx[i]
            seq, positions, qsl = np.arange(num), ctx_a, np.arange(num + 1)
        else:
            qsl = np.zeros(num + 1, np.int64)
            np.cumsum(qlen, out=qsl[1:])
            seq = np.repeat(np.arange(num), qlen)
            positions = np.arange(qsl[-1]) - qsl[:-1][seq] + ctx_a[seq]
        meta = self._attention_metadata(np.array(rows, np.int64), seq, positions, ctx_a + qlen, qsl)
        tree = self._tree_layout(batch, qsl, positions) if spec and len(ids) != num else None
        if tree is not None:  # token trees: depth-based RoPE positions (slots stay consecutive), a tree mask
            positions, meta.tree_mask = tree
        device = self.device
        if device.type != "cpu":
            meta = meta.to(device)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=device)
        return input_ids, torch.from_numpy(positions).to(device), meta, qsl[1:].tolist()

    def _attention_metadata(self, rows: np.ndarray, seq: np.ndarray, positions: np.ndarray, seq_lens: np.ndarray,
                            qsl: np.ndarray) -> AttentionMetadata:
        """Host metadata from the batch's table ``rows`` ``[B]``, each token's
        sequence ``seq`` and position ``[T]``, ``seq_lens`` ``[B]`` and
        ``query_start_loc`` ``[B + 1]`` (int64 numpy arrays). The block table
        is a contiguous int32 copy of the batch's rows, ``max(seq_lens)`` blocks wide."""
        bs = self.block_size
        if self.sliding_window is not None:
            null_released_blocks(self._bt, rows, seq_lens - np.diff(qsl), self.sliding_window, bs)
        blocks, offsets = np.divmod(positions, bs)
        slots = self._bt[rows[seq], blocks].astype(np.int64) * bs + offsets
        width = int(-(-seq_lens.max() // bs))
        return AttentionMetadata(
            slot_mapping=torch.from_numpy(slots),
            block_table=torch.from_numpy(self._bt[rows, :width]),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)),
        )

    def _metadata(self, states: list[CachedRequestState], outputs: list[list[int]]) -> SamplingMetadata:
        # Prompts only matter to penalties; skipping them otherwise saves a
        # per-token validation pass over every prompt every step.
        penalties = any(s.params.uses_penalties for s in states)
        prompts = [s.token_ids[: s.num_prompt_tokens] if penalties else () for s in states]
        return SamplingMetadata.from_requests([s.params for s in states], prompts, outputs, self.vocab_size,
                                              self.device, eos_token_id=self.eos_token_id,
                                              request_ids=[s.req_id for s in states])

    @staticmethod
    def _rows_to_sample(batch, spec: dict[str, list[int]]) -> tuple[list[int], list[tuple[int, int]]]:
        """Which requests sample: ``plain`` (batch indices; their last row) and
        ``verify`` ((batch index, number of drafts); the row before each draft
        plus the bonus row). A chunked prefill short of its end samples nothing."""
        plain: list[int] = []
        verify: list[tuple[int, int]] = []
        for i, (state, c, n) in enumerate(batch):
            d = c + n - len(state.token_ids)
            if d == 0 and not spec:
                plain.append(i)
                continue
            if d < 0:
                continue
            if d != len(spec.get(state.req_id, ())):
                raise RuntimeError(f"runner and scheduler disagree on request {state.req_id!r}: {d} positions past "
                                   f"its {len(state.token_ids)} tokens but {len(spec.get(state.req_id, ()))} "
                                   f"drafts scheduled")
            if d:
                verify.append((i, d))
            else:
                plain.append(i)
        return plain, verify

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one scheduled step; see the module docstring."""
        self._update_states(so)
        self.last_verification = []
        self._grammar_advanced = {}
        connector = self.kv_connector
        if connector is not None:
            self._connector_before(so)
        if so.is_empty():
            if connector is not None:
                if connector.has_pending_work():  # nothing to compute but KV in flight: wait, do not spin
                    connector.wait_for_any(0.05)
                return ModelRunnerOutput([], [], kv_connector_output=self._connector_after(so, None))
            return ModelRunnerOutput([], [])
        spec = so.scheduled_spec_decode_tokens
        batch = [(self.requests[rid], c, n) for rid, c, n in so.iter_scheduled()]
        input_ids, positions, meta, ends = self._prepare(so, batch)
        lora_errors = None if self.lora is None else self.lora.begin_step([s.req_id for s, _, _ in batch],
                                                                          [n for _, _, n in batch])
        try:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        finally:
            if self.lora is not None:  # the rows' adapters hold for this forward only (servelab.lora)
                self.lora.end_step()
        transfers = self._connector_after(so, meta) if connector is not None else None
        if self.prompt_logprobs.pending:  # requests asking for prompt logprobs: their prompt positions' logits
            self.prompt_logprobs.collect(self.model, batch, hidden, ends)

        plain, verify = self._rows_to_sample(batch, spec)
        sampled: list[list[int]] = [[] for _ in batch]
        logprobs: list[Any] = [None] * len(batch)
        errors: dict[str, str] = dict(lora_errors or {})  # request id -> why it fails (user code raised, ...)
        if plain or verify:
            rows = [ends[i] - 1 for i in plain] + [r for i, d in verify for r in range(ends[i] - d - 1, ends[i])]
            if len(rows) != hidden.shape[0] or rows != list(range(len(rows))):  # else every row in order (decode)
                hidden = hidden[torch.tensor(rows, device=hidden.device)]
            logits = self.model.compute_logits(hidden)  # fp32 [R, V]
            if self.structured is not None and len(self.structured):
                self._apply_grammars(batch, plain, verify, spec, logits, errors)
            if plain:
                self._sample_plain(batch, plain, logits[: len(plain)], sampled, logprobs, errors)
            if verify:
                self._verify(batch, verify, logits[len(plain):], spec, sampled, logprobs, errors)

        req_ids = [state.req_id for state, _, _ in batch]
        if self.structured is not None and len(self.structured):
            self._advance_grammars(batch, sampled, errors)
        for (state, _, _), toks in zip(batch, sampled):
            if state.req_id not in errors:
                state.token_ids.extend(toks)
        spec_out = self._propose(batch, sampled, errors) if self.num_speculative_tokens else None
        if errors:  # a failed request hands back nothing (the scheduler ends it)
            for i, rid in enumerate(req_ids):
                if rid in errors:
                    sampled[i], logprobs[i] = [], None
                    if spec_out is not None:
                        spec_out[i] = []
        any_logprobs = any(lp is not None for lp in logprobs)
        return ModelRunnerOutput(req_ids, sampled, spec_out, logprobs if any_logprobs else None, errors=errors,
                                 kv_connector_output=transfers)

    # ---- the KV connector's worker side -------------------------------------------------

    def _layers(self) -> Any:
        return self.kv_caches.views if hasattr(self.kv_caches, "views") else self.kv_caches

    def _connector_before(self, so: SchedulerOutput) -> None:
        """Metadata bound; saves of what this forward overwrites; loads started and waited for."""
        connector, metadata = self.kv_connector, so.kv_connector_metadata
        if metadata is not None:
            metadata.started = True
        connector.bind_connector_metadata(metadata)
        connector.handle_preemptions(metadata)
        connector.start_load_kv()
        for layer in range(len(self._layers())):
            connector.wait_for_layer_load(layer)

    def _connector_after(self, so: SchedulerOutput, attn_metadata: Any) -> Any:
        """Saves of this step's KV, then the transfers finished since the last step."""
        connector = self.kv_connector
        if attn_metadata is not None:
            for layer, kv_layer in enumerate(self._layers()):
                connector.save_kv_layer(layer, kv_layer, attn_metadata)
        connector.wait_for_save()
        result = connector.get_finished(set(so.finished_req_ids))
        connector.clear_connector_metadata()
        return result

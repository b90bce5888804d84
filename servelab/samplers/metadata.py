"""``SamplingMetadata``: everything the stateless ``Sampler`` needs for one step.

Built once per step from the batch's requests, so the ``Sampler`` itself holds
no per-batch state. Tensors that only some features need (penalties, top-k,
whitelists...) are ``None`` when no request in the batch uses the feature,
which is how the sampler skips whole steps.

Seeded requests: the noise stream of a seeded request is derived from
``(seed, number of tokens it has generated)`` at every step
(:func:`servelab._internal.sampling_noise.seeded_generator`). Nothing needs
to survive between steps, so a seeded request samples the same tokens
whatever else is in the batch, wherever its row sits, and after preemption
and recompute. Generators are created fresh by :meth:`SamplingMetadata.generators`
on each use, so running the sampler twice on one metadata repeats the seeded
rows exactly. The cost is one generator seeding per seeded request per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from servelab._internal.sampling_noise import seeded_generator
from servelab.samplers.params import SAMPLING_EPS, SamplingParams


def _check_token_lists(name: str, lists: object, num_reqs: int, vocab_size: int) -> list[list[int]]:
    if isinstance(lists, (str, bytes)) or not isinstance(lists, Sequence):
        raise TypeError(f"{name} must be a sequence of token-id sequences, got {type(lists).__name__}")
    if len(lists) != num_reqs:
        raise ValueError(f"{name} has {len(lists)} entries but there are {num_reqs} sampling params; give one each")
    out = []
    for row, ids in enumerate(lists):
        as_list = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        # C-speed check of the common case (plain ints in range); the loop below
        # runs only to name the offending entry. Called every step on every history.
        if not as_list or (set(map(type, as_list)) == {int} and min(as_list) >= 0 and max(as_list) < vocab_size):
            out.append(as_list)
            continue
        for token_id in as_list:
            if not isinstance(token_id, int) or isinstance(token_id, bool):
                raise TypeError(f"{name}[{row}] holds {token_id!r}; valid: int token ids")
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"{name}[{row}] holds token id {token_id}; valid: [0, {vocab_size})")
        out.append(as_list)
    return out


def _check_params(sampling_params: object, vocab_size: object, eos_token_id: object) -> tuple[SamplingParams, ...]:
    if isinstance(sampling_params, SamplingParams) or not isinstance(sampling_params, Sequence):
        raise TypeError("sampling_params must be a sequence of SamplingParams (one per request)")
    params = tuple(sampling_params)
    for row, item in enumerate(params):
        if not isinstance(item, SamplingParams):
            raise TypeError(f"sampling_params[{row}] must be a SamplingParams, got {type(item).__name__}")
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise ValueError(f"vocab_size = {vocab_size!r} is invalid; valid: an int >= 1")
    if eos_token_id is not None and not (isinstance(eos_token_id, int) and 0 <= eos_token_id < vocab_size):
        raise ValueError(f"eos_token_id = {eos_token_id!r} is invalid; valid: None or an int in [0, {vocab_size})")
    for item in params:
        item.validate_token_ids(vocab_size)
    return params


def _allowed_token_mask(params: Sequence[SamplingParams], vocab_size: int, device: torch.device) -> torch.Tensor | None:
    """bool ``[B, V]`` (True = allowed), or None when no request has a whitelist."""
    if all(item.allowed_token_ids is None for item in params):
        return None
    mask = torch.ones(len(params), vocab_size, dtype=torch.bool)
    for row, item in enumerate(params):
        if item.allowed_token_ids is not None:
            mask[row] = False
            mask[row, list(item.allowed_token_ids)] = True
    return mask.to(device)


def _padded(lists: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(ids) for ids in lists), default=0)
    out = torch.full((len(lists), width), pad, dtype=torch.int64)
    for row, ids in enumerate(lists):
        if ids:
            out[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return out.to(device)


@dataclass
class SamplingMetadata:
    """Per-step batch state for :class:`~servelab.samplers.Sampler`; shapes ``B`` = requests, ``V`` = vocab.

    Build it with :meth:`from_requests`. Fields:

    - ``temperature`` float32 ``[B]``; ``greedy_rows`` rows with temperature < 1e-5;
      ``all_greedy`` / ``all_random`` let the sampler skip work.
    - ``top_k`` int32 ``[B]`` (-1 = off; values clamped to ``V``, which also means off),
      ``top_p`` / ``min_p`` float32 ``[B]``; None when unused.
    - ``seeded_rows``: row -> (seed, step) for seeded random requests; see :meth:`generators`.
    - ``prompt_token_ids`` / ``output_token_ids`` int64 ``[B, max_len]`` padded with ``V``, and
      ``repetition_penalties`` / ``frequency_penalties`` / ``presence_penalties`` float32 ``[B]``:
      None unless some request uses a penalty.
    - ``output_token_id_lists``: the outputs as lists (min_tokens, bad words, custom processors).
    - ``allowed_token_mask`` bool ``[B, V]`` (True = allowed) or None.
    - ``max_num_logprobs``: largest ``logprobs`` asked in the batch, None if none asked.
    """

    params: tuple[SamplingParams, ...]
    vocab_size: int
    device: torch.device
    temperature: torch.Tensor
    greedy_rows: tuple[int, ...]
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    seeded_rows: dict[int, tuple[int, int]]
    prompt_token_ids: torch.Tensor | None
    output_token_ids: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    presence_penalties: torch.Tensor | None
    output_token_id_lists: tuple[list[int], ...]
    allowed_token_mask: torch.Tensor | None
    max_num_logprobs: int | None
    eos_token_id: int | None = None
    request_ids: tuple[str, ...] | None = None
    extra: dict[str, object] = field(default_factory=dict)  # scratch space for custom processors

    @property
    def num_reqs(self) -> int:
        return len(self.params)

    @property
    def all_greedy(self) -> bool:
        return len(self.greedy_rows) == self.num_reqs

    @property
    def all_random(self) -> bool:
        return not self.greedy_rows

    def generators(self) -> dict[int, torch.Generator]:
        """Fresh generators for this step's seeded rows (row -> generator); unseeded rows are absent."""
        return {row: seeded_generator(seed, step, self.device) for row, (seed, step) in self.seeded_rows.items()}

    def generator_list(self) -> list[torch.Generator | None]:
        """One entry per row: a fresh generator for seeded rows, else None (the verifiers' format)."""
        generators = self.generators()
        return [generators.get(row) for row in range(self.num_reqs)]

    @classmethod
    def from_requests(
        cls,
        sampling_params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str = "cpu",
        *,
        eos_token_id: int | None = None,
        request_ids: Sequence[str] | None = None,
    ) -> SamplingMetadata:
        """Build the metadata of one step.

        Args:
            sampling_params: one :class:`SamplingParams` per request (row order).
            prompt_token_ids: per request, its prompt token ids.
            output_token_ids: per request, the tokens it has generated so far.
            vocab_size: the logits' last dimension; all token ids are checked against it.
            device: where the tensors go (the logits' device).
            eos_token_id: the model's EOS, masked by ``min_tokens`` unless ``ignore_eos``.
            request_ids: optional ids, kept for custom processors and debugging.
        """
        params = _check_params(sampling_params, vocab_size, eos_token_id)
        num_reqs = len(params)
        prompts = _check_token_lists("prompt_token_ids", prompt_token_ids, num_reqs, vocab_size)
        outputs = _check_token_lists("output_token_ids", output_token_ids, num_reqs, vocab_size)
        if request_ids is not None and len(request_ids) != num_reqs:
            raise ValueError(f"request_ids has {len(request_ids)} entries; valid: one per request ({num_reqs})")
        device = torch.device(device)

        def per_row(values: list[float], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        greedy_rows = tuple(row for row, item in enumerate(params) if item.temperature < SAMPLING_EPS)
        random_params = [item for item in params if not item.is_greedy]
        # top_k >= vocab keeps every token (like -1): clamped here so the int32 tensor never
        # sees a value it cannot hold (SamplingParams accepts any int >= 1).
        top_k = per_row([min(item.top_k, vocab_size) for item in params], torch.int32) if any(
            1 <= item.top_k < vocab_size for item in random_params) else None
        top_p = per_row([item.top_p for item in params], torch.float32) if any(
            item.top_p < 1.0 for item in random_params) else None
        min_p = per_row([item.min_p for item in params], torch.float32) if any(
            item.min_p > 0.0 for item in random_params) else None
        seeded_rows = {
            row: (item.seed, len(outputs[row]))
            for row, item in enumerate(params)
            if item.seed is not None and not item.is_greedy
        }

        uses_penalties = any(item.uses_penalties for item in params)
        allowed_mask = _allowed_token_mask(params, vocab_size, device)
        asked = [item.logprobs for item in params if item.logprobs is not None]

        return cls(
            params=params,
            vocab_size=vocab_size,
            device=device,
            temperature=per_row([item.temperature for item in params], torch.float32),
            greedy_rows=greedy_rows,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seeded_rows=seeded_rows,
            prompt_token_ids=_padded(prompts, vocab_size, device) if uses_penalties else None,
            output_token_ids=_padded(outputs, vocab_size, device) if uses_penalties else None,
            repetition_penalties=per_row([i.repetition_penalty for i in params], torch.float32) if uses_penalties else None,
            frequency_penalties=per_row([i.frequency_penalty for i in params], torch.float32) if uses_penalties else None,
            presence_penalties=per_row([i.presence_penalty for i in params], torch.float32) if uses_penalties else None,
            output_token_id_lists=tuple(outputs),
            allowed_token_mask=allowed_mask,
            max_num_logprobs=max(asked) if asked else None,
            eos_token_id=eos_token_id,
            request_ids=tuple(request_ids) if request_ids is not None else None,
        )

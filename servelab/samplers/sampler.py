"""The ``Sampler``: logits in, one token per request out, in a fixed order.

The order is the semantics (DESIGN, Samplers):

1. snapshot raw logprobs (if any request asks for logprobs);
2. float32;
3. allowed-token whitelist, bad words;
4. processors that can change the argmax (min_tokens, logit_bias, custom ones);
5. penalties (repetition, frequency, presence);
6. greedy result (argmax);
7. temperature (rows with temperature < 1e-5 divide by 1);
8. argmax-invariant processors (custom ones, then min-p);
9. top-k / top-p;
10. sample (seeded requests draw their noise from their own generator);
11. greedy result where temperature < 1e-5;
12. logprobs of the raw distribution (top-n, plus the sampled token's logprob and rank).

Steps 8 (min-p), 9 and 10 are one fused op, ``top_k_top_p_sample``, from the
Triton kernels or the PyTorch reference (see :mod:`servelab.samplers.backends`).
A batch that is all greedy stops after step 6.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from servelab.reference._sampling_noise import draw_exponential_noise
from servelab.reference.sampling import top_k_top_p_keep_mask
from servelab.samplers.backends import check_backend_name, op_module
from servelab.samplers.metadata import SamplingMetadata
from servelab.samplers.params import SAMPLING_EPS
from servelab.samplers.penalties import apply_penalties
from servelab.samplers.processors import (
    LogitsProcessor,
    apply_allowed_token_mask,
    apply_bad_words,
    check_processor,
    default_processors,
    is_active,
)


@dataclass
class LogprobsOutput:
    """Logprobs of the raw distribution for a batch.

    ``token_ids`` int64 ``[B, 1 + n]`` and ``logprobs`` float32 ``[B, 1 + n]``:
    column 0 is the sampled token, columns 1..n the top-n tokens (descending),
    ``n`` the largest ``logprobs`` asked in the batch. ``sampled_token_ranks``
    int64 ``[B]``: 1 + the number of tokens strictly more likely than the
    sampled one.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    sampled_token_ranks: torch.Tensor

    def for_request(self, row: int, num_logprobs: int) -> list[tuple[int, float]]:
        """``[(sampled id, logprob), (top-1 id, logprob), ...]`` with ``num_logprobs`` top entries."""
        if not 0 <= num_logprobs < self.token_ids.shape[1]:
            raise ValueError(f"num_logprobs = {num_logprobs}; valid: [0, {self.token_ids.shape[1] - 1}]")
        ids = self.token_ids[row, : num_logprobs + 1].tolist()
        values = self.logprobs[row, : num_logprobs + 1].tolist()
        return list(zip(ids, values))


@dataclass
class SamplerOutput:
    """``sampled_token_ids`` int64 ``[B]``; ``logprobs`` when some request asked for them."""

    sampled_token_ids: torch.Tensor
    logprobs: LogprobsOutput | None = None


def _gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_top: int) -> LogprobsOutput:
    sampled_logprob = raw_logprobs.gather(1, sampled[:, None])
    ranks = (raw_logprobs > sampled_logprob).sum(dim=-1) + 1
    top = raw_logprobs.topk(num_top, dim=-1)
    return LogprobsOutput(
        token_ids=torch.cat([sampled[:, None], top.indices], dim=1),
        logprobs=torch.cat([sampled_logprob, top.values], dim=1),
        sampled_token_ranks=ranks,
    )


class Sampler:
    """Stateless sampler: ``forward(logits, metadata) -> SamplerOutput``.

    Args:
        logits_processors: extra processors (see :mod:`servelab.samplers.processors`),
            run after the built-ins of their kind, in the order given.
        backend: ``"auto"``, ``"torch"`` or ``"triton"`` for the fused
            min-p/top-k/top-p sampling op.
    """

    def __init__(self, logits_processors: Sequence[LogitsProcessor] = (), *, backend: str = "auto") -> None:
        self.backend = check_backend_name(backend)
        for processor in logits_processors:
            check_processor(processor)
        processors = (*default_processors(), *logits_processors)
        self.argmax_changing = tuple(p for p in processors if not p.argmax_invariant)
        self.argmax_invariant = tuple(p for p in processors if p.argmax_invariant)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        return self.forward(logits, metadata)

    def _check(self, logits: object, metadata: object) -> None:
        if not isinstance(metadata, SamplingMetadata):
            raise TypeError(f"metadata must be a SamplingMetadata, got {type(metadata).__name__}")
        if not isinstance(logits, torch.Tensor) or not logits.dtype.is_floating_point or logits.dim() != 2:
            raise TypeError("logits must be a floating torch.Tensor of shape [num_reqs, vocab]")
        expected = (metadata.num_reqs, metadata.vocab_size)
        if tuple(logits.shape) != expected:
            raise ValueError(f"logits has shape {tuple(logits.shape)} but the metadata describes {expected}")
        same_device = logits.device.type == metadata.device.type and (
            metadata.device.index is None or logits.device.index == metadata.device.index
        )
        if not same_device:
            raise ValueError(f"logits are on {logits.device} but the metadata on {metadata.device}")

    def _apply_argmax_changing(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Steps 2-5: float32, constraints, argmax-changing processors, penalties."""
        logits = logits.float()
        if metadata.allowed_token_mask is not None:
            logits = apply_allowed_token_mask(logits, metadata.allowed_token_mask)
        logits = apply_bad_words(logits, metadata)
        for processor in self.argmax_changing:
            if is_active(processor, metadata):
                logits = processor.apply(logits, metadata)
        if metadata.repetition_penalties is not None:
            logits = apply_penalties(
                logits,
                metadata.prompt_token_ids,
                metadata.output_token_ids,
                metadata.repetition_penalties,
                metadata.frequency_penalties,
                metadata.presence_penalties,
            )
        return logits

    def _apply_temperature_and_invariant(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Steps 7-8 (without min-p, which the sampling op fuses)."""
        temperature = metadata.temperature
        safe_temperature = torch.where(temperature < SAMPLING_EPS, 1.0, temperature)
        logits = logits / safe_temperature[:, None]
        for processor in self.argmax_invariant:
            if is_active(processor, metadata):
                logits = processor.apply(logits, metadata)
        return logits

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of ``logits`` (float ``[B, V]``, any float dtype)."""
        self._check(logits, metadata)
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)  # step 1
        processed = self._apply_argmax_changing(logits, metadata)
        greedy = processed.argmax(dim=-1)  # step 6
        if metadata.all_greedy or metadata.num_reqs == 0:
            sampled = greedy
        else:
            scaled = self._apply_temperature_and_invariant(processed, metadata)
            noise = draw_exponential_noise(
                metadata.num_reqs,
                metadata.vocab_size,
                logits.device,
                generators=metadata.generators(),
                skip_rows=metadata.greedy_rows,
            )
            sampling = op_module("sampling", self.backend, logits.device)
            # The params were validated when built: skip the op's syncing range checks.
            sampled = sampling.top_k_top_p_sample(
                scaled, metadata.top_k, metadata.top_p, metadata.min_p, noise, check_inputs=False
            )
            sampled = torch.where(metadata.temperature < SAMPLING_EPS, greedy, sampled)  # step 11
        logprobs = None
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)  # step 12
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def compute_probs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Float32 ``[B, V]``: the distribution each row samples from (steps 2-9).

        This is what ``rejection_sample`` expects as ``target_probs``. Greedy
        rows get temperature 1 (only their argmax matters). Filtered tokens
        have probability 0. For speculative decoding, build the metadata with
        one row per verified position (the request's params repeated, its
        output history extended by the drafts before that position), so
        penalties and min_tokens see the history each position would have.
        """
        self._check(logits, metadata)
        scaled = self._apply_temperature_and_invariant(self._apply_argmax_changing(logits, metadata), metadata)
        keep = top_k_top_p_keep_mask(scaled, metadata.top_k, metadata.top_p, metadata.min_p)
        return torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)

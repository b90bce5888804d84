"""Repetition, frequency and presence penalties (OpenAI / vLLM definitions).

For request *i* with prompt tokens P and output tokens O (counts ``c_v`` in O):

- repetition ``r``: for every token in P *or* O, a positive logit is divided
  by ``r`` and a negative one multiplied by ``r`` (``r > 1`` discourages).
- frequency ``f``: ``logit_v -= f * c_v`` for tokens in O.
- presence ``p``: ``logit_v -= p`` for tokens in O (``c_v > 0``).

Repetition is applied first, then frequency and presence, as vLLM does. The
sampler applies penalties before temperature, so a penalty means the same
thing at every temperature.
"""

from __future__ import annotations

import torch


def token_counts(padded_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-row token counts, int32 ``[B, vocab]``, from int64 ``[B, L]`` ids padded with ``vocab_size``."""
    num_rows = padded_token_ids.shape[0]
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=torch.int32, device=padded_token_ids.device)
    counts.scatter_add_(1, padded_token_ids, torch.ones_like(padded_token_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    repetition_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
) -> torch.Tensor:
    """Return penalised float32 logits ``[B, V]`` (the input is not modified).

    ``prompt_token_ids`` / ``output_token_ids`` int64 ``[B, L]`` padded with ``V``;
    the three penalty tensors float32 ``[B]`` (1.0 / 0.0 / 0.0 mean "off").
    """
    vocab_size = logits.shape[-1]
    output_counts = token_counts(output_token_ids, vocab_size)
    in_output = output_counts > 0
    seen = in_output | (token_counts(prompt_token_ids, vocab_size) > 0)
    repetition = repetition_penalties[:, None]
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, repeated, logits)
    logits = logits - frequency_penalties[:, None] * output_counts
    return logits - presence_penalties[:, None] * in_output

"""Logits processors: the pluggable steps of the sampler.

A processor is any object with

- ``argmax_invariant: bool`` — False if it can change which token is most
  likely (it then runs in step 4, before the greedy result is taken); True if
  it never does (it runs in step 8, after temperature, and greedy requests
  never see it);
- ``apply(logits, metadata) -> logits`` — float32 ``[B, V]`` in and out; it
  must not modify ``logits`` in place (the sampler may still hold it) and
  reads per-request settings from ``metadata.params[row]`` (custom settings
  go in ``SamplingParams.extra_args``).

Optionally ``is_active(metadata) -> bool`` lets a processor skip a batch that
does not use it. Pass custom processors to ``Sampler(logits_processors=...)``;
the sampler never needs editing. Built-ins: :class:`MinTokensProcessor` and
:class:`LogitBiasProcessor` (step 4). min-p is the one built-in argmax-invariant
processor; it is fused with top-k/top-p into the sampling op and runs right
after any custom argmax-invariant processors.

Also here: the fixed step-3 constraints (allowed-token whitelist, bad words).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from servelab.samplers.metadata import SamplingMetadata


@runtime_checkable
class LogitsProcessor(Protocol):
    """The interface a logits processor implements (see the module docstring)."""

    argmax_invariant: bool

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor: ...


def check_processor(processor: object) -> None:
    """Raise ``TypeError`` unless ``processor`` implements :class:`LogitsProcessor`."""
    if not callable(getattr(processor, "apply", None)):
        raise TypeError(f"logits processor {processor!r} has no apply(logits, metadata) method")
    flag = getattr(processor, "argmax_invariant", None)
    if not isinstance(flag, bool):
        raise TypeError(f"logits processor {processor!r} must declare argmax_invariant as a bool, got {flag!r}")


def is_active(processor: object, metadata: SamplingMetadata) -> bool:
    check = getattr(processor, "is_active", None)
    return True if check is None else bool(check(metadata))


class MinTokensProcessor:
    """Until a request has ``min_tokens`` outputs, mask its stop tokens (and EOS unless ``ignore_eos``)."""

    argmax_invariant = False

    def is_active(self, metadata: SamplingMetadata) -> bool:
        return any(params.min_tokens > 0 for params in metadata.params)

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        rows: list[int] = []
        columns: list[int] = []
        for row, params in enumerate(metadata.params):
            if len(metadata.output_token_id_lists[row]) < params.min_tokens:
                stop_ids = params.all_stop_token_ids(metadata.eos_token_id)
                rows.extend([row] * len(stop_ids))
                columns.extend(stop_ids)
        if not rows:
            return logits
        logits = logits.clone()
        logits[torch.tensor(rows, device=logits.device), torch.tensor(columns, device=logits.device)] = float("-inf")
        return logits


class LogitBiasProcessor:
    """Add ``SamplingParams.logit_bias[token]`` to that token's logit."""

    argmax_invariant = False

    def is_active(self, metadata: SamplingMetadata) -> bool:
        return any(params.logit_bias for params in metadata.params)

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        rows: list[int] = []
        columns: list[int] = []
        biases: list[float] = []
        for row, params in enumerate(metadata.params):
            for token_id, bias in (params.logit_bias or {}).items():
                rows.append(row)
                columns.append(token_id)
                biases.append(bias)
        if not rows:
            return logits
        bias_matrix = torch.zeros_like(logits)
        index = (torch.tensor(rows, device=logits.device), torch.tensor(columns, device=logits.device))
        bias_matrix[index] = torch.tensor(biases, device=logits.device)
        return logits + bias_matrix


def default_processors() -> tuple[MinTokensProcessor, LogitBiasProcessor]:
    """The built-in processors, in the order the sampler runs them."""
    return (MinTokensProcessor(), LogitBiasProcessor())


# --- step 3: hard constraints -------------------------------------------------


def apply_allowed_token_mask(logits: torch.Tensor, allowed_token_mask: torch.Tensor) -> torch.Tensor:
    """Set logits of tokens outside each row's whitelist (bool ``[B, V]``, True = allowed) to -inf."""
    return logits.masked_fill(~allowed_token_mask, float("-inf"))


def bad_word_bans(metadata: SamplingMetadata) -> list[tuple[int, int]]:
    """(row, token) pairs banned this step by ``bad_words_token_ids``.

    A one-token bad word is always banned. A longer one bans its last token
    when the request's most recent *output* tokens equal the rest of it (as
    vLLM does: the prompt does not count), so the full word can never be
    completed.
    """
    bans: list[tuple[int, int]] = []
    for row, params in enumerate(metadata.params):
        history = metadata.output_token_id_lists[row]
        for sequence in params.bad_words_token_ids or ():
            prefix = sequence[:-1]
            if len(prefix) <= len(history) and (not prefix or tuple(history[-len(prefix):]) == prefix):
                bans.append((row, sequence[-1]))
    return bans


def apply_bad_words(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    bans = bad_word_bans(metadata)
    if not bans:
        return logits
    rows, columns = zip(*bans)
    logits = logits.clone()
    logits[torch.tensor(rows, device=logits.device), torch.tensor(columns, device=logits.device)] = float("-inf")
    return logits

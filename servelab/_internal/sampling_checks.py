"""Input checks shared by the sampling/verification kernels and references.

Both implementations of an op call the same checks, so they refuse the same
inputs with the same message: the argument, the value, and what is valid.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(name: str, value: object, *, ndim: int, floating: bool | None = None) -> torch.Tensor:
    """Check that ``value`` is a tensor of rank ``ndim`` (float/int if asked)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(value.shape)}")
    if floating is True and value.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (fp16, bf16, fp32, fp64), got {value.dtype}")
    if floating is False and (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
    return value


def _check_row_vector(name: str, value: object, num_rows: int, device: torch.device, floating: bool) -> torch.Tensor:
    tensor = check_tensor(name, value, ndim=1, floating=floating)
    if tensor.shape[0] != num_rows:
        raise ValueError(f"{name} must have one entry per row ({num_rows}), got shape {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device} but logits are on {device}; put them on one device")
    return tensor


def check_sampling_inputs(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    exponential_noise: torch.Tensor,
) -> None:
    """Validate the arguments of ``top_k_top_p_sample`` (see its docstring)."""
    check_tensor("logits", logits, ndim=2, floating=True)
    num_rows, vocab_size = logits.shape
    if vocab_size == 0:
        raise ValueError("logits has an empty vocabulary dimension; valid: vocab_size >= 1")
    if vocab_size >= 2**31:
        raise ValueError(f"vocab_size = {vocab_size} does not fit int32 indexing; valid: < 2**31")
    noise = check_tensor("exponential_noise", exponential_noise, ndim=2, floating=True)
    if tuple(noise.shape) != tuple(logits.shape):
        raise ValueError(
            f"exponential_noise must match logits' shape {tuple(logits.shape)}, got {tuple(noise.shape)}"
        )
    if noise.device != logits.device:
        raise ValueError(f"exponential_noise is on {noise.device} but logits are on {logits.device}")
    if top_k is not None:
        _check_row_vector("top_k", top_k, num_rows, logits.device, floating=False)
    if top_p is not None:
        _check_row_vector("top_p", top_p, num_rows, logits.device, floating=True)
        if num_rows and not bool(((top_p > 0) & (top_p <= 1)).all()):
            bad = top_p[~((top_p > 0) & (top_p <= 1))][0].item()
            raise ValueError(f"top_p holds {bad}; valid: (0, 1] (1 disables top-p)")
    if min_p is not None:
        _check_row_vector("min_p", min_p, num_rows, logits.device, floating=True)
        if num_rows and not bool(((min_p >= 0) & (min_p <= 1)).all()):
            bad = min_p[~((min_p >= 0) & (min_p <= 1))][0].item()
            raise ValueError(f"min_p holds {bad}; valid: [0, 1] (0 disables min-p)")


@dataclass(frozen=True)
class DraftBatch:
    """The host-side shape of a batch of ragged drafts, after validation."""

    num_draft_tokens: list[int]  # k_i per request
    draft_offsets: list[int]  # [num_reqs + 1], prefix sums of k_i
    greedy: list[bool]  # per request
    vocab_size: int

    @property
    def num_reqs(self) -> int:
        return len(self.num_draft_tokens)

    @property
    def max_draft(self) -> int:
        return max(self.num_draft_tokens, default=0)


def _as_count_list(num_draft_tokens: object) -> list[int]:
    if isinstance(num_draft_tokens, torch.Tensor):
        check_tensor("num_draft_tokens", num_draft_tokens, ndim=1, floating=False)
        counts = num_draft_tokens.tolist()
    elif isinstance(num_draft_tokens, Sequence) and not isinstance(num_draft_tokens, (str, bytes)):
        counts = list(num_draft_tokens)
        for position, count in enumerate(counts):
            if not isinstance(count, int) or isinstance(count, bool):
                raise TypeError(f"num_draft_tokens[{position}] must be an int, got {type(count).__name__}")
    else:
        raise TypeError(
            f"num_draft_tokens must be a 1-D integer tensor or a list of ints, got {type(num_draft_tokens).__name__}"
        )
    for position, count in enumerate(counts):
        if count < 0:
            raise ValueError(f"num_draft_tokens[{position}] = {count} is negative; valid: >= 0")
    return counts


def check_draft_batch(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor | Sequence[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: bool | torch.Tensor,
    generator: object,
    *,
    check_inputs: bool = True,
) -> DraftBatch:
    """Validate the ``rejection_sample`` contract; return its host-side shape.

    With ``check_inputs=False`` only what the host needs anyway is read
    (the counts and the greedy flags); tensors are trusted.
    """
    counts = _as_count_list(num_draft_tokens)
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    greedy_list = _as_greedy_list(greedy, len(counts))
    if not check_inputs:
        return DraftBatch(counts, offsets, greedy_list, target_probs.shape[-1])
    check_tensor("draft_token_ids", draft_token_ids, ndim=1, floating=False)
    check_tensor("target_probs", target_probs, ndim=2, floating=True)
    total = sum(counts)
    if draft_token_ids.shape[0] != total:
        raise ValueError(
            f"draft_token_ids has {draft_token_ids.shape[0]} entries but sum(num_draft_tokens) = {total}; "
            "valid: one entry per draft token, requests back to back"
        )
    if target_probs.shape[0] != total + len(counts):
        raise ValueError(
            f"target_probs has {target_probs.shape[0]} rows but sum(num_draft_tokens + 1) = {total + len(counts)}; "
            "valid: per request one row per draft position, then one bonus row"
        )
    vocab_size = target_probs.shape[1]
    if vocab_size == 0:
        raise ValueError("target_probs has an empty vocabulary dimension")
    device = target_probs.device
    if draft_token_ids.device != device:
        raise ValueError(f"draft_token_ids is on {draft_token_ids.device} but target_probs on {device}")
    if draft_probs is not None:
        check_tensor("draft_probs", draft_probs, ndim=2, floating=True)
        if tuple(draft_probs.shape) != (total, vocab_size):
            raise ValueError(
                f"draft_probs must have shape [sum(num_draft_tokens), vocab] = {(total, vocab_size)}, "
                f"got {tuple(draft_probs.shape)} (pass None for one-hot n-gram drafts)"
            )
        if draft_probs.device != device:
            raise ValueError(f"draft_probs is on {draft_probs.device} but target_probs on {device}")
    if total:
        low, high = (int(v) for v in torch.aminmax(draft_token_ids))
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"draft_token_ids holds {bad}, outside the vocabulary; valid: [0, {vocab_size})")
    check_generator_argument(generator, len(counts))
    check_probabilities("target_probs", target_probs)
    if draft_probs is not None:
        check_probabilities("draft_probs", draft_probs)
    return DraftBatch(counts, offsets, greedy_list, vocab_size)


def check_probabilities(name: str, probs: torch.Tensor, row_mask: torch.Tensor | None = None) -> None:
    """Every row of ``probs`` (float ``[..., vocab]``) is a usable distribution.

    Valid: finite, non-negative entries and a positive sum per row (rows need
    not be normalised). ``row_mask`` bool ``probs.shape[:-1]`` restricts the
    check to the rows that will be read (padding rows of a tree batch). One
    device sync when the input is fine; the slow diagnosis only runs on failure.
    """
    if probs.numel() == 0:
        return
    # Two reductions, no [.., vocab] temporaries: amin propagates NaN (NaN >= 0 is False)
    # and catches negatives and -inf; a row holding +inf sums to inf.
    row_sum = probs.sum(dim=-1)
    usable = (probs.amin(dim=-1) >= 0) & torch.isfinite(row_sum) & (row_sum > 0)
    if row_mask is not None:
        usable |= ~row_mask
    if bool(usable.all()):
        return
    index = tuple(int(i) for i in (~usable).nonzero()[0])
    row = probs[index]
    where = f"row {index[0]}" if len(index) == 1 else f"row {list(index)}"
    valid = "valid: finite probabilities >= 0 with a positive sum in every row"
    if bool(torch.isnan(row).any()):
        raise ValueError(f"{name} holds NaN in {where}; {valid}")
    if bool(torch.isinf(row).any()):
        raise ValueError(f"{name} holds inf in {where}; {valid}")
    if bool((row < 0).any()):
        raise ValueError(f"{name} holds {float(row.min())} (negative) in {where}; {valid}")
    raise ValueError(f"{name} {where} has no positive mass (all zeros); {valid}")


def _as_greedy_list(greedy: object, num_reqs: int) -> list[bool]:
    if isinstance(greedy, bool):
        return [greedy] * num_reqs
    if isinstance(greedy, torch.Tensor):
        if greedy.dtype != torch.bool or greedy.dim() != 1 or greedy.shape[0] != num_reqs:
            raise ValueError(
                f"greedy must be a bool or a bool tensor with one entry per request ({num_reqs}), "
                f"got dtype {greedy.dtype} shape {tuple(greedy.shape)}"
            )
        return [bool(flag) for flag in greedy.tolist()]
    raise TypeError(f"greedy must be a bool or a bool tensor, got {type(greedy).__name__}")


def check_generator_argument(generator: object, num_reqs: int) -> None:
    """``generator``: None, one ``torch.Generator``, or one (or None) per request."""
    if generator is None or isinstance(generator, torch.Generator):
        return
    if isinstance(generator, Sequence) and not isinstance(generator, (str, bytes)):
        if len(generator) != num_reqs:
            raise ValueError(
                f"generator holds {len(generator)} entries; valid: None, one torch.Generator, "
                f"or one per request ({num_reqs})"
            )
        for position, entry in enumerate(generator):
            if entry is not None and not isinstance(entry, torch.Generator):
                raise TypeError(f"generator[{position}] must be a torch.Generator or None, got {type(entry).__name__}")
        return
    raise TypeError(f"generator must be None, a torch.Generator or a list of them, got {type(generator).__name__}")


def check_typical_options(posterior_threshold: object, posterior_alpha: object) -> tuple[float, float]:
    """Typical acceptance's two knobs: finite reals > 0."""
    out = []
    for name, value in (("posterior_threshold", posterior_threshold), ("posterior_alpha", posterior_alpha)):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} = {value} is invalid; valid: finite and > 0")
        out.append(float(value))
    return out[0], out[1]


def compute_dtype(probs: torch.Tensor) -> torch.dtype:
    """float64 stays float64 (tests compare in it); everything else is computed in float32."""
    return torch.float64 if probs.dtype == torch.float64 else torch.float32

"""Random noise for sampling and verification, drawn outside the kernels.

Every random choice in the samplers is an *exponential race*: with
``E_v ~ Exp(1)`` drawn independently per token, ``argmax_v w_v / E_v`` is token
``v`` with probability ``w_v / sum(w)`` for any non-negative weights ``w`` (the
smallest of independent ``Exp(rate=w_v)`` variables wins with probability
proportional to its rate). No normalisation, no cumulative sum, no sort, and
the only randomness is the noise tensor, so a Triton kernel and its PyTorch
reference given the same noise pick the same token. Both call these helpers to
draw it, in the same order from the same generators.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(value: int) -> int:
    # A well-mixed 64-bit hash, so (seed, step) pairs that differ in one bit
    # give unrelated generator streams.
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def seeded_generator(seed: int, step: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request at one decoding step.

    The stream is a pure function of ``(seed, step)`` where ``step`` is the
    number of tokens the request has generated so far. Nothing has to persist
    between steps: a seeded request gets the same noise whatever batch it sits
    in, after preemption and recompute, and in another process.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed(_splitmix64(_splitmix64(seed) ^ step))
    return generator


def draw_exponential_noise(
    num_rows: int,
    vocab_size: int,
    device: torch.device | str,
    *,
    generators: Mapping[int, torch.Generator] | None = None,
    generator: torch.Generator | None = None,
    skip_rows: Sequence[int] = (),
) -> torch.Tensor:
    """Exp(1) noise, float32 ``[num_rows, vocab_size]``, one row per request.

    Row ``i`` comes from ``generators[i]`` when present (seeded requests), so it
    depends on that generator only. All other rows are drawn in one call from
    ``generator`` (None: torch's default generator for ``device``). Rows in
    ``skip_rows`` (greedy requests) are filled with 1.0 and consume nothing.
    """
    generators = generators or {}
    skipped = set(skip_rows)
    shared_rows = [row for row in range(num_rows) if row not in generators and row not in skipped]
    if shared_rows and len(shared_rows) == num_rows:  # the common case: no fill pass needed
        return torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device).exponential_(generator=generator)
    noise = torch.ones(num_rows, vocab_size, dtype=torch.float32, device=device)
    if shared_rows:
        index = torch.tensor(shared_rows, device=device)
        noise[index] = torch.empty(len(shared_rows), vocab_size, device=device).exponential_(generator=generator)
    for row, row_generator in generators.items():
        if row not in skipped:
            noise[row].exponential_(generator=row_generator)
    return noise


def draw_rejection_noise(
    num_draft_tokens: Sequence[int],
    vocab_size: int,
    device: torch.device | str,
    generator: torch.Generator | Sequence[torch.Generator | None] | None,
    skip_requests: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Noise for verifying one batch of drafts.

    Returns ``(uniform, exponential)``: ``uniform`` float32 ``[sum(k_i)]`` in
    [0, 1), one per draft token, for the accept test; ``exponential`` float32
    ``[num_reqs, vocab_size]``, one Exp(1) row per request, for the single
    recovered or bonus token each request emits (only one is ever drawn per
    request, so one row suffices). ``generator`` is one generator for the whole
    batch, or one per request (None entries use the default generator), which
    is how seeded requests stay independent of the batch. Requests in
    ``skip_requests`` (greedy) get ones and consume nothing.
    """
    num_reqs = len(num_draft_tokens)
    total = sum(num_draft_tokens)
    skipped = set(skip_requests)
    if len(skipped) == num_reqs:  # all greedy: nothing random, leave the generators untouched
        return (
            torch.zeros(total, dtype=torch.float32, device=device),
            torch.ones(num_reqs, vocab_size, dtype=torch.float32, device=device),
        )
    if generator is None or isinstance(generator, torch.Generator):
        uniform = torch.rand(total, dtype=torch.float32, device=device, generator=generator)
        exponential = draw_exponential_noise(
            num_reqs, vocab_size, device, generator=generator, skip_rows=skip_requests
        )
        return uniform, exponential
    uniform = torch.zeros(total, dtype=torch.float32, device=device)
    offsets = [0]
    for count in num_draft_tokens:
        offsets.append(offsets[-1] + count)
    seeded = {row: gen for row, gen in enumerate(generator) if gen is not None}
    shared = [row for row in range(num_reqs) if row not in seeded]
    # Unseeded requests share one call; seeded ones draw their own slice.
    shared_slices = [torch.arange(offsets[r], offsets[r + 1]) for r in shared]
    if shared_slices:
        index = torch.cat(shared_slices).to(device)
        uniform[index] = torch.rand(index.numel(), dtype=torch.float32, device=device)
    for row, row_generator in seeded.items():
        if row not in skipped and num_draft_tokens[row]:
            uniform[offsets[row] : offsets[row + 1]] = torch.rand(
                num_draft_tokens[row], dtype=torch.float32, device=device, generator=row_generator
            )
    exponential = draw_exponential_noise(
        num_reqs, vocab_size, device, generators=seeded, skip_rows=skip_requests
    )
    return uniform, exponential


def draw_request_noise(
    num_reqs: int,
    vocab_size: int,
    device: torch.device | str,
    generator: torch.Generator | Sequence[torch.Generator | None] | None,
    skip_rows: Sequence[int] = (),
) -> torch.Tensor:
    """Exp(1) noise float32 ``[num_reqs, vocab_size]`` for one emitted token per request.

    ``generator``: None, one generator for the batch, or one (or None) per
    request (seeded requests then depend only on their own generator). Rows
    in ``skip_rows`` (greedy) are ones and consume nothing.
    """
    if generator is None or isinstance(generator, torch.Generator):
        return draw_exponential_noise(num_reqs, vocab_size, device, generator=generator, skip_rows=skip_rows)
    seeded = {row: gen for row, gen in enumerate(generator) if gen is not None}
    return draw_exponential_noise(num_reqs, vocab_size, device, generators=seeded, skip_rows=skip_rows)

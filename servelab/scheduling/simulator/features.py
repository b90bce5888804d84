"""What a cost model reads from one scheduler step: token, sequence and attention counts."""

from __future__ import annotations

FEATURES = ("num_tokens", "num_kv_tokens", "num_seqs", "num_prefill_tokens", "attn_pairs")
"""What :func:`step_features` returns, in order (the columns :meth:`StepCostModel.fit` takes before seconds)."""


def step_features(out) -> tuple[int, int, int, int, float]:
    """``(num_tokens, num_kv_tokens, num_seqs, num_prefill_tokens, attn_pairs)`` of a ``SchedulerOutput``.

    A *decode* is a request scheduled for one token; every token of a request
    scheduled for more (a prompt chunk, drafts to verify) is a *prefill* token,
    and such a chunk of ``n`` tokens after ``c`` computed ones reads
    ``n * (c + (n + 1) / 2)`` query-key pairs (causal).
    """
    counts = list(out.num_scheduled_tokens.values())
    num_tokens = out.total_num_scheduled_tokens
    num_prefill = num_tokens - counts.count(1)
    pairs = 0.0
    if num_prefill:
        for _, computed, n in out.iter_scheduled():
            if n > 1:
                pairs += n * (computed + (n + 1) / 2)
    return num_tokens, out.total_num_kv_tokens, len(counts), num_prefill, pairs


EXTRA_FEATURES = ("num_prefill_seqs", "decode_restarts", "restarted_decode_seqs")
"""What :func:`extra_features` returns, in order; ``FEATURES + EXTRA_FEATURES`` are the columns of
the nine-term rows :meth:`StepCostModel.fit` takes (before seconds)."""


def extra_features(out, continuity: DecodeContinuity) -> tuple[int, int, int]:
    """``(num_prefill_seqs, decode_restarts, restarted_decode_seqs)`` of a ``SchedulerOutput``: the
    sequences scheduled for more than one token (each a separately padded attention problem, with
    its own masks), then ``continuity(out)`` (stateful: call once per step, in order)."""
    prefill_seqs = sum(1 for n in out.num_scheduled_tokens.values() if n > 1)
    return (prefill_seqs, *continuity(out))


class DecodeContinuity:
    """Whether a pure decode step continues the previous step, as a stateful feature.

    A backend may carry a decode batch's K/V from one step to the next (the CPU
    ``"sdpa"`` backend's dense buffers): a pure decode step over the *same*
    requests as the previous pure decode step gathers nothing, any other pure
    decode step (the first after a prompt, or after a request joined or left)
    gathers every context afresh. Called once per step, in order, with each
    ``SchedulerOutput``; returns ``(decode_restarts, restarted_decode_seqs)``:
    ``(1, n)`` for a pure decode step of ``n`` sequences that does not continue
    the previous one, else ``(0, 0)``. A step with a multi-token chunk (its
    decodes go through the per-step gather anyway) returns ``(0, 0)`` and ends
    the run of decode steps.
    """

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: frozenset | None = None

    def __call__(self, out) -> tuple[int, int]:
        counts = out.num_scheduled_tokens
        pure = bool(counts) and all(n == 1 for n in counts.values())
        key = frozenset(counts) if pure else None
        restarted = pure and key != self._last
        self._last = key
        return (1, len(counts)) if restarted else (0, 0)

    def reset(self) -> None:
        self._last = None

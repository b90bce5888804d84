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
    gathers every context afresh, and so do the decodes of a step that also
    holds a multi-token chunk (such a step is planned from the paged cache and
    ends the run of carried steps). Called once per step, in order, with each
    ``SchedulerOutput``; returns ``(decode_restarts, restarted_decode_seqs)``:
    ``(1, n)`` for a step whose ``n`` one-token sequences are gathered afresh,
    ``(0, 0)`` for a carried pure decode step or a step without decodes.
    """

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: frozenset | None = None

    def __call__(self, out) -> tuple[int, int]:
        counts = out.num_scheduled_tokens
        decodes = sum(1 for n in counts.values() if n == 1)
        pure = bool(counts) and decodes == len(counts)
        key = frozenset(counts) if pure else None
        restarted = decodes > 0 and (not pure or key != self._last)
        self._last = key
        return (1, decodes) if restarted else (0, 0)

    def reset(self) -> None:
        self._last = None

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

"""Reference merge of two partial attentions: the spec for
:func:`servelab.kernels.merge_attn_states`.

Two attentions of the same queries over disjoint key sets A and B combine
exactly: with ``m = max(lse_a, lse_b)``, ``w_a = exp(lse_a - m)`` and
``w_b = exp(lse_b - m)``, the attention over ``A ∪ B`` is
``(w_a * out_a + w_b * out_b) / (w_a + w_b)`` and its log-sum-exp is
``m + log(w_a + w_b)``. An empty partial has ``lse = -inf`` and weight 0; when
both are empty the result is 0 with ``lse = -inf`` (never NaN), and the
output of an empty partial is never read into the result.
"""

from __future__ import annotations

import torch

from servelab._internal.attention_checks import check_merge_attn_states_args


def merge_attn_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    check_inputs: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge partial attention outputs by their log-sum-exps.

    Args:
        out_a, out_b: ``[num_tokens, num_heads, head_size]``, one float dtype
            (float16/bfloat16/float32; float64 for float64 math). Each is a
            normalised attention output over its own key set.
        lse_a, lse_b: float32 ``[num_tokens, num_heads]`` (float64 with float64
            outputs): natural-log sum of exp(scores); ``-inf`` = empty partial.
        out: optional output tensor (``out_a``'s shape and dtype), written in place.
        check_inputs: reject NaN / ``+inf`` LSEs (reads the LSE values).

    Returns:
        ``(out, lse)``: merged output in ``out_a``'s dtype and merged float32
        (float64) LSE, so merges chain: ``merge(merge(a, b), c)``.
    """
    check_merge_attn_states_args(out_a, lse_a, out_b, lse_b, out=out, check_values=check_inputs)
    compute_dtype = torch.float64 if out_a.dtype == torch.float64 else torch.float32
    lse_a, lse_b = lse_a.to(compute_dtype), lse_b.to(compute_dtype)
    peak = torch.maximum(lse_a, lse_b)
    # Where both partials are empty, shift by 0 instead of -inf so that
    # exp(-inf - 0) = 0 rather than exp(-inf - -inf) = NaN.
    peak = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)
    weight_a = torch.exp(lse_a - peak)
    weight_b = torch.exp(lse_b - peak)
    total = weight_a + weight_b
    safe_total = torch.where(total > 0, total, torch.ones_like(total))
    # An empty partial contributes nothing, even if its output holds garbage.
    part_a = torch.where(weight_a[..., None] > 0, weight_a[..., None] * out_a.to(compute_dtype), 0.0)
    part_b = torch.where(weight_b[..., None] > 0, weight_b[..., None] * out_b.to(compute_dtype), 0.0)
    merged = (part_a + part_b) / safe_total[..., None]
    merged_lse = peak + torch.log(total)  # log(0) = -inf for two empty partials
    if out is None:
        out = torch.empty_like(out_a)
    out.copy_(merged)
    return out, merged_lse

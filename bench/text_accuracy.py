"""Teacher-forced accuracy of a variant's logits against a reference's, shared by the accuracy studies
(``kv_quant_accuracy.py``, ``quant_weights.py``)."""

from __future__ import annotations

import torch


def text_metrics(ref: list[torch.Tensor], got: list[torch.Tensor], seqs: list[list[int]]) -> dict[str, float]:
    """Per text ``i``, ``ref[i]`` / ``got[i]`` are float logits ``[len(seqs[i]), vocab]``: the variant's perplexity
    on the next tokens, the mean KL(ref || got) per position and the share of positions whose argmax agrees."""
    nll, kl, agree, count = 0.0, 0.0, 0, 0
    for r, g, tokens in zip(ref, got, seqs):
        target = torch.tensor(tokens[1:])
        log_r, log_g = torch.log_softmax(r[:-1].double(), -1), torch.log_softmax(g[:-1].double(), -1)
        nll += float(-log_g.gather(1, target[:, None]).sum())
        kl += float((log_r.exp() * (log_r - log_g)).sum())
        agree += int((r[:-1].argmax(-1) == g[:-1].argmax(-1)).sum())
        count += target.shape[0]
    return {"ppl": float(torch.exp(torch.tensor(nll / count))), "kl_mean": kl / count, "top1_agreement": agree / count,
            "tokens": count}

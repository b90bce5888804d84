"""``MoEConfig``: the mixture-of-experts fields of a transformers config, read and validated once.

Each registered MoE architecture names the same things differently:

============  ===================  ===================  =====================  ================
arch          experts              expert width         renormalize top-k      sparse layers
============  ===================  ===================  =====================  ================
mixtral       num_local_experts    intermediate_size    always                 every layer
qwen2_moe     num_experts          moe_intermediate     norm_topk_prob         decoder_sparse_step,
                                                                               minus mlp_only_layers
qwen3_moe     num_experts          moe_intermediate     norm_topk_prob         (as qwen2_moe)
olmoe         num_experts          intermediate_size    norm_topk_prob         every layer
============  ===================  ===================  =====================  ================

Qwen2-MoE adds a shared expert (``shared_expert_intermediate_size``) gated by
``sigmoid(shared_expert_gate(x))``. ``num_expert_group`` / ``topk_group``
(grouped top-k) are read when a config has them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MoEConfig", "MOE_MODEL_TYPES"]

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def _int(hf: Any, name: str, *, minimum: int = 1) -> int:
    value = getattr(hf, name, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")
    return value


@dataclass(frozen=True)
class MoEConfig:
    """What a sparse MoE block needs (see the module docstring for where each comes from).

    Attributes:
        num_experts: routed (logical) experts per sparse layer.
        top_k: experts per token.
        intermediate_size: one expert's gate/up width.
        renormalize: rescale a token's top-k weights to sum to 1.
        shared_expert_intermediate_size: width of the always-on shared expert (0: none).
        sparse_layers: per layer, whether its MLP is a sparse MoE block.
        num_expert_group, topk_group: grouped top-k (both ``None``: plain top-k).
        activation: the experts' gated activation (``"silu"``).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    shared_expert_intermediate_size: int
    sparse_layers: tuple[bool, ...]
    num_expert_group: int | None = None
    topk_group: int | None = None
    activation: str = "silu"

    @classmethod
    def from_hf(cls, hf: Any) -> "MoEConfig":
        """Read the MoE fields of a transformers config of a model type in :data:`MOE_MODEL_TYPES`.

        Raises:
            ValueError: an unknown model type, a missing / non-positive field, ``top_k`` above the
                expert count, an activation other than SiLU, router jitter, grouped top-k that
                does not divide the experts.
        """
        model_type = getattr(hf, "model_type", None)
        if model_type not in MOE_MODEL_TYPES:
            raise ValueError(f"model_type={model_type!r} is not a MoE type servelab reads; "
                             f"valid: {', '.join(MOE_MODEL_TYPES)}")
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported for {model_type}; only 'silu'")
        num_layers = _int(hf, "num_hidden_layers")
        if model_type == "mixtral":
            experts, width, renormalize = _int(hf, "num_local_experts"), _int(hf, "intermediate_size"), True
        else:
            experts = _int(hf, "num_experts")
            width = _int(hf, "moe_intermediate_size" if model_type.startswith("qwen") else "intermediate_size")
            renormalize = bool(getattr(hf, "norm_topk_prob", False))
        top_k = _int(hf, "num_experts_per_tok")
        if top_k > experts:
            raise ValueError(f"num_experts_per_tok={top_k} exceeds the {experts} experts")
        if model_type.startswith("qwen"):
            step = _int(hf, "decoder_sparse_step")
            dense = set(getattr(hf, "mlp_only_layers", None) or [])
            sparse = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
        else:
            sparse = (True,) * num_layers
        shared = _int(hf, "shared_expert_intermediate_size", minimum=0) if model_type == "qwen2_moe" else 0
        groups, topk_group = getattr(hf, "n_group", None), getattr(hf, "topk_group", None)
        if groups is not None and experts % groups:
            raise ValueError(f"n_group={groups!r} must divide the {experts} experts")
        return cls(num_experts=experts, top_k=top_k, intermediate_size=width, renormalize=renormalize,
                   shared_expert_intermediate_size=shared, sparse_layers=sparse, num_expert_group=groups,
                   topk_group=topk_group)

    def active_parameters_per_token(self, hidden_size: int) -> int:
        """Expert parameters one token reads in one sparse layer: ``top_k`` experts plus the
        shared expert (3 matrices of ``hidden x width`` each) and the router."""
        routed = self.top_k * 3 * hidden_size * self.intermediate_size
        shared_width = self.shared_expert_intermediate_size
        shared = 3 * hidden_size * shared_width + (hidden_size if shared_width else 0)  # + its sigmoid gate
        return routed + shared + self.num_experts * hidden_size

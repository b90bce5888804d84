"""Self-speculative drafting: the target's own first layers draft (``"layer_skip"``).

LayerSkip / Draft & Verify style early exit with no second checkpoint: the
draft model is a *view* of the target (:func:`early_exit_view`) that runs its
embedding, its first ``num_layers`` decoder layers, its final norm and its LM
head — the same weight tensors, nothing copied. The view keeps its own KV
for those layers in a side paged cache (a :class:`DraftModelDrafter` cache),
so drafting never touches the target's cache or its block accounting.
Chains by default; ``tree="static"`` / ``"dynamic"`` grow top-k token trees.

Without early-exit training (the LayerSkip recipe) a shallow exit predicts
the deep model's token less often; ``bench/spec_decode.py`` measures how
often on SmolLM2 and what it buys.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from torch import nn

from servelab.samplers.drafters.draft_model import DraftModelDrafter

__all__ = ["LayerSkipDrafter", "early_exit_view"]


def early_exit_view(target: Any, num_layers: int) -> Any:
    """A model object sharing ``target``'s weights whose forward stops after ``num_layers``
    decoder layers (then the final norm; ``compute_logits`` is the target's LM head)."""
    layers = list(target.model.layers)
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or not 1 <= num_layers < len(layers):
        raise ValueError(f"num_layers={num_layers!r}; valid: an int in [1, {len(layers) - 1}] (the target has "
                         f"{len(layers)} layers)")
    inner = copy.copy(target.model)
    inner._modules = dict(inner._modules)  # never the target's module dict
    inner._modules["layers"] = nn.ModuleList(layers[:num_layers])
    view = copy.copy(target)
    view._modules = dict(view._modules)
    view._modules["model"] = inner
    view.__dict__.pop("_plan_memory", None)  # attention state carried between forwards is per model object
    changes: dict[str, Any] = {"num_hidden_layers": num_layers}
    windows = getattr(target.config, "sliding_windows", None)
    if windows is not None:  # per-layer settings follow the kept layers
        changes["sliding_windows"] = tuple(windows)[:num_layers]
    view.__dict__["config"] = dataclasses.replace(target.config, **changes)
    return view


class LayerSkipDrafter(DraftModelDrafter):
    """Registered as ``"layer_skip"``: drafts with the target's first ``num_layers`` layers.

    Args:
        num_layers: exit layer (default: half the target's layers).
        tree, tree_width, tree_depth: as :class:`DraftModelDrafter` (None: chains).
        block_size, num_blocks: the side KV cache (None: sized by the pipeline).
        model: the target; the pipeline binds it (:meth:`bind_target`) when the
            drafter is given by name or object.
    """

    def __init__(self, num_layers: int | None = None, *, tree: str | None = None, tree_width: int = 2,
                 tree_depth: int | None = None, block_size: int = 16, num_blocks: int | None = None,
                 model: Any = None) -> None:
        self._set_tree_options(tree, tree_width, tree_depth)
        self.num_layers = num_layers
        self._cache_options = (block_size, num_blocks)
        self.model = None
        self.kv_caches = None
        self.block_size, self.num_blocks = block_size, num_blocks
        self._free, self._states, self._tmp = [], {}, 0
        self._target: Any = None
        if model is not None:
            self.bind_target(model)

    def bind_target(self, target: Any) -> None:
        """Build the early-exit view of ``target`` (called once by the pipeline)."""
        if self.model is not None:
            if self._target is target:
                return
            if self._states:
                raise RuntimeError("this LayerSkipDrafter drafts for another target's requests; make a new one")
            self.kv_caches, self.num_blocks = None, self._cache_options[1]  # rebuilt for the new target
        num_layers = self.num_layers if self.num_layers is not None else max(1, len(target.model.layers) // 2)
        block_size, num_blocks = self._cache_options
        super().__init__(early_exit_view(target, num_layers), block_size=block_size, num_blocks=num_blocks,
                         tree=self.tree, tree_width=self.tree_width, tree_depth=self.tree_depth)
        self.num_layers, self._target = num_layers, target

    def propose_for_requests(self, requests):
        if self.model is None:
            raise RuntimeError("the layer_skip drafter has no target model yet: give it to a Pipeline (which "
                               "binds it) or call bind_target(model)")
        return super().propose_for_requests(requests)

    def __repr__(self) -> str:
        return f"LayerSkipDrafter(num_layers={self.num_layers}, tree={self.tree!r})"

"""The drafter interface and its registry.

:class:`Drafter` (ABC), :class:`DraftProposal` and :class:`DraftRequest` are
defined in :mod:`servelab.samplers.interfaces` (the contracts) and re-exported
here. The registry names the built-in drafters:

- ``"ngram"``: :class:`~servelab.samplers.drafters.NgramDrafter` (options ``min_n``, ``max_n``);
- ``"draft_model"``: a small model with its own paged KV cache
  (:class:`~servelab.samplers.drafters.DraftModelDrafter`; options ``path``, ``dtype``,
  ``device``, ``attention``, ``block_size``, ``num_blocks``, ``tree`` (None: a chain;
  ``"static"`` or ``"dynamic"``: a top-k token tree), ``tree_width``);
- ``"ngram_tree"``: several prompt-lookup continuations merged into a token tree
  (:class:`~servelab.samplers.drafters.NgramTreeDrafter`; ``min_n``, ``max_n``, ``max_branches``);
- ``"layer_skip"``: self-speculation with the target's own first layers and LM head
  (:class:`~servelab.samplers.drafters.LayerSkipDrafter`; built by the pipeline with
  the target model; options ``num_layers``, ``tree``, ``tree_width``).

:func:`get_drafter` also takes a checkpoint folder path (a folder with a
``config.json``): the draft-model drafter loaded from it. A proposal may be a
token tree (:class:`~servelab.samplers.draft_tree.DraftTree`, ``DraftProposal.from_tree``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from servelab._internal.registry import Registry
from servelab.samplers.draft_tree import MAX_TREE_NODES, DraftTree, check_parents
from servelab.samplers.interfaces import Drafter, DraftProposal, DraftRequest

__all__ = [
    "DraftProposal",
    "DraftRequest",
    "DraftTree",
    "Drafter",
    "available_drafters",
    "check_drafter",
    "check_proposals",
    "get_drafter",
    "register_drafter",
]


def check_drafter(obj: object) -> None:
    """Raise ``TypeError`` unless ``obj`` has the two methods the runner calls."""
    missing = [name for name in ("propose_for_requests", "release") if not callable(getattr(obj, name, None))]
    if missing:
        raise TypeError(f"drafter {type(obj).__name__} lacks {', '.join(missing)}; subclass "
                        "servelab.samplers.drafters.Drafter or implement propose_for_requests(requests) "
                        "and release(req_id)")


_DRAFTERS: Registry[Drafter] = Registry("drafter", factory=True, check=check_drafter)
_DRAFTERS.register("ngram", "servelab.samplers.drafters.ngram:NgramDrafter")
_DRAFTERS.register("draft_model", "servelab.samplers.drafters.draft_model:load_draft_model_drafter")
_DRAFTERS.register("ngram_tree", "servelab.samplers.drafters.ngram_tree:NgramTreeDrafter")
_DRAFTERS.register("layer_skip", "servelab.samplers.drafters.layer_skip:LayerSkipDrafter")


def register_drafter(name: str, obj: Any, *, override: bool = False) -> None:
    """Register a drafter class or factory (called with ``get_drafter``'s options) under ``name``.

    A ready-made drafter object is accepted too (every ``get_drafter(name)``
    then returns that same object). Duplicate names raise ``ValueError``
    unless ``override=True``.
    """
    if not isinstance(obj, (str, type)) and not _is_factory(obj):
        check_drafter(obj)
        instance = obj

        def obj(**options: Any) -> Any:
            if options:
                raise TypeError(f"drafter {name!r} is a ready-made object; it takes no options")
            return instance
    _DRAFTERS.register(name, obj, override=override)


def _is_factory(obj: object) -> bool:
    return callable(obj) and not callable(getattr(obj, "propose_for_requests", None))


def available_drafters() -> list[str]:
    """Registered drafter names (a checkpoint folder path is accepted besides these)."""
    return _DRAFTERS.available()


def _looks_like_path(value: str | os.PathLike) -> bool:
    return isinstance(value, os.PathLike) or os.sep in value or Path(value).is_dir()


def get_drafter(name_or_obj: str | os.PathLike | Drafter, **options: Any) -> Drafter:
    """A drafter from a registered name (with ``options``), a checkpoint folder, or an object.

    Unknown names raise ``ValueError`` listing the known ones; an object
    without ``propose_for_requests`` / ``release`` raises ``TypeError``.
    """
    if isinstance(name_or_obj, os.PathLike) or (
        isinstance(name_or_obj, str) and name_or_obj not in _DRAFTERS and _looks_like_path(name_or_obj)
    ):
        return _DRAFTERS.get("draft_model", path=name_or_obj, **options)
    try:
        return _DRAFTERS.get(name_or_obj, **options)
    except ValueError as error:
        if isinstance(name_or_obj, str) and name_or_obj not in _DRAFTERS:
            raise ValueError(f"{error}; or a draft-model checkpoint folder (with config.json)") from None
        raise


def check_proposals(requests: Sequence[DraftRequest], proposals: object, vocab_size: int) -> list[DraftProposal]:
    """Validate what a (possibly user-written) drafter returned for ``requests``.

    One :class:`DraftProposal` per request, at most ``k`` token ids each, all
    in ``[0, vocab_size)``, ``probs`` None or float ``[len(token_ids), V]``
    with ``V <= vocab_size``, ``parents`` None or a valid tree over the drafts
    (one per draft, ``-1 <= parents[n] < n``, at most ``MAX_TREE_NODES``).
    Raises ``TypeError`` / ``ValueError`` naming the
    request; the caller fails the requests of that call.
    """
    if not isinstance(proposals, Sequence) or len(proposals) != len(requests):
        got = len(proposals) if isinstance(proposals, Sequence) else type(proposals).__name__
        raise ValueError(f"drafter returned {got} proposals for {len(requests)} requests; valid: one per request")
    for request, proposal in zip(requests, proposals):
        if not isinstance(proposal, DraftProposal):
            raise TypeError(f"drafter returned {type(proposal).__name__} for request {request.req_id!r}; "
                            "valid: a DraftProposal")
        ids = proposal.token_ids
        if len(ids) > request.k:
            raise ValueError(f"drafter proposed {len(ids)} tokens for request {request.req_id!r} asking for "
                             f"at most {request.k}")
        for token in ids:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
                raise ValueError(f"drafter proposed token {token!r} for request {request.req_id!r}; "
                                 f"valid: ints in [0, {vocab_size})")
        probs = proposal.probs
        if probs is not None and (not isinstance(probs, torch.Tensor) or probs.dim() != 2
                                  or probs.shape[0] != len(ids) or probs.shape[1] > vocab_size):
            shape = tuple(probs.shape) if isinstance(probs, torch.Tensor) else type(probs).__name__
            raise ValueError(f"drafter probs for request {request.req_id!r} have shape {shape}; "
                             f"valid: None or [{len(ids)}, <= {vocab_size}]")
        if proposal.parents is not None:
            _check_tree_parents(request.req_id, proposal.parents, len(ids))
    return list(proposals)


def _check_tree_parents(req_id: str, parents: Sequence[int], num_nodes: int) -> None:
    if isinstance(parents, (str, bytes)) or not isinstance(parents, Sequence) or len(parents) != num_nodes:
        raise ValueError(f"drafter parents for request {req_id!r} are {parents!r}; valid: None (a chain) or "
                         f"one parent per draft ({num_nodes})")
    if num_nodes > MAX_TREE_NODES:
        raise ValueError(f"drafter proposed a tree of {num_nodes} nodes for request {req_id!r}; valid: at most "
                         f"{MAX_TREE_NODES}")
    try:
        check_parents(list(parents))
    except (TypeError, ValueError) as error:
        raise ValueError(f"drafter tree for request {req_id!r}: {error}") from None

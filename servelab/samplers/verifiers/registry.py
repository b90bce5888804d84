"""The verifier registry: choose how drafts are verified, by name or by object.

Built-in names (each a class; ``get_verifier(name, **options)`` builds one):

- ``"rejection"`` (the default): :class:`~servelab.samplers.verifiers.RejectionVerifier`,
  exact rejection sampling; options ``backend`` (``"auto"``, ``"torch"``, ``"triton"``)
  and ``check_inputs``.
- ``"typical"``: :class:`~servelab.samplers.verifiers.TypicalAcceptanceVerifier`
  (Medusa); options ``posterior_threshold``, ``posterior_alpha``, ``check_inputs``.
- ``"tree"``: :class:`~servelab.samplers.verifiers.TreeVerifier`, SpecInfer-style
  token-tree verification; a chain is verified as a one-branch tree.

Any object with ``name`` and ``verify(...)`` (the
:class:`~servelab.samplers.interfaces.Verifier` protocol) can be passed
wherever a verifier name is accepted, or registered under a name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from servelab._internal.conformance import check_conforms
from servelab._internal.registry import Registry
from servelab.samplers.interfaces import Verifier

__all__ = [
    "DEFAULT_VERIFIER",
    "available_verifiers",
    "check_verifier",
    "check_verifier_output",
    "get_verifier",
    "register_verifier",
]

DEFAULT_VERIFIER = "rejection"


def check_verifier(obj: object) -> None:
    """Raise ``TypeError`` unless ``obj`` implements the :class:`Verifier` protocol
    (every missing member named; ``name`` must be a str)."""
    check_conforms(obj, Verifier, "verifier")
    name = getattr(obj, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"verifier {type(obj).__name__}.name must be a str, got {type(name).__name__}")


_VERIFIERS: Registry[Verifier] = Registry("verifier", factory=True, check=check_verifier)
_VERIFIERS.register("rejection", "servelab.samplers.verifiers.rejection:RejectionVerifier")
_VERIFIERS.register("typical", "servelab.samplers.verifiers.typical:TypicalAcceptanceVerifier")
_VERIFIERS.register("tree", "servelab.samplers.verifiers.tree:TreeVerifier")


def register_verifier(name: str, obj: Any, *, override: bool = False) -> None:
    """Register a verifier class / factory (built with ``get_verifier``'s options) or a ready object.

    Duplicate names raise ``ValueError`` unless ``override=True``.
    """
    if not isinstance(obj, (str, type)) and callable(getattr(obj, "verify", None)):
        check_verifier(obj)
        instance = obj

        def obj(**options: Any) -> Any:
            if options:
                raise TypeError(f"verifier {name!r} is a ready-made object; it takes no options")
            return instance
    elif not isinstance(obj, str) and not callable(obj):
        raise TypeError(f"verifier {name!r} must be a class, a factory or an object with verify(), "
                        f"got {type(obj).__name__}")
    _VERIFIERS.register(name, obj, override=override)


def available_verifiers() -> list[str]:
    """Registered verifier names, sorted."""
    return _VERIFIERS.available()


def get_verifier(name_or_obj: str | Verifier = DEFAULT_VERIFIER, **options: Any) -> Verifier:
    """A verifier from a name (built with ``options``) or an object implementing the protocol.

    Unknown names raise ``ValueError`` listing the known ones; objects without
    ``name`` / ``verify`` raise ``TypeError``.
    """
    verifier = _VERIFIERS.get(name_or_obj, **options)
    if isinstance(name_or_obj, str):
        check_verifier(verifier)
    return verifier


def check_verifier_output(output: object, num_draft_tokens: Sequence[int], vocab_size: int) -> torch.Tensor:
    """Validate what a (possibly user-written) verifier returned; returns it.

    Expected: an int64 tensor ``[num_reqs, max k_i + 1]`` whose row ``i``
    holds at most ``k_i`` accepted drafts and one final token in
    ``[0, vocab_size)``, then only ``-1``. (Whether the accepted tokens equal
    the drafts is the caller's business.) Raises ``ValueError`` / ``TypeError``.
    """
    counts = list(num_draft_tokens)
    width = max(counts, default=0) + 1
    if not isinstance(output, torch.Tensor) or output.dtype != torch.int64:
        got = output.dtype if isinstance(output, torch.Tensor) else type(output).__name__
        raise TypeError(f"verifier output must be an int64 tensor, got {got}")
    if tuple(output.shape) != (len(counts), width):
        raise ValueError(f"verifier output has shape {tuple(output.shape)}; valid: {(len(counts), width)}")
    if not counts:
        return output
    emitted = output >= 0
    lengths = emitted.sum(dim=1)
    position = torch.arange(width, device=output.device)[None, :]
    prefix = emitted == (position < lengths[:, None])
    limits = torch.tensor(counts, device=output.device) + 1
    in_vocab = (output < vocab_size) & (output >= -1)
    ok = prefix.all(dim=1) & (lengths >= 1) & (lengths <= limits) & in_vocab.all(dim=1)
    if not bool(ok.all()):
        row = int((~ok).nonzero()[0])
        raise ValueError(f"verifier output row {row} = {output[row].tolist()} is malformed; valid: at most "
                         f"{counts[row]} accepted drafts, then one token in [0, {vocab_size}), then -1")
    return output

"""Typical acceptance (Medusa), fast path, and the ``"typical"`` verifier.

Same rule and noise as the reference
(:func:`servelab.reference.typical_acceptance.typical_acceptance_sample`,
a per-request loop that is the spec); here everything is batched: one
entropy pass over all target rows (no gathered copy of the draft rows), one
gather for ``p_j(x_j)``, the leading run of accepts by a cumulative product,
and one exponential race over the stop rows. With ``check_inputs=False`` the
only host syncs are the counts and greedy flags the layout needs.

Draft ``x_j`` is accepted while ``p_j(x_j) > min(posterior_threshold,
posterior_alpha * exp(-H(p_j)))``; the first failure stops the walk and one
token is emitted from the row where it stopped (argmax for greedy requests,
else a sample). This trades exactness for acceptance: it does *not* preserve
the target distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from servelab._internal.draft_layout import DraftIndex, TreeVerifyOutput, check_tree_batch
from servelab._internal.sampling_checks import check_draft_batch, check_typical_options, compute_dtype
from servelab._internal.sampling_noise import draw_request_noise

__all__ = ["TypicalAcceptanceVerifier", "typical_acceptance_sample"]


def typical_acceptance_sample(
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor | Sequence[int],
    target_probs: torch.Tensor,
    *,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    greedy: bool | torch.Tensor = False,
    generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
    check_inputs: bool = True,
) -> torch.Tensor:
    """Medusa's typical acceptance; returns int64 ``[num_reqs, max(k_i) + 1]`` padded with -1.

    Args:
        draft_token_ids: int ``[sum(k_i)]``, request *i* owns ``k_i`` consecutive entries.
        num_draft_tokens: ``k_i`` per request (list or 1-D int tensor; 0 allowed).
        target_probs: float ``[sum(k_i + 1), vocab]``, per request its draft rows then a bonus row
            (computed in float32, or float64 if given float64).
        posterior_threshold: the hard cap ``epsilon`` on the acceptance threshold (Medusa: 0.09).
        posterior_alpha: the entropy scale ``delta`` (Medusa: 0.3, about sqrt(epsilon)).
        greedy: bool or bool ``[num_reqs]``: emit the argmax instead of a sample at the stop.
        generator: None, one generator, or one (or None) per request.
        check_inputs: validate shapes, ids and probabilities (NaN / negative /
            all-zero rows raise ``ValueError`` naming ``target_probs``).
    """
    threshold, alpha = check_typical_options(posterior_threshold, posterior_alpha)
    batch = check_draft_batch(draft_token_ids, num_draft_tokens, target_probs, None, greedy, generator,
                              check_inputs=check_inputs)
    device = target_probs.device
    num_reqs, vocab_size = batch.num_reqs, batch.vocab_size
    if num_reqs == 0:
        return torch.full((0, batch.max_draft + 1), -1, dtype=torch.int64, device=device)
    target = target_probs.to(compute_dtype(target_probs))
    draft_ids = draft_token_ids.long()
    index = DraftIndex.build(batch, device)

    rows = index.target_row_of_draft
    p_draft = target[rows, draft_ids]  # [sum k_i]
    num_accepted = _leading_typical_accepts(target, rows, p_draft, index, threshold, alpha)

    stop_rows = target[index.stop_rows(num_accepted)]  # [num_reqs, vocab]
    greedy_rows = [row for row, flag in enumerate(batch.greedy) if flag]
    noise = draw_request_noise(num_reqs, vocab_size, device, generator, skip_rows=greedy_rows)
    if len(greedy_rows) == num_reqs:
        final_token = stop_rows.argmax(dim=-1)
    else:
        final_token = torch.where(stop_rows > 0, stop_rows / noise, -1.0).argmax(dim=-1)
        if greedy_rows:
            is_greedy = torch.tensor(batch.greedy, dtype=torch.bool, device=device)
            final_token = torch.where(is_greedy, stop_rows.argmax(dim=-1), final_token)
    return index.assemble(draft_ids, num_accepted, final_token)


def _leading_typical_accepts(target: torch.Tensor, rows: torch.Tensor, p_draft: torch.Tensor, index: DraftIndex,
                             threshold: float, alpha: float) -> torch.Tensor:
    """int64 ``[num_reqs]``: accepted drafts per request, computing as few entropies as possible.

    ``bar = min(threshold, alpha * exp(-H)) <= threshold``, so ``p > threshold``
    accepts and ``p = 0`` rejects whatever the entropy. Only a request's first
    draft that is neither needs ``H`` (it decides where the request stops, or
    lets it go on); drafts after a stop are never looked at, like the
    reference's early exit. At most ``max k`` rounds of at most ``num_reqs`` rows.
    """
    accept = p_draft > threshold
    undecided = (p_draft > 0) & ~accept
    while True:
        num_accepted = index.leading_accepts(accept)
        stop = (index.starts + num_accepted).clamp(max=max(p_draft.shape[0] - 1, 0))
        pending = ((num_accepted < index.counts) & undecided[stop] if p_draft.numel()
                   else torch.zeros_like(num_accepted, dtype=torch.bool))
        entries = stop[pending]
        if not entries.numel():
            return num_accepted
        decided_rows = target[rows[entries]]
        entropy = -torch.special.xlogy(decided_rows, decided_rows).sum(dim=-1)
        accept[entries] = p_draft[entries] > alpha * torch.exp(-entropy)
        undecided[entries] = False


class TypicalAcceptanceVerifier:
    """The ``"typical"`` verifier: :func:`typical_acceptance_sample` behind the Verifier protocol.

    ``draft_probs`` are ignored (the rule looks at the target only).
    """

    name = "typical"

    def __init__(self, posterior_threshold: float = 0.09, posterior_alpha: float = 0.3, *,
                 check_inputs: bool = True) -> None:
        self.posterior_threshold, self.posterior_alpha = check_typical_options(posterior_threshold, posterior_alpha)
        self.check_inputs = bool(check_inputs)

    def __repr__(self) -> str:
        return (f"TypicalAcceptanceVerifier(posterior_threshold={self.posterior_threshold}, "
                f"posterior_alpha={self.posterior_alpha})")

    def verify(
        self,
        draft_token_ids: torch.Tensor,
        num_draft_tokens: Sequence[int],
        target_probs: torch.Tensor,
        draft_probs: torch.Tensor | None,
        *,
        greedy: torch.Tensor,
        generators: Sequence[torch.Generator | None],
    ) -> torch.Tensor:
        """See :class:`servelab.samplers.interfaces.Verifier`."""
        return typical_acceptance_sample(
            draft_token_ids, num_draft_tokens, target_probs,
            posterior_threshold=self.posterior_threshold, posterior_alpha=self.posterior_alpha,
            greedy=greedy, generator=list(generators), check_inputs=self.check_inputs,
        )

    def verify_trees(self, draft_token_ids: torch.Tensor, parents: torch.Tensor, target_probs: torch.Tensor,
                     draft_probs: torch.Tensor | None = None, *, greedy: torch.Tensor | bool = False,
                     generators: Sequence[torch.Generator | None] | None = None) -> TreeVerifyOutput:
        """Typical acceptance over token trees (Medusa's tree rule); layout as
        :meth:`TreeVerifier.verify_trees`, ``draft_probs`` ignored.

        From the root, the first child (index order) whose token passes the
        typical test at its parent's row is taken, until no child passes; one
        token is then emitted from that row (argmax for greedy trees, else a
        sample): the chain rule of :func:`typical_acceptance_sample`, per branch.
        """
        parents, _, _ = check_tree_batch(draft_token_ids, parents, target_probs, check_inputs=self.check_inputs)
        num_trees, num_nodes = draft_token_ids.shape
        flags = [bool(greedy)] * num_trees if isinstance(greedy, bool) else [bool(g) for g in greedy.tolist()]
        generators = list(generators) if generators is not None else [None] * num_trees
        target = target_probs.to(compute_dtype(target_probs))
        entropy = -torch.special.xlogy(target, target).sum(dim=-1)  # [B, N + 1]
        bar = torch.clamp(self.posterior_alpha * torch.exp(-entropy), max=self.posterior_threshold)
        ids, parent_rows = draft_token_ids.tolist(), parents.tolist()
        paths, finals = [], []
        for b in range(num_trees):
            path, slot = self._typical_path(ids[b], parent_rows[b], target[b], bar[b])
            row = target[b, slot]
            finals.append(int(row.argmax()) if flags[b] else int(torch.multinomial(row, 1, generator=generators[b])))
            paths.append(path)
        deepest = max((len(p) for p in paths), default=0)
        tokens = torch.full((num_trees, deepest + 1), -1, dtype=torch.int64)
        nodes = torch.full((num_trees, deepest), -1, dtype=torch.int64)
        for b, (path, final) in enumerate(zip(paths, finals)):
            tokens[b, : len(path) + 1] = torch.tensor([ids[b][n] for n in path] + [final])
            nodes[b, : len(path)] = torch.tensor(path, dtype=torch.int64)
        device = draft_token_ids.device
        return TreeVerifyOutput(tokens.to(device), nodes.to(device))

    @staticmethod
    def _typical_path(ids: list[int], parents: list[int], target: torch.Tensor,
                      bar: torch.Tensor) -> tuple[list[int], int]:
        """(accepted nodes, slot where the walk stopped) of one tree."""
        path: list[int] = []
        node = -1
        while True:
            slot = node + 1
            passing = [child for child, parent in enumerate(parents)
                       if parent == node and ids[child] >= 0 and float(target[slot, ids[child]]) > float(bar[slot])]
            if not passing:
                return path, slot
            node = passing[0]
            path.append(node)

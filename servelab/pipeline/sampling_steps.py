"""Sampling, draft verification and drafting of one runner step, with each
request isolated from the others' failures.

The runner calls user-replaceable code at three points, always through its
protocol: ``sampler.forward`` (plain requests; logits processors run inside
it), ``sampler.compute_probs`` + ``verifier.verify`` (requests with drafts),
and ``drafter.propose_for_requests`` (next drafts). Each is called **once for
the whole batch**. If that call raises an ``Exception``, it is retried **once
per request**, and only the requests whose own call raises fail (their
messages go to ``ModelRunnerOutput.errors``; the scheduler ends them with
``finish_reason="error"``). Cost: nothing while nothing fails; a failing
batch call costs one extra call per request of that batch. What the calls
return is checked too (a token outside the vocabulary, a verifier row that
is not "a prefix of the drafts, then one token", a sampler row listed in
``SamplerOutput.errors``): such a row fails its request alone, without a
retry. ``BaseException`` (``KeyboardInterrupt``) is never caught here: the
pipeline rolls the step back.

Why per-request retries and not per-request calls: the batch call is the
fast path (one sampler pass over ``[R, V]`` logits, one verifier kernel).
Seeded requests draw from their own generators, so a retried request samples
exactly what it would have sampled in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from servelab._internal.sampling_noise import seeded_generator
from servelab.samplers.interfaces import Drafter, SamplerProtocol, Verifier
from servelab.samplers.metadata import SamplingMetadata
from servelab.samplers.drafters import DraftRequest, check_proposals


class RowError(str):
    """A result saying "this request fails, with this message" (no retry)."""


def _describe(what: str, exc: BaseException) -> str:
    return f"{what} raised {type(exc).__name__}: {exc}"


def call_isolated(call: Callable[[list[Any]], list[Any]], items: list[Any], key: Callable[[Any], str],
                  errors: dict[str, str], what: str) -> list[Any]:
    """``call(items)``, or on an ``Exception`` ``call([item])`` for each item.

    Returns one result per item: the call's result, a :class:`RowError`, or
    None for an item whose own call raised (its message is in ``errors``
    under ``key(item)``). ``call`` must return one result per item given.
    """
    try:
        results = call(items)
        if len(results) != len(items):
            raise RuntimeError(f"{what} returned {len(results)} results for {len(items)} requests")
        return results
    except Exception as exc:
        if len(items) == 1:
            errors[key(items[0])] = _describe(what, exc)
            return [None]
    results = []
    for item in items:
        try:
            (result,) = call([item])
        except Exception as exc:
            errors[key(item)] = _describe(what, exc)
            result = None
        results.append(result)
    return results


def _subset(tensor: torch.Tensor, rows: list[int], total: int) -> torch.Tensor:
    if len(rows) == total:
        return tensor
    return tensor[torch.tensor(rows, device=tensor.device)]


class SamplingSteps:
    """The sampling half of :class:`~servelab.pipeline.runner.ModelRunner` (a mixin:
    it uses the runner's ``sampler``, ``verifier``, ``drafter``, ``vocab_size``,
    ``max_model_len``, ``num_speculative_tokens``, ``last_verification`` and
    ``_metadata``). ``batch`` is the step's list of ``(state, computed, scheduled)``."""

    # Set by ModelRunner.__init__ (the pieces it is typed on).
    sampler: SamplerProtocol
    verifier: Verifier
    drafter: Drafter | None
    vocab_size: int
    max_model_len: int
    num_speculative_tokens: int
    last_verification: list[tuple[int, int]]
    _metadata: Callable[..., SamplingMetadata]

    # ---- plain sampling ---------------------------------------------------------

    def _sample_plain(self, batch, plain: list[int], logits: torch.Tensor, sampled: list[list[int]],
                      logprobs: list[Any], errors: dict[str, str]) -> None:
        """One token per plain request; ``logits`` fp32 ``[len(plain), V]`` in ``plain`` order.

        An all-plain-greedy batch takes the sampler's ``greedy_tokens`` shortcut
        (argmax without building :class:`SamplingMetadata`) when it offers one;
        it returns exactly what ``forward`` would, or None to take this path.
        """
        vocab = self.vocab_size
        shortcut = getattr(self.sampler, "greedy_tokens", None)
        tokens = shortcut(logits, [batch[i][0].params for i in plain]) if shortcut is not None else None
        if tokens is not None:
            for i, token in zip(plain, tokens):
                sampled[i] = [token]
            return

        def call(positions: list[int]) -> list[Any]:
            states = [batch[plain[p]][0] for p in positions]
            metadata = self._metadata(states, [s.token_ids[s.num_prompt_tokens:] for s in states])
            out = self.sampler.forward(_subset(logits, positions, len(plain)), metadata)
            tokens = out.sampled_token_ids.tolist()
            row_errors = getattr(out, "errors", None) or {}
            results: list[Any] = []
            for row, (state, token) in enumerate(zip(states, tokens)):
                if row in row_errors:
                    results.append(RowError(f"sampling failed: {row_errors[row]}"))
                elif type(token) is not int or not 0 <= token < vocab:
                    results.append(RowError(f"the sampler returned token {token!r}, outside the vocabulary "
                                            f"[0, {vocab})"))
                else:
                    n = state.params.logprobs
                    entry = [out.logprobs.for_request(row, n)] if n is not None and out.logprobs is not None \
                        else None
                    results.append((token, entry))
            return results

        results = call_isolated(call, list(range(len(plain))), lambda p: batch[plain[p]][0].req_id, errors,
                                "the sampler (or a logits processor)")
        for p, result in enumerate(results):
            i = plain[p]
            if isinstance(result, RowError):
                errors[batch[i][0].req_id] = str(result)
            elif result is not None:
                sampled[i] = [result[0]]
                logprobs[i] = result[1]

    # ---- draft verification -----------------------------------------------------

    def _draft_probs(self, states, num_drafts: list[int], spec: dict[str, list[int]],
                     device: torch.device) -> torch.Tensor | None:
        """float32 ``[sum k_i, V]`` the drafts were drawn from, or None when every draft is one-hot."""
        if all(s.draft_probs is None for s in states):
            return None
        parts = []
        for s, d in zip(states, num_drafts):
            if s.draft_probs is None or s.draft_probs.shape[0] < d:
                ids = torch.tensor(spec[s.req_id][:d], device=device)
                parts.append(torch.nn.functional.one_hot(ids, self.vocab_size).float())
            else:
                q = s.draft_probs[:d].to(device, torch.float32)
                if q.shape[1] < self.vocab_size:  # a draft vocab may be a prefix of the target's
                    q = torch.nn.functional.pad(q, (0, self.vocab_size - q.shape[1]))
                parts.append(q)
        return torch.cat(parts)

    def _check_verified(self, row: list[int], drafts: list[int]) -> list[int] | RowError:
        """The emitted tokens of one verifier row, or why the row breaks the contract."""
        toks = [t for t in row if t >= 0]
        name = getattr(self.verifier, "name", type(self.verifier).__name__)
        ok = (0 < len(toks) <= len(drafts) + 1 and row[: len(toks)] == toks and toks[:-1] == drafts[: len(toks) - 1]
              and 0 <= toks[-1] < self.vocab_size)
        if ok:
            return toks
        return RowError(f"verifier {name!r} returned {row} for drafts {drafts}; valid: a prefix of the drafts, "
                        f"then one token in [0, {self.vocab_size}), then -1 padding")

    def _verify(self, batch, verify: list[tuple[int, int]], logits: torch.Tensor, spec: dict[str, list[int]],
                sampled: list[list[int]], logprobs: list[Any], errors: dict[str, str]) -> None:
        """Verify each request's drafts; ``logits`` fp32 ``[sum(d + 1), V]``, request-contiguous."""
        starts, total = [], 0
        for _, d in verify:
            starts.append(total)
            total += d + 1

        def call(entries: list[int]) -> list[Any]:
            rows, row_states, row_outputs, drafts_flat, num_drafts, states = [], [], [], [], [], []
            for e in entries:
                i, d = verify[e]
                state = batch[i][0]
                drafts = spec[state.req_id][:d]
                history = state.token_ids[state.num_prompt_tokens:]
                for j in range(d + 1):  # position j has seen the first j drafts
                    row_states.append(state)
                    row_outputs.append(history + drafts[:j])
                rows += range(starts[e], starts[e] + d + 1)
                drafts_flat += drafts
                num_drafts.append(d)
                states.append(state)
            metadata = self._metadata(row_states, row_outputs)
            target_probs = self.sampler.compute_probs(_subset(logits, rows, total), metadata)
            device = target_probs.device
            generators = [seeded_generator(s.params.seed, len(s.token_ids) - s.num_prompt_tokens, device)
                          if s.params.seed is not None and not s.params.is_greedy else None for s in states]
            out = self.verifier.verify(
                torch.tensor(drafts_flat, dtype=torch.int64, device=device), num_drafts, target_probs,
                self._draft_probs(states, num_drafts, spec, device),
                greedy=torch.tensor([s.params.is_greedy for s in states], device=device), generators=generators)
            out = out.tolist()
            if len(out) != len(entries):
                raise ValueError(f"the verifier returned {len(out)} rows for {len(entries)} requests")
            return [self._check_verified(row, spec[s.req_id][:d]) for row, s, d in zip(out, states, num_drafts)]

        results = call_isolated(call, list(range(len(verify))), lambda e: batch[verify[e][0]][0].req_id, errors,
                                "draft verification (the sampler's compute_probs or the verifier)")
        raw = None
        for e, toks in enumerate(results):
            i, d = verify[e]
            state = batch[i][0]
            state.draft_probs = None
            if isinstance(toks, RowError):
                errors[state.req_id] = str(toks)
            if toks is None or isinstance(toks, RowError):
                continue
            sampled[i] = toks
            self.last_verification.append((d, len(toks) - 1))
            n = state.params.logprobs
            if n is not None:  # emitted token j came from logits row j: logprobs of the raw distribution
                if raw is None:
                    raw = torch.log_softmax(logits.float(), dim=-1)
                rows = raw[starts[e]:starts[e] + len(toks)]
                picked = rows.gather(1, torch.tensor(toks, device=rows.device)[:, None])[:, 0].tolist()
                top = rows.topk(n, dim=-1) if n else None
                logprobs[i] = [[(t, lp)] + (list(zip(top.indices[j].tolist(), top.values[j].tolist())) if n else [])
                               for j, (t, lp) in enumerate(zip(toks, picked))]

    # ---- next drafts ---------------------------------------------------------------

    def _draft_asks(self, batch, sampled: list[list[int]], errors: dict[str, str]) -> list[tuple[int, Any, int]]:
        """``(batch index, state, k)`` of every request that got tokens and goes on."""
        k_max = self.num_speculative_tokens
        asks = []
        for i, ((state, _, _), toks) in enumerate(zip(batch, sampled)):
            if not toks or state.req_id in errors:
                continue
            num_out = len(state.token_ids) - state.num_prompt_tokens
            if toks[-1] in state.stop_ids and num_out >= state.params.min_tokens:
                continue  # it stops here
            # Drafts the scheduler could never use: past max_model_len, or past
            # max_tokens (verification emits accepted drafts + 1).
            k = min(k_max, self.max_model_len - len(state.token_ids))
            if state.params.max_tokens is not None:
                k = min(k, state.params.max_tokens - num_out - 1)
            if k > 0:
                asks.append((i, state, k))
        return asks

    def _propose(self, batch, sampled: list[list[int]], errors: dict[str, str]) -> list[list[int]]:
        """Next drafts for every request that just got tokens and goes on."""
        spec_out: list[list[int]] = [[] for _ in batch]
        asks = self._draft_asks(batch, sampled, errors)
        if not asks:
            return spec_out

        def call(items: list[tuple[int, Any, int]]) -> list[Any]:
            requests = [DraftRequest(s.req_id, s.token_ids, k, s.params) for _, s, k in items]
            return check_proposals(requests, self.drafter.propose_for_requests(requests), self.vocab_size)

        proposals = call_isolated(call, asks, lambda a: a[1].req_id, errors, "the drafter")
        for (i, state, k), proposal in zip(asks, proposals):
            if proposal is not None:
                spec_out[i] = list(proposal.token_ids[:k])
                state.draft_probs = proposal.probs
        return spec_out


def release_quietly(release: Callable[[str], None], req_id: str) -> str | None:
    """``drafter.release(req_id)``; a raising drafter cannot fail a request that
    already ended, so the error is returned (and warned about), not raised."""
    try:
        release(req_id)
    except Exception as exc:
        import warnings

        message = _describe(f"drafter.release({req_id!r})", exc)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        return message
    return None


__all__ = ["RowError", "SamplingSteps", "call_isolated", "release_quietly"]

"""The ``Sampler``: logits in, one token per request out, in a fixed order.

The order is the semantics:

1. snapshot raw logprobs (if any request asks for logprobs);
2. float32;
3. allowed-token whitelist, bad words;
4. processors that can change the argmax (min_tokens, logit_bias, custom ones);
5. penalties (repetition, frequency, presence);
6. greedy result (argmax);
7. temperature (rows with temperature < 1e-5 divide by 1);
8. argmax-invariant processors (custom ones, then min-p);
9. top-k / top-p;
10. sample (seeded requests draw their noise from their own generator);
11. greedy result where temperature < 1e-5;
12. logprobs of the raw distribution (top-n, plus the sampled token's logprob and rank).

Steps 8 (min-p), 9 and 10 are one fused op, ``top_k_top_p_sample``, from the
Triton kernels or the PyTorch reference (see :mod:`servelab.samplers.backends`).
A batch that is all greedy stops after step 6. A batch that is all *plain*
greedy (see :meth:`Sampler.greedy_tokens`) may skip building the metadata
altogether: every step above but 6 is then a no-op.

Rows that cannot be sampled never get a made-up token. After step 5 (and,
for random rows, after step 8) a row whose logits hold NaN or +inf, or whose
every token is -inf (the whitelist, bad words, min_tokens or a processor
masked everything), is reported in ``SamplerOutput.errors`` with token -1; the
other rows are sampled as usual (one extra max-reduction per check, one host
sync per call). Temperatures cannot overflow float32: ``SamplingParams``
refuses temperatures above the float32 maximum, and any overflow a processor
causes after scaling is caught by the same check.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from servelab._internal.sampling_filters import top_k_top_p_keep_mask
from servelab._internal.sampling_noise import draw_exponential_noise
from servelab.samplers.backends import check_backend_name, get_sampling_backend
from servelab.samplers.interfaces import LogprobsOutput, SamplerOutput
from servelab.samplers.metadata import SamplingMetadata
from servelab.samplers.params import SAMPLING_EPS, SamplingParams
from servelab.samplers.penalties import apply_penalties
from servelab.samplers import cpu_argmax
from servelab.samplers.processors import (
    LogitsProcessor,
    apply_allowed_token_mask,
    apply_bad_words,
    check_processor,
    default_processors,
    is_active,
)


# Row problems, in the order they are reported (0 = fine).
_ROW_OK, _ROW_NAN, _ROW_POSINF, _ROW_ALL_MASKED = 0, 1, 2, 3
_ROW_MESSAGES = {
    _ROW_NAN: "the logits of this request are NaN (from the model or a logits processor); nothing can be sampled",
    _ROW_POSINF: "the logits of this request hold +inf (from the model, a logits processor, or overflow after "
                 "temperature); nothing can be sampled",
    _ROW_ALL_MASKED: "every token is masked for this request (allowed_token_ids, bad words, min_tokens or a "
                     "logits processor left no token with a finite logit)",
}


def _row_problems(logits: torch.Tensor) -> torch.Tensor:
    """int8 ``[R]`` problem code per row of float ``[R, V]`` logits, from one max-reduction.

    ``amax`` propagates NaN, so one pass finds NaN rows, rows holding +inf and rows all -inf.
    """
    row_max = logits.amax(dim=-1)
    codes = torch.zeros(logits.shape[0], dtype=torch.int8, device=logits.device)
    codes = torch.where(row_max == float("-inf"), _ROW_ALL_MASKED, codes)
    codes = torch.where(row_max == float("inf"), _ROW_POSINF, codes)
    return torch.where(torch.isnan(row_max), _ROW_NAN, codes).to(torch.int8)


def _errors_of(codes: torch.Tensor) -> dict[int, str]:
    bad = codes.nonzero().flatten().tolist() if bool(codes.any()) else []
    values = codes[bad].tolist() if bad else []
    return {row: _ROW_MESSAGES[code] for row, code in zip(bad, values)}


def _gather_logprobs(raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_top: int) -> LogprobsOutput:
    # Rows in error carry token -1: read column 0 for them (their entry is meaningless but well-formed).
    num_top = min(num_top, raw_logprobs.shape[-1])
    sampled_logprob = raw_logprobs.gather(1, sampled.clamp(min=0)[:, None])
    ranks = (raw_logprobs > sampled_logprob).sum(dim=-1) + 1
    top = raw_logprobs.topk(num_top, dim=-1)
    return LogprobsOutput(
        token_ids=torch.cat([sampled[:, None], top.indices], dim=1),
        logprobs=torch.cat([sampled_logprob, top.values], dim=1),
        sampled_token_ranks=ranks,
    )


def is_plain_greedy(params: SamplingParams) -> bool:
    """True when ``params`` decodes by plain argmax: greedy, and nothing that changes
    the logits or asks for more than the token (no logprobs, penalties,
    ``min_tokens``, ``logit_bias``, whitelist or bad words)."""
    return (params.temperature < SAMPLING_EPS and params.logprobs is None and params.min_tokens == 0
            and not params.logit_bias and params.allowed_token_ids is None and not params.bad_words
            and not params.bad_words_token_ids and params.repetition_penalty == 1.0
            and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0)


class Sampler:
    """Stateless sampler: ``forward(logits, metadata) -> SamplerOutput``.

    Args:
        logits_processors: extra processors (see :mod:`servelab.samplers.processors`),
            run after the built-ins of their kind, in the order given.
        backend: ``"auto"``, a registered sampling backend name (``"torch"``,
            ``"triton"``) or a backend object, for the fused min-p/top-k/top-p
            sampling op (see :mod:`servelab.samplers.backends`).

    Implements the :class:`servelab.samplers.interfaces.SamplerProtocol` protocol.
    """

    def __init__(self, logits_processors: Sequence[LogitsProcessor] = (), *, backend: str | object = "auto") -> None:
        self.backend = check_backend_name(backend)
        for processor in logits_processors:
            check_processor(processor)
        self.has_custom_processors = bool(logits_processors)
        processors = (*default_processors(), *logits_processors)
        self.argmax_changing = tuple(p for p in processors if not p.argmax_invariant)
        self.argmax_invariant = tuple(p for p in processors if p.argmax_invariant)

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        return self.forward(logits, metadata)

    def _check(self, logits: object, metadata: object) -> None:
        if not isinstance(metadata, SamplingMetadata):
            raise TypeError(f"metadata must be a SamplingMetadata, got {type(metadata).__name__}")
        if not isinstance(logits, torch.Tensor) or not logits.dtype.is_floating_point or logits.dim() != 2:
            raise TypeError("logits must be a floating torch.Tensor of shape [num_reqs, vocab]")
        expected = (metadata.num_reqs, metadata.vocab_size)
        if tuple(logits.shape) != expected:
            raise ValueError(f"logits has shape {tuple(logits.shape)} but the metadata describes {expected}")
        same_device = logits.device.type == metadata.device.type and (
            metadata.device.index is None or logits.device.index == metadata.device.index
        )
        if not same_device:
            raise ValueError(f"logits are on {logits.device} but the metadata on {metadata.device}")

    def _apply_argmax_changing(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Steps 2-5: float32, constraints, argmax-changing processors, penalties."""
        logits = logits.float()
        if metadata.allowed_token_mask is not None:
            logits = apply_allowed_token_mask(logits, metadata.allowed_token_mask)
        logits = apply_bad_words(logits, metadata)
        for processor in self.argmax_changing:
            if is_active(processor, metadata):
                logits = processor.apply(logits, metadata)
        if metadata.repetition_penalties is not None:
            logits = apply_penalties(
                logits,
                metadata.prompt_token_ids,
                metadata.output_token_ids,
                metadata.repetition_penalties,
                metadata.frequency_penalties,
                metadata.presence_penalties,
            )
        return logits

    def _apply_temperature_and_invariant(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Steps 7-8 (without min-p, which the sampling op fuses)."""
        temperature = metadata.temperature
        safe_temperature = torch.where(temperature < SAMPLING_EPS, 1.0, temperature)
        logits = logits / safe_temperature[:, None]
        for processor in self.argmax_invariant:
            if is_active(processor, metadata):
                logits = processor.apply(logits, metadata)
        return logits

    @property
    def _stock(self) -> bool:
        """True when neither the class nor the instance replaces a stage of :meth:`forward`."""
        cls, own = type(self), vars(self)
        return all(getattr(cls, name) is getattr(Sampler, name) and name not in own
                   for name in ("forward", "_check", "_apply_argmax_changing"))

    def greedy_tokens(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> list[int] | None:
        """The tokens :meth:`forward` would return for all-plain-greedy rows, without metadata.

        ``logits`` float32 ``[R, V]``, ``params`` one per row. Returns None (call
        :meth:`forward`) unless this sampler has no custom processors, its class
        overrides none of ``forward``'s stages, and every request is
        :func:`is_plain_greedy`: then steps 1-5 and 7-12 do nothing
        and the result is the argmax of each row. Rows holding NaN or +inf, or
        all -inf, also return None, so :meth:`forward` reports them exactly as
        usual.
        """
        if self.has_custom_processors or not self._stock or logits.dtype != torch.float32 or logits.dim() != 2 \
                or logits.shape[0] != len(params) or not all(map(is_plain_greedy, params)):
            return None
        # Each row's argmax, None when a row's maximum is not finite: exactly when forward's row
        # check fails (the C pass on a CPU: torch's argmax is ~20x slower over a large vocabulary).
        return cpu_argmax.finite_argmax(logits)

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of ``logits`` (float ``[R, V]``, any float dtype).

        Rows that cannot be sampled get token -1 and a message in ``errors``.
        """
        self._check(logits, metadata)
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)  # step 1
        processed = self._apply_argmax_changing(logits, metadata)
        problems = _row_problems(processed)
        greedy = processed.argmax(dim=-1)  # step 6
        if metadata.all_greedy or metadata.num_reqs == 0:
            sampled = greedy
        else:
            sampled, problems = self._sample_random_rows(processed, greedy, problems, metadata)
        errors = _errors_of(problems)
        if errors:
            sampled = torch.where(problems != _ROW_OK, -1, sampled)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)  # step 12
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs, errors=errors)

    def _sample_random_rows(self, processed: torch.Tensor, greedy: torch.Tensor, problems: torch.Tensor,
                            metadata: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 7-11; returns (tokens int64 ``[R]``, updated problem codes)."""
        random_rows = metadata.temperature >= SAMPLING_EPS
        scaled = self._apply_temperature_and_invariant(processed, metadata)
        problems = torch.where((problems == _ROW_OK) & random_rows, _row_problems(scaled), problems)
        # The sampling op must not see NaN / +inf rows: give them a harmless row (their token is dropped).
        scaled = torch.where((problems != _ROW_OK)[:, None], 0.0, scaled)
        noise = draw_exponential_noise(
            metadata.num_reqs,
            metadata.vocab_size,
            processed.device,
            generators=metadata.generators(),
            skip_rows=metadata.greedy_rows,
        )
        backend = get_sampling_backend(self.backend, processed.device)
        # The params were validated when built: skip the op's syncing range checks.
        sampled = backend.top_k_top_p_sample(
            scaled, metadata.top_k, metadata.top_p, metadata.min_p, noise, check_inputs=False
        )
        return torch.where(random_rows, sampled, greedy), problems  # step 11

    def compute_probs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Float32 ``[R, V]``: the distribution each row samples from (steps 2-9).

        This is what the verifiers expect as ``target_probs``. Greedy rows get
        temperature 1 (only their argmax matters). Filtered tokens have
        probability 0. Rows that cannot be sampled are NaN; use
        :meth:`compute_probs_and_errors` to get their messages. For speculative
        decoding, build the metadata with one row per verified position (the
        request's params repeated, its output history extended by the drafts
        before that position), so penalties and min_tokens see the history
        each position would have.
        """
        return self.compute_probs_and_errors(logits, metadata)[0]

    def compute_probs_and_errors(self, logits: torch.Tensor,
                                 metadata: SamplingMetadata) -> tuple[torch.Tensor, dict[int, str]]:
        """``compute_probs`` plus row -> message for the rows that cannot be sampled (NaN in the probs)."""
        self._check(logits, metadata)
        processed = self._apply_argmax_changing(logits, metadata)
        scaled = self._apply_temperature_and_invariant(processed, metadata)
        first = _row_problems(processed)
        problems = torch.where(first != _ROW_OK, first, _row_problems(scaled))
        bad = (problems != _ROW_OK)[:, None]
        scaled = torch.where(bad, 0.0, scaled)
        keep = top_k_top_p_keep_mask(scaled, metadata.top_k, metadata.top_p, metadata.min_p)
        probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
        return torch.where(bad, float("nan"), probs), _errors_of(problems)

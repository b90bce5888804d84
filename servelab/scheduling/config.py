"""``SchedulerConfig``: the limits one scheduling step works under.

Every field is checked once, here, with the shared helpers of
:mod:`servelab._internal.validation`: ``TypeError`` for a wrong type,
``ValueError`` for a value out of range, both naming the field
(``SchedulerConfig.max_num_seqs``), the value and what would be valid (never
``assert``: ``python -O`` strips it).

Defaults: this is the scheduling layer's own config, for using a
``Scheduler`` directly (tests, the simulator, benchmarks). A
:class:`~servelab.Pipeline` never relies on these defaults: it derives a
``SchedulerConfig`` from its ``PipelineConfig`` (the single source of the
pipeline's defaults, see :meth:`servelab.config.PipelineConfig.scheduler_config`)
and passes every field explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelab._internal.validation import check_bool, check_int


def _check_int(name: str, value: object, minimum: int) -> None:
    check_int(f"SchedulerConfig.{name}", value, min_value=minimum)


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one ``schedule()`` call (defaults: standalone use only; a
    pipeline passes every field, see the module docstring).

    Attributes:
        max_num_batched_tokens: token budget of one step (prompt chunks,
            decode tokens and draft tokens together).
        max_num_seqs: most requests running at once (a model runner's batch
            slots).
        max_model_len: longest sequence (prompt + output) a request may reach;
            longer prompts are rejected by ``add_request``, and output stops
            with finish reason ``"length"`` when it is reached.
        enable_chunked_prefill: split prompts over steps. When False a prompt
            is computed in one step, so the budget must hold the longest one
            (``max_num_batched_tokens >= max_model_len``).
        long_prefill_token_threshold: most tokens one request gets per step
            (0: no cap). Keeps one long prompt from taking a whole step while
            decodes wait behind it. Needs chunked prefill.
        num_speculative_tokens: drafts per request and step (0: no speculative
            decoding). Each running request is given this many lookahead KV
            slots so a drafter can write its draft tokens' KV.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_model_len", self.max_model_len, 1)
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        check_bool("SchedulerConfig.enable_chunked_prefill", self.enable_chunked_prefill)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"SchedulerConfig.max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.max_model_len} with enable_chunked_prefill=False, so a long prompt "
                "could never be scheduled; raise max_num_batched_tokens, lower max_model_len or enable "
                "chunked prefill"
            )
        if not self.enable_chunked_prefill and self.long_prefill_token_threshold:
            raise ValueError(
                f"SchedulerConfig.long_prefill_token_threshold={self.long_prefill_token_threshold} splits prompts, "
                "which enable_chunked_prefill=False forbids; set it to 0 or enable chunked prefill"
            )

"""Step-cost model: how long one model step takes, from what was scheduled.

    seconds = base_s
            + per_token_s          * scheduled tokens          (linear layers, every token)
            + per_prefill_token_s  * prefill tokens            (extra or less per token of a multi-token chunk:
                                                                 a GEMM row vs a GEMV row)
            + per_seq_s            * scheduled sequences       (per-sequence host work, sampling, metadata)
            + per_kv_token_s       * KV positions read         (attention reads: sum of computed + scheduled)
            + per_attn_pair_s      * prefill attention pairs   (sum over prefill chunks of n * (computed + (n+1)/2))

``base_s`` is the per-step floor (reading the weights once, launch and Python
overhead). The three original coefficients keep their meaning and defaults
(round numbers for a 7B fp16 model on one A100-class GPU: ~9 ms to stream
14 GB of weights, ~70 us of FLOPs per token, ~0.35 us per 512 KB token of KV);
the new terms default to 0, so ``StepCostModel(base, per_token, per_kv)``
behaves as before.

Where the numbers come from:

- :meth:`StepCostModel.fit` / :meth:`StepCostModel.from_run`: least squares,
  non-negative, on measured steps;
- :func:`servelab.scheduling.simulator.calibrate`: runs a calibration workload
  through a real ``Pipeline`` and fits every term;
- :meth:`StepCostModel.for_hardware`: a first-principles roofline
  (:mod:`.hardware`) for a model config on a GPU or this CPU.

The simulator asks a cost model ``time_of(scheduler_output)``; any object with
that method (or with ``step_time(num_tokens, num_kv_tokens)``) can stand in.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from servelab.scheduling.simulator.features import FEATURES, step_features
from servelab.scheduling.simulator.hardware import RooflineCostModel, roofline_cost_model

_COEFFICIENTS = ("base_s", "per_token_s", "per_kv_token_s", "per_seq_s", "per_prefill_token_s", "per_attn_pair_s")


@dataclass(frozen=True)
class StepCostModel:
    """Linear step time (seconds); every coefficient >= 0 except ``per_prefill_token_s``, which may
    be negative down to ``-per_token_s`` (a prefill token may cost less than a decode token)."""

    base_s: float = 9e-3
    per_token_s: float = 7e-5
    per_kv_token_s: float = 3.5e-7
    per_seq_s: float = 0.0
    per_prefill_token_s: float = 0.0
    per_attn_pair_s: float = 0.0

    def __post_init__(self) -> None:
        for name in _COEFFICIENTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
                raise ValueError(f"StepCostModel.{name}={value!r} must be a finite number")
            if name == "per_prefill_token_s":
                if value < -self.per_token_s:
                    raise ValueError(f"StepCostModel.per_prefill_token_s={value!r} must be >= -per_token_s "
                                     f"({-self.per_token_s!r}): a prefill token cannot cost less than nothing")
            elif value < 0:
                raise ValueError(f"StepCostModel.{name}={value!r} must be a number >= 0")

    def step_time(self, num_tokens: int, num_kv_tokens: int, num_seqs: int = 0, num_prefill_tokens: int = 0,
                  attn_pairs: float = 0.0) -> float:
        return (self.base_s + self.per_token_s * num_tokens + self.per_kv_token_s * num_kv_tokens
                + self.per_seq_s * num_seqs + self.per_prefill_token_s * num_prefill_tokens
                + self.per_attn_pair_s * attn_pairs)

    def time_of(self, out) -> float:
        """Seconds for the step a ``SchedulerOutput`` describes."""
        if not (self.per_seq_s or self.per_prefill_token_s or self.per_attn_pair_s):
            return self.base_s + self.per_token_s * out.total_num_scheduled_tokens + \
                self.per_kv_token_s * out.total_num_kv_tokens
        return self.step_time(*step_features(out))

    @classmethod
    def fit(cls, steps: Sequence[Sequence[float]]) -> StepCostModel:
        """Least-squares fit to measured steps, constrained to valid coefficients.

        Rows are ``(num_tokens, num_kv_tokens, seconds)`` (the three-term model)
        or ``(*FEATURES, seconds)`` (all six terms). Every subset of the terms is
        fitted and the best valid one kept (exact for this many unknowns); each
        column is scaled to unit maximum first, so microsecond and second terms
        are fitted alike.
        """
        data = np.asarray(steps, dtype=float)
        if data.ndim != 2 or data.shape[1] not in (3, len(FEATURES) + 1) or len(data) < data.shape[1]:
            raise ValueError(f"steps must be >= 3 rows of (num_tokens, num_kv_tokens, seconds) or >= 6 rows of "
                             f"({', '.join(FEATURES)}, seconds), got shape {data.shape}")
        if not np.all(np.isfinite(data)):
            raise ValueError("steps hold a non-finite number")
        x, y = data[:, :-1], data[:, -1]
        if x.shape[1] == 2:
            x = np.column_stack([x, np.zeros((len(x), 3))])
        # Columns: base, tokens, kv, seqs, prefill tokens, pairs (the order of _COEFFICIENTS).
        design = np.column_stack([np.ones(len(x)), x[:, 0], x[:, 1], x[:, 2], x[:, 3], x[:, 4]])
        scale = np.abs(design).max(axis=0)
        scale[scale == 0] = 1.0
        design = design / scale
        best, best_err = np.zeros(6), float(np.sum(y ** 2))
        usable = [j for j in range(6) if np.any(design[:, j])]
        for size in range(1, len(usable) + 1):
            for cols in itertools.combinations(usable, size):
                coef, *_ = np.linalg.lstsq(design[:, cols], y, rcond=None)
                full = np.zeros(6)
                full[list(cols)] = coef / scale[list(cols)]
                if not _valid(full):
                    continue
                err = float(np.sum((design[:, cols] @ coef - y) ** 2))
                if err < best_err * (1 - 1e-12):
                    best, best_err = full, err
        return cls(*(float(v) for v in best))

    @classmethod
    def from_run(cls, run_metrics) -> StepCostModel:
        """Fit the three-term model to a pipeline run's measured steps: ``run_metrics``
        is a :class:`servelab.pipeline.RunMetrics` (its ``scheduled_tokens``,
        ``kv_tokens`` and ``step_times``). :func:`.calibrate` fits every term."""
        try:
            steps = list(zip(run_metrics.scheduled_tokens, run_metrics.kv_tokens, run_metrics.step_times))
        except AttributeError:
            raise TypeError(f"run_metrics must be a pipeline RunMetrics, got {type(run_metrics).__name__}") from None
        if len(steps) < 3:
            raise ValueError(f"run_metrics has {len(steps)} steps; fitting needs at least 3")
        return cls.fit(steps)

    @staticmethod
    def for_hardware(hardware, model, **kwargs) -> RooflineCostModel:
        """A first-principles roofline cost model for ``model`` (a config: layers, hidden, heads...)
        on ``hardware`` (a name from the shipped table or a :class:`.hardware.Hardware`); see
        :func:`.hardware.roofline_cost_model` for the arguments. Not linear: returns a
        :class:`.hardware.RooflineCostModel` (same ``time_of`` / ``step_time`` interface)."""
        return roofline_cost_model(hardware, model, **kwargs)

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _valid(coef: np.ndarray) -> bool:
    base, per_token, per_kv, per_seq, per_prefill, per_pair = coef
    return min(base, per_token, per_kv, per_seq, per_pair) >= 0 and per_prefill >= -per_token

"""Step-cost model: how long one model step takes, from what was scheduled.

    seconds = base_s + per_token_s * scheduled_tokens + per_kv_token_s * kv_tokens

``scheduled_tokens`` are the tokens computed this step (linear layers: compute
bound for prefill chunks); ``kv_tokens`` are the KV positions attention reads
(``num_computed_tokens + scheduled`` summed over requests: memory bound for
decodes); ``base_s`` is the per-step floor (reading the weights once, launch
overhead). The defaults are round numbers for a 7B fp16 model on one
A100-class GPU: ~9 ms to stream 14 GB of weights, ~70 us of FLOPs per token,
~0.35 us per 512 KB token of KV. :meth:`StepCostModel.fit` replaces them with
a least-squares fit of measured steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepCostModel:
    """Linear step time (seconds); every coefficient >= 0."""

    base_s: float = 9e-3
    per_token_s: float = 7e-5
    per_kv_token_s: float = 3.5e-7

    def __post_init__(self) -> None:
        for name in ("base_s", "per_token_s", "per_kv_token_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"StepCostModel.{name}={value!r} must be a number >= 0")

    def step_time(self, num_tokens: int, num_kv_tokens: int) -> float:
        return self.base_s + self.per_token_s * num_tokens + self.per_kv_token_s * num_kv_tokens

    @classmethod
    def fit(cls, steps: Sequence[tuple[float, float, float]]) -> StepCostModel:
        """Least-squares fit to measured ``(num_tokens, num_kv_tokens, seconds)``
        steps, constrained to non-negative coefficients (every subset of the
        three terms is fitted and the best feasible one kept: exact for three
        unknowns)."""
        data = np.asarray(steps, dtype=float)
        if data.ndim != 2 or data.shape[1] != 3 or len(data) < 3:
            raise ValueError(f"steps must be >= 3 rows of (num_tokens, num_kv_tokens, seconds), got shape "
                             f"{data.shape}")
        design = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])
        y = data[:, 2]
        best, best_err = np.zeros(3), float(np.sum(y ** 2))
        for size in (1, 2, 3):
            for cols in itertools.combinations(range(3), size):
                coef, *_ = np.linalg.lstsq(design[:, cols], y, rcond=None)
                if np.any(coef < 0):
                    continue
                err = float(np.sum((design[:, cols] @ coef - y) ** 2))
                if err < best_err - 1e-18:
                    best, best_err = np.zeros(3), err
                    best[list(cols)] = coef
        return cls(float(best[0]), float(best[1]), float(best[2]))

    @classmethod
    def from_run(cls, run_metrics) -> StepCostModel:
        """Fit to a pipeline run's measured steps: ``run_metrics`` is a
        :class:`servelab.pipeline.RunMetrics` (its ``scheduled_tokens``,
        ``kv_tokens`` and ``step_times``), so the simulator can replay a
        workload at the speed of the model that was measured."""
        try:
            steps = list(zip(run_metrics.scheduled_tokens, run_metrics.kv_tokens, run_metrics.step_times))
        except AttributeError:
            raise TypeError(f"run_metrics must be a pipeline RunMetrics, got {type(run_metrics).__name__}") from None
        if len(steps) < 3:
            raise ValueError(f"run_metrics has {len(steps)} steps; fitting needs at least 3")
        return cls.fit(steps)

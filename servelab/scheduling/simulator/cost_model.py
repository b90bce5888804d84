"""Step-cost model: how long one model step takes, from what was scheduled.

    seconds = base_s
            + per_token_s          * scheduled tokens          (linear layers, every token)
            + per_prefill_token_s  * prefill tokens            (extra or less per token of a multi-token chunk:
                                                                 a GEMM row vs a GEMV row)
            + per_seq_s            * scheduled sequences       (per-sequence host work, sampling, metadata)
            + per_kv_token_s       * KV positions read         (attention reads: sum of computed + scheduled)
            + per_attn_pair_s      * prefill attention pairs   (sum over prefill chunks of n * (computed + (n+1)/2))
            + per_prefill_seq_s    * prefill sequences         (sequences of a multi-token chunk: one padded
                                                                 attention problem and mask each)
            + per_decode_restart_s * decode restarts           (1 for a step whose decodes are not carried over
                                                                 from the previous step: K/V gathered afresh)
            + per_restarted_seq_s  * restarted decode seqs     (the decodes of such a step)

``base_s`` is the per-step floor (reading the weights once, launch and Python
overhead). The three original coefficients keep their meaning and defaults
(round numbers for a 7B fp16 model on one A100-class GPU: ~9 ms to stream
14 GB of weights, ~70 us of FLOPs per token, ~0.35 us per 512 KB token of KV);
the new terms default to 0, so ``StepCostModel(base, per_token, per_kv)``
behaves as before. The two restart terms depend on the previous step's
requests (:class:`.features.DecodeContinuity`); the model itself holds no
state: ``timer()`` returns a ``time_of`` with its own continuity, for one
sequence of steps (the simulator takes one per run and replica), and
``time_of(out, continuity)`` takes it as an argument (without one, every
decode step counts as a restart); ``step_time`` takes the counts as arguments.

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
from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np

from servelab.scheduling.simulator.features import EXTRA_FEATURES, FEATURES, DecodeContinuity, extra_features, step_features
from servelab.scheduling.simulator.hardware import RooflineCostModel, roofline_cost_model

_COEFFICIENTS = ("base_s", "per_token_s", "per_kv_token_s", "per_seq_s", "per_prefill_token_s", "per_attn_pair_s",
                 "per_prefill_seq_s", "per_decode_restart_s", "per_restarted_seq_s")
_ALL = len(FEATURES) + len(EXTRA_FEATURES)


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
    per_prefill_seq_s: float = 0.0
    per_decode_restart_s: float = 0.0
    per_restarted_seq_s: float = 0.0

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
                  attn_pairs: float = 0.0, num_prefill_seqs: int = 0, decode_restarts: int = 0,
                  restarted_decode_seqs: int = 0) -> float:
        return (self.base_s + self.per_token_s * num_tokens + self.per_kv_token_s * num_kv_tokens
                + self.per_seq_s * num_seqs + self.per_prefill_token_s * num_prefill_tokens
                + self.per_attn_pair_s * attn_pairs + self.per_prefill_seq_s * num_prefill_seqs
                + self.per_decode_restart_s * decode_restarts
                + self.per_restarted_seq_s * restarted_decode_seqs)

    def time_of(self, out, continuity: DecodeContinuity | None = None) -> float:
        """Seconds for the step a ``SchedulerOutput`` describes. ``continuity``: the sequence's
        :class:`.features.DecodeContinuity` for the restart terms (None: a fresh one, so a decode
        step counts as a restart); :meth:`timer` binds one."""
        if self.per_prefill_seq_s or self.per_decode_restart_s or self.per_restarted_seq_s:
            return self.step_time(*step_features(out), *extra_features(out, continuity or DecodeContinuity()))
        if not (self.per_seq_s or self.per_prefill_token_s or self.per_attn_pair_s):
            return self.base_s + self.per_token_s * out.total_num_scheduled_tokens + \
                self.per_kv_token_s * out.total_num_kv_tokens
        return self.step_time(*step_features(out))

    def timer(self) -> Callable[[object], float]:
        """``time_of`` for one sequence of steps, with its own decode continuity (call it once per
        step, in order): what the simulator charges each replica's steps with."""
        if not (self.per_decode_restart_s or self.per_restarted_seq_s):
            return self.time_of
        continuity = DecodeContinuity()
        return lambda out: self.time_of(out, continuity)

    @classmethod
    def fit(cls, steps: Sequence[Sequence[float]], *, outlier_mads: float | None = None,
            relative: bool = False) -> StepCostModel:
        """Least-squares fit to measured steps, constrained to valid coefficients.

        Rows are ``(num_tokens, num_kv_tokens, seconds)`` (the three-term model),
        ``(*FEATURES, seconds)`` (six terms) or ``(*FEATURES, *EXTRA_FEATURES,
        seconds)`` (all nine). Every subset of the terms is fitted and the best
        valid one kept (exact for this many unknowns); each column is scaled to
        unit maximum first, so microsecond and second terms are fitted alike.
        ``outlier_mads``: fit, drop the rows whose (weighted) residual exceeds this
        many median absolute residuals (steps a shared machine interrupted),
        refit from all rows again; up to three rounds.
        ``relative``: minimise squared *relative* errors (each row weighted by
        1 / its fitted seconds, twice reweighted), so a few long prefill steps
        do not outweigh the many short decode steps that set TPOT.
        """
        data = np.asarray(steps, dtype=float)
        widths = (3, len(FEATURES) + 1, _ALL + 1)
        if data.ndim != 2 or data.shape[1] not in widths or len(data) < data.shape[1]:
            raise ValueError(f"steps must be >= 3 rows of (num_tokens, num_kv_tokens, seconds), >= 6 rows of "
                             f"({', '.join(FEATURES)}, seconds) or >= 9 rows of (..., {', '.join(EXTRA_FEATURES)}, "
                             f"seconds), got shape {data.shape}")
        if not np.all(np.isfinite(data)):
            raise ValueError("steps hold a non-finite number")
        if outlier_mads is not None and not (isinstance(outlier_mads, (int, float)) and outlier_mads > 0):
            raise ValueError(f"outlier_mads={outlier_mads!r}; valid: None or a number > 0")
        x, y = data[:, :-1], data[:, -1]
        # Columns: base, then the features in _COEFFICIENTS' order; absent features are zero columns.
        design = np.column_stack([np.ones(len(x)), x, np.zeros((len(x), _ALL - x.shape[1]))])
        weight = np.ones_like(y)
        best = _fit_subsets(design, y)
        for _ in range(2 if relative else 0):
            # Weights from the fitted times, not the measured ones: 1 / measured would favour the
            # steps that happened to run fast and bias every prediction low.
            weight = 1.0 / np.maximum(design @ best, 1e-3 * max(float(np.median(y)), 1e-12))
            best = _fit_subsets(design * weight[:, None], y * weight)
        rounds, mads = (3, float(outlier_mads)) if outlier_mads is not None else (0, 0.0)
        for _ in range(rounds):  # trim, refit, trim again from the better fit
            residual = np.abs(design @ best - y) * weight
            keep = residual <= mads * max(float(np.median(residual)), 1e-12)
            if keep.sum() < design.shape[1] or keep.all():
                break
            best = _fit_subsets(design[keep] * weight[keep, None], y[keep] * weight[keep])
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


def _fit_subsets(design: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The best valid least-squares coefficients over every subset of ``design``'s columns."""
    width = design.shape[1]
    scale = np.abs(design).max(axis=0)
    scale[scale == 0] = 1.0
    design = design / scale
    best, best_err = np.zeros(width), float(np.sum(y ** 2))
    usable = [j for j in range(width) if np.any(design[:, j])]
    for size in range(1, len(usable) + 1):
        for cols in itertools.combinations(usable, size):
            coef, *_ = np.linalg.lstsq(design[:, cols], y, rcond=None)
            full = np.zeros(width)
            full[list(cols)] = coef / scale[list(cols)]
            if not _valid(full):
                continue
            err = float(np.sum((design[:, cols] @ coef - y) ** 2))
            if err < best_err * (1 - 1e-12):
                best, best_err = full, err
    return best


def _valid(coef: np.ndarray) -> bool:
    per_token, per_prefill = coef[1], coef[4]
    others = np.delete(coef, 4)
    return bool(others.min() >= 0) and per_prefill >= -per_token

"""The pipeline: glue that turns the components into a serving engine.

- :mod:`~servelab.pipeline.pipeline`: ``Pipeline`` (``from_pretrained``,
  ``generate``, ``stream``, ``add_request`` / ``step``).
- :mod:`~servelab.pipeline.runner`: ``ModelRunner`` — ``SchedulerOutput`` to
  model inputs (persistent block table, slot mapping), sampling, draft
  verification, next drafts.
- :mod:`~servelab.pipeline.drafting`: ``DraftModelDrafter`` (a small model with
  its own paged KV cache) and ``resolve_drafter``.
- :mod:`~servelab.pipeline.detokenizer`: incremental detokenizer with stop strings.
- :mod:`~servelab.pipeline.outputs`: ``GenerationOutput``, ``StreamEvent``.
- :mod:`~servelab.pipeline.metrics`: ``RunMetrics`` (per run and per step).
- :mod:`~servelab.pipeline.report`: ``plot_report`` (matplotlib, imported on use).
"""

from servelab.pipeline.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from servelab.pipeline.drafting import DraftModelDrafter, DraftRequest, resolve_drafter
from servelab.pipeline.metrics import MetricsRecorder, RunMetrics
from servelab.pipeline.outputs import GenerationOutput, StreamEvent
from servelab.pipeline.pipeline import Pipeline, default_num_blocks
from servelab.pipeline.runner import CachedRequestState, ModelRunner


def plot_report(run_metrics, path, title: str = ""):
    """See :func:`servelab.pipeline.report.plot_report` (imported lazily: matplotlib is heavy)."""
    from servelab.pipeline.report import plot_report as _plot

    return _plot(run_metrics, path, title)


__all__ = [
    "CachedRequestState", "DetokenizerDelta", "DraftModelDrafter", "DraftRequest", "GenerationOutput",
    "IncrementalDetokenizer", "MetricsRecorder", "ModelRunner", "Pipeline", "RunMetrics", "StreamEvent",
    "default_num_blocks", "plot_report", "resolve_drafter",
]

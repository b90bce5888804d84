"""The pipeline: glue that turns the components into a serving engine.

- :mod:`~servelab.pipeline.pipeline`: ``Pipeline`` (``from_pretrained``,
  ``generate``, ``chat``, ``stream``, ``add_request`` / ``step``).
- :mod:`~servelab.pipeline.setup`: the pieces built from a
  :class:`~servelab.config.PipelineConfig` (attention ``"auto"``, KV cache
  manager, drafter); :mod:`~servelab.pipeline.sizing`: the default KV pool
  size and peak memory.
- :mod:`~servelab.pipeline.inputs`: prompts, batch arguments, chat templates.
- :mod:`~servelab.pipeline.runner`: ``ModelRunner`` — ``SchedulerOutput`` to
  model inputs (persistent block table, slot mapping), and
  :mod:`~servelab.pipeline.sampling_steps`: sampling, draft verification,
  next drafts, each request isolated from the others' failures.
- :mod:`~servelab.pipeline.hybrid`: models whose layers differ (Gemma 2,
  Qwen2 with sliding layers): one KV-cache group per kind of layer, the
  shared buffer, ``HybridModelRunner`` (one block table per group).
- :mod:`~servelab.pipeline.detokenizer`: incremental detokenizer with stop strings.
- :mod:`~servelab.pipeline.outputs`: ``GenerationOutput``, ``StreamEvent``.
- :mod:`~servelab.pipeline.metrics`: ``RunMetrics`` (per run and per step).
- :mod:`~servelab.pipeline.report`: ``plot_report`` (matplotlib, imported on use).
"""

from servelab.pipeline.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from servelab.pipeline.hybrid import HybridModelRunner
from servelab.pipeline.metrics import MetricsRecorder, RunMetrics
from servelab.pipeline.outputs import GenerationOutput, StreamEvent
from servelab.pipeline.pipeline import Pipeline
from servelab.pipeline.runner import CachedRequestState, ModelRunner
from servelab.pipeline.sizing import default_num_blocks, peak_rss_bytes
from servelab.samplers.drafters import DraftModelDrafter, DraftRequest, resolve_drafter  # their home; kept here too


def plot_report(run_metrics, path, title: str = ""):
    """See :func:`servelab.pipeline.report.plot_report` (imported lazily: matplotlib is heavy)."""
    from servelab.pipeline.report import plot_report as _plot

    return _plot(run_metrics, path, title)


__all__ = [
    "CachedRequestState", "DetokenizerDelta", "DraftModelDrafter", "DraftRequest", "GenerationOutput",
    "HybridModelRunner", "IncrementalDetokenizer", "MetricsRecorder", "ModelRunner", "Pipeline", "RunMetrics", "StreamEvent",
    "default_num_blocks", "peak_rss_bytes", "plot_report", "resolve_drafter",
]

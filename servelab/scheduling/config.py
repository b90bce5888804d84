"""``SchedulerConfig``: the limits one scheduling step works under (defined in
:mod:`servelab.config`, which imports nothing heavy; re-exported here).

Every field is checked once, here, with the shared helpers of
:mod:`servelab._internal.validation`: ``TypeError`` for a wrong type,
``ValueError`` for a value out of range, both naming the field
(``SchedulerConfig.max_num_seqs``), the value and what would be valid (never
``assert``: ``python -O`` strips it).

Defaults: **the one set of scheduling defaults in servelab** (vLLM's
``max_num_seqs=256``, ``max_num_batched_tokens=2048``). A ``Scheduler`` used
directly, the simulator (``simulate(..., scheduler_config=None)`` is
``SchedulerConfig()``), the ``servelab simulate`` command and a
:class:`~servelab.Pipeline` all start from them: the pipeline's
:class:`~servelab.config.SchedulingConfig` takes its defaults from this class
(it adds the policy, and ``max_model_len=None`` meaning "the model's"), and
:meth:`servelab.config.PipelineConfig.scheduler_config` derives the
scheduler's object from it.
"""

from servelab.config import SchedulerConfig

__all__ = ["SchedulerConfig"]

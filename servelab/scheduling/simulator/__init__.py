"""Trace-driven simulation of scheduling policies.

A real :class:`~servelab.scheduling.Scheduler` and
:class:`~servelab.blocks.KVCacheManager` serve a workload; a linear step-cost
model stands in for the model and advances a virtual clock. 10,000 requests
take seconds on one CPU core.

- :mod:`.workload`: Poisson / gamma arrivals, fixed / uniform / lognormal /
  CSV lengths, shared-prefix groups, clients, priorities.
- :mod:`.cost_model`: ``StepCostModel`` (prefill / decode / per-sequence /
  attention terms) and its least-squares ``fit``; :mod:`.calibrate`:
  ``calibrate(pipe)`` fits it to a real ``Pipeline``'s measured steps;
  :mod:`.hardware`: ``StepCostModel.for_hardware(hardware, model)``, a roofline
  on a shipped table of GPUs and this CPU (``hardware.json``, sourced).
- :mod:`.loop`: the one simulation loop (``SimLoop``) that ``simulate``,
  ``servelab.cluster.simulate_cluster`` and the vLLM engine share, its request
  factory and its one cost call (``step_timer``).
- :mod:`.engine`: ``simulate`` and ``compare_policies`` (``engine="servelab"``
  or ``engine="vllm"``: the same trace through vLLM's real scheduler, see
  :mod:`.vllm_engine`; vLLM is imported only then).
- :mod:`.metrics`: ``SimulationResult`` (TTFT, ITL, TPOT, e2e, throughput,
  goodput, prefix hit rate, preemptions, KV usage, per-client service).
- :mod:`.report`: a text table, a CSV and a matplotlib figure.
- :mod:`.traces`: ``load_trace``: real traces (Mooncake with its prefix-block
  hashes, Azure), from a file or a shipped trace's name.

Example::

    from servelab.scheduling.simulator import WorkloadSpec, compare_policies, format_table
    results = compare_policies(WorkloadSpec(num_requests=2000, rate=8), ["fcfs", "sjf", "vtc"])
    print(format_table(results))
"""

from servelab.scheduling.simulator.calibrate import calibrate, measure_steps
from servelab.scheduling.simulator.cost_model import StepCostModel
from servelab.scheduling.simulator.features import FEATURES, step_features
from servelab.scheduling.simulator.hardware import (
    MODEL_PRESETS,
    Hardware,
    ModelShape,
    RooflineCostModel,
    hardware_table,
    roofline_cost_model,
)
from servelab.scheduling.simulator.engine import ENGINES, VirtualClock, compare_policies, simulate
from servelab.scheduling.simulator.loop import SimLoop, step_timer
from servelab.scheduling.simulator.metrics import ClientStats, LatencySummary, SimulationResult
from servelab.scheduling.simulator.report import format_client_table, format_table, plot_results, write_csv
from servelab.scheduling.simulator.traces import SHIPPED_TRACES, BlockTokens, Trace, load_trace
from servelab.scheduling.simulator.workload import (
    LengthDist,
    TraceRequest,
    WorkloadSpec,
    arrival_stream,
    generate_workload,
    iter_workload,
    load_trace_csv,
    validate_trace,
)

__all__ = [
    "ENGINES", "FEATURES", "MODEL_PRESETS", "Hardware", "ModelShape", "RooflineCostModel", "calibrate",
    "hardware_table", "measure_steps", "roofline_cost_model", "step_features", "SHIPPED_TRACES", "BlockTokens", "ClientStats", "LatencySummary", "LengthDist", "SimulationResult",
    "StepCostModel", "Trace", "TraceRequest", "VirtualClock", "WorkloadSpec", "compare_policies", "format_client_table", "format_table",
    "SimLoop", "arrival_stream", "iter_workload", "step_timer",
    "generate_workload", "load_trace", "load_trace_csv", "plot_results", "simulate", "validate_trace", "write_csv",
]

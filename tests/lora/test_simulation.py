"""LoRAStepCost: the simulator's step cost with adapter loads (slots LRU over max_loras)."""

from types import SimpleNamespace

import pytest

from servelab.lora.simulation import LoRAStepCost
from servelab.scheduling.simulator.cost_model import StepCostModel


def step(**scheduled):
    return SimpleNamespace(num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                           total_num_kv_tokens=0)


def test_loads_are_charged_once_per_slot_fill():
    base = StepCostModel(base_s=1.0, per_token_s=0.0, per_kv_token_s=0.0)
    cost = LoRAStepCost(base, {"r1": "A", "r2": "B", "r3": "C"}, max_loras=2, load_s=10.0, per_adapter_s=0.5,
                        per_lora_token_s=0.01)
    time_of = cost.timer()
    assert time_of(step(r1=4, r2=1, r0=7)) == pytest.approx(1 + 2 * 10 + 2 * 0.5 + 5 * 0.01)  # A, B loaded
    assert time_of(step(r1=1, r2=1)) == pytest.approx(1 + 2 * 0.5 + 2 * 0.01)  # both in slots
    assert time_of(step(r3=1, r1=1)) == pytest.approx(1 + 10 + 2 * 0.5 + 2 * 0.01)  # C takes B's slot (A runs in this step)
    assert time_of(step(r2=1)) == pytest.approx(1 + 10 + 0.5 + 0.01)  # B again: C's slot (A was used after C)
    assert time_of(step(r0=3)) == pytest.approx(1.0)  # base requests only
    assert (cost.loads, cost.steps_with_loads) == (4, 3)
    with pytest.raises(ValueError, match="more than max_loras=2"):
        cost.timer()(step(r1=1, r2=1, r3=1))


def test_settings_are_checked():
    with pytest.raises(ValueError, match="load_s"):
        LoRAStepCost(StepCostModel(), {}, max_loras=1, load_s=-1)
    with pytest.raises(ValueError, match="max_loras"):
        LoRAStepCost(StepCostModel(), {}, max_loras=0)


def test_simulated_runs_use_the_real_schedulers_max_loras_constraint():
    """Trace requests over 4 adapters through simulate(): the real scheduler keeps each step
    within max_loras (LoRAStepCost raises otherwise), and fewer slots mean more loads."""
    from servelab.scheduling import SchedulerConfig
    from servelab.scheduling.simulator import simulate
    from servelab.scheduling.simulator.workload import TraceRequest

    names = ["A", "B", "C", "D", None]
    trace = [TraceRequest(f"r{i}", 0.01 * i, list(range(100 + i, 132 + i)), 8, lora_name=names[i % 5])
             for i in range(40)]
    adapter_of = {r.request_id: r.lora_name for r in trace}
    runs = {}
    for slots in (1, 2, 4):
        cost = LoRAStepCost(StepCostModel(), adapter_of, max_loras=slots, load_s=0.05)
        result = simulate(trace, scheduler_config=SchedulerConfig(max_loras=slots), cost_model=cost)
        assert len(result.requests) == 40 and all(r.finish_reason == "length" for r in result.requests)
        runs[slots] = (cost.loads, max(r.finish_time for r in result.requests))
    assert runs[4][0] == 4  # every adapter loaded once
    assert runs[1][0] > runs[2][0] > runs[4][0]
    assert runs[1][1] > runs[4][1]  # the loads show in the simulated time

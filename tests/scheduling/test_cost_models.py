"""Cost models: the fit recovers known coefficients, calibration fits a real pipeline and the simulator
then tracks it (loose bound: the number lives in bench/sim_fidelity.py), the roofline behaves as physics says."""

from __future__ import annotations

import json
import math
from importlib import resources

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.scheduling.simulator import (
    FEATURES,
    LengthDist,
    ModelShape,
    StepCostModel,
    WorkloadSpec,
    calibrate,
    generate_workload,
    hardware_table,
    simulate,
)

coef = st.floats(0, 1e-2, allow_nan=False)


@settings(max_examples=25, deadline=None)
@given(coef, coef, st.floats(0, 1e-6), coef, st.floats(0, 1e-3), st.floats(0, 1e-8), st.integers(0, 2**31))
def test_fit_recovers_the_coefficients_of_noiseless_steps(base, tok, kv, seq, pre, pair, seed):
    true = StepCostModel(base, tok, kv, seq, pre, pair)
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(40):
        seqs = int(rng.integers(1, 64))
        prefill = int(rng.integers(0, 2048)) * int(rng.integers(0, 2))
        tokens = seqs + prefill
        kv_tokens = tokens + int(rng.integers(0, 50_000))
        pairs = float(prefill * rng.integers(1, 1000))
        rows.append((tokens, kv_tokens, seqs, prefill, pairs, true.step_time(tokens, kv_tokens, seqs, prefill, pairs)))
    fitted = StepCostModel.fit(rows)
    predicted = [fitted.step_time(*r[:-1]) for r in rows]
    np.testing.assert_allclose(predicted, [r[-1] for r in rows], rtol=1e-6, atol=1e-12)


def test_three_column_fit_and_validation_still_work():
    rows = [(t, 10 * t, 0.001 + 2e-5 * t + 1e-7 * 10 * t) for t in (1, 8, 64, 512)]
    model = StepCostModel.fit(rows)
    assert model.base_s == pytest.approx(0.001) and model.per_seq_s == 0.0
    with pytest.raises(ValueError, match="per_prefill_token_s"):
        StepCostModel(per_token_s=1e-5, per_prefill_token_s=-2e-5)
    with pytest.raises(ValueError, match="rows"):
        StepCostModel.fit([(1, 2, 3, 0.1)])
    assert len(FEATURES) == 5


def test_hardware_table_has_every_device_with_sources():
    table = hardware_table()
    assert {"A100-80GB", "H100-SXM", "H200", "L40S", "MI300X", "cpu-measured"} <= set(table)
    raw = json.loads((resources.files("servelab.scheduling.simulator") / "hardware.json").read_text())
    for name, hw in table.items():
        assert {"peak_flops", "mem_bw", "efficiencies", "overheads"} <= set(raw[name]["sources"]), name
    assert table["H200"].mem_bw > table["H100-SXM"].mem_bw and table["H200"].peak_flops == table["H100-SXM"].peak_flops


def test_roofline_is_memory_bound_for_decode_and_compute_bound_for_long_prefill():
    model = StepCostModel.for_hardware("H100-SXM", "llama-3.1-8b")
    hw, shape = model.hardware, model.model
    weights = (shape.linear_params + shape.hidden_size * shape.vocab_size) * 2
    one = model.breakdown(1, 1024, 1)
    assert one["gemm"] == pytest.approx(weights / (hw.mem_bw * hw.bandwidth_efficiency))
    assert model.decode_throughput(64, 1024) > 10 * model.decode_throughput(1, 1024)  # batching amortises weights
    long = model.breakdown(8192, 8192, 1, 8192, 8192 * 4096.5)
    assert long["gemm"] == pytest.approx(2 * shape.linear_params * 8192 / (hw.peak_flops * hw.gemm_efficiency),
                                         rel=0.02)
    assert StepCostModel.for_hardware("H200", "llama-3.1-8b").decode_throughput(1, 1024) > \
        model.decode_throughput(1, 1024)  # more bandwidth, faster decode
    with pytest.raises(ValueError, match="not in the table"):
        StepCostModel.for_hardware("TPU", "llama-3.1-8b")
    with pytest.raises(ValueError, match="preset"):
        StepCostModel.for_hardware("H100-SXM", "gpt-5")
    assert ModelShape.from_config({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                   "intermediate_size": 128, "vocab_size": 100}).head_dim == 16


def test_simulator_runs_on_a_roofline_model():
    trace = generate_workload(WorkloadSpec(num_requests=60, rate=50.0, seed=2))
    result = simulate(trace, "fcfs", cost_model=StepCostModel.for_hardware("A100-80GB", "llama-3.1-8b"))
    assert result.num_failed == 0 and 0 < result.latency("tpot").p50 < 0.2


def _real_online(pipe, trace, tag="t", clock=None):
    import time

    from servelab.samplers import SamplingParams

    clock = clock or time.perf_counter
    start, i, last = clock(), 0, {}
    while i < len(trace) or pipe.has_unfinished_requests():
        now = clock() - start
        while i < len(trace) and trace[i].arrival_time <= now:
            pipe.add_request(list(trace[i].prompt_token_ids),
                             SamplingParams(temperature=0.0, max_tokens=trace[i].max_tokens, ignore_eos=True),
                             request_id=f"{tag}-{trace[i].request_id}", detokenize=False)
            i += 1
        if not pipe.has_unfinished_requests():
            time.sleep(max(trace[i].arrival_time - now, 0.0))
            continue
        for event in pipe.step():
            if event.new_token_ids:
                last[event.request_id] = clock() - start  # noqa: PERF403
    return max(last.values())


def test_calibrated_simulator_tracks_the_real_pipeline_and_a_wrong_model_does_not(tmp_path):
    import time

    import torch

    from servelab import Pipeline
    from servelab.models import build_tiny_model

    torch.set_num_threads(1)
    path = build_tiny_model(tmp_path / "m", arch="llama", seed=0, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    pipe = Pipeline.from_pretrained(path, attention_backend="sdpa", max_num_seqs=8, max_num_batched_tokens=256,
                                    max_model_len=256)
    # CPU time of this one-thread process, for the fit and the serve alike: on a shared machine the wall
    # clock also counts other processes' turns on the core, which no cost model can know.
    clock = time.thread_time
    cost, rows = calibrate(pipe, prompt_lens=(8, 32), max_tokens=6, return_steps=True, clock=clock)
    assert len(rows) > 30 and cost.base_s + cost.per_seq_s > 0
    # Every request arrives at once: the run's length is the sum of its steps' costs, not the arrivals'
    # (an arrival-bound run ends when its last arrival does, whatever the cost model says).
    trace = generate_workload(WorkloadSpec(num_requests=24, rate=math.inf, prompt_len=LengthDist("uniform", 4, 40),
                                           output_len=LengthDist("uniform", 8, 24), vocab_size=pipe.vocab_size,
                                           seed=5))
    real_end = min(_real_online(pipe, trace, f"serve{k}", clock) for k in range(2))  # the less disturbed of two serves
    kv = pipe.kv_cache_manager

    def sim_end(model) -> float:
        sim = simulate(trace, "fcfs", scheduler_config=pipe.scheduler.config, num_blocks=kv.num_blocks,
                       block_size=kv.block_size, cost_model=model)
        assert sim.num_failed == 0
        return max(m.token_times[-1] for m in sim.requests)

    ratio = sim_end(cost) / real_end
    print(f"calibrated sim/real end ratio {ratio:.3f}")
    doubled = StepCostModel(**{k: 2 * v for k, v in cost.as_dict().items()})
    zero = StepCostModel(0.0, 0.0, 0.0)
    # Within 1.45x either way: the calibrated model passes, a model twice too slow (or free) cannot.
    within = [1 / 1.45 < r < 1.45 for r in (ratio, sim_end(doubled) / real_end, sim_end(zero) / real_end)]
    assert within == [True, False, False], f"calibrated ratio {ratio:.3f}"

"""The simulator's step-cost model fitted to a real pipeline run."""

import pytest

from servelab import Pipeline
from servelab.samplers import SamplingParams
from servelab.scheduling import StepCostModel


def test_cost_model_fits_a_pipeline_run(tiny):
    pipe = Pipeline.from_pretrained(tiny["llama"], block_size=8, max_num_batched_tokens=32, max_num_seqs=4)
    prompts = [[5 + i] * (10 + 7 * i) for i in range(6)]
    pipe.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    run = pipe.last_run_metrics
    assert len(run.kv_tokens) == run.num_steps and all(k >= s for k, s in zip(run.kv_tokens, run.scheduled_tokens))
    model = StepCostModel.from_run(run)
    predicted = sum(model.step_time(s, k) for s, k in zip(run.scheduled_tokens, run.kv_tokens))
    measured = sum(run.step_times)
    assert min(model.base_s, model.per_token_s, model.per_kv_token_s) >= 0
    assert 0.5 < predicted / measured < 2.0


def test_cost_model_from_run_rejects_other_objects():
    with pytest.raises(TypeError, match="RunMetrics"):
        StepCostModel.from_run(object())

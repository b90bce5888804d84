"""Scheduler overhead per step: one ``schedule()`` + ``update_from_output()`` with
N requests decoding (prefix caching on, fake model), N = 256 and 1024.

Run: ``pytest bench/bench_scheduler.py`` (pytest-benchmark; ``-k 1024`` for
one size). Each round is one decode step of every request; requests never
finish during the measurement (their ``max_tokens`` is far away), so every
round does the same work: N tokens scheduled, N tokens appended, a block
allocated and hashed every 16 steps per request.
"""

from __future__ import annotations

import pytest

from servelab.blocks import FullAttentionSpec, KVCacheManager
from servelab.samplers.params import SamplingParams
from servelab.scheduling import ModelRunnerOutput, Request, Scheduler, SchedulerConfig

# Rows appended to bench/results/results.csv by bench/conftest.py.
RESULTS_COMPONENT, RESULTS_IMPLEMENTATION = "scheduler", "servelab"
PROMPT = 128
ROUNDS = 200
TOKEN = 7


def decoding_scheduler(num_running: int) -> Scheduler:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype="float16")
    per_request = (PROMPT + ROUNDS + 64) // 16 + 2
    kv = KVCacheManager(spec, num_running * per_request + 1, enable_caching=True)
    config = SchedulerConfig(max_num_batched_tokens=max(8192, num_running), max_num_seqs=num_running,
                             max_model_len=4096)
    sched = Scheduler(config, kv, "fcfs")
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    for i in range(num_running):
        sched.add_request(Request(f"r{i}", [(i * 131 + j) % 32000 for j in range(PROMPT)], params))
    while any(r.num_output_tokens == 0 for r in sched.running) or len(sched.waiting):  # prefill everyone
        out = sched.schedule()
        ids = list(out.num_scheduled_tokens)
        reqs = sched.requests
        sched.update_from_output(out, ModelRunnerOutput(
            ids, [[TOKEN] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in ids]))
    assert len(sched.running) == num_running
    return sched


@pytest.mark.parametrize("num_running", [256, 1024])
def test_decode_step(benchmark, num_running):
    sched = decoding_scheduler(num_running)
    sampled = [[TOKEN]] * num_running

    def one_step():
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled))

    benchmark.pedantic(one_step, rounds=ROUNDS, warmup_rounds=5, iterations=1)
    assert len(sched.running) == num_running
    stats = benchmark.stats.stats
    benchmark.extra_info["us_per_step"] = stats.mean * 1e6
    benchmark.extra_info["us_per_request"] = stats.mean * 1e6 / num_running

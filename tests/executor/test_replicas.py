"""Data-parallel replicas as processes behind the cluster routers, held to one pipeline and to the simulator.

One pair of replica processes serves a slice of the shipped Mooncake trace (scaled to
8-token blocks) under two routers: every output equals a single in-process pipeline's
(greedy), and each router's prefix hit rate equals the simulator's prediction for the
same replicas and arrivals (sequential arrivals make both deterministic). Then one
replica is killed: its in-flight requests fail with the reason, the other serves on.
"""

from __future__ import annotations

import os
import signal

import pytest

from servelab import Pipeline, SamplingParams
from servelab.cluster import simulate_cluster
from servelab.cluster.replicas import Replicas, scaled_block_trace, sequential_arrivals
from servelab.models import build_tiny_model
from servelab.scheduling.simulator.traces import load_trace

NUM_BLOCKS, BLOCK = 160, 8


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("replicas") / "tiny", max_position_embeddings=1024)
    trace = load_trace("mooncake_conversation", max_model_len=512 * 70)[:60]
    requests = scaled_block_trace(trace, tokens_per_block=BLOCK, source_block=512, vocab_size=512, max_tokens=2)
    requests = [(p, m) for p, m in requests if len(p) + m <= (NUM_BLOCKS - 2) * BLOCK]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in requests]
    return path, requests, params


def test_replicas_match_one_pipeline_and_the_simulator_then_survive_a_killed_replica(workload):
    path, requests, params = workload
    prompts = [p for p, _ in requests]
    single = Pipeline.from_pretrained(path, num_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=1024)
    expected = [o.token_ids for o in single.generate(prompts, params)]
    with Replicas(path, 2, num_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=1024) as reps:
        for router in ("round_robin", "consistent_hash"):
            reps.reset_prefix_caches()
            run = reps.run(prompts, params, router=router, max_in_flight=1)
            assert run.num_failed == 0 and [o.token_ids for o in run.outputs] == expected
            assert sum(run.routed) == len(prompts)
            sim = simulate_cluster(sequential_arrivals(requests), replicas=2, router=router, num_blocks=NUM_BLOCKS,
                                   block_size=BLOCK)
            predicted = sim.summary()["prefix_hit_rate"]
            assert run.prefix_hit_rate > 0 and abs(predicted - run.prefix_hit_rate) <= 0.1 * run.prefix_hit_rate
        # a replica killed while it serves: its requests fail with the reason, the other one serves on
        victim = reps.replicas[1].proc.pid
        reps.run(prompts[:2], params[:2], router="round_robin")  # warm: both replicas answered once
        os.kill(victim, signal.SIGKILL)
        run = reps.run(prompts[:8], params[:8], router="round_robin", max_in_flight=8)
        failed = [o for o in run.outputs if o.finish_reason == "error"]
        served = [o for o in run.outputs if o.finish_reason != "error"]
        assert failed and all("replica 1" in o.error for o in failed)
        assert served and all(o.replica == 0 for o in served)
    assert all(not r.proc.is_alive() for r in reps.replicas)

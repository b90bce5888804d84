"""Real engines and the simulator give the same prefix hits when they see the same requests in the same order.

One in-process pipeline against ``simulate`` on a slice of the shipped Mooncake trace (scaled to
8-token blocks) with a pool far smaller than the slice's blocks, so eviction decides the hits:
request for request the same cached tokens. Then two replica processes after a prefix-cache reset:
the driver's KV-event indexes are empty (the clear is published with the reset, not after the next
run's first routing decision), and a ``prefix_affinity`` run one request at a time routes and hits
exactly as ``simulate_cluster`` does.
"""

from __future__ import annotations

import pytest

from servelab import Pipeline, SamplingParams
from servelab.cluster import simulate_cluster
from servelab.cluster.replicas import Replicas, scaled_block_trace, sequential_arrivals
from servelab.models import build_tiny_model
from servelab.scheduling.config import SchedulerConfig
from servelab.scheduling.simulator import simulate
from servelab.scheduling.simulator.traces import load_trace

NUM_BLOCKS, BLOCK, MAX_LEN = 80, 8, 1024
SIM = {"num_blocks": NUM_BLOCKS, "block_size": BLOCK, "watermark": 0.0,  # the pipeline's pool has no watermark
       "scheduler_config": SchedulerConfig(max_model_len=MAX_LEN)}


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("real_vs_sim") / "tiny", max_position_embeddings=MAX_LEN)
    trace = load_trace("mooncake_conversation", max_model_len=512 * 70)[:80]
    requests = scaled_block_trace(trace, tokens_per_block=BLOCK, source_block=512, vocab_size=512, max_tokens=2)
    requests = [(p, m) for p, m in requests if len(p) + m <= (NUM_BLOCKS - 2) * BLOCK]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in requests]
    return path, requests, params


def test_one_pipeline_hits_what_simulate_predicts_under_eviction(workload, one_torch_thread):
    path, requests, params = workload
    assert sum(len(p) for p, _ in requests) // BLOCK > 3 * NUM_BLOCKS, "the slice must not fit the pool"
    pipe = Pipeline.from_pretrained(path, num_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=MAX_LEN)
    real = []
    for i, ((prompt, _), p) in enumerate(zip(requests, params)):  # one at a time, as sequential_arrivals
        pipe.add_request(prompt, p, request_id=f"dp-{i}", detokenize=False)
        while pipe.has_unfinished_requests():
            pipe.step()
        real.append(pipe.get_output(f"dp-{i}", pop=True).metrics.num_cached_tokens)
    pipe.close()
    sim = {m.request_id: m.num_cached_tokens for m in simulate(sequential_arrivals(requests), **SIM).requests}
    assert sum(real) > 0
    assert real == [sim[f"dp-{i}"] for i in range(len(requests))]


def test_replicas_after_a_reset_route_and_hit_as_the_simulator(workload):
    path, requests, params = workload
    requests, params = requests[:40], params[:40]
    prompts = [p for p, _ in requests]
    with Replicas(path, 2, num_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=MAX_LEN) as reps:
        reps.run(prompts[:10], params[:10], router="round_robin", max_in_flight=4)  # fills both caches
        assert all(r.kv_index.hashes for r in reps.replicas)
        reps.reset_prefix_caches()
        assert not any(r.kv_index.hashes for r in reps.replicas)
        run = reps.run(prompts, params, router="prefix_affinity", max_in_flight=1)
    sim = simulate_cluster(sequential_arrivals(requests), replicas=2, router="prefix_affinity", **SIM)
    assert run.num_failed == 0 and run.routed == sim.routed
    assert [o.num_cached_tokens for o in run.outputs] == [m.num_cached_tokens for m in sim.cluster.requests]

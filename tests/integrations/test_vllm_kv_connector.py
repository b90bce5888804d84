"""servelab's offload connector inside vLLM's real v1 Scheduler (CPU), its worker side played on
fake caches: external hits counted, loads requested into the blocks vLLM allocated, delayed frees
until the worker reports the copy, a failed load recomputed; and the same trace through servelab's
Scheduler with its own ``OffloadConnector`` gets the same external hits (differential).

The fake model writes, for every computed position, the position's token id into the KV caches, so
a loaded block is checked to hold exactly its tokens. Skipped without vLLM; CI runs it in the vLLM
CPU environment (ci/vllm-cpu/setup.sh).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

from servelab.integrations.vllm.harness import build_scheduler, make_request, model_output  # noqa: E402
from servelab.integrations.vllm.kv_connector import ServelabOffloadConnector  # noqa: E402

BLOCK, NUM_BLOCKS = 16, 9  # 8 usable blocks: two 6-block prompts do not both stay cached


def _config(cpu_blocks=64):
    return KVTransferConfig(kv_connector="ServelabOffloadConnector",
                            kv_connector_module_path="servelab.integrations.vllm.kv_connector",
                            kv_role="kv_both", kv_connector_extra_config={"cpu_blocks": cpu_blocks},
                            kv_load_failure_policy="recompute")  # servelab's rule (vLLM's default: fail)


def _prompt(seed: int, n: int = 5 * BLOCK + 3):
    g = torch.Generator().manual_seed(seed)
    return [1000 + seed] + torch.randint(10, 30000, (n - 1,), generator=g).tolist()


class FakeWorker:
    """The worker side (servelab's connector, WORKER role) on a fake cache ``[2, blocks, block, 1]``
    that the fake model fills with token ids; a ``lose`` set of keys vanishes before loads."""

    def __init__(self, sched):
        self.conn = ServelabOffloadConnector(sched.vllm_config, KVConnectorRole.WORKER, None)
        self.cache = torch.full((2, NUM_BLOCKS, BLOCK, 1), -1.0)
        self.conn.register_kv_caches({"layer.0": self.cache})
        self.lose_next_load = False

    def step(self, sched, out):
        if self.lose_next_load and out.kv_connector_metadata.loads:
            for _, pairs in out.kv_connector_metadata.loads:
                self.conn.host.pop(pairs[0][0], None)
            self.lose_next_load = False
        self.conn.bind_connector_metadata(out.kv_connector_metadata)
        self.conn.start_load_kv(None)
        self.conn.wait_for_save()
        res = self.conn.get_transfer_results(set(out.finished_req_ids))
        self.conn.clear_connector_metadata()
        for rid, n in out.num_scheduled_tokens.items():  # the model writes KV for the scheduled positions
            req = sched.requests[rid]  # (vLLM advanced num_computed_tokens when it scheduled them)
            table = sched.kv_cache_manager.get_block_ids(rid)[0]
            for pos in range(req.num_computed_tokens - n, req.num_computed_tokens):
                self.cache[:, table[pos // BLOCK], pos % BLOCK, 0] = float(req.all_token_ids[pos])
        mro = model_output(sched, out)
        mro.kv_connector_output = KVConnectorOutput(finished_sending=res.finished_sending or None,
                                                    finished_recving=res.finished_recving or None,
                                                    failed_recving=res.failed_recving)
        return mro


def _run(sched, worker, requests, max_steps=500):
    """Add ``requests`` one at a time, each run to completion; per request: tokens it computed."""
    computed = {}
    for req in requests:
        sched.add_request(req)
        for _ in range(max_steps):
            if req.request_id not in sched.requests and not sched.has_unfinished_requests():
                break
            out = sched.schedule()
            for rid, n in out.num_scheduled_tokens.items():
                computed[rid] = computed.get(rid, 0) + n
            sched.update_from_output(out, worker.step(sched, out))
        else:
            raise AssertionError("no progress")
    return computed


def _requests(prompts):
    return [make_request(f"r{i}", p, 2, block_size=BLOCK) for i, p in enumerate(prompts)]


def test_external_hits_loads_and_delayed_frees():
    sched = build_scheduler(num_blocks=NUM_BLOCKS, block_size=BLOCK, kv_transfer_config=_config())
    conn = sched.connector
    assert isinstance(conn, ServelabOffloadConnector)
    worker = FakeWorker(sched)
    a, b = _prompt(1), _prompt(2)
    # a, then b (evicts a's blocks from the 11-block pool), then a again: a comes back from the host tier.
    computed = _run(sched, worker, _requests([a, b, a]))
    assert computed["r0"] == len(a) + 1 and computed["r1"] == len(b) + 1  # the prompt, then one decode step
    assert computed["r2"] == computed["r0"] - 5 * BLOCK  # 5 full blocks loaded, the tail computed
    assert conn.num_hit_tokens > 0 and conn.num_offloaded_blocks >= 10  # (the rest: local prefix hits)
    assert len(worker.conn.host) >= 10
    # idle: every delayed free was released once the worker reported the copy
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1


def test_loaded_blocks_hold_their_tokens():
    sched = build_scheduler(num_blocks=NUM_BLOCKS, block_size=BLOCK, kv_transfer_config=_config())
    worker = FakeWorker(sched)
    a, b = _prompt(3), _prompt(4)
    _run(sched, worker, _requests([a, b]))
    req = make_request("again", a, 1, block_size=BLOCK)
    sched.add_request(req)
    out = sched.schedule()  # parks it: WAITING_FOR_REMOTE_KVS, blocks allocated, a load requested
    assert out.num_scheduled_tokens == {} and out.kv_connector_metadata.loads
    _, pairs = out.kv_connector_metadata.loads[0]
    sched.update_from_output(out, worker.step(sched, out))
    start = 5 - len(pairs)  # the external hit ends at a's last full block
    for i, (_, block_id) in enumerate(pairs, start):
        assert worker.cache[0, block_id, :, 0].tolist() == [float(t) for t in a[i * BLOCK:(i + 1) * BLOCK]]


def test_failed_load_recomputes():
    sched = build_scheduler(num_blocks=NUM_BLOCKS, block_size=BLOCK, kv_transfer_config=_config())
    worker = FakeWorker(sched)
    a, b = _prompt(5), _prompt(6)
    _run(sched, worker, _requests([a, b]))
    worker.lose_next_load = True
    computed = _run(sched, worker, [make_request("again", a, 2, block_size=BLOCK)])
    assert computed["again"] > len(a) + 1 - 5 * BLOCK  # the lost load was recomputed, not read
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1


def test_same_external_hits_as_servelab():
    """The trace through servelab's Scheduler + OffloadConnector: the same tokens come from the tier."""
    from servelab.blocks import FullAttentionSpec, KVCacheManager
    from servelab.connectors.offload import OffloadConnector
    from servelab.samplers.params import SamplingParams
    from servelab.scheduling import ModelRunnerOutput, Request, Scheduler, SchedulerConfig

    prompts = [_prompt(s) for s in (7, 8, 7, 9, 8)]
    sched = build_scheduler(num_blocks=NUM_BLOCKS, block_size=BLOCK, kv_transfer_config=_config())
    vllm_computed = _run(sched, FakeWorker(sched), _requests(prompts))

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype="float32")
    kv = KVCacheManager(spec, NUM_BLOCKS, True, max_model_len=4096, watermark=0.0)
    conn = OffloadConnector(cpu_blocks=64, save="all")
    conn.bind_kv_cache_manager(kv)
    conn.register_kv_caches([(torch.zeros(NUM_BLOCKS, BLOCK),)], [[0]])
    mine = Scheduler(SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16, max_model_len=4096), kv,
                     kv_connector=conn)
    computed = {}
    for i, p in enumerate(prompts):
        mine.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=2, ignore_eos=True)))
        for _ in range(500):
            if not mine.has_unfinished_requests():
                break
            out = mine.schedule()
            for rid, n in out.num_scheduled_tokens.items():
                computed[rid] = computed.get(rid, 0) + n
            conn.bind_connector_metadata(out.kv_connector_metadata)
            conn.handle_preemptions(out.kv_connector_metadata)
            conn.start_load_kv()
            conn.wait_for_any(1.0)
            result = conn.get_finished(set(out.finished_req_ids))
            ids = list(out.num_scheduled_tokens)
            reqs = mine.requests
            mine.update_from_output(out, ModelRunnerOutput(
                ids, [[7] if reqs[r].num_computed_tokens >= reqs[r].num_tokens else [] for r in ids],
                kv_connector_output=result))
    conn.shutdown()
    assert computed == vllm_computed
    assert conn.stats()["hit_tokens"] == sched.connector.num_hit_tokens > 0

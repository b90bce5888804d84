"""KV-connector fault stages under the suite's invariants (``fault_driver.Driver``: no fault
escapes, every request ends once, greedy outputs agree with a fresh pipeline, no leak, no
zombie, no poisoned cache): an ``offload`` load fails (the request recomputes), an
``offload`` save fails (only that copy is lost), a ``pd`` lease expires while the consumer
pulls (it recomputes), a ``pd`` consumer never comes (the producer frees at lease
expiry) — each alone and together with an engine fault (a forward raising, a schedule
interrupted) that rolls back the step around parked and loading requests."""

from __future__ import annotations

import pytest
import torch
from fault_driver import DRAIN_STEPS, PROMPTS, Driver
from fault_env import BLOCK_SIZE, MAX_MODEL_LEN, model_for, tokenizer
from fault_helpers import Fault, uninstrument

from servelab import Pipeline, SamplingParams
from servelab.connectors.channels import InProcessChannel
from servelab.connectors.offload import OffloadConnector
from servelab.connectors.pd import PDConnector

ENGINE_FAULTS = [None, ("forward", "error", "after"), ("schedule", "interrupt", "after")]


class TickingClock:
    """Each reading is one second later: leases of under a second run out by the next step."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0
        return self.now


def _traffic(driver: Driver, engine_fault) -> None:
    for rounds in range(2):  # the second round finds the first round's prefixes in the tier
        rids = [driver.add(i, "greedy") for i in (0, 3, 6, 1)] + [driver.add(4, "sampled")]
        if engine_fault is not None and rounds == 1:
            stage, kind, when = engine_fault
            driver.plan.arm(Fault(stage, kind, None, when))
        for _ in range(DRAIN_STEPS):
            if not driver.pipe.has_unfinished_requests():
                break
            driver.step()
            driver.check_consistent()
        assert all(r not in driver.live for r in rids)
    assert engine_fault is None or driver.plan.fired, f"the engine fault {engine_fault} never fired"


def _flaky(real, every: int, exc: BaseException | None = None):
    calls = []

    def wrapper(*args):
        calls.append(args)
        if len(calls) % every == 0:
            if exc is not None:
                raise exc
            return None
        return real(*args)

    return wrapper


@pytest.mark.parametrize("engine_fault", ENGINE_FAULTS)
@pytest.mark.parametrize("stage", ["load_fails", "save_fails"])
def test_offload_stage(stage, engine_fault):
    conn = OffloadConnector(cpu_blocks=64)
    if stage == "load_fails":
        conn._read = _flaky(conn._read, 2)
    else:
        conn._save = _flaky(conn._save, 2, OSError("INJECTED disk full"))
    driver = Driver("torch", pool_slack=0, max_num_seqs=2, budget=10, kv_connector=conn)
    try:
        _traffic(driver, engine_fault)
        stats = conn.stats()
        assert stats["failed_loads" if stage == "load_fails" else "failed_saves"] > 0, stats
        assert stats["loads"] > 0, f"the tier never served a load: {stats}"
        driver.drain_and_check(probe=3)
    finally:
        uninstrument(driver.pipe)
        conn.shutdown()


def _producer_handoffs(channel: InProcessChannel, lease_s: float) -> tuple[Pipeline, dict[int, dict]]:
    """A producer pipeline that prefilled every prompt (its transfers are open on ``channel``)."""
    producer = Pipeline(model_for("torch", "producer"), tokenizer(), block_size=BLOCK_SIZE, num_blocks=64,
                        enable_prefix_caching=True, attention_backend="torch", max_model_len=MAX_MODEL_LEN,
                        kv_connector=PDConnector("producer", channel, lease_s=lease_s))
    with torch.inference_mode():
        outs = producer.generate([list(p) for p in PROMPTS], SamplingParams(temperature=0.0, max_tokens=1))
    return producer, {i: producer.kv_connector.transfer_params(o.request_id) for i, o in enumerate(outs)}


@pytest.mark.parametrize("engine_fault", ENGINE_FAULTS)
def test_pd_lease_expires_during_pull(engine_fault):
    pulls = []

    class ExpiringChannel(InProcessChannel):
        def pull(self, transfer_id, indices, writer):
            pulls.append(transfer_id)
            if len(pulls) % 2:  # every other transfer's lease runs out just as the consumer pulls
                with self._lock:
                    if transfer_id in self._entries:
                        self._entries[transfer_id].expires = self.clock()
            return super().pull(transfer_id, indices, writer)

    clock = [0.0]
    channel = ExpiringChannel(clock=lambda: clock[0])
    producer, handoffs = _producer_handoffs(channel, lease_s=500.0)
    consumer = PDConnector("consumer", channel)
    driver = Driver("torch", pool_slack=0, max_num_seqs=2, budget=10, kv_connector=consumer,
                    extra_args_for=lambda i: {"kv_transfer_params": handoffs[i]})
    try:
        _traffic(driver, engine_fault)
        assert consumer.num_failed_loads > 0 and consumer.num_received > 0
        driver.drain_and_check(probe=3)
        clock[0] += 1000.0
        producer.step()  # every lease has run out: the producer holds nothing
        assert producer.kv_cache_manager.num_free_blocks == producer.num_blocks - 1
    finally:
        uninstrument(driver.pipe)


@pytest.mark.parametrize("engine_fault", ENGINE_FAULTS)
def test_pd_consumer_never_comes(engine_fault):
    channel = InProcessChannel(clock=TickingClock())
    producer = PDConnector("producer", channel, lease_s=0.5)
    driver = Driver("torch", pool_slack=2, max_num_seqs=2, budget=10, kv_connector=producer)
    try:
        _traffic(driver, engine_fault)
        assert producer.num_sent > 0
        driver.drain_and_check(probe=3)  # settles: every lease ran out, nothing leaked
    finally:
        uninstrument(driver.pipe)

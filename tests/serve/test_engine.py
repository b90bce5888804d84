"""AsyncPipeline: outputs equal the serial reference under concurrency (hypothesis), a cancelled or
closed stream aborts its request (blocks freed), the waiting queue refuses when full, shutdown ends
every live request, and the gauges come back to 0 running / 0 waiting / 0% KV."""

import asyncio

import pytest
from hypothesis import given, settings, strategies as st

from servelab import Pipeline, SamplingParams
from servelab.reference.async_engine import SerialAsyncEngine
from servelab.serve import AsyncPipeline, EngineDeadError, EngineFullError


@pytest.fixture(scope="module")
def pipes(tiny_path, one_torch_thread):
    return [Pipeline.from_pretrained(tiny_path, block_size=4, num_blocks=128) for _ in range(2)]


def _idle(pipe):
    return pipe.kv_cache_manager.usage == 0.0 and not pipe._tracked and not pipe.scheduler.has_unfinished_requests()


async def _settle(engine, pipe, timeout=10.0):
    """Wait until the engine thread has ended every request (aborts land on the next loop turn)."""
    for _ in range(int(timeout / 0.01)):
        if _idle(pipe) and engine.metrics.num_running == 0 and engine.metrics.num_waiting == 0:
            return True
        await asyncio.sleep(0.01)
    return False


request_st = st.tuples(st.lists(st.integers(1, 500), min_size=1, max_size=20), st.integers(1, 6),
                       st.integers(1, 3), st.sampled_from([0.0, 1.0]), st.integers(0, 2**32))


@settings(max_examples=8)
@given(requests=st.lists(request_st, min_size=1, max_size=6))
def test_concurrent_outputs_equal_the_serial_reference(pipes, requests):
    async def run(engine):
        params = [SamplingParams(max_tokens=m, n=n, temperature=t, seed=s, ignore_eos=True)
                  for _, m, n, t, s in requests]
        streams = [engine.add_request(list(p), sp) for (p, *_), sp in zip(requests, params)]
        outs = await asyncio.gather(*(s.collect() for s in streams))
        await engine.shutdown()
        return [[c.token_ids for c in out.outputs] for out in outs]

    fast = asyncio.run(run(AsyncPipeline(pipes[0])))
    reference = asyncio.run(run(SerialAsyncEngine(pipes[1])))
    assert fast == reference
    assert _idle(pipes[0]) and _idle(pipes[1])


def test_updates_add_up_to_the_output_with_logprobs(pipes):
    async def run():
        engine = AsyncPipeline(pipes[0])
        stream = engine.add_request("The cache line", SamplingParams(max_tokens=6, n=2, seed=1, logprobs=2))
        updates = [u async for u in stream]
        await engine.shutdown()
        return updates, stream.output

    updates, out = asyncio.run(run())
    assert updates[-1].finished and sum(u.finished for u in updates) == 1
    for c in out.outputs:
        mine = [u for u in updates if u.completion_index == c.index]
        assert [t for u in mine for t in u.new_token_ids] == c.token_ids
        assert "".join(u.new_text for u in mine) == c.text
        assert [e for u in mine for e in u.new_logprobs] == c.logprobs and len(c.logprobs[0]) == 3


@pytest.mark.parametrize("how", ["cancel", "aclose", "break"])
def test_a_stream_given_up_aborts_its_request(pipes, how):
    pipe = pipes[0]

    async def run():
        engine = AsyncPipeline(pipe)
        stream = engine.add_request("The cache", SamplingParams(max_tokens=400, ignore_eos=True, n=2))
        if how == "cancel":
            async def consume():
                async for _ in stream:
                    pass
            task = asyncio.create_task(consume())
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        elif how == "aclose":
            await stream.__anext__()
            await stream.aclose()
        else:
            async with stream:
                async for _ in stream:
                    break
        settled = await _settle(engine, pipe)
        finished = dict(engine.metrics.finished)
        await engine.shutdown()
        return settled, finished

    settled, finished = asyncio.run(run())
    assert settled and finished["abort"] == 1


def test_full_waiting_queue_refuses_and_shutdown_ends_live_requests(pipes):
    async def run():
        engine = AsyncPipeline(pipes[0], max_waiting=2)
        params = SamplingParams(max_tokens=300, ignore_eos=True)
        streams = [engine.add_request("a b", params), engine.add_request("c d", params)]
        with pytest.raises(EngineFullError, match="max_waiting=2"):
            engine.add_request("e f", params)  # nothing has run yet: both still wait
        await streams[0].__anext__()
        await engine.shutdown()
        outs = [await s.collect() for s in streams]
        with pytest.raises(EngineDeadError):
            engine.add_request("g", params)
        return outs

    outs = asyncio.run(run())
    assert [o.finish_reason for o in outs] == ["abort", "abort"]
    assert _idle(pipes[0])


def test_bad_requests_end_with_an_error_not_an_exception(pipes):
    async def run():
        engine = AsyncPipeline(pipes[0])
        out = await engine.add_request([10**6], SamplingParams(max_tokens=2)).collect()
        await engine.shutdown()
        return out

    out = asyncio.run(run())
    assert out.finish_reason == "error" and "vocabulary" in out.error


def test_max_waiting_is_validated(pipes):
    with pytest.raises(ValueError, match="max_waiting=0"):
        AsyncPipeline(pipes[0], max_waiting=0)

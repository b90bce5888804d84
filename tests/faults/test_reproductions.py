"""The reproductions of the fault-isolation issue that concern the pipeline as a whole,
each verbatim as a test (P: a prompt over 32 tokens, G: greedy)."""

from __future__ import annotations

import pytest
from fault_env import fresh_greedy, model_for, tokenizer

from servelab import Pipeline
from servelab.samplers import Sampler, SamplingParams
from servelab.scheduling.interfaces import SchedulingPolicy

P = [1] + [(17 * i) % 480 + 3 for i in range(40)]
Q = P[:33] + [9, 8, 7, 6]  # shares P's first two 16-token blocks
G = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _pipe(**kwargs) -> Pipeline:
    kwargs.setdefault("num_blocks", 64)
    return Pipeline(model_for("torch", "repro"), tokenizer(), attention_backend="torch", max_model_len=128,
                    enable_prefix_caching=True, **kwargs)


def _fresh(prompt) -> list[int]:
    return list(fresh_greedy("torch", tuple(prompt), G.max_tokens)[0])


def _idle(pipe: Pipeline) -> None:
    assert not pipe.has_unfinished_requests()
    assert pipe.kv_cache_manager.num_free_blocks == pipe.num_blocks - 1


@pytest.mark.parametrize("fault", [KeyboardInterrupt, RuntimeError])
def test_failed_forward_does_not_poison_the_prefix_cache(fault):
    """Item 1: Ctrl-C (or an exception) in the forward, then the same prompt."""
    pipe = _pipe()
    f = pipe.model.forward
    pipe.model.forward = lambda *a, **k: (_ for _ in ()).throw(fault("boom"))
    try:
        outs = pipe.generate([P], G)
    except KeyboardInterrupt:
        outs = None
    finally:
        pipe.model.forward = f
    if outs is not None:  # an exception fails the request, with the reason
        assert outs[0].finish_reason == "error" and "boom" in outs[0].error
    _idle(pipe)
    assert pipe.generate([P], G)[0].token_ids == _fresh(P)
    assert pipe.generate([Q], G)[0].token_ids == _fresh(Q)
    _idle(pipe)


class _RaiseFor:
    """A logits processor that raises for requests tagged ``extra_args={"raise": True}``."""

    argmax_invariant = False

    def __init__(self, exc: type[BaseException]) -> None:
        self.exc = exc

    def apply(self, logits, metadata):
        if any((p.extra_args or {}).get("raise") for p in metadata.params):
            raise self.exc("processor says no")
        return logits


def test_a_raising_logits_processor_fails_only_its_request():
    """Item 2: one request's processor raising used to abort the whole batch."""
    pipe = _pipe(sampler=Sampler(logits_processors=[_RaiseFor(ValueError)]))
    bad = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, extra_args={"raise": True})
    outs = pipe.generate([P, Q, P], [G, bad, G])
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert "processor says no" in outs[1].error
    assert outs[0].token_ids == outs[2].token_ids == _fresh(P)
    _idle(pipe)
    assert pipe.generate([Q], G)[0].token_ids == _fresh(Q)


def test_an_interrupted_logits_processor_leaves_a_clean_engine():
    """Item 1 (raising processor): Ctrl-C inside user sampling code."""
    pipe = _pipe(sampler=Sampler(logits_processors=[_RaiseFor(KeyboardInterrupt)]))
    bad = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, extra_args={"raise": True})
    with pytest.raises(KeyboardInterrupt):
        pipe.generate([P, Q], [G, bad])
    _idle(pipe)
    assert pipe.generate([P, Q], G)[0].token_ids == _fresh(P)
    assert pipe.generate([Q], G)[0].token_ids == _fresh(Q)


class _KeyRaises(SchedulingPolicy):
    name = "key-raises"

    def __init__(self, exc: type[Exception], on_call: int) -> None:
        self.exc, self.on_call, self.calls = exc, on_call, 0

    def key(self, request):
        self.calls += 1
        if self.calls == self.on_call:
            raise self.exc("key() failed")
        return request.arrival_time


@pytest.mark.parametrize("exc", [ValueError, RuntimeError])
def test_a_raising_policy_key_leaves_no_zombie_or_orphan(exc):
    """Item 3: key() raising while the third request of a call is queued."""
    pipe = _pipe(policy=_KeyRaises(exc, on_call=3))
    try:
        outs = pipe.generate([P, Q, P, Q], G)
    except exc:
        outs = None
    if outs is not None:  # failing only the request is fine too
        assert sum(o.finish_reason == "error" for o in outs) == 1
    _idle(pipe)
    assert not pipe.scheduler.requests
    assert [o.token_ids for o in pipe.generate([P, Q], G)] == [_fresh(P), _fresh(Q)]
    _idle(pipe)


def test_a_request_id_colliding_with_an_automatic_id_orphans_nothing():
    """Item 3: an explicit id equal to the next automatic one."""
    pipe = _pipe()
    pipe.add_request(P, G, request_id="req-1")
    outs = pipe.generate([Q, Q, Q], G)
    assert [o.token_ids for o in outs] == [_fresh(Q)] * 3
    while pipe.has_unfinished_requests():
        pipe.step()
    assert pipe.get_output("req-1", pop=True).token_ids == _fresh(P)
    _idle(pipe)
    assert not pipe.scheduler.requests and not pipe.runner.requests


def test_preempted_in_the_step_that_scheduled_it_leaves_nothing_indexed():
    """Item 1, second half: a request scheduled and then preempted within one
    ``schedule()`` call must not leave uncomputed blocks findable."""
    pipe = _pipe(num_blocks=8, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    long = [1] + [(13 * i) % 480 + 3 for i in range(15)]
    outs = pipe.generate([long, P[:16], long[:12] + [5, 6, 7, 8]], G)
    assert outs[0].token_ids == _fresh(long)
    _idle(pipe)
    for prompt in (long, P[:16], long[:12] + [5, 6, 7, 8]):
        assert pipe.generate([prompt], G)[0].token_ids == _fresh(prompt)

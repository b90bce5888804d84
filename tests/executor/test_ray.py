"""The "ray" executor runs the multiproc tests' TP=2 check and fault: token-exact, then a killed actor.

Ray actors instead of spawned processes, the same rank code; skipped without Ray (the
``ray`` extra, part of ``dev``).
"""

from __future__ import annotations

import os
import signal

import pytest

from servelab import Pipeline, SamplingParams

ray = pytest.importorskip("ray")

from tests.executor.test_multiproc import GREEDY, PROMPTS, SETTINGS, reference, tiny  # noqa: E402,F401


def test_ray_tp2_is_token_exact_then_a_killed_actor_fails_its_requests(tiny, reference):  # noqa: F811
    from servelab.executor.ray_executor import RayExecutor

    executor = RayExecutor(step_timeout_s=30.0, ray_init_kwargs={"num_cpus": 2})
    with Pipeline.from_pretrained(tiny, tensor_parallel_size=2, distributed_executor_backend=executor,
                                  **SETTINGS) as pipe:
        assert [o.token_ids for o in pipe.generate(PROMPTS, GREEDY)] == reference
        pids = executor.worker_pids()
        os.kill(pids[1], signal.SIGKILL)
        out = pipe.generate(["after the kill"], GREEDY)[0]
        assert out.finish_reason == "error" and "Ray worker" in out.error
        again = pipe.generate(["and after that"], GREEDY)[0]
        assert again.finish_reason == "error" and again.error == out.error  # refused with the same reason
    assert executor.actors == []
    assert not ray.is_initialized()  # the local cluster it started ended with it (no orphan processes)

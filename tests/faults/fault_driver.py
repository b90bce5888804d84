"""``Driver``: a pipeline under fault injection, and the bookkeeping that checks it.

Used by the state machine (random traffic and faults) and by the stage-by-
stage matrix. The driver adds requests with ids it chooses, steps the
pipeline, records every event, and checks the invariants of the suite:

- a fault in user code or the model never escapes ``step()`` (an interrupt
  is re-raised; only the engine's own stages may raise an exception);
- every request ends exactly once (one final event) and its output agrees
  with its events; a failed request says why, and it is one a fired fault
  could fail (``FaultPlan.may_fail``: the request it was aimed at, or one of
  the batch call it fired in): no collateral damage;
- a greedy request's tokens are a prefix of a fresh pipeline's greedy output;
- once faults stop the pipeline drains to idle, then every KV block but the
  null block is free and nothing is left in the scheduler, the KV cache
  manager or the runner; and a greedy request on a prompt the faulty steps
  touched gives exactly the fresh pipeline's output (no poisoned cache).
"""

from __future__ import annotations

import random
from collections import Counter

import torch
from fault_env import BLOCK_SIZE, MAX_MODEL_LEN, fresh_greedy, model_for, tokenizer
from fault_helpers import (
    ENGINE_STAGES,
    INJECTED,
    QUEUEING_STAGES,
    FaultPlan,
    FaultyPolicy,
    FaultyTokenizer,
    InjectedError,
    RaisingProcessor,
    instrument,
    leak_report,
    make_drafter,
    make_verifier,
)

from servelab import Pipeline
from servelab.samplers import Sampler, SamplingParams

MAX_TOKENS = 8
DRAIN_STEPS = 300

_rng = random.Random(7)
# Three 2-block prefixes shared by the prompts, so the prefix cache is hit
# (a prompt of exactly one prefix is a full-block hit).
_PREFIXES = [[1] + [_rng.randrange(3, 500) for _ in range(2 * BLOCK_SIZE - 1)] for _ in range(3)]
PROMPTS = [tuple(_PREFIXES[i % 3] + [_rng.randrange(3, 500) for _ in range(n)])
           for i, n in enumerate([0, 1, 3, 4, 5, 6, 9, 2])]
LONGEST_PROMPT = max(len(p) for p in PROMPTS)


def reference(backend: str, prompt: tuple[int, ...]) -> tuple[tuple[int, ...], str]:
    """A fresh pipeline's greedy output of ``MAX_TOKENS`` tokens: (ids, text)."""
    return fresh_greedy(backend, prompt, MAX_TOKENS)


def stop_string_for(backend: str, prompt: tuple[int, ...]) -> str:
    """Two letters from the middle of the greedy text: a stop string the request meets."""
    text = reference(backend, prompt)[1]
    pieces = [text[i:i + 2] for i in range(1, max(len(text) - 1, 1)) if text[i:i + 2].isalpha()]
    return pieces[len(pieces) // 2] if pieces else "\x00never"


class Driver:
    """A pipeline with every fault seam installed, and its bookkeeping."""

    def __init__(self, backend: str = "torch", *, pool_slack: int = 2, max_num_seqs: int = 3, budget: int = 12,
                 spec: int = 0, kv_connector=None, extra_args_for=None) -> None:
        self.backend, self.spec = backend, spec
        self.extra_args_for = extra_args_for  # prompt index -> more SamplingParams.extra_args (connector tests)
        self.plan = FaultPlan()
        longest = LONGEST_PROMPT + MAX_TOKENS + spec
        need = -(-longest // BLOCK_SIZE) + 1  # the longest request alone, plus the null block
        kwargs = dict(block_size=BLOCK_SIZE, num_blocks=need + pool_slack, enable_prefix_caching=True,
                      attention_backend=backend, max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max(budget, spec + 1), policy=FaultyPolicy(self.plan),
                      kv_connector=kv_connector)
        if spec:
            kwargs.update(drafter=make_drafter(self.plan), num_speculative_tokens=spec,
                          verifier=make_verifier(self.plan))
        self.pipe = Pipeline(model_for(backend), FaultyTokenizer(tokenizer(), self.plan),
                             sampler=Sampler(logits_processors=[RaisingProcessor(self.plan)]), **kwargs)
        instrument(self.pipe, self.plan)
        self.counter = 0
        self.live: dict[str, dict] = {}  # request id -> what was asked
        self.ended: Counter = Counter()
        self.tokens: dict[str, list[int]] = {}
        self.used_prompts: set[int] = set()

    # ---- traffic -----------------------------------------------------------------

    def params(self, rid: str, prompt: tuple[int, ...], kind: str, max_tokens: int) -> SamplingParams:
        extra = {"rid": rid}  # lets the logits processor tell rows apart
        if self.extra_args_for is not None:
            extra.update(self.extra_args_for(PROMPTS.index(prompt)))
        if kind == "sampled":
            return SamplingParams(temperature=0.9, max_tokens=max_tokens, seed=self.counter, extra_args=extra)
        stop = [stop_string_for(self.backend, prompt)] if kind == "stop" else ()
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop=stop, extra_args=extra)

    def add(self, prompt_index: int, kind: str = "greedy", max_tokens: int = MAX_TOKENS) -> str | None:
        """Add a request; None when ``add_request`` raised (then it must leave no trace)."""
        self.counter += 1
        rid = f"r{self.counter}"
        prompt = PROMPTS[prompt_index]
        try:
            self.pipe.add_request(list(prompt), self.params(rid, prompt, kind, max_tokens), request_id=rid)
        except (KeyboardInterrupt, InjectedError) as exc:
            assert INJECTED in str(exc), exc
            try:
                self.pipe.get_output(rid)
            except KeyError:
                pass
            else:
                raise AssertionError(f"{rid}: add_request raised {exc!r} but the pipeline still tracks it")
            assert rid not in self.pipe.scheduler.requests, f"{rid} half-added after {exc!r}"
            return None
        self.used_prompts.add(prompt_index)
        self.live[rid] = dict(prompt=prompt, kind=kind, max_tokens=max_tokens)
        self.tokens[rid] = []
        return rid

    def abort(self, rid: str) -> None:
        try:
            self.pipe.abort_request(rid)
        except (KeyboardInterrupt, InjectedError) as exc:
            assert INJECTED in str(exc), exc

    def step(self) -> None:
        """One ``pipe.step()``; an escaping fault must be allowed to escape."""
        try:
            events = self.pipe.step()
        except KeyboardInterrupt as exc:
            assert INJECTED in str(exc), exc  # only ours: the pipeline re-raises after rolling back
            return
        except InjectedError as exc:
            stage = self.plan.fired[-1].stage
            assert stage in ENGINE_STAGES, f"a fault in user code or the model escaped step(): {exc!r}"
            return
        self.record(events)

    def record(self, events) -> None:
        for event in events:
            rid = event.request_id
            assert rid in self.tokens, f"orphan: an event for {rid}, which this driver never added"
            assert not self.ended[rid], f"{rid} got an event after its final one: {event}"
            self.tokens[rid] += list(event.new_token_ids)
            if event.finished:
                self.ended[rid] += 1
                self._check_finished(rid, event)

    def _check_finished(self, rid: str, event) -> None:
        asked = self.live.pop(rid)
        out = self.pipe.get_output(rid, pop=True)
        assert list(out.token_ids) == self.tokens[rid], (rid, out.token_ids, self.tokens[rid])
        assert out.finish_reason == event.finish_reason, (rid, out.finish_reason, event.finish_reason)
        if out.finish_reason == "error":
            assert out.error, f"{rid} failed without a message"
            self.check_not_collateral(rid, out.error)
        if asked["kind"] != "sampled":
            want = reference(self.backend, asked["prompt"])[0][: asked["max_tokens"]]
            assert tuple(out.token_ids) == want[: len(out.token_ids)], \
                f"{rid} ({out.finish_reason}, {out.error}): {out.token_ids} is not a prefix of {want}"
            if out.finish_reason == "length":
                assert len(out.token_ids) == asked["max_tokens"]

    def check_not_collateral(self, rid: str, error: str) -> None:
        """A failed request must be in the scope of a fired fault (not a bystander)."""
        fired = [(f.stage, f.kind, f.target, sorted(f.scope)) for f in self.plan.fired]
        assert self.plan.may_fail(rid), f"{rid} failed ({error}) but no fired fault could fail it: {fired}"

    def check_consistent(self) -> None:
        """Cheap checks valid at any time."""
        for rid, n in self.ended.items():
            assert n == 1, f"{rid} ended {n} times"
            assert rid not in self.pipe.scheduler.requests, f"{rid} ended but the scheduler still has it"

    # ---- whole calls and the final checks -------------------------------------------

    def generate(self, prompt_indices, max_tokens: int = MAX_TOKENS) -> None:
        """A ``generate`` call (faults may be armed): when it returns or raises,
        everything it started has ended and released its blocks."""
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = None
        try:
            outs = self.pipe.generate([list(PROMPTS[i]) for i in prompt_indices], params)
        except (KeyboardInterrupt, InjectedError) as exc:
            assert INJECTED in str(exc), exc
            allowed = ENGINE_STAGES | QUEUEING_STAGES
            stage = str(exc).split(" at ", 1)[1].split(" ", 1)[0]  # "INJECTED error at STAGE (target ..)"
            assert isinstance(exc, KeyboardInterrupt) or stage in allowed, \
                f"a fault in user code or the model escaped generate(): {exc!r}"
        self.used_prompts.update(prompt_indices)
        if not self.live:
            self.settle_transfers()
            assert leak_report(self.pipe) == [], leak_report(self.pipe)
        if outs is not None:
            assert len(outs) == len(prompt_indices)
            for i, out in zip(prompt_indices, outs):
                assert out.finish_reason is not None
                if out.finish_reason == "error":
                    self.check_not_collateral(out.request_id, out.error)
                want = reference(self.backend, PROMPTS[i])[0][:max_tokens]
                assert tuple(out.token_ids) == want[: len(out.token_ids)], (out.finish_reason, out.error)
                if out.finish_reason == "length":
                    assert len(out.token_ids) == max_tokens

    def settle_transfers(self) -> None:
        """Step until a KV connector holds no blocks (leases run out, loads land)."""
        for _ in range(DRAIN_STEPS):
            if not self.pipe.scheduler.has_pending_kv_transfers():
                return
            self.step()
        raise AssertionError("KV transfers never settled: blocks held forever")

    def drain_and_check(self, probe: int = 0) -> None:
        self.plan.disarm()
        for _ in range(DRAIN_STEPS):
            if not self.pipe.has_unfinished_requests():
                break
            self.step()
        self.settle_transfers()
        assert not self.live, f"requests never ended (zombies): {sorted(self.live)[:5]}"
        assert leak_report(self.pipe) == [], leak_report(self.pipe)
        self.check_consistent()
        # The poisoned-cache check: greedy, alone, on a prompt the faulty steps touched.
        used = sorted(self.used_prompts) or [0]
        prompt = PROMPTS[probe if probe in used else used[probe % len(used)]]
        with torch.inference_mode():
            out = self.pipe.generate([list(prompt)], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                                    ignore_eos=True))
        fired = [(f.stage, f.kind, f.when) for f in self.plan.fired]
        assert tuple(out[0].token_ids) == reference(self.backend, prompt)[0], \
            f"after faults {fired} the greedy output differs from a fresh pipeline's (poisoned cache)"
        self.settle_transfers()
        assert leak_report(self.pipe) == [], leak_report(self.pipe)

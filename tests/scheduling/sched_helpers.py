"""Small builders shared by the scheduling tests: a scheduler over a tiny KV
cache, a fake model, and a model-runner mirror that rebuilds block tables from
``SchedulerOutput`` alone."""

from __future__ import annotations

from collections.abc import Callable

from servelab.blocks import FullAttentionSpec, KVCacheManager
from servelab.samplers.params import SamplingParams
from servelab.scheduling import ModelRunnerOutput, Request, Scheduler, SchedulerConfig, SchedulerOutput

TOKEN = 7
EOS = 2


class StepClock:
    """A clock the tests move by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(*, num_blocks: int = 64, block_size: int = 4, enable_caching: bool = True, policy="fcfs",
                   watermark: float = 0.0, **config) -> Scheduler:
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("max_num_seqs", 8)
    config.setdefault("max_model_len", 256)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype="float32")
    kv = KVCacheManager(spec, num_blocks, enable_caching, watermark=watermark)
    return Scheduler(SchedulerConfig(**config), kv, policy, clock=StepClock())


def req(request_id: str, prompt: int | list[int], max_tokens: int | None = 4, *, start: int = 100,
        **kwargs) -> Request:
    """A request with ``prompt`` tokens (a count gives start, start+1, ...)."""
    tokens = list(range(start, start + prompt)) if isinstance(prompt, int) else prompt
    params = kwargs.pop("params", None) or SamplingParams(max_tokens=max_tokens)
    kwargs.setdefault("eos_token_id", EOS)
    return Request(request_id, tokens, params, **kwargs)


def fake_output(sched: Scheduler, out: SchedulerOutput,
                token: Callable[[Request], list[int]] | None = None) -> ModelRunnerOutput:
    """One token (``TOKEN`` or ``token(request)``) for each request whose
    computation reached the end of its tokens, nothing for partial prefills."""
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = sched.requests.get(rid)  # None: aborted since schedule(); its output is ignored
        if r is None:
            sampled.append([TOKEN])
        elif r.num_computed_tokens >= r.num_tokens:
            sampled.append(token(r) if token else [TOKEN])
        else:
            sampled.append([])
    return ModelRunnerOutput(ids, sampled)


def step(sched: Scheduler, token=None):
    out = sched.schedule()
    results = sched.update_from_output(out, fake_output(sched, out, token))
    sched.clock.now += 1.0
    return out, results


def run_to_end(sched: Scheduler, max_steps: int = 10_000, token=None) -> dict[str, object]:
    """Step until nothing is unfinished; returns the final output of every request."""
    final = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        _, results = step(sched, token)
        for o in results:
            if o.finished:
                assert o.request_id not in final, f"{o.request_id} finished twice"
                final[o.request_id] = o
    else:
        raise AssertionError(f"not done after {max_steps} steps")
    # Failures/aborts noted after the last step come out of one more update.
    for o in sched.update_from_output(sched.schedule(), ModelRunnerOutput([], [])):
        final[o.request_id] = o
    return final


class RunnerMirror:
    """What a model runner keeps: one block-table row per KV-cache group per
    request (a tuple of lists, as ``get_block_ids`` answers), built only from
    scheduler outputs (never asking the scheduler)."""

    def __init__(self) -> None:
        self.rows: dict[str, tuple[list[int], ...]] = {}
        self.computed: dict[str, int] = {}

    @staticmethod
    def _per_group(ids: object, what: str) -> tuple[list[int], ...]:
        assert type(ids) is tuple and all(type(g) is list for g in ids), f"{what}: {ids!r} is not one list per group"
        return tuple(list(g) for g in ids)

    def apply(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.rows.pop(rid, None)
        for data in out.scheduled_new_reqs:
            assert data.req_id not in self.rows, f"{data.req_id} is new twice"
            self.rows[data.req_id] = self._per_group(data.block_ids, "block_ids")
            self.computed[data.req_id] = data.num_computed_tokens
        c = out.scheduled_cached_reqs
        for rid, resumed, new_ids, computed in zip(c.req_ids, c.resumed, c.new_block_ids, c.num_computed_tokens):
            new_ids = self._per_group(new_ids, "new_block_ids")
            if resumed:
                assert rid not in self.rows, f"resumed {rid} was not dropped at preemption"
                self.rows[rid] = new_ids
            elif new_ids:  # (): nothing new in any group
                assert len(new_ids) == len(self.rows[rid]), f"{rid}: new ids for {len(new_ids)} groups"
                for row, ids in zip(self.rows[rid], new_ids):
                    row.extend(ids)
            self.computed[rid] = computed

"""Fit the simulator's step cost to a real ``Pipeline``: run a calibration workload, time every step.

:func:`calibrate` serves a grid of offline batches (batch sizes x prompt
lengths, all arriving at once, then the same requests arriving one per step so
prefill chunks and decodes share steps; output lengths vary +-50% so batches
shrink as requests end, as they do online) through the pipeline, records each
step's :func:`.features.step_features` and :func:`.features.extra_features`
and its time (``pipe.step()`` from call to return: schedule, forward,
sampling, update, delivery), and fits every term of
:class:`.cost_model.StepCostModel` by non-negative least squares on relative errors
(TPOT is set by the many short decode steps, not by the few long prefills),
refitted without the steps a shared machine interrupted (``outlier_mads``).

The pipeline is left as found: no request is left in it, its scheduler's
``schedule`` is observed only for the duration of the call.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from servelab.samplers.params import SamplingParams
from servelab.scheduling.simulator.cost_model import StepCostModel
from servelab.scheduling.simulator.features import DecodeContinuity, extra_features, step_features


def measure_steps(pipe: Any, prompts: Sequence[Sequence[int]], max_tokens: int | Sequence[int], *,
                  one_per_step: bool = False,
                  clock: Callable[[], float] = time.perf_counter) -> list[tuple]:
    """Serve ``prompts`` (greedy, ``max_tokens`` each, or one count per prompt; EOS ignored) through
    ``pipe``; return one ``(*FEATURES, *EXTRA_FEATURES, seconds)`` row per step that scheduled
    tokens. ``one_per_step`` adds the requests one before each step instead of all at once.
    ``clock`` times the steps: wall time by default; ``time.thread_time`` (CPU time of a 1-thread
    pipeline) on a machine shared with others."""
    if pipe.has_unfinished_requests():
        raise ValueError("pipe has unfinished requests; calibrate an idle pipeline")
    sched = pipe.scheduler
    seen: list[Any] = []
    original = sched.schedule

    def observed():
        out = original()
        seen.append(out)
        return out

    sched.schedule = observed  # an instance attribute, removed below: the class method is untouched
    rows = []
    counts = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if len(counts) != len(prompts) or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
        raise ValueError(f"max_tokens={max_tokens!r}; valid: an int >= 1 or one per prompt ({len(prompts)})")
    continuity = DecodeContinuity()
    try:
        queue = [(list(p), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
                 for p, n in zip(prompts, counts)]
        if not one_per_step:
            for p, params in queue:
                pipe.add_request(p, params, detokenize=False)
            queue = []
        while queue or pipe.has_unfinished_requests():
            if queue:
                p, params = queue.pop(0)
                pipe.add_request(p, params, detokenize=False)
            before = len(seen)
            start = clock()
            pipe.step()
            elapsed = clock() - start
            if len(seen) > before and seen[-1].total_num_scheduled_tokens:
                rows.append((*step_features(seen[-1]), *extra_features(seen[-1], continuity), elapsed))
    finally:
        del sched.schedule
    return rows


def calibrate(pipe: Any, *, batch_sizes: Sequence[int] | None = None, prompt_lens: Sequence[int] = (16, 48, 160),
              max_tokens: int = 16, repeats: int = 1, seed: int = 0, return_steps: bool = False,
              clock: Callable[[], float] = time.perf_counter, outlier_mads: float | None = 5.0):
    """A :class:`StepCostModel` fitted to ``pipe``'s measured steps (see the module docstring).

    Args:
        pipe: a ``servelab.Pipeline`` with no unfinished request.
        batch_sizes, prompt_lens: the grid (prompt lengths vary +-25% around each, clipped to
            the pipeline's ``max_model_len``). Default batch sizes: powers of two up to the
            scheduler's ``max_num_seqs`` (a fit is only trusted inside the range it saw).
        max_tokens: output tokens per request, on average (each draws from +-50%, at least 1).
        repeats: how many times the grid runs (after one warm-up batch that is not recorded).
        seed: the prompts' token ids.
        return_steps: also return the measured rows ``(*FEATURES, seconds)``.
        clock: times the steps (see :func:`measure_steps`).
        outlier_mads: see :meth:`StepCostModel.fit` (None: keep every step).
    """
    if batch_sizes is None:
        cap = int(pipe.scheduler.config.max_num_seqs)
        batch_sizes = sorted({min(2 ** k, cap) for k in range(cap.bit_length() + 1)})
    for name, values in (("batch_sizes", batch_sizes), ("prompt_lens", prompt_lens)):
        if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"{name}={values!r}; valid: a non-empty sequence of ints >= 1")
    for name, value in (("max_tokens", max_tokens), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}; valid: an int >= 1")
    rng = random.Random(seed)
    vocab = int(getattr(pipe, "vocab_size", 1000))
    limit = max(int(getattr(pipe, "max_model_len", 4096)) - max_tokens - 1, 1)

    def prompts(n: int, length: int) -> list[list[int]]:
        lens = [min(max(1, round(length * rng.uniform(0.75, 1.25))), limit) for _ in range(n)]
        return [[rng.randrange(3, max(vocab, 4)) for _ in range(k)] for k in lens]

    def outputs(n: int) -> list[int]:
        return [max(1, round(max_tokens * rng.uniform(0.5, 1.5))) for _ in range(n)]

    measure_steps(pipe, prompts(2, prompt_lens[0]), max_tokens, clock=clock)  # warm-up: first-call costs stay out of the fit
    rows: list[tuple] = []
    for _ in range(repeats):
        for b in batch_sizes:
            for length in prompt_lens:
                rows += measure_steps(pipe, prompts(b, length), outputs(b), clock=clock)
                if b > 1:
                    rows += measure_steps(pipe, prompts(b, length), outputs(b), one_per_step=True, clock=clock)
    model = StepCostModel.fit(rows, outlier_mads=outlier_mads, relative=True)
    return (model, rows) if return_steps else model

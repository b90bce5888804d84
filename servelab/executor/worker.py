"""What one worker rank builds and runs: its model part, KV pages and model runner.

A :class:`WorkerSpec` is everything a rank needs, sent once when the worker starts
(pickled; the model's weights as a :class:`ModelSource` whose tensors travel through
shared memory, not copies). :func:`build_worker_runner` makes the rank's runner the way
the pipeline makes its own: :func:`~servelab.pipeline.setup.prepare_model` with the rank's
:class:`~servelab.executor.parallel_state.ParallelState` (sharding, quantization, LoRA),
then the stage's layers (:func:`~servelab.executor.sharding.split_stages`),
the attention backend, this rank's KV pages (``num_blocks`` pages of its own heads and
layers: the driver's block ids index every rank's pool alike), the drafter and a
:class:`~servelab.pipeline.runner.ModelRunner`.

:func:`serve` is the rank's loop over driver messages, shared by the process and Ray
executors: ``(seq, kind, payload)`` in, ``(seq, status, payload)`` out, where only the
last rank returns the runner's output.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from servelab.executor.parallel_state import ParallelState

__all__ = ["ModelSource", "WorkerSpec", "build_worker_runner", "handle_message"]


@dataclass
class ModelSource:
    """A model rebuilt in a worker: its class, config, dtype and state dict (shared tensors)."""

    model_class: type
    config: Any
    dtype: torch.dtype
    state_dict: dict[str, torch.Tensor]
    pack_weights: bool = True

    @classmethod
    def of(cls, model: Any) -> ModelSource:
        state = {k: v.detach() for k, v in model.state_dict().items()}
        # a mapping proxy does not pickle; the workers never read the sampling defaults
        config = dataclasses.replace(model.config, generation_defaults={})
        return cls(type(model), config, model.dtype, state, bool(getattr(model, "pack_weights", True)))

    def build(self, device: torch.device | str = "cpu") -> Any:
        from servelab.models.linear import set_weight_packing

        model = self.model_class(self.config, None, dtype=self.dtype, device="meta").to_empty(device=device)
        model.load_state_dict(self.state_dict, strict=True)
        set_weight_packing(model, self.pack_weights)
        return model.eval().requires_grad_(False)


@dataclass
class WorkerSpec:
    """One replica's worker settings (the driver's resolved values)."""

    source: ModelSource
    config: Any  # the PipelineConfig
    max_model_len: int
    block_size: int
    num_blocks: int
    max_num_seqs: int
    eos_token_id: int | None
    extra_eos: tuple[int, ...] = ()
    sampler: Any = None
    kv_cache_dtype: Any = None
    sliding_window: int | None = None
    threads_per_worker: int = 1
    collective_timeout_s: float = 30.0
    device: str = "cpu"
    extra: dict[str, Any] = field(default_factory=dict)


def build_worker_runner(spec: WorkerSpec, state: ParallelState) -> Any:
    """The rank's :class:`~servelab.pipeline.runner.ModelRunner` (see the module docstring)."""
    from servelab.executor.sharding import split_stages
    from servelab.models import allocate_kv_caches
    from servelab.pipeline.runner import ModelRunner
    from servelab.pipeline.setup import attach_attention, build_drafter, check_attention, prepare_model
    from servelab.samplers import Sampler
    from servelab.samplers.structured import StructuredOutputManager
    from servelab.samplers.verifiers import get_verifier

    config = spec.config
    model = prepare_model(spec.source.build(spec.device), config, parallel_state=state, rank=state.rank)
    model = split_stages(model, state)  # after sharding: the last stage keeps the sharded head
    model.check_inputs = False
    attach_attention(model, config.attention_backend, spec.block_size)
    kv_caches = allocate_kv_caches(model, spec.num_blocks, spec.block_size, dtype=spec.kv_cache_dtype)
    check_attention(model, kv_caches.views[0][0])
    vocab = model.config.vocab_size
    drafter = build_drafter(config, model, block_size=spec.block_size, num_blocks=spec.num_blocks,
                            max_num_seqs=spec.max_num_seqs, vocab_size=vocab)
    eos = () if spec.eos_token_id is None else (spec.eos_token_id, *spec.extra_eos)
    structured = StructuredOutputManager(None, vocab, eos, backend=config.grammar_backend)
    runner = ModelRunner(model, kv_caches, spec.block_size, max_model_len=spec.max_model_len,
                         sampler=spec.sampler if spec.sampler is not None else Sampler(), drafter=drafter,
                         verifier=get_verifier(config.speculative.verifier),
                         num_speculative_tokens=config.speculative.num_speculative_tokens,
                         max_num_reqs=spec.max_num_seqs, eos_token_id=spec.eos_token_id, structured=structured)
    runner.sliding_window = spec.sliding_window
    runner.kv_cache_bytes = int(  # type: ignore[attr-defined]  # read by the worker loop
        kv_caches.buffer.numel() * kv_caches.buffer.element_size())
    return runner


class WorkerClock:
    """Seconds this rank spent in ``execute`` (``compute_s`` is that minus communication)."""

    def __init__(self) -> None:
        self.execute_s = 0.0
        self.steps = 0


def handle_message(runner: Any, state: ParallelState, clock: WorkerClock, kind: str, payload: Any) -> Any:
    """Apply one driver message to the rank's runner; returns what the rank answers.

    Kinds: ``"execute"`` ``(removed ids, SchedulerOutput)`` -> ``(ModelRunnerOutput,
    last_verification, finished prompt logprobs)`` on the last rank, None elsewhere;
    ``"rollback"`` ``(removed ids, SchedulerOutput)``; ``"stats"`` -> the rank's clock.
    """
    if kind in ("execute", "rollback"):
        removed, so = payload
        for rid in removed:
            runner.remove_request(rid)
        if kind == "rollback":
            runner.rollback(so)
            return None
        start = time.perf_counter()
        out = runner.execute(so)
        clock.execute_s += time.perf_counter() - start
        clock.steps += 1
        if not state.is_last_rank:
            return None
        finished = dict(runner.prompt_logprobs.finished)
        runner.prompt_logprobs.finished.clear()
        return out, list(runner.last_verification), finished
    if kind == "stats":
        comm = state.comm_seconds()
        return {"rank": state.rank, "comm_s": comm, "compute_s": clock.execute_s - comm, "steps": clock.steps}
    raise ValueError(f"unknown worker message kind {kind!r}")


def error_text(exc: BaseException) -> str:
    """``"Type: message"`` plus the innermost frames (what the driver's error shows)."""
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return f"{type(exc).__name__}: {exc}\n{''.join(frames[-3:])}"

"""A servelab logits processor as a vLLM v1 custom logits processor.

vLLM v1 logits processors are classes (``vllm.v1.sample.logits_processor
.LogitsProcessor``): built once per engine with ``(vllm_config, device,
is_pin_memory)``, told about the persistent batch through
``update_state(BatchUpdate)`` (requests added at an index with their
``SamplingParams``, prompt and a live reference to their output list; removed;
moved or swapped), and called once per step as ``apply(logits)`` on the
float32 ``[num_reqs, vocab]`` logits of the batch rows in index order.
``is_argmax_invariant()`` tells vLLM whether greedy requests may skip it.

A servelab processor (:class:`servelab.samplers.processors.LogitsProcessor`)
is stateless per batch instead: ``apply(logits, metadata)`` reads each row's
settings from ``metadata.params[row]`` (custom settings in
``SamplingParams.extra_args``) and its history from
``metadata.output_token_id_lists[row]``. :func:`make_logits_processor_cls`
bridges the two: the class keeps the batch (index -> params, prompt, outputs)
from the updates, builds servelab's ``SamplingMetadata`` for the rows each
step and calls the servelab processor.

- **Argmax invariance** is the processor's ``argmax_invariant`` flag,
  returned by ``is_argmax_invariant()``. vLLM then runs it where servelab's
  sampler does: before the greedy argmax when False (with min_tokens and
  logit_bias), after temperature when True (with min-p; greedy rows never
  see it).
- **Parameters.** vLLM's ``SamplingParams`` are converted to servelab's for
  the fields a processor may read: temperature, top_k, top_p, min_p, seed,
  max_tokens, min_tokens, stop_token_ids, ignore_eos and ``extra_args``
  (vLLM applies penalties, bias and masks itself). A vLLM setting servelab
  refuses (e.g. ``top_k=0``, which vLLM treats as off) falls back to the
  servelab default for that field.
- ``is_active(metadata)``, when the processor has it, skips a step.
- ``validate_params``: a processor may define
  ``validate_params(params: servelab SamplingParams)``; vLLM calls it on each
  request at admission (so a bad ``extra_args`` fails that request with a 400,
  not the engine).

The processor itself: pass an object (used as is; it must be picklable when
vLLM's engine runs in another process) or a class / zero-argument factory
(called once per vLLM instance).
"""

from __future__ import annotations

import copyreg
from collections.abc import Callable
from typing import Any

from servelab.integrations.vllm._compat import require_vllm

require_vllm()

import torch  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality  # noqa: E402

from servelab.samplers.metadata import SamplingMetadata  # noqa: E402
from servelab.samplers.params import SamplingParams as ServelabParams  # noqa: E402
from servelab.samplers.processors import check_processor, is_active  # noqa: E402

__all__ = ["make_logits_processor_cls", "to_servelab_params"]

_COPIED = ("temperature", "top_k", "top_p", "min_p", "seed", "max_tokens", "min_tokens", "ignore_eos")


def to_servelab_params(params) -> ServelabParams:
    """servelab ``SamplingParams`` for a vLLM ``SamplingParams`` (the fields a processor reads)."""
    fields: dict[str, Any] = {"extra_args": dict(params.extra_args) if params.extra_args else None}
    for name in _COPIED:
        fields[name] = getattr(params, name)
    fields["stop_token_ids"] = tuple(params.stop_token_ids or ())
    if fields["top_k"] is not None and fields["top_k"] <= 0:
        fields["top_k"] = -1  # vLLM: 0 or -1 means off
    try:
        return ServelabParams(**fields)
    except (TypeError, ValueError):
        for name in list(fields):  # keep what servelab accepts, field by field
            if name == "extra_args":
                continue
            try:
                ServelabParams(**{name: fields[name]})
            except (TypeError, ValueError):
                del fields[name]
        return ServelabParams(**fields)


def make_logits_processor_cls(processor: Any, *, name: str | None = None) -> type:
    """A vLLM v1 ``LogitsProcessor`` class running servelab ``processor``.

    Args:
        processor: an object with ``argmax_invariant: bool`` and
            ``apply(logits, metadata) -> logits`` (servelab's protocol), or a
            class / zero-argument callable returning one.
        name: the class name (default ``Servelab<ProcessorClass>``).

    Returns:
        A class for ``LLM(..., logits_processors=[cls])``.
    """
    if isinstance(processor, type) or (callable(processor) and not hasattr(processor, "apply")):
        factory: Callable[[], Any] = processor
        check_processor(factory())  # fail now, not at engine start
    else:
        check_processor(processor)
        factory = lambda: processor  # noqa: E731
    probe = factory()
    label = name or f"Servelab{type(probe).__name__}"
    body = {"__doc__": f"vLLM v1 logits processor running servelab's {type(probe).__name__}.",
            "_servelab_factory": staticmethod(factory), "__module__": __name__}
    validate = getattr(probe, "validate_params", None)
    if callable(validate):
        body["validate_params"] = classmethod(lambda cls, params: validate(to_servelab_params(params)))
    cls = _ProcessorMeta(label, (_ServelabLogitsProcessor,), body)
    cls._servelab_spec = (processor, name)
    return cls


class _ProcessorMeta(type(LogitsProcessor)):
    """Metaclass of bridged processor classes: they pickle by value (processor + name)."""


def _rebuild(processor: Any, name: str | None) -> type:
    return make_logits_processor_cls(processor, name=name)


copyreg.pickle(_ProcessorMeta, lambda cls: (_rebuild, cls._servelab_spec))


class _ServelabLogitsProcessor(LogitsProcessor):
    """Batch bookkeeping for one servelab processor (see the module docstring)."""

    _servelab_factory: Callable[[], Any]

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.processor = self._servelab_factory()
        check_processor(self.processor)
        self.device = device
        eos = None
        model_config = getattr(vllm_config, "model_config", None)
        if model_config is not None:
            eos = getattr(getattr(model_config, "hf_config", None), "eos_token_id", None)
        self.eos_token_id = eos if isinstance(eos, int) else None
        # index -> (servelab params, prompt ids, live output ids)
        self.rows: dict[int, tuple[ServelabParams, list[int], list[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return bool(self.processor.argmax_invariant)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        rows = self.rows
        for index in batch_update.removed:
            rows.pop(index, None)
        for index, params, prompt, outputs in batch_update.added:
            rows[index] = (to_servelab_params(params), list(prompt or ()), outputs)
        for a, b, direction in batch_update.moved:
            entry_a, entry_b = rows.pop(a, None), rows.pop(b, None)
            if entry_a is not None:
                rows[b] = entry_a
            if direction == MoveDirectionality.SWAP and entry_b is not None:
                rows[a] = entry_b

    def metadata(self, num_rows: int, vocab_size: int) -> SamplingMetadata:
        """servelab's metadata for batch rows ``0..num_rows-1`` (rows vLLM never described get defaults)."""
        default = (ServelabParams(), [], [])
        entries = [self.rows.get(i, default) for i in range(num_rows)]
        return SamplingMetadata.from_requests([e[0] for e in entries], [e[1] for e in entries],
                                              [list(e[2]) for e in entries], vocab_size, self.device,
                                              eos_token_id=self.eos_token_id if self.eos_token_id is not None
                                              and self.eos_token_id < vocab_size else None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows or logits.shape[0] == 0:
            return logits
        meta = self.metadata(logits.shape[0], logits.shape[1])
        if not is_active(self.processor, meta):
            return logits
        out = self.processor.apply(logits, meta)
        if out.shape != logits.shape:
            raise ValueError(f"logits processor {self.processor!r} returned shape {tuple(out.shape)}, "
                             f"expected {tuple(logits.shape)}")
        return out

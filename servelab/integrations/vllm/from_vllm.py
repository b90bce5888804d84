"""The other way: a vLLM v1 custom logits processor inside servelab's ``Sampler``.

:func:`from_vllm_logits_processor` wraps a vLLM ``LogitsProcessor`` (a class,
built once with ``(vllm_config, device, is_pin_memory)``, or a built object)
as a servelab :class:`~servelab.samplers.processors.LogitsProcessor`, so a
processor written for vLLM can be measured on servelab's pipeline unchanged:

    sampler = Sampler(logits_processors=[from_vllm_logits_processor(MyVllmProc)])

How the two batch models meet. vLLM tells a processor about a *persistent*
batch through ``update_state(BatchUpdate)`` and then calls ``apply(logits)``.
servelab calls ``apply(logits, metadata)`` on whatever rows are being
sampled, which are not a persistent batch (a request verifying ``d`` drafts
owns ``d + 1`` rows, each with its own history). So every call describes the
rows afresh: the rows of the previous call are removed and this call's rows
are added at their indices, each with its params converted to vLLM's and its
own copy of the output history (the prompt slot is None). A processor that derives its state from the
params and output lists (vLLM's built-ins and the documented custom pattern)
behaves as in vLLM; one that accumulates state across steps under an index
would see every step as a new batch. ``argmax_invariant`` is the processor's
``is_argmax_invariant()``, so servelab runs it at the same point vLLM does.
"""

from __future__ import annotations

from typing import Any

from servelab.integrations.vllm._compat import require_vllm

require_vllm()

import torch  # noqa: E402
from vllm import SamplingParams as VllmParams  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor  # noqa: E402

__all__ = ["from_vllm_logits_processor", "to_vllm_params"]


def to_vllm_params(params: Any) -> VllmParams:
    """vLLM ``SamplingParams`` for a servelab one: the fields a vLLM processor reads."""
    return VllmParams(temperature=params.temperature, top_k=params.top_k if params.top_k > 0 else 0,
                      top_p=params.top_p, min_p=params.min_p, seed=params.seed, max_tokens=params.max_tokens,
                      min_tokens=params.min_tokens, stop_token_ids=list(params.stop_token_ids),
                      ignore_eos=params.ignore_eos, extra_args=dict(params.extra_args or {}) or None,
                      logit_bias=dict(params.logit_bias) if params.logit_bias else None)


class VllmLogitsProcessorAdapter:
    """A vLLM v1 logits processor behind servelab's ``apply(logits, metadata)`` (see the module docstring)."""

    def __init__(self, processor: LogitsProcessor) -> None:
        if not isinstance(processor, LogitsProcessor):
            raise TypeError(f"processor must be a vLLM v1 LogitsProcessor, got {type(processor).__name__}")
        self.processor = processor
        self.argmax_invariant = bool(processor.is_argmax_invariant())
        self._num_rows = 0

    def apply(self, logits: torch.Tensor, metadata: Any) -> torch.Tensor:
        """float32 ``[R, V]`` in, ``[R, V]`` out (a new tensor: vLLM processors may write in place)."""
        rows = metadata.num_reqs
        # The prompt slot is None (vLLM allows it): servelab's metadata carries prompts only as a
        # padded tensor, and only when penalties need them.
        added = [(i, to_vllm_params(metadata.params[i]), None, list(metadata.output_token_id_lists[i]))
                 for i in range(rows)]
        self.processor.update_state(BatchUpdate(batch_size=rows, removed=list(range(self._num_rows)),
                                                added=added, moved=[]))
        self._num_rows = rows
        out = self.processor.apply(logits.clone())
        if out.shape != logits.shape:
            raise ValueError(f"vLLM logits processor {type(self.processor).__name__} returned shape "
                             f"{tuple(out.shape)}, expected {tuple(logits.shape)}")
        return out


def from_vllm_logits_processor(processor: Any, *, vllm_config: Any = None,
                               device: torch.device | str = "cpu") -> VllmLogitsProcessorAdapter:
    """A servelab logits processor running vLLM ``processor`` (a ``LogitsProcessor``
    subclass, built here with ``(vllm_config, device, False)``, or an instance)."""
    if isinstance(processor, type):
        if not issubclass(processor, LogitsProcessor):
            raise TypeError(f"processor must be a vLLM v1 LogitsProcessor class, got {processor.__name__}")
        processor = processor(vllm_config, torch.device(device), False)
    return VllmLogitsProcessorAdapter(processor)

"""servelab: a kernel-first research toolkit for LLM serving.

The engine that vLLM v1 builds as one piece is taken apart here into
independent components, each with a fast implementation, a plain reference
with the same signature, tests holding one to the other, and a benchmark:

- :mod:`servelab.blocks`      KV-cache specs, memory layout, block hashing,
                              ``BlockPool`` and ``KVCacheManager``.
- :mod:`servelab.kernels`     Triton kernels (paged attention, cache writes,
                              sampling, verification).
- :mod:`servelab.reference`   the PyTorch / plain-Python references: the spec.
- :mod:`servelab.scheduling`  requests, scheduler, policies, simulator.
- :mod:`servelab.samplers`    sampling parameters, sampler, spec-decode verifiers.
- :mod:`servelab.models`      Llama-family model loading HF checkpoints.
- :mod:`servelab.pipeline`    ``Pipeline``: model runner, detokenizer, metrics.
- :mod:`servelab.config`      ``PipelineConfig``: every pipeline setting and its default.

The names a user needs first are here, as in vLLM
(``from vllm import LLM, SamplingParams``)::

    from servelab import Pipeline, PipelineConfig, SamplingParams

Importing ``servelab`` is cheap: subpackages are imported on first use, and
nothing here imports Triton (which is Linux-only).
"""

__version__ = "0.1.0"

# name -> module that defines it; imported on first attribute access.
_LAZY = {
    "Pipeline": "servelab.pipeline.pipeline",
    "GenerationOutput": "servelab.pipeline.outputs",
    "SamplingParams": "servelab.samplers.params",
    "StructuredOutputsParams": "servelab.samplers.structured.params",
    "PipelineConfig": "servelab.config",
    "CacheConfig": "servelab.config",
    "SchedulingConfig": "servelab.config",
    "SpeculativeConfig": "servelab.config",
    "LoRAConfig": "servelab.config",
    "ParallelConfig": "servelab.config",
    "LoRARequest": "servelab.lora.request",
    # pieces of this stage add their public names here: "LoRARequest", "AsyncPipeline", ...
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    # Lazy: ``import servelab`` stays cheap; torch and the models load on first use.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'servelab' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

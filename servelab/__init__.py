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

Importing ``servelab`` is cheap: subpackages are imported on first use, and
nothing here imports Triton (which is Linux-only).
"""

__version__ = "0.1.0"

__all__ = ["Pipeline", "__version__"]


def __getattr__(name: str):
    # Lazy: ``import servelab`` stays cheap; the pipeline (torch, models) loads on first use.
    if name == "Pipeline":
        from servelab.pipeline import Pipeline

        return Pipeline
    raise AttributeError(f"module 'servelab' has no attribute {name!r}")

"""servelab pieces inside other serving engines.

- :mod:`servelab.integrations.vllm`: scheduling policies as a vLLM v1 scheduler
  class, logits processors as vLLM v1 custom logits processors, the Triton
  paged attention as a vLLM attention backend, and the helpers that build
  vLLM's real scheduler on a CPU (differential tests, ``servelab simulate
  --engine vllm``). Optional: ``pip install "servelab[vllm]"`` (a GPU machine)
  or the CPU recipe in ``ci/vllm-cpu/``.

Nothing here is imported by the rest of servelab; each integration imports its
engine lazily and says how to install it when it is missing.
"""

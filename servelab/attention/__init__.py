"""Attention: the backend interface and registry, the SDPA fast path for CPUs.

- :mod:`servelab.attention.backends`: :class:`AttentionBackend` (the
  interface: capabilities with defaults, three typed ops and a per-step
  ``plan``), the registry (``register_attention_backend`` /
  ``get_attention_backend`` / ``available_attention_backends``) and the
  built-in backends ``"sdpa"`` (batched SDPA, the CPU default under
  ``"auto"``), ``"torch"`` (the references, registered lazily) and
  ``"triton"`` (the kernels, the CUDA default under ``"auto"``).
- :mod:`servelab.attention.sdpa`: paged attention as batched
  ``scaled_dot_product_attention`` calls, planned once per step.
- :mod:`servelab.attention.ops`: vectorised torch KV write and state merge
  (every backend's defaults).

The Triton kernels themselves live in :mod:`servelab.kernels`.
"""

from servelab.attention.backends import *  # noqa: F401,F403
from servelab.attention.backends import __all__  # noqa: F401

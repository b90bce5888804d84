"""servelab pieces inside vLLM (v1 engine; vLLM 0.33.x).

Three lines each (see ``README_SNIPPET.md`` in this folder)::

    from servelab.integrations.vllm import make_scheduler_cls, make_logits_processor_cls
    llm = LLM(model, scheduler_cls=make_scheduler_cls("sjf"))                 # a servelab policy
    llm = LLM(model, logits_processors=[make_logits_processor_cls(MyProc)])  # a servelab processor

- :func:`make_scheduler_cls` (:mod:`.scheduler`): a servelab scheduling
  policy (name or object) as a subclass of vLLM's v1 ``Scheduler``; dotted
  paths for ``--scheduler-cls``: ``servelab.integrations.vllm.schedulers.<name>``.
- :func:`make_logits_processor_cls` (:mod:`.logits`): a servelab logits
  processor as a vLLM v1 custom logits processor class.
- :func:`register_attention_backend` (:mod:`.attention`): servelab's Triton
  paged attention as vLLM's ``CUSTOM`` attention backend (GPU).
- :mod:`.harness`: vLLM's real scheduler built on a CPU (differential tests,
  ``servelab simulate --engine vllm``).

Importing this package without vLLM raises ``ImportError`` saying how to
install it (``pip install "servelab[vllm]"``, or ``ci/vllm-cpu/setup.sh`` on a
CPU-only machine); an unsupported vLLM version is refused with the versions
that are supported.
"""

from servelab.integrations.vllm._compat import SUPPORTED_VLLM, UnsupportedVLLMVersion, require_vllm

VLLM_VERSION = require_vllm()

from servelab.integrations.vllm.from_vllm import from_vllm_logits_processor  # noqa: E402
from servelab.integrations.vllm.logits import make_logits_processor_cls  # noqa: E402
from servelab.integrations.vllm.scheduler import PolicyRequestQueue, VllmRequestView, make_scheduler_cls  # noqa: E402


def register_attention_backend(name: str = "CUSTOM") -> str:
    """Register servelab's Triton paged attention as vLLM attention backend ``name``
    (see :func:`servelab.integrations.vllm.attention.register`); returns the name to pass
    as ``attention_backend``."""
    from servelab.integrations.vllm.attention import register

    return register(name)


__all__ = [
    "PolicyRequestQueue", "SUPPORTED_VLLM", "UnsupportedVLLMVersion", "VLLM_VERSION", "VllmRequestView",
    "from_vllm_logits_processor", "make_logits_processor_cls", "make_scheduler_cls", "register_attention_backend",
]

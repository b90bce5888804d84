"""A C kernel that must equal torch's op bit for bit, checked once per process by its probe.

Who uses it: :mod:`servelab.models.cpu_norm` (RMSNorm) and :mod:`servelab.models.cpu_silu` (SiLU),
whose results depend on the order and the ``exp`` torch's build uses on this CPU: each holds one
:class:`ProbedKernel`, asks :meth:`~ProbedKernel.usable_library` on its hot path, and offers its
:meth:`~ProbedKernel.unavailable_reason`, :meth:`~ProbedKernel.available` and
:meth:`~ProbedKernel.reset` as its own functions. The library is built (or loaded) the first
time that happens in a process unless the decode path built it first.
"""

from __future__ import annotations

from typing import Any, Callable

from servelab.attention import cpu_decode

NO_LIBRARY = "the C CPU kernels are unavailable (no compiler, a failed build, or SERVELAB_CPU_KERNELS=0)"


class ProbedKernel:
    """``probe(lib)`` returns ``None`` when the library's kernel equals torch's op on every probe, else
    the first mismatch, said in words; it runs once per process (or after :meth:`reset`)."""

    def __init__(self, probe: Callable[[Any], str | None]) -> None:
        self._probe = probe
        self.reset()

    def reset(self) -> None:
        """Forget the check (tests; after ``cpu_kernel_build.reset``)."""
        self.lib: Any = None  # the ctypes library once the probe passed
        self.checked = False
        self.reason: str | None = None

    def unavailable_reason(self) -> str | None:
        """``None`` when the kernel is built and bit-identical to torch's op here, else why not."""
        if not self.checked:
            lib = cpu_decode.library()
            self.reason = NO_LIBRARY if lib is None else self._probe(lib)
            self.lib = lib if self.reason is None else None
            self.checked = True
        return self.reason

    def available(self) -> bool:
        """Whether the kernel may run (see :meth:`unavailable_reason`)."""
        return self.unavailable_reason() is None

    def usable_library(self) -> Any:
        """The checked library, or ``None`` (checking first if it never was): the hot path's question."""
        if self.lib is None and not self.checked:
            self.unavailable_reason()
        return self.lib

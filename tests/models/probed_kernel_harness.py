"""Shared by the tests of the kernels checked once per process (``servelab.models.probed_kernel``:
``cpu_norm``, ``cpu_silu``): their fixtures and a float view of a C pointer."""

from __future__ import annotations

import ctypes
import shutil
from types import ModuleType
from typing import Any

import pytest
import torch

from servelab.attention import cpu_kernel_build


def kernel_fixture(module: ModuleType, what: str, without_compiler: str) -> Any:
    """A module-scoped ``kernel`` fixture: the checked kernel of ``module``; skips only without a C
    compiler (``without_compiler`` says what runs then); a compiler that gives no usable kernel fails."""

    @pytest.fixture(scope="module", name="kernel")
    def kernel() -> None:
        if shutil.which(cpu_kernel_build.compiler()) is None:
            pytest.skip(f"no C compiler: {without_compiler}")
        if not module.available():
            pytest.fail(f"a C compiler exists but the C {what} is unavailable: {module.unavailable_reason()}")

    return kernel


def unchecked_fixture(module: ModuleType) -> Any:
    """An ``unchecked`` fixture: ``module``'s once-per-process check forgotten before the test and
    after it (the test patches the library)."""

    @pytest.fixture(name="unchecked")
    def unchecked():
        module.reset()
        yield
        module.reset()

    return unchecked


def floats(address: int, count: int) -> torch.Tensor:
    """``count`` float32 at ``address`` (a stand-in library's view of a C call's pointer), shared."""
    return torch.frombuffer((ctypes.c_float * count).from_address(address), dtype=torch.float32)

"""Test-wide settings.

Triton kernels run on CPU tensors through the interpreter. The variable must be
set before any ``@triton.jit`` function is created, so it is set here, at the
top of the first module pytest imports; export ``TRITON_INTERPRET=0`` to run
the same tests natively on a GPU.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Interpreter-backed examples take tens of milliseconds or more; a per-example
# deadline would only measure the machine. Examples are derandomized in CI so a
# failure reproduces from the log alone.
settings.register_profile(
    "default",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "ci",
    parent=settings.get_profile("default"),
    derandomize=True,
    print_blob=True,
)
settings.load_profile("ci" if os.environ.get("CI") else "default")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module on one torch thread, restoring the count afterwards. Tiny
    models' matmuls gain nothing from threads, and on a shared 2-core runner
    the thread pool's contention makes them several times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def _kernel_cache_in_tmp(tmp_path_factory):
    """Compiled kernels (``servelab.attention.cpu_kernel_build``) go to a temporary folder,
    never the user's cache (checkpoints are still found under the usual cache root)."""
    patch = pytest.MonkeyPatch()
    patch.setenv("SERVELAB_KERNEL_CACHE", str(tmp_path_factory.mktemp("kernels")))
    yield
    patch.undo()

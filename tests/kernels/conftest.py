"""Shared setup for the kernel tests.

* Makes the case builders in this folder importable (``--import-mode=importlib``).
* Tests marked ``interpreter`` run the Triton kernels on CPU tensors, which
  needs ``TRITON_INTERPRET=1`` (set by ``tests/conftest.py`` unless exported
  otherwise). With the interpreter off they are skipped with that reason; the
  native GPU checks of the same kernels are ``bench/gpu/run_all.py``'s.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from attention_cases import INTERPRETER_ON  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if INTERPRETER_ON:
        return
    skip = pytest.mark.skip(reason="runs Triton kernels on CPU tensors: needs TRITON_INTERPRET=1 "
                                   "(native GPU checks: python bench/gpu/run_all.py)")
    for item in items:
        if "interpreter" in item.keywords and str(item.fspath).startswith(os.path.dirname(__file__)):
            item.add_marker(skip)

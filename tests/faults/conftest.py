"""Fixtures of the fault-injection tests (the shared model and references live in ``fault_env.py``)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(autouse=True, scope="module")
def _faults_run_on_one_thread(one_torch_thread):
    """Tiny models: see ``one_torch_thread``."""

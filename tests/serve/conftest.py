"""Fixtures of the serve tests: one tiny checkpoint per session (random weights, built locally)."""

import pytest

from servelab.models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("serve-tiny") / "m", arch="llama", seed=0)

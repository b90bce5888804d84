import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from lora_helpers import ADAPTERS, make_peft_adapter  # noqa: E402

from servelab.models import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_lora(tmp_path_factory):
    """(base checkpoint folder, {adapter name: PEFT adapter folder}) on the tiny Llama."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_model(root / "base", arch="llama")
    adapters = {name: make_peft_adapter(base, root / name, seed=seed, **kwargs)
                for name, (kwargs, seed) in ADAPTERS.items()}
    return base, adapters

"""Without vLLM (the main environment), the integration says how to install it."""

import importlib.util

import pytest


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_importing_the_vllm_integration_without_vllm_says_how_to_install_it():
    with pytest.raises(ImportError, match=r'pip install "servelab\[vllm\]"') as info:
        import servelab.integrations.vllm  # noqa: F401
    assert "ci/vllm-cpu/setup.sh" in str(info.value)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_simulate_with_the_vllm_engine_without_vllm_is_a_one_line_error(capsys):
    from servelab.cli import main

    assert main(["simulate", "--engine", "vllm", "--num-requests", "3", "--policy", "fcfs"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "servelab[vllm]" in err

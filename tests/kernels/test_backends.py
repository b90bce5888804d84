"""Attention backend registry: lookup, capability reasons, refusal instead of fallback."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from attention_cases import build_case

from servelab.backends import (
    AttentionBackend,
    TorchAttentionBackend,
    UnsupportedInputError,
    available_attention_backends,
    get_attention_backend,
    register_attention_backend,
    triton_device_problem,
)


def test_lookup_by_name_and_unknown_name_lists_valid_ones():
    assert get_attention_backend("torch").name == "torch"
    assert get_attention_backend("triton").name == "triton"
    assert {"torch", "triton"} <= set(available_attention_backends())
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'.*torch.*triton"):
        get_attention_backend("flash")


@pytest.mark.interpreter
def test_both_backends_compute_the_same_ops():
    case = build_case([1, 4], [11, 6], num_q_heads=4, num_kv_heads=2, head_size=32, block_size=8,
                      dtype=torch.float32, seed=1)
    results = {name: get_attention_backend(name).paged_attention(*case.args(), sliding_window=4)
               for name in ("torch", "triton")}
    torch.testing.assert_close(results["triton"], results["torch"], rtol=1e-5, atol=1e-5)
    for name in ("torch", "triton"):
        backend = get_attention_backend(name)
        key_cache, value_cache = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)
        key = torch.randn(2, 2, 16)
        backend.reshape_and_cache(key, key, key_cache, value_cache, torch.tensor([6, -1]))
        assert torch.equal(key_cache[1, 2], key[0]) and torch.count_nonzero(key_cache) == 32
        out, lse = backend.merge_attn_states(key, torch.zeros(2, 2), key, torch.zeros(2, 2))
        torch.testing.assert_close(out, key)


@pytest.mark.interpreter
def test_reasons_for_dtype_head_size_and_block_size():
    triton_backend, torch_backend = get_attention_backend("triton"), get_attention_backend("torch")
    q64 = torch.randn(2, 4, 64, dtype=torch.float64)
    assert "float64" in triton_backend.supports(q64)
    assert torch_backend.supports(q64) is None
    wide = torch.randn(2, 4, 320)
    assert "head sizes up to 256, got 320" in triton_backend.supports(wide)
    assert torch_backend.supports(wide) is None
    q = torch.randn(2, 4, 64)
    assert triton_backend.supports(q, torch.zeros(3, 16, 2, 64)) is None  # interpreter is on in tests
    assert "key_cache dtype" in triton_backend.supports(q, torch.zeros(3, 16, 2, 64, dtype=torch.float16))
    # The declaration itself is inspectable.
    assert torch.float64 not in triton_backend.capabilities.dtypes
    assert "split_kv" in triton_backend.capabilities.features


def test_unsupported_input_is_refused_with_the_reason_not_run_elsewhere():
    case = build_case([1], [5], num_q_heads=2, num_kv_heads=1, head_size=16, block_size=8,
                      dtype=torch.float32)
    args = [t.double() if t.is_floating_point() else t for t in case.args()]
    with pytest.raises(UnsupportedInputError, match="float64"):
        get_attention_backend("triton").paged_attention(*args)
    assert issubclass(UnsupportedInputError, ValueError)
    get_attention_backend("torch").paged_attention(*args)


def test_device_reasons():
    assert "0 active drivers" in triton_device_problem("cpu", interpreted=False)
    assert triton_device_problem("cpu", interpreted=True) is None
    assert "TRITON_INTERPRET" in triton_device_problem("cuda", interpreted=True)
    assert "not on meta" in triton_device_problem("meta", interpreted=False)
    meta_query = torch.empty(2, 4, 64, device="meta")
    assert "meta" in get_attention_backend("torch").supports(meta_query)


def test_register_custom_backend():
    class Doubling(TorchAttentionBackend):
        name = "doubling"

        def _paged_attention(self, *args, **kwargs):
            return 2 * super()._paged_attention(*args, **kwargs)

    register_attention_backend("doubling-test", Doubling)
    try:
        backend = get_attention_backend("doubling-test")
        assert isinstance(backend, AttentionBackend) and "doubling-test" in available_attention_backends()
        case = build_case([1], [5], num_q_heads=2, num_kv_heads=1, head_size=16, block_size=8,
                          dtype=torch.float32)
        torch.testing.assert_close(backend.paged_attention(*case.args()),
                                   2 * get_attention_backend("torch").paged_attention(*case.args()))
        with pytest.raises(ValueError, match="already registered"):
            register_attention_backend("doubling-test", Doubling)
        register_attention_backend("doubling-test", TorchAttentionBackend, replace=True)
        with pytest.raises(TypeError):
            register_attention_backend("broken", "not callable")
    finally:
        from servelab import backends

        backends._REGISTRY.pop("doubling-test", None)


def _run_python(code, **env):
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
        env={**os.environ, **env},
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


def test_without_interpreter_or_gpu_triton_reports_zero_active_drivers():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: CPU tensors are simply the wrong device there")
    out = _run_python(
        """
        import sys, torch
        from servelab.backends import get_attention_backend, UnsupportedInputError
        assert "triton" not in sys.modules, "servelab.backends must not import triton"
        backend = get_attention_backend("triton")
        print("REASON:", backend.supports(torch.randn(2, 2, 16)))
        from servelab.kernels import paged_attention
        q = torch.randn(1, 1, 16); cache = torch.randn(1, 8, 1, 16)
        i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
        try:
            paged_attention(q, cache, cache, i32([0]).view(1, 1), i32(1), i32(0, 1))
        except ValueError as error:
            print("KERNEL:", error)
        try:
            backend.paged_attention(q, cache, cache, i32([0]).view(1, 1), i32(1), i32(0, 1))
        except UnsupportedInputError as error:
            print("BACKEND:", error)
        """,
        TRITON_INTERPRET="0",
    )
    lines = dict(line.split(":", 1) for line in out.strip().splitlines())
    assert set(lines) == {"REASON", "KERNEL", "BACKEND"}, out
    assert all("0 active drivers" in text for text in lines.values()), out


def test_backends_module_imports_without_triton():
    out = _run_python(
        """
        import sys
        sys.modules["triton"] = None  # as on macOS / Windows: import triton fails
        import torch
        from servelab.backends import get_attention_backend
        backend = get_attention_backend("triton")
        print(backend.supports(torch.randn(2, 2, 16)))
        print(get_attention_backend("torch").supports(torch.randn(2, 2, 16)))
        """
    )
    reason, torch_reason = out.strip().splitlines()
    assert "Triton is not installed" in reason and torch_reason == "None"

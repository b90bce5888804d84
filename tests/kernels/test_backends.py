"""Attention backend registry: lookup, capability reasons, refusal instead of fallback."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from attention_cases import build_case

from servelab.attention.backends import (
    AttentionBackend,
    AttentionCapabilities,
    UnsupportedInputError,
    available_attention_backends,
    get_attention_backend,
    register_attention_backend,
    triton_device_problem,
)
from servelab.reference.attention_backend import TorchAttentionBackend


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
        register_attention_backend("doubling-test", TorchAttentionBackend, override=True)
        assert type(get_attention_backend("doubling-test")) is TorchAttentionBackend
        instance = Doubling()
        register_attention_backend("doubling-test", instance, override=True)
        assert get_attention_backend("doubling-test") is instance
        with pytest.raises(TypeError, match="lacks"):
            register_attention_backend("broken", object())
        with pytest.raises(TypeError):
            register_attention_backend("broken", "not a lazy string")
        for bad in ("", " padded ", 3):
            with pytest.raises(ValueError, match="invalid"):
                register_attention_backend(bad, Doubling)
        assert "broken" not in available_attention_backends()
    finally:
        register_attention_backend("doubling-test", TorchAttentionBackend, override=True)


def test_builtin_names_auto_and_objects():
    assert {"sdpa", "torch", "triton"} <= set(available_attention_backends())
    assert get_attention_backend("auto").name == "sdpa"  # on a CPU
    backend = get_attention_backend("sdpa")
    assert get_attention_backend(backend) is backend  # an object passes through
    with pytest.raises(TypeError, match="lacks"):
        get_attention_backend(object())
    with pytest.raises(ValueError, match=r"unknown attention backend 'flash'.*'sdpa'"):
        get_attention_backend("flash")


def test_capabilities_have_defaults():
    caps = AttentionCapabilities()
    assert caps.max_head_size is None and caps.block_sizes == (1, None) and "gqa" in caps.features
    assert torch.float32 in caps.dtypes and "cpu" in caps.device_types


def test_user_backend_in_a_few_lines_runs_the_model():
    """A researcher's backend through the public API only (the README's example)."""
    from servelab.models import AttentionMetadata, LlamaForCausalLM, ModelConfig, allocate_kv_caches, tiny_config

    calls = []

    class Counting(AttentionBackend):  # only the attention op; KV write and merge use the defaults
        name = "counting"

        def _paged_attention(self, query, *args, **kwargs):
            calls.append(query.shape[0])
            return get_attention_backend("sdpa").paged_attention(query, *args, **kwargs)

    register_attention_backend("counting-test", Counting, override=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_hf(tiny_config()), "counting-test").eval()
    caches = allocate_kv_caches(model, num_blocks=4, block_size=4)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    meta = AttentionMetadata(torch.arange(4, 7), i32(1, 2).view(1, 2), i32(3), i32(0, 3))
    with torch.inference_mode():
        hidden = model(torch.tensor([1, 5, 9]), torch.arange(3), caches, meta)
        model.attention = "sdpa"
        expected = model(torch.tensor([1, 5, 9]), torch.arange(3), caches, meta)
    assert calls == [3] * model.config.num_hidden_layers
    torch.testing.assert_close(hidden, expected)


def test_default_write_and_merge_match_the_references():
    from servelab.attention import ops
    from servelab.reference import merge_attn_states, reshape_and_cache

    torch.manual_seed(0)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([3, -1, 17, 0, 9])
    caches = [torch.zeros(4, 8, 2, 8) for _ in range(4)]
    ops.reshape_and_cache(key, value, caches[0], caches[1], slots)
    reshape_and_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(ValueError, match="same slot twice"):
        ops.reshape_and_cache(key, value, caches[0], caches[1], torch.tensor([3, 3, 1, 2, 4]))
    lse_a = torch.tensor([[0.5, float("-inf")], [float("-inf"), float("-inf")]] * 2 + [[1.0, 2.0]])
    lse_b = torch.tensor([[1.5, 0.0], [float("-inf"), float("-inf")]] * 2 + [[float("-inf"), 2.0]])
    got = ops.merge_attn_states(key, lse_a, value, lse_b)
    want = merge_attn_states(key, lse_a, value, lse_b)
    torch.testing.assert_close(got, want)
    assert not torch.isnan(got[0]).any()


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
        from servelab.attention.backends import get_attention_backend, UnsupportedInputError
        assert "triton" not in sys.modules, "servelab.attention.backends must not import triton"
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
        from servelab.attention.backends import get_attention_backend
        backend = get_attention_backend("triton")
        print(backend.supports(torch.randn(2, 2, 16)))
        print(get_attention_backend("torch").supports(torch.randn(2, 2, 16)))
        """
    )
    reason, torch_reason = out.strip().splitlines()
    assert "Triton is not installed" in reason and torch_reason == "None"

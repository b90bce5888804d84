"""Mixed-adapter batches token-exact against transformers + peft ``generate`` (one model per
adapter, one prompt at a time) on the tiny Llama: base requests and 3 adapters interleaved
(ranks 8 and 4, q/v-only and MLP-only targets, rsLoRA), under chunked prefill, preemption,
prefix caching, n-gram speculation, fewer slots than adapters, a small host cache, each kernel."""

import pytest
import torch
from lora_helpers import peft_greedy, random_prompts

from servelab import Pipeline, SamplingParams
from servelab.lora import LoRARequest

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
NAMES = [None, "all-r8", "qv-r4", "mlp-rs"]
LENGTHS = (4, 17, 9, 30)


@pytest.fixture(scope="module")
def oracle(tiny_lora):
    """(prompts, per (adapter name or None) -> peft's greedy outputs for every prompt)."""
    base, adapters = tiny_lora
    prompts = random_prompts(LENGTHS, seed=11)
    want = {name: peft_greedy(base, adapters[name] if name else None, prompts, MAX_TOKENS) for name in NAMES}
    # the adapters change the outputs (else the test could not fail)
    assert all(want[name] != want[None] for name in NAMES[1:])
    assert len({str(want[n]) for n in NAMES}) == len(NAMES)
    return prompts, want


def requests_of(adapters):
    return {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(sorted(adapters.items()))}


def assert_lora_idle(pipe):
    manager = pipe.kv_cache_manager
    assert manager.num_free_blocks == pipe.num_blocks - 1
    assert not pipe.runner.requests and not pipe.scheduler.has_unfinished_requests()
    assert not pipe.lora_manager.pinned() and len(pipe._lora) == 0


VARIANTS = {
    "default": dict(),
    "slots_below_adapters": dict(max_loras=2, max_cpu_loras=2),
    "one_slot_chunked": dict(max_loras=1, max_num_batched_tokens=8),
    "preemption": dict(block_size=4, num_blocks=24),
    "ngram": dict(drafter="ngram", num_speculative_tokens=3),
    "chunked_threshold_ngram": dict(max_num_batched_tokens=16, long_prefill_token_threshold=5, drafter="ngram",
                                    num_speculative_tokens=2),
    "no_prefix_caching": dict(enable_prefix_caching=False),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_mixed_batch_matches_peft(tiny_lora, oracle, variant, one_torch_thread):
    base, adapters = tiny_lora
    prompts, want = oracle
    kwargs = dict(max_loras=3, max_lora_rank=8) | VARIANTS[variant]
    pipe = Pipeline.from_pretrained(base, enable_lora=True, **kwargs)
    reqs = requests_of(adapters)
    # every prompt with every adapter, interleaved; then a few again (prefix-cache hits, per adapter)
    batch = [(p, n) for p in range(len(prompts)) for n in NAMES]
    again = [(3, n) for n in NAMES]
    preemptions = 0
    for run in (batch, again):
        outs = pipe.generate([prompts[p] for p, _ in run], GREEDY, lora_request=[reqs.get(n) for _, n in run])
        for (p, name), out in zip(run, outs):
            assert out.error is None, out.error
            assert out.token_ids == want[name][p], (variant, name, p)
        preemptions += pipe.last_run_metrics.num_preemptions
    if variant == "preemption":
        assert preemptions > 0
    if variant in ("default", "ngram", "slots_below_adapters"):  # a small pool may have evicted them
        assert pipe.last_run_metrics.prefix_cache_hit_rate > 0
    assert_lora_idle(pipe)


def test_prefix_cache_is_keyed_by_adapter(tiny_lora, oracle, one_torch_thread):
    """The same prompt under the base model, then under an adapter: no KV shared across them."""
    base, adapters = tiny_lora
    prompts, want = oracle
    reqs = requests_of(adapters)
    pipe = Pipeline.from_pretrained(base, enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4)
    assert pipe.generate([prompts[3]], GREEDY)[0].token_ids == want[None][3]
    out = pipe.generate([prompts[3]], GREEDY, lora_request=reqs["all-r8"])[0]
    assert out.token_ids == want["all-r8"][3] and out.metrics.num_cached_tokens == 0
    again = pipe.generate([prompts[3]], GREEDY, lora_request=reqs["all-r8"])[0]
    assert again.token_ids == want["all-r8"][3] and again.metrics.num_cached_tokens > 0


def test_kernels_give_the_same_tokens(tiny_lora, oracle, one_torch_thread):
    """The Triton kernels (interpreter) and the reference, swapped in by name, in a pipeline."""
    base, adapters = tiny_lora
    prompts, want = oracle
    reqs = requests_of(adapters)
    for kernel in ("triton", "reference"):
        pipe = Pipeline.from_pretrained(base, enable_lora=True, max_loras=3, max_lora_rank=8)
        pipe.lora_manager.kernel = kernel
        names = [None, "qv-r4", "all-r8"]  # a prefill (SGMV) step, then decode (BGMV) steps
        outs = pipe.generate([prompts[0]] * len(names), SamplingParams(temperature=0.0, max_tokens=3),
                             lora_request=[reqs.get(n) for n in names])
        assert [o.token_ids for o in outs] == [want[n][0][:3] for n in names], kernel


def test_parallel_sampling_children_inherit_the_adapter(tiny_lora, oracle, one_torch_thread):
    base, adapters = tiny_lora
    prompts, want = oracle
    reqs = requests_of(adapters)
    pipe = Pipeline.from_pretrained(base, enable_lora=True, max_loras=2, max_lora_rank=8)
    out = pipe.generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, n=3),
                        lora_request=reqs["qv-r4"])[0]
    assert [c.token_ids for c in out.completions] == [want["qv-r4"][1]] * 3
    assert_lora_idle(pipe)


def test_stream_and_add_request_take_an_adapter(tiny_lora, oracle, one_torch_thread):
    base, adapters = tiny_lora
    prompts, want = oracle
    reqs = requests_of(adapters)
    pipe = Pipeline.from_pretrained(base, enable_lora=True, max_loras=2, max_lora_rank=8)
    tokens = {}
    for event in pipe.stream([prompts[0], prompts[2]], GREEDY, lora_request=[reqs["mlp-rs"], None]):
        tokens.setdefault(event.index, []).extend(event.new_token_ids)
    assert tokens == {0: want["mlp-rs"][0], 1: want[None][2]}
    rid = pipe.add_request(prompts[2], GREEDY, lora_request=reqs["all-r8"])
    while pipe.has_unfinished_requests():
        pipe.step()
    assert pipe.get_output(rid, pop=True).token_ids == want["all-r8"][2]
    assert_lora_idle(pipe)


@pytest.mark.parametrize("quantization", [None, "int8"])
@torch.no_grad()
def test_wrapped_layer_equals_merged_weights(tiny_lora, quantization):
    """One layer: base + LoRA delta equals the dense layer with B @ A * scaling merged in; the
    wrapper goes over whatever the layer is (a quantized layer through the MODEL_STEPS order)."""
    from servelab.config import PipelineConfig
    from servelab.models import load_model
    from servelab.pipeline.setup import prepare_model
    base, adapters = tiny_lora
    model, _ = load_model(base, pack_weights=False)
    config = PipelineConfig().replace(enable_lora=True, max_loras=2, max_lora_rank=8, quantization=quantization)
    model = prepare_model(model, config)
    manager = model.lora_manager
    assert (type(manager.layers["model.layers.0.mlp.down_proj"].base).__name__ == "Linear") == (quantization is None)
    slot = manager.activate_adapter(requests_of(adapters)["all-r8"])
    layer = manager.layers["model.layers.1.self_attn.qkv_proj"]
    x = torch.randn(5, layer.in_features)
    merged = layer.dense_weight().clone()
    adapter = manager.add_adapter(requests_of(adapters)["all-r8"])
    for part, hf in zip(layer.slices, layer.hf_names):
        a, b = adapter.weights[hf]
        merged[part.start:part.start + part.size] += b @ a
    from servelab.lora.kernels import LoRAMapping
    manager.state.mapping = LoRAMapping.from_requests([slot], [5])
    torch.testing.assert_close(layer(x), x @ merged.T, atol=1e-5, rtol=1e-5)
    manager.state.mapping = None
    torch.testing.assert_close(layer(x), x @ layer.dense_weight().T, atol=1e-5, rtol=1e-5)

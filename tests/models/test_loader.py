"""Loading paths: sharded checkpoints, legacy configs, dtypes, KV-cache helpers,
attention objects (references module, registry backends, Triton interpreter)."""

import json

import pytest
import torch
from model_harness import ATOL, hf_logits, load_hf, random_prompts, run_schedule
from safetensors import safe_open

import servelab.reference
from servelab.attention.backends import get_attention_backend
from servelab.blocks import KVCacheBuffers
from servelab.models import (
    allocate_kv_caches,
    build_tiny_model,
    checkpoint_files,
    load_model,
    prepare_inputs,
    random_weights,
    tiny_config,
)


def test_sharded_checkpoint_equals_single_file(checkpoints, tmp_path):
    path = build_tiny_model(tmp_path / "sharded", arch="qwen2", seed=0, num_shards=3)
    files = checkpoint_files(path)
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in files}
    sharded, _ = load_model(path)
    single = checkpoints["qwen2"].model
    for (name, a), (_, b) in zip(sharded.named_parameters(), single.named_parameters()):
        assert torch.equal(a, b), name
    seq = random_prompts([20], 512, seed=0)[0]
    torch.testing.assert_close(hf_logits(load_hf(path), seq), hf_logits(checkpoints["qwen2"].hf, seq))


def test_fused_projections_hold_hf_tensors(checkpoints):
    ck = checkpoints["qwen2"]
    attn = ck.model.model.layers[1].self_attn
    with safe_open(str(ck.path / "model.safetensors"), "pt") as f:
        k = f.get_tensor("model.layers.1.self_attn.k_proj.weight")
        kb = f.get_tensor("model.layers.1.self_attn.k_proj.bias")
        up = f.get_tensor("model.layers.1.mlp.up_proj.weight")
    assert torch.equal(attn.qkv_proj.weight[64:96], k)
    assert torch.equal(attn.qkv_proj.bias[64:96], kb)
    assert torch.equal(ck.model.model.layers[1].mlp.gate_up_proj.weight[128:], up)


def test_tied_checkpoint(checkpoints, tmp_path):
    ck = checkpoints["qwen2"]
    with safe_open(str(ck.path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
    assert ck.model.lm_head is None and ck.model.lm_head_weight is ck.model.model.embed_tokens.weight
    # A tied checkpoint that also stores lm_head.weight loads (the copy is ignored, as HF does).
    cfg = tiny_config("qwen2")
    weights = random_weights(cfg, seed=0)
    weights["lm_head.weight"] = torch.zeros(512, 64)
    path = tmp_path / "tied_extra"
    path.mkdir()
    cfg.save_pretrained(str(path))
    from safetensors.torch import save_file
    save_file(weights, str(path / "model.safetensors"))
    model, _ = load_model(path)
    assert torch.equal(model.lm_head_weight, weights["model.embed_tokens.weight"])


def test_legacy_rope_scaling_config(tmp_path):
    """A transformers-4.x style config (top-level rope_theta, rope_scaling with 'type')."""
    path = build_tiny_model(tmp_path / "legacy", arch="llama", seed=2)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("rope_parameters")
    cfg.update(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 3.0})
    (path / "config.json").write_text(json.dumps(cfg))
    model, config = load_model(path)
    assert (config.rope_type, config.rope_theta) == ("linear", 5e5)
    seq = random_prompts([30], config.vocab_size, seed=1)[0]
    got, _, _ = run_schedule(model, [seq], [30], 10_000, 4)
    torch.testing.assert_close(got[0], hf_logits(load_hf(path), seq), atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 0.25), (torch.float16, 0.05)])
def test_half_precision(checkpoints, dtype, tol):
    ck = checkpoints["mistral"]
    model, _ = load_model(ck.path, dtype=dtype)
    assert model.dtype == dtype
    caches = allocate_kv_caches(model, 32, 4)
    assert caches.views[0][0].dtype == dtype
    seqs = random_prompts((5, 30), ck.config.vocab_size, seed=1)
    low, _, _ = run_schedule(model, seqs, (5, 20), 10_000, 4)
    full, _, _ = run_schedule(ck.model, seqs, (5, 20), 10_000, 4)
    for a, b in zip(low, full):
        assert a.dtype == torch.float32  # compute_logits always hands back float32
        assert (a - b).abs().max() < tol
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_allocate_kv_caches_and_layouts(checkpoints):
    model = checkpoints["llama"].model
    caches = allocate_kv_caches(model, num_blocks=10, block_size=4)
    assert isinstance(caches, KVCacheBuffers) and len(caches.views) == 2
    assert all(float(t[0].abs().sum()) == 0 for layer in caches.views for t in layer)  # null block zeroed
    caches.buffer.zero_()  # the rest is uninitialized: zero it to see exactly which slots get written
    key, value = caches.views[1]
    assert key.shape == value.shape == (10, 4, 2, 16) and key.dtype == torch.float32
    ids, pos, meta = prepare_inputs([[1, 9, 8, 7, 6], [1, 4]], [0, 0], [[3, 7], [5]], 4)
    with torch.no_grad():
        a = model(ids, pos, caches, meta)  # KVCacheBuffers accepted directly
        other = allocate_kv_caches(model, 10, 4, layout="block_outermost")
        b = model(ids, pos, other.views, meta)  # strided views of one buffer
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    # Writes landed where the slot mapping says: token 4 of seq 0 -> block 7, offset 0.
    assert caches.views[0][0][7, 0].abs().sum() > 0 and caches.views[0][0][7, 1:].abs().sum() == 0


def test_prepare_inputs_layout():
    ids, pos, meta = prepare_inputs([[5, 6, 7], [8]], [2, 6], [[4, 9], [3, 1]], 4)
    assert ids.tolist() == [5, 6, 7, 8] and pos.tolist() == [2, 3, 4, 6]
    assert meta.slot_mapping.tolist() == [4 * 4 + 2, 4 * 4 + 3, 9 * 4 + 0, 1 * 4 + 2]
    assert meta.seq_lens.tolist() == [5, 7] and meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.block_table.dtype == torch.int32 and meta.block_table.tolist() == [[4, 9], [3, 1]]
    assert meta.logits_indices().tolist() == [2, 3]


class SpyAttention:
    """Duck-typed attention: delegates to the references and records the calls."""

    def __init__(self):
        self.calls = []

    def reshape_and_cache(self, *args, **kwargs):
        return servelab.reference.reshape_and_cache(*args, **kwargs)

    def paged_attention(self, *args, **kwargs):
        self.calls.append(kwargs)
        return servelab.reference.paged_attention(*args, **kwargs)


@pytest.mark.parametrize("attention", ["module", "backend", "spy"])
def test_attention_objects(checkpoints, attention):
    ck = checkpoints["mistral"]
    obj = {"module": servelab.reference, "backend": get_attention_backend("torch"), "spy": SpyAttention()}[attention]
    model, _ = load_model(ck.path, attention=obj)
    assert model.attention is obj
    seqs = random_prompts((4, 25), ck.config.vocab_size, seed=9)
    got, _, _ = run_schedule(model, seqs, (4, 10), 8, 4)
    for seq, logits in zip(seqs, got):
        torch.testing.assert_close(logits, hf_logits(ck.hf, seq), atol=ATOL, rtol=0)
    if attention == "spy":
        assert obj.calls and all(c["sliding_window"] == 16 and c["scale"] == 0.25 for c in obj.calls)
    model.attention = "torch"  # swapped by name
    assert model.attention.name == "torch"


@pytest.mark.interpreter
def test_triton_backend_under_interpreter(checkpoints):
    """The Triton kernels (CPU interpreter) drive the same model to the same logits."""
    ck = checkpoints["mistral"]
    model, _ = load_model(ck.path, attention="triton")
    seqs = random_prompts((3, 22), ck.config.vocab_size, seed=4)
    got, _, _ = run_schedule(model, seqs, (3, 19), 10_000, 4)
    for seq, logits in zip(seqs, got):
        torch.testing.assert_close(logits, hf_logits(ck.hf, seq), atol=ATOL, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-3), (torch.bfloat16, 0.25)])
def test_cuda_model_matches_cpu(checkpoints, dtype, tol):
    ck = checkpoints["mistral"]
    model, _ = load_model(ck.path, dtype=dtype, device="cuda")
    assert model.device.type == "cuda"
    seqs = random_prompts((5, 40), ck.config.vocab_size, seed=3)
    ids, pos, meta = prepare_inputs(seqs, [0, 0], [[3, 1, 8, 6, 2, 9, 4, 7, 5, 10], [11, 12, 13]], 16,
                                    device="cuda")
    caches = allocate_kv_caches(model, 16, 16)
    with torch.no_grad():
        logits = model.compute_logits(model(ids, pos, caches, meta)).cpu()
    starts = meta.query_start_loc.tolist()
    for i, seq in enumerate(seqs):
        assert (logits[starts[i]:starts[i + 1]] - hf_logits(ck.hf, seq)).abs().max() < tol


def test_eos_ids_and_defaults_from_generation_config(tmp_path):
    """EOS ids of config.json and generation_config.json are merged (config first, no
    duplicates); the generation config's sampling fields become generation_defaults."""
    from servelab.models import load_config

    path = build_tiny_model(tmp_path / "gen", arch="llama", eos_token_id=[2, 5])
    (path / "generation_config.json").write_text(json.dumps({
        "eos_token_id": [7, 2], "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 64,
        "do_sample": True, "repetition_penalty": None, "bos_token_id": 1}))
    config = load_config(path)
    assert config.eos_token_ids == (2, 5, 7)
    assert dict(config.generation_defaults) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 64}
    from servelab.samplers import SamplingParams
    SamplingParams(**config.generation_defaults)  # the names are SamplingParams' own
    (path / "generation_config.json").unlink()
    bare = load_config(path)
    assert bare.eos_token_ids == (2, 5) and dict(bare.generation_defaults) == {}


def test_pipeline_stops_on_an_eos_listed_only_in_generation_config(tmp_path):
    from servelab import Pipeline
    from servelab.samplers import SamplingParams

    path = build_tiny_model(tmp_path / "eos", arch="qwen2", seed=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    free = Pipeline.from_pretrained(path).generate([[1, 40, 41, 42]], greedy)[0].token_ids
    stop_at = next(i for i, t in enumerate(free) if t not in free[:i] and t != 2 and i >= 2)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, free[stop_at]]}))
    out = Pipeline.from_pretrained(path).generate([[1, 40, 41, 42]], greedy)[0]
    assert out.token_ids == free[:stop_at + 1] and out.finish_reason == "stop"

"""The four MoE architectures against transformers' own implementation, on tiny random checkpoints
built locally from each architecture's HF config: per-position logits on a chunked, batched, paged
schedule; token-exact greedy generation; checkpoints in transformers' per-expert on-disk format
(``save_pretrained``) load to the same model; through the pipeline with prefix caching, preemption
and n-gram speculation, token-exact with no KV block leaked."""

from __future__ import annotations

import pytest
import torch

from model_harness import greedy_generate, hf_logits, load_hf, random_prompts, run_schedule

from servelab import Pipeline, SamplingParams
from servelab.models import load_model
from servelab.moe import MOE_MODEL_TYPES as MOE_ARCHS, SparseMoeBlock, moe_blocks


@pytest.fixture(scope="module", params=MOE_ARCHS)
def ckpt(request, moe_checkpoint):
    path = moe_checkpoint(request.param)
    model, config = load_model(path)
    return request.param, path, model, config, load_hf(path)


def _hf_greedy(hf, prompt, new):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, min_new_tokens=new)
    return out[0, len(prompt):].tolist()


def test_architecture_and_sparse_layers(ckpt):
    arch, _, model, config, _ = ckpt
    assert config.arch == arch
    blocks = moe_blocks(model)
    expected = [0, 2] if arch == "qwen2_moe" else [0, 1]  # qwen2_moe: layer 1 is dense (mlp_only_layers)
    assert [i for i, _ in blocks] == expected and all(isinstance(b, SparseMoeBlock) for _, b in blocks)
    assert (blocks[0][1].shared_expert is not None) == (arch == "qwen2_moe")


def test_logits_match_transformers_on_a_chunked_batch(ckpt):
    _, _, model, config, hf = ckpt
    prompts = random_prompts([17, 11], config.vocab_size, seed=1)
    logits, _, mixed = run_schedule(model, prompts, [12, 5], budget=7, block_size=4)
    assert mixed
    for seq, got in zip(prompts, logits):
        torch.testing.assert_close(got, hf_logits(hf, seq), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["cpu", "reference", "triton"])
def test_greedy_is_token_exact(ckpt, kernel):
    _, _, model, config, hf = ckpt
    prompts = random_prompts([15, 9], config.vocab_size, seed=2)
    for _, block in moe_blocks(model):
        block.experts.kernel = kernel
    try:
        ours = greedy_generate(model, prompts, 8)
    finally:
        for _, block in moe_blocks(model):
            block.experts.kernel = "auto"
    assert ours == [_hf_greedy(hf, p, 8) for p in prompts]


def _write_per_expert(src, dst, arch):
    """Copy checkpoint ``src`` to ``dst`` with one tensor per expert and projection (the format of
    published MoE checkpoints; Mixtral's: ``block_sparse_moe.experts.N.w1/w3/w2``)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    out = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        prefix = name.rpartition(".experts.")[0] if ".experts." in name else None
        if arch == "mixtral":
            name = name.replace(".mlp.", ".block_sparse_moe.")
            prefix = prefix and prefix.replace(".mlp", ".block_sparse_moe")
        gate, up, down = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        if name.endswith("experts.gate_up_proj"):
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{prefix}.experts.{e}.{gate}.weight"] = tensor[e, :inter].clone()
                out[f"{prefix}.experts.{e}.{up}.weight"] = tensor[e, inter:].clone()
        elif name.endswith("experts.down_proj"):
            for e in range(tensor.shape[0]):
                out[f"{prefix}.experts.{e}.{down}.weight"] = tensor[e].clone()
        else:
            out[name] = tensor
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_per_expert_checkpoint_format_loads_the_same_model(ckpt, tmp_path):
    arch, path, model, config, hf = ckpt
    legacy = _write_per_expert(path, tmp_path / "legacy", arch)
    again, _ = load_model(legacy)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    prompt = random_prompts([7], config.vocab_size, seed=3)[0]  # transformers reads the format as well
    torch.testing.assert_close(hf_logits(load_hf(legacy), prompt), hf_logits(hf, prompt))


def test_a_missing_or_repeated_expert_is_named(ckpt, tmp_path):
    arch, path, _, _, _ = ckpt
    legacy = _write_per_expert(path, tmp_path / "legacy", arch)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(legacy / "model.safetensors"))
    dropped = next(n for n in tensors if ".experts.3." in n)
    extra = dict(tensors)
    extra[dropped.replace(".experts.3.", ".experts.9.")] = tensors[dropped].clone()
    del tensors[dropped]
    save_file(tensors, str(legacy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing .*experts"):
        load_model(legacy)
    save_file(extra, str(legacy / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="names expert 9; the config has 8"):
        load_model(legacy)


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_pipeline_prefix_caching_preemption_speculation(arch, moe_checkpoint):
    path = moe_checkpoint(arch)
    hf = load_hf(path)
    pipe = Pipeline.from_pretrained(path, enable_prefix_caching=True, block_size=4, num_blocks=16,
                                    drafter="ngram", num_speculative_tokens=3)
    base = random_prompts([14], pipe.model.config.vocab_size, seed=5)[0]
    prompts = [base + base[1:6], base + base[2:9], base[:10] + base[1:10]]  # shared prefix, repeats
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    pipe.generate(prompts[:1], params)  # its blocks cached: the batch's shared prefix hits
    outs = pipe.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert list(out.token_ids) == _hf_greedy(hf, prompt, 12)
    metrics = pipe.last_run_metrics
    assert metrics.num_preemptions > 0 and metrics.prefix_cache_hit_rate > 0 and metrics.speculative
    manager = pipe.kv_cache_manager
    assert manager.num_free_blocks == pipe.num_blocks - 1 and not manager.req_to_blocks


def test_moe_config_reads_each_family_and_refuses_bad_fields():
    from servelab.models import tiny_config
    from servelab.moe import MoEConfig

    q2 = MoEConfig.from_hf(tiny_config("qwen2_moe", num_hidden_layers=4, mlp_only_layers=[2], decoder_sparse_step=2))
    assert q2.sparse_layers == (False, True, False, True) and q2.shared_expert_intermediate_size == 96
    assert (q2.num_experts, q2.top_k, q2.intermediate_size, q2.renormalize) == (8, 4, 32, False)
    mix = MoEConfig.from_hf(tiny_config("mixtral"))
    assert mix.renormalize and mix.intermediate_size == 128 and mix.sparse_layers == (True, True)
    h = 64  # per token and sparse layer: top-k experts' 3 matrices, the shared expert and its gate, the router
    assert q2.active_parameters_per_token(h) == 4 * 3 * h * 32 + 3 * h * 96 + h + 8 * h
    assert mix.active_parameters_per_token(h) == 2 * 3 * h * 128 + 8 * h
    with pytest.raises(ValueError, match="num_experts_per_tok=9 exceeds the 8 experts"):
        MoEConfig.from_hf(tiny_config("olmoe", num_experts_per_tok=9))
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported for mixtral"):
        MoEConfig.from_hf(tiny_config("mixtral", hidden_act="gelu"))
    with pytest.raises(ValueError, match="use_sliding_window=True is not supported for model_type='qwen3_moe'"):
        from servelab.models import ModelConfig

        ModelConfig.from_hf(tiny_config("qwen3_moe", use_sliding_window=True, sliding_window=16))

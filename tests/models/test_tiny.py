"""build_tiny_model writes a checkpoint transformers recognizes, deterministically, with a usable tokenizer."""

import json

import pytest
import torch
from model_harness import ARCHS
from safetensors.torch import load_file

from servelab.models import build_tiny_model, load_config, load_tokenizer


def test_deterministic_per_seed_and_arch(tmp_path):
    a = build_tiny_model(tmp_path / "a", arch="llama", seed=5)
    b = build_tiny_model(tmp_path / "b", arch="llama", seed=5)
    c = build_tiny_model(tmp_path / "c", arch="llama", seed=6)
    m = build_tiny_model(tmp_path / "m", arch="mistral", seed=5)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    wa, wc, wm = (load_file(str(p / "model.safetensors")) for p in (a, c, m))
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])
    assert not torch.equal(wa["model.embed_tokens.weight"], wm["model.embed_tokens.weight"])


@pytest.mark.parametrize("arch", ARCHS)
def test_defaults(checkpoints, arch):
    ck = checkpoints[arch]
    cfg = ck.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.vocab_size) == (64, 2, 4, 2, 16, 512)
    assert cfg.arch == arch and type(ck.hf).__name__ == {
        "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}[arch]
    assert cfg.sliding_windows == ((16, 16) if arch == "mistral" else (None, None))
    assert cfg.tie_word_embeddings == (arch == "qwen2")
    assert cfg.qkv_bias == (arch == "qwen2") and not cfg.o_bias
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (1, (2,), 0)
    gen = json.loads((ck.path / "generation_config.json").read_text())
    assert (gen["eos_token_id"], gen["bos_token_id"], gen["pad_token_id"]) == (2, 1, 0)


def test_overrides(tmp_path):
    path = build_tiny_model(tmp_path / "o", arch="qwen2", num_hidden_layers=3, vocab_size=600,
                            hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    cfg = load_config(path)
    assert (cfg.num_hidden_layers, cfg.vocab_size, cfg.hidden_size, cfg.num_key_value_heads) == (3, 600, 32, 1)
    weights = load_file(str(path / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].shape == (600, 32)
    assert "model.layers.2.self_attn.v_proj.bias" in weights


def test_tokenizer(checkpoints):
    from transformers import AutoTokenizer

    path = checkpoints["llama"].path
    tok = load_tokenizer(path)
    auto = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    assert (len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (512, 1, 2, 0)
    for text in ["The cache is full.", "  spaces\tand\nnewlines ", "ünïcödé — 你好 🙂", "x = {'k': 42}"]:
        ids = tok(text)["input_ids"]
        assert ids[0] == 1 and ids == auto(text)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=True) == text
    # Trained merges make common text shorter than its bytes.
    assert len(tok("the serving engine reads a batch")["input_ids"]) < 20

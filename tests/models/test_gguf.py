"""GGUF files load like checkpoint folders: a tiny checkpoint written as GGUF
(by the minimal llama.cpp-style writer below: llama.cpp's tensor names, its
rotary permutation of Llama q/k, a gpt2-type BPE tokenizer) must give back the
same parameters, config and tokenizer; refusals name what is wrong."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from servelab.models import build_tiny_model, load_config, load_model, load_tokenizer

gguf = pytest.importorskip("gguf", reason='GGUF support needs pip install "servelab[gguf]"')
pytest.importorskip("accelerate", reason='GGUF support needs pip install "servelab[gguf]"')

from servelab.models.gguf import check_gguf, convert_gguf, find_gguf_file  # noqa: E402

_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
TEXTS = ["The cache holds keys.", "naïve café 你好 🙂", "  spaces\tand\nlines ", "x = [1, 2, 3]; <s> </s>"]


def gguf_name(hf_name):
    stem, _, leaf = hf_name.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{leaf}"
    layer, _, module = stem.removeprefix("model.layers.").partition(".")
    return f"blk.{layer}.{_LAYER[module]}.{leaf}"


def llama_permute(w, n_head):
    """llama.cpp's rotary permutation of q/k rows (transformers undoes it on load)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(folder, out, *, arch="llama", name=None, qtype="F32", raw_types=None, eot=None):
    """A tiny HF checkpoint folder as a GGUF file; 2-D weights stored as ``qtype``
    (``raw_types``: GGUF tensor name -> type written as zero bytes, for refusals)."""
    from safetensors.numpy import load_file

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(name or f"tiny {arch}")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_vocab_size(cfg["vocab_size"])
    vocab = dict(tok["model"]["vocab"])
    vocab.update({a["content"]: a["id"] for a in tok["added_tokens"]})
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    if eot is not None:
        writer.add_eot_token_id(eot)
    writer.add_pad_token_id(cfg["pad_token_id"])
    writer.add_add_bos_token(True)
    for hf_name, w in load_file(str(folder / "model.safetensors")).items():
        name_ = gguf_name(hf_name)
        if arch == "llama" and (".attn_q." in name_ or ".attn_k." in name_):
            w = llama_permute(w, cfg["num_attention_heads" if ".attn_q." in name_ else "num_key_value_heads"])
        w = np.ascontiguousarray(w, dtype=np.float32)
        kind = (raw_types or {}).get(name_, qtype if w.ndim == 2 else "F32")
        qt = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            writer.add_tensor(name_, w)
            continue
        if raw_types and name_ in raw_types:  # bytes of the right size, never decoded
            block, size = gguf.GGML_QUANT_SIZES[qt]
            data = np.zeros((*w.shape[:-1], w.shape[-1] // block * size), dtype=np.uint8)
        else:
            data = gguf.quants.quantize(w, qt)
        writer.add_tensor(name_, data, raw_shape=data.shape, raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


# llama.cpp writes Mistral as architecture "llama" and records no sliding window:
# a window-less Mistral loads as the Llama it computes like.
CASES = {"llama": ("llama", {}, None), "qwen2": ("qwen2", {}, None),
         "mistral": ("llama", {"sliding_window": None}, "Mistral tiny")}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for case, (gguf_arch, overrides, name) in CASES.items():
        folder = build_tiny_model(root / case, arch=case, seed=3, **overrides)
        home = root / f"{case}-gguf"
        home.mkdir()
        out[case] = (folder, write_gguf(folder, home / f"tiny-{case}.F32.gguf", arch=gguf_arch, name=name))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_loads_the_same_model_and_tokenizer(tiny, case):
    folder, file = tiny[case]
    ref, ref_cfg = load_model(folder)
    for path in (file, file.parent):  # the file, or a folder holding it and no config.json
        model, cfg = load_model(path)
        assert cfg.arch == CASES[case][0] and cfg.eos_token_ids == ref_cfg.eos_token_ids == (2,)
        assert (cfg.num_key_value_heads, cfg.head_dim, cfg.tie_word_embeddings) == \
            (ref_cfg.num_key_value_heads, ref_cfg.head_dim, ref_cfg.tie_word_embeddings)
        for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
            assert torch.equal(a, b), name  # F32 round trip, q/k un-permuted: bit-exact
    ref_tok, tok = load_tokenizer(folder), load_tokenizer(file)
    for text in TEXTS:
        # transformers gives a qwen2 GGUF Qwen2's own pre-tokenizer (a regex split), so only
        # llama-type files must split text exactly like the byte-level BPE they were written from.
        if case != "qwen2":
            assert tok.encode(text) == ref_tok.encode(text)
        ids = ref_tok.encode(text)
        assert tok.decode(ids, skip_special_tokens=True) == ref_tok.decode(ids, skip_special_tokens=True)
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text.replace("<s>", "").replace("</s>", "")


def test_quantized_gguf_is_dequantized_exactly(tiny, tmp_path):
    folder, _ = tiny["llama"]
    file = write_gguf(folder, tmp_path / "tiny.Q8_0.gguf", qtype="Q8_0")
    info = check_gguf(file)
    assert info.tensor_types == {"Q8_0": 16, "F32": 5} and info.architecture == "llama"
    model, _ = load_model(file)
    ref, _ = load_model(folder)
    reader = gguf.GGUFReader(str(file))
    stored = {t.name: t for t in reader.tensors}
    t = stored["blk.1.ffn_down.weight"]
    expected = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
    got = model.model.layers[1].mlp.down_proj.weight
    assert torch.equal(got, expected.reshape(got.shape))
    for (name, a), (_, b) in zip(ref.named_parameters(), model.named_parameters()):
        assert (a - b).abs().max() <= 0.02 * a.abs().max(), name  # 8-bit rounding, nothing worse


def test_eot_token_is_an_eos_and_convert_writes_a_plain_checkpoint(tiny, tmp_path):
    folder, _ = tiny["llama"]  # (transformers 5 re-derives a qwen2 tokenizer's splitting from the class)
    file = write_gguf(folder, tmp_path / "tiny-eot.gguf", arch="llama", eot=7)
    assert load_config(file).eos_token_ids == (2, 7)
    out = convert_gguf(file, tmp_path / "converted")
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, 7]
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and "local_files_only" not in tok_cfg
    converted, converted_cfg = load_model(out)
    assert converted_cfg.eos_token_ids == (2, 7)
    ref, _ = load_model(folder)
    for (name, a), (_, b) in zip(ref.named_parameters(), converted.named_parameters()):
        assert torch.equal(a, b), name
    for text in TEXTS:
        assert load_tokenizer(out).encode(text) == load_tokenizer(file).encode(text)


def test_unsupported_architecture_and_tensor_type(tiny, tmp_path):
    folder, _ = tiny["llama"]
    bad_arch = write_gguf(folder, tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ValueError, match=r"architecture='gpt2', which is not supported; supported: llama, qwen2"):
        load_model(bad_arch)
    bad_type = write_gguf(folder, tmp_path / "q81.gguf", raw_types={"blk.0.ffn_down.weight": "Q8_1"})
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.ffn_down\.weight' is stored as Q8_1.*supported: .*Q4_1"):
        load_model(bad_type)
    not_gguf = tmp_path / "junk.gguf"
    not_gguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match=r"cannot read GGUF file .*junk\.gguf"):
        load_model(not_gguf)
    named_mistral = write_gguf(folder, tmp_path / "m.gguf", name="mistral")  # the reader's own dead end
    with pytest.raises(ValueError, match=r"transformers cannot load GGUF file 'm\.gguf'"):
        load_model(named_mistral)


def test_gguf_path_errors(tiny, tmp_path):
    _, file = tiny["llama"]
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(file.read_bytes())
    with pytest.raises(ValueError, match=r"2 \.gguf files \(a\.gguf, b\.gguf\); pass the one to load"):
        load_model(two)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"is a file but not a \.gguf file"):
        load_model(tmp_path / "weights.bin")
    with pytest.raises(ValueError, match=r"does not exist"):
        load_model(tmp_path / "nowhere")
    assert find_gguf_file(tiny["llama"][0]) is None  # a HF folder stays a HF folder


def test_missing_gguf_package_names_the_extra(tiny, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(ImportError, match=r'gguf package.*pip install "servelab\[gguf\]"'):
        load_model(tiny["llama"][1])


def test_pipeline_from_a_gguf_file(tiny):
    from servelab import Pipeline
    from servelab.samplers import SamplingParams

    folder, file = tiny["qwen2"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["The cache holds keys.", "Boats carry wood"]
    want = [o.token_ids for o in Pipeline.from_pretrained(folder).generate(prompts, params)]
    got = Pipeline.from_pretrained(file).generate(prompts, params)
    assert [o.token_ids for o in got] == want and all(o.text for o in got)

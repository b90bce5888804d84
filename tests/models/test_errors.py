"""Bad checkpoints and bad calls fail with a ValueError/TypeError that says what is wrong."""

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from servelab.models import (
    AttentionMetadata,
    LlamaForCausalLM,
    build_tiny_model,
    load_config,
    load_model,
    prepare_inputs,
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("pristine") / "llama", arch="llama")


@pytest.fixture
def ckpt(pristine, tmp_path):
    """A fresh copy of a good checkpoint for each test to break."""
    return shutil.copytree(pristine, tmp_path / "ckpt")


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_weights(path, fn):
    file = path / "model.safetensors"
    weights = load_file(str(file))
    fn(weights)
    save_file(weights, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize("changes, match", [
    ({"model_type": "gpt_neox"}, r"model_type='gpt_neox' is not supported"),
    ({"model_type": "not_a_model"}, r"cannot read .*config\.json"),
    ({"architectures": ["LlamaForSequenceClassification"]}, r"architectures=.*LlamaForSequenceClassification"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ({"num_local_experts": 8}, r"num_local_experts=8 is not supported \(mixture-of-experts"),
    ({"quantization_config": {"quant_method": "gptq"}}, r"quantization_config=.* \(quantized weights\)"),
    ({"rope_parameters": {"rope_type": "mystery", "rope_theta": 1e4}}, r"rope_type='mystery'.*not supported"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                          "long_factor": [2.0] * 8}}, r"rope_type='longrope'"),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5"),
    ({"num_key_value_heads": 3}, r"num_key_value_heads=3 must be a positive divisor of num_attention_heads=4"),
    ({"sliding_window": 8}, r"sliding_window=8 is not supported for model_type='llama'"),
    ({"head_dim": 15}, r"(?s)cannot read .*config\.json.*even rotary"),  # transformers refuses it first
])
def test_unsupported_config(ckpt, changes, match):
    edit_config(ckpt, **changes)
    with pytest.raises(ValueError, match=match):
        load_model(ckpt)


def test_mistral_attention_bias_refused(tmp_path):
    path = build_tiny_model(tmp_path / "m", arch="mistral", attention_bias=True)
    with pytest.raises(ValueError, match=r"attention_bias=True is not supported for model_type='mistral'"):
        load_config(path)


def test_missing_weight(ckpt):
    edit_weights(ckpt, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model(ckpt)


def test_missing_lm_head_when_untied(ckpt):
    edit_weights(ckpt, lambda w: w.pop("lm_head.weight"))
    with pytest.raises(ValueError, match=r"'lm_head\.weight'"):
        load_model(ckpt)


def test_unexpected_weight(ckpt):
    edit_weights(ckpt, lambda w: w.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'.*no bias"):
        load_model(ckpt)


def test_extra_layer_is_unexpected(ckpt):
    edit_weights(ckpt, lambda w: w.update({"model.layers.2.input_layernorm.weight": torch.ones(64)}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.2\.input_layernorm\.weight'"):
        load_model(ckpt)


def test_wrong_shape(ckpt):
    edit_weights(ckpt, lambda w: w.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(16, 64)}))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight'.*\(16, 64\).*\(32, 64\)"):
        load_model(ckpt)


def test_no_safetensors(ckpt):
    (ckpt / "model.safetensors").rename(ckpt / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"no \*\.safetensors.*pickled"):
        load_model(ckpt)


def test_index_names_missing_shard(ckpt):
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"model-00002-of-00002\.safetensors"):
        load_model(ckpt)


def test_duplicate_tensor_across_shards(ckpt):
    save_file({"model.norm.weight": torch.ones(64)}, str(ckpt / "extra.safetensors"))
    with pytest.raises(ValueError, match=r"'model\.norm\.weight' appears twice"):
        load_model(ckpt)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match=r"config\.json not found"):
        load_model(tmp_path)


def test_bad_dtype(ckpt):
    with pytest.raises(ValueError, match=r"dtype=torch\.int8 is not supported"):
        load_model(ckpt, dtype=torch.int8)


def test_bad_attention_object(ckpt):
    with pytest.raises(TypeError, match=r"lacks reshape_and_cache, paged_attention"):
        load_model(ckpt, attention=object())
    with pytest.raises(ValueError, match=r"unknown attention backend 'nope'"):
        load_model(ckpt, attention="nope")


def test_bad_forward_inputs(pristine):
    model, config = load_model(pristine)
    caches = [(torch.zeros(8, 4, 2, 16), torch.zeros(8, 4, 2, 16)) for _ in range(2)]
    ids, pos, meta = prepare_inputs([[1, 5, 7]], [0], [[3]], 4)
    with pytest.raises(ValueError, match=r"token id 512 is outside the vocabulary \[0, 512\)"):
        model(torch.tensor([1, 512, 7]), pos, caches, meta)
    with pytest.raises(ValueError, match=r"positions shape"):
        model(ids, pos[:2], caches, meta)
    with pytest.raises(ValueError, match=r"kv_caches has 1 entries; the model has 2 layers"):
        model(ids, pos, caches[:1], meta)
    with pytest.raises(ValueError, match=r"slot_mapping has 2 entries for 3 tokens"):
        bad = AttentionMetadata(meta.slot_mapping[:2], meta.block_table, meta.seq_lens, meta.query_start_loc)
        model(ids, pos, caches, bad)
    assert isinstance(model, LlamaForCausalLM)


def test_prepare_inputs_errors():
    with pytest.raises(ValueError, match=r"block_tables\[0\] has 1 blocks of 4 tokens but the sequence needs 6"):
        prepare_inputs([[1, 2, 3]], [3], [[5]], 4)
    with pytest.raises(ValueError, match=r"token_ids\[1\] is empty"):
        prepare_inputs([[1], []], [0, 0], [[1], [2]], 4)
    with pytest.raises(ValueError, match=r"one entry per sequence"):
        prepare_inputs([[1]], [0, 0], [[1]], 4)


def test_build_tiny_model_errors(tmp_path):
    with pytest.raises(ValueError, match=r"arch='gpt2' is not supported"):
        build_tiny_model(tmp_path / "a", arch="gpt2")
    with pytest.raises(ValueError, match=r"vocab_size=100 must be an int >= the tokenizer's 512"):
        build_tiny_model(tmp_path / "b", vocab_size=100)


# ---- damaged files, odd-but-valid folders (loaders name the file and what is wrong) ----

def test_zero_byte_safetensors(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"model\.safetensors'.*the file is empty \(0 bytes\)"):
        load_model(ckpt)


def test_truncated_safetensors(ckpt):
    file = ckpt / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"model\.safetensors'.*\({len(data) // 2} bytes\) is truncated or corrupt"):
        load_model(ckpt)


def test_nan_weight_is_refused_naming_the_tensor(ckpt):
    def poison(w):
        w["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    edit_weights(ckpt, poison)
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.down_proj\.weight'.*1 non-finite.*index \(3, 5\)"):
        load_model(ckpt)


def test_weight_overflowing_half_precision_is_refused(ckpt):
    edit_weights(ckpt, lambda w: w["model.norm.weight"].__setitem__(0, 1e6))
    load_model(ckpt)  # fine in float32
    with pytest.raises(ValueError, match=r"'model\.norm\.weight'.*non-finite.*torch\.float16"):
        load_model(ckpt, dtype=torch.float16)


def test_eos_outside_the_vocabulary(ckpt):
    edit_config(ckpt, eos_token_id=512)
    with pytest.raises(ValueError, match=r"eos_token_id=512 in config\.json is invalid.*valid: ints in \[0, 512\)"):
        load_model(ckpt)
    edit_config(ckpt, eos_token_id=2)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, -1]}))
    with pytest.raises(ValueError, match=r"eos_token_id=\[2, -1\] in generation_config\.json.*-1 is outside"):
        load_model(ckpt)


def test_checkpoint_without_tokenizer_loads_for_token_ids(ckpt):
    from servelab import Pipeline
    from servelab.models import load_tokenizer
    from servelab.models.tokenizer import TOKENIZER_FILES
    from servelab.samplers import SamplingParams

    for name in TOKENIZER_FILES + ("special_tokens_map.json",):
        (ckpt / name).unlink(missing_ok=True)
    model, _ = load_model(ckpt)
    with pytest.warns(UserWarning, match=r"no tokenizer files.*prompts must be token ids"):
        assert load_tokenizer(ckpt) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note above; the pipeline may also check the files itself
        pipe = Pipeline.from_pretrained(ckpt)
    assert pipe.tokenizer is None
    out = pipe.generate([[1, 5, 9]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    try:  # a text prompt fails (the call, or just that request) saying token ids are needed
        text_out = pipe.generate("hello", SamplingParams(max_tokens=2))
    except ValueError as exc:
        message = str(exc)
    else:
        assert text_out[0].finish_reason == "error"
        message = text_out[0].error
    assert "token ids" in message


def test_broken_tokenizer_is_an_error_not_none(ckpt):
    from servelab.models import load_tokenizer

    (ckpt / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ValueError, match=r"cannot load the tokenizer in .*ckpt"):
        load_tokenizer(ckpt)

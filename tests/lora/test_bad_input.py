"""Bad adapters fail only their own request, with a message naming the adapter and why;
the other requests run (token-exact); no slot, pin or KV block leaks; a bad adapter never
falls back to the base model silently."""

import json
import shutil

import pytest
import torch
from lora_helpers import make_peft_adapter, peft_greedy, random_prompts, write_adapter_files

from servelab import Pipeline, SamplingParams
from servelab.lora import LoRARequest
from servelab.models import build_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PROMPT = random_prompts((9,), seed=5)[0]


@pytest.fixture(scope="module")
def bad_adapters(tiny_lora, tmp_path_factory):
    base, adapters = tiny_lora
    root = tmp_path_factory.mktemp("bad")
    good_config = json.loads((adapters["all-r8"] / "adapter_config.json").read_text())
    other_base = build_tiny_model(root / "other-base", arch="llama", hidden_size=96)
    folders = {
        "missing": root / "does-not-exist",
        "no-config": write_adapter_files(root / "no-config", {}, {}),
        "rank-16": make_peft_adapter(base, root / "rank-16", seed=4, r=16, lora_alpha=16, target_modules=["q_proj"]),
        "other-base": make_peft_adapter(other_base, root / "other-base-adapter", seed=5, r=4, lora_alpha=8,
                                        target_modules=["q_proj", "v_proj"]),
        "lm-head": write_adapter_files(root / "lm-head", dict(good_config, r=2, target_modules=["lm_head"]), {
            "base_model.model.lm_head.lora_A.weight": torch.zeros(2, 64),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(512, 2)}),
        "dora": write_adapter_files(root / "dora", dict(good_config, use_dora=True), {}),
    }
    (folders["no-config"] / "adapter_config.json").unlink()
    bad_json = shutil.copytree(adapters["qv-r4"], root / "bad-json")
    (bad_json / "adapter_config.json").write_text("{not json")
    folders["bad-json"] = bad_json
    return folders


REASONS = {
    "missing": "does not exist or is not a folder",
    "no-config": "no adapter_config.json",
    "bad-json": "not readable JSON",
    "rank-16": "rank r=16 is above max_lora_rank=8",
    "other-base": "an adapter for another base model",
    "lm-head": "'model.lm_head'|'lm_head' is not an adaptable module",
    "dora": "DoRA",
}


def assert_idle(pipe):
    assert pipe.kv_cache_manager.num_free_blocks == pipe.num_blocks - 1
    assert not pipe.runner.requests and not pipe.scheduler.has_unfinished_requests()
    assert not pipe.lora_manager.pinned() and len(pipe._lora) == 0


def test_each_bad_adapter_fails_its_request_only(tiny_lora, bad_adapters, one_torch_thread):
    base, adapters = tiny_lora
    pipe = Pipeline.from_pretrained(base, enable_lora=True, max_loras=2, max_lora_rank=8)
    good = LoRARequest("all-r8", 1, str(adapters["all-r8"]))
    bad = [LoRARequest(name, 10 + i, str(path)) for i, (name, path) in enumerate(sorted(bad_adapters.items()))]
    outs = pipe.generate([PROMPT] * (len(bad) + 2), GREEDY, lora_request=[good, *bad, None])
    assert outs[0].token_ids == peft_greedy(base, adapters["all-r8"], [PROMPT], 6)[0]
    assert outs[-1].token_ids == peft_greedy(base, None, [PROMPT], 6)[0]
    for request, out in zip(bad, outs[1:-1]):
        assert out.finish_reason == "error" and out.token_ids == [], request.lora_name  # never the base model
        assert f"LoRA adapter {request.lora_name!r}" in out.error
        import re
        assert re.search(REASONS[request.lora_name], out.error), out.error
    assert pipe.lora_manager.list_adapters() == ["all-r8"]  # nothing half-loaded
    assert_idle(pipe)


def test_lora_request_without_enable_lora_fails_the_request(tiny_lora):
    base, adapters = tiny_lora
    pipe = Pipeline.from_pretrained(base)
    outs = pipe.generate([PROMPT, PROMPT], GREEDY, lora_request=[LoRARequest("qv-r4", 2, str(adapters["qv-r4"])),
                                                                 None])
    assert outs[0].finish_reason == "error" and "adapter 'qv-r4'" in outs[0].error
    assert "enable_lora=True" in outs[0].error
    assert outs[1].error is None and len(outs[1].token_ids) == 6


def test_malformed_calls_raise_and_a_wrong_type_fails_its_request(tiny_lora):
    base, _ = tiny_lora
    pipe = Pipeline.from_pretrained(base, enable_lora=True, max_loras=1, max_lora_rank=8)
    with pytest.raises(ValueError, match="a list of 2"):
        pipe.generate([PROMPT, PROMPT], GREEDY, lora_request=[None])
    with pytest.raises(TypeError, match="LoRARequest or None, got str"):
        pipe.generate([PROMPT], GREEDY, lora_request=["qv-r4"])
    rid = pipe.add_request(PROMPT, GREEDY, lora_request="qv-r4")  # one request: it fails, nothing raises
    pipe.step()
    out = pipe.get_output(rid, pop=True)
    assert out.finish_reason == "error" and "got str" in out.error


def test_adapter_removed_after_host_eviction_fails_at_activation(tiny_lora, tmp_path, one_torch_thread):
    """Registered, evicted from the host while its request waits, then its folder vanishes:
    the request fails at activation naming it; the others finish; nothing leaks."""
    base, adapters = tiny_lora
    moved = shutil.copytree(adapters["qv-r4"], tmp_path / "qv-copy")
    pipe = Pipeline.from_pretrained(base, enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=1)
    names = [("all-r8", adapters["all-r8"]), ("qv-copy", moved)]
    rids = [pipe.add_request(PROMPT, GREEDY, lora_request=LoRARequest(n, i + 1, str(p)))
            for i, (n, p) in enumerate(names)]
    assert pipe.lora_manager.list_adapters() == ["qv-copy"]  # all-r8 evicted from the host: reloaded later
    shutil.rmtree(moved)
    pipe.lora_manager.remove_adapter("qv-copy")  # gone from the host too: must be read again
    while pipe.has_unfinished_requests():
        pipe.step()
    first, second = (pipe.get_output(r, pop=True) for r in rids)
    assert first.token_ids == peft_greedy(base, adapters["all-r8"], [PROMPT], 6)[0]
    assert second.finish_reason == "error" and "LoRA adapter 'qv-copy'" in second.error
    assert_idle(pipe)

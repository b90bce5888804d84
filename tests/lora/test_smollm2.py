"""Mixed-adapter batches on the real SmolLM2-135M-Instruct checkpoint, token-exact against
transformers + peft: 3 adapters made with peft (different ranks, targets, rsLoRA) plus base
requests, interleaved, with chunked prefill and n-gram speculation, max_loras below the
number of adapters. Runs when the converted checkpoint is cached or
SERVELAB_FETCH_REAL_CHECKPOINT=1 (as tests/models/test_real_checkpoint.py)."""

import os

import pytest
from lora_helpers import ALL_MODULES, make_peft_adapter, peft_greedy

from servelab import Pipeline, SamplingParams
from servelab.lora import LoRARequest
from servelab.models import hub

TEXTS = ["The river runs under three bridges before it reaches the sea. Boats carry",
         "A recipe for bread: flour, water, salt and"]
ADAPTERS = {
    "sql": (dict(r=8, lora_alpha=16, target_modules=ALL_MODULES), 21),
    "poem": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]), 22),
    "legal": (dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["o_proj", "gate_proj", "up_proj"]), 23),
}
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def smollm2_adapters(tmp_path_factory):
    pytest.importorskip("peft")
    if not hub.is_fetched():
        if os.environ.get("SERVELAB_FETCH_REAL_CHECKPOINT") != "1":
            pytest.skip("the converted SmolLM2 folder is not cached; set SERVELAB_FETCH_REAL_CHECKPOINT=1")
        hub.fetch_smollm2()
    base = hub.smollm2_path()
    root = tmp_path_factory.mktemp("smollm2-lora")
    return base, {name: make_peft_adapter(base, root / name, seed=seed, scale=1.5, **kw)
                  for name, (kw, seed) in ADAPTERS.items()}


def test_smollm2_mixed_adapters_match_peft(smollm2_adapters, one_torch_thread):
    base, adapters = smollm2_adapters
    pipe = Pipeline.from_pretrained(base, enable_lora=True, max_loras=2, max_lora_rank=16,
                                    max_num_batched_tokens=32, drafter="ngram", num_speculative_tokens=2)
    prompts = [pipe.tokenizer.encode(t) for t in TEXTS]
    names = [None, "sql", "poem", "legal"]
    reqs = {n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())}
    want = {n: peft_greedy(base, adapters[n] if n else None, prompts, MAX_TOKENS) for n in names}
    assert all(want[n] != want[None] for n in names[1:]), want  # each adapter changes the output
    batch = [(p, n) for p in range(len(prompts)) for n in names]
    outs = pipe.generate([prompts[p] for p, _ in batch], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                         lora_request=[reqs.get(n) for _, n in batch])
    for (p, n), out in zip(batch, outs):
        assert out.error is None and out.token_ids == want[n][p], (n, TEXTS[p], out.text)
    assert pipe.lora_manager.stats.slot_evictions > 0  # 3 adapters through 2 slots
    assert not pipe.lora_manager.pinned()

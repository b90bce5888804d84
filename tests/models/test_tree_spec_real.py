"""The three tree-era drafters on the real SmolLM2-135M-Instruct checkpoint:
greedy output token-exact against transformers' ``generate``, with trees
(``ngram_tree``; ``layer_skip`` growing dynamic and ``draft_model`` static
top-k trees), under a pool small enough to preempt. (Layer-skip chains and
every drafter x verifier pair are checked on the tiny model, in
``tests/pipeline/test_tree_spec.py``; one pair per drafter here keeps CI short.)

Runs when the converted checkpoint is cached or ``SERVELAB_FETCH_REAL_CHECKPOINT=1``
(as ``test_real_checkpoint.py``); skipped otherwise.
"""

import os

import pytest
import torch

from servelab.models import hub

FETCH_ENV = "SERVELAB_FETCH_REAL_CHECKPOINT"
NEW_TOKENS = 16
TEXTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The river runs under three bridges before it reaches the sea. The river runs under",
]


@pytest.fixture(scope="module")
def smollm2():
    if not hub.is_fetched():
        if os.environ.get(FETCH_ENV) != "1":
            pytest.skip(f"the converted SmolLM2 folder is not in {hub.smollm2_path()}; set {FETCH_ENV}=1")
        hub.fetch_smollm2()
    return hub.smollm2_path()


@pytest.fixture(scope="module")
def prompts_and_want(smollm2):
    from transformers import AutoModelForCausalLM

    from servelab.models import load_tokenizer

    tokenizer = load_tokenizer(smollm2)
    prompts = [tokenizer.encode(text) for text in TEXTS]
    model = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        want = [model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(ids):].tolist() for ids in prompts]
    return prompts, want


def _drafter(kind, smollm2):
    from servelab.samplers.drafters import DraftModelDrafter, LayerSkipDrafter

    if kind == "layer_skip-chain":
        return LayerSkipDrafter(num_layers=10)
    if kind == "layer_skip-tree":
        return LayerSkipDrafter(num_layers=10, tree="dynamic", tree_width=2)
    if kind == "draft_model-tree":  # the checkpoint drafting for itself: every top-1 path is right
        return DraftModelDrafter.from_pretrained(smollm2, attention="sdpa", tree="static", tree_width=2)
    return kind


@pytest.mark.parametrize("kind,verifier", [("ngram_tree", "tree"), ("layer_skip-tree", "tree"),
                                           ("draft_model-tree", "rejection")])
def test_greedy_is_token_exact_with_trees(smollm2, prompts_and_want, kind, verifier):
    from servelab import Pipeline
    from servelab.samplers import SamplingParams

    prompts, want = prompts_and_want
    pipe = Pipeline.from_pretrained(smollm2, drafter=_drafter(kind, smollm2), num_speculative_tokens=4,
                                    verifier=verifier, num_blocks=12, block_size=16)
    got = pipe.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in got] == want
    assert pipe.last_run_metrics.num_accepted_tokens > 0

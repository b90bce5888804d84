"""servelab's decoder against Hugging Face transformers on the same tiny checkpoints.

For every position a schedule computes — all prompts in one mixed forward,
prompts split into chunks over several forwards, or a prefill followed by
token-by-token decodes — the float32 logits must equal transformers' logits
for the whole (unpadded) sequence at that position. Block tables are random
and non-contiguous; Mistral's sequences run past its 16-token window.
"""

import pytest
import torch
from model_harness import ARCHS, ATOL, greedy_generate, hf_logits, random_prompts, run_schedule

from servelab.models import load_tokenizer

LENGTHS = (1, 9, 23, 50)
# mode -> (prompt lengths, token budget per step)
SCHEDULES = {
    "one_forward": (LENGTHS, 10_000),  # (a) a mixed batch of whole prompts in ONE forward
    "chunked": ((1, 6, 20, 45), 7),  # (b) prompts split over forwards, context growing in the cache
    "decode": ((1, 5, 12, 20), 10_000),  # (c) prefill, then one token per step (teacher-forced)
}


@pytest.fixture(params=["torch", "sdpa"])
def backend(request, checkpoints):
    """Run the test with each CPU attention backend set on every model, then restore the default."""
    saved = {arch: ck.model.attention for arch, ck in checkpoints.items()}
    for ck in checkpoints.values():
        ck.model.attention = request.param
    yield request.param
    for arch, ck in checkpoints.items():
        ck.model.attention = saved[arch]


@pytest.mark.parametrize("mode", list(SCHEDULES))
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_hf(checkpoints, backend, arch, block_size, mode):
    ck = checkpoints[arch]
    prompt_lens, budget = SCHEDULES[mode]
    sequences = random_prompts(LENGTHS, ck.config.vocab_size, seed=block_size)
    got, steps, mixed = run_schedule(ck.model, sequences, prompt_lens, budget, block_size, seed=block_size)
    assert (steps == 1) == (mode == "one_forward")
    if mode == "chunked":
        assert mixed  # some forward carried prompt chunks and decode tokens together
    for seq, logits in zip(sequences, got):
        torch.testing.assert_close(logits, hf_logits(ck.hf, seq), atol=ATOL, rtol=0)


def test_mistral_window_matters(checkpoints):
    """The window changes the logits past position 16, so matching HF above is meaningful."""
    ck = checkpoints["mistral"]
    seq = random_prompts([40], ck.config.vocab_size, seed=3)[0]
    windowed, _, _ = run_schedule(ck.model, [seq], [40], 10_000, 16)
    model = ck.model
    saved = [layer.self_attn.sliding_window for layer in model.model.layers]
    try:
        for layer in model.model.layers:
            layer.self_attn.sliding_window = None
        full, _, _ = run_schedule(model, [seq], [40], 10_000, 16)
    finally:
        for layer, w in zip(model.model.layers, saved):
            layer.self_attn.sliding_window = w
    assert ck.config.sliding_windows == (16, 16)
    torch.testing.assert_close(windowed[0][:16], full[0][:16], atol=1e-5, rtol=0)
    assert (windowed[0][16:] - full[0][16:]).abs().max() > 1e-2


PROMPTS = ["The cache", "On a quiet morning the baker", "def add(a, b):", "Boats carry wood, salt and"]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generate_matches_hf(checkpoints, backend, arch):
    ck = checkpoints[arch]
    tok = load_tokenizer(ck.path)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    ours = greedy_generate(ck.model, prompts, max_new_tokens=10, block_size=4,
                           eos_token_ids=ck.config.eos_token_ids)
    for prompt, got in zip(prompts, ours):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = ck.hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                                 do_sample=False, pad_token_id=tok.pad_token_id)
        assert got == out[0, len(prompt):].tolist(), tok.decode(prompt)
    assert len({tuple(o) for o in ours}) == len(ours)  # not degenerate: prompts lead somewhere different

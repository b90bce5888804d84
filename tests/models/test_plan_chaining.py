"""The model hands a backend its previous plan only when that is safe.

With the "sdpa" backend consecutive decode steps carry their K/V
(``servelab.attention.decode_kv``). The model must stop the carry when a
cache tensor was written between forwards, when a forward failed midway,
and when the backend or the caches changed; the logits must then equal a
run that never carried anything.
"""

from __future__ import annotations

import pytest
import torch
from model_harness import PagedRunner

from servelab.models import build_tiny_model, load_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("chain"), arch="llama", seed=3, hidden_size=64,
                            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2)
    model, _ = load_model(path)
    model.attention = "sdpa"
    return model


def decode(runner, last, steps, *, before_step=None):
    """``steps`` greedy decode steps of every sequence; logits per step."""
    out = []
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        logits = runner.step({s: [t] for s, t in last.items()})
        last = {s: int(v[-1].argmax()) for s, v in logits.items()}
        out.append(torch.stack([logits[s][-1] for s in sorted(logits)]))
    return out


def prefill(model, seed=0):
    runner = PagedRunner(model, block_size=4, num_blocks=64, seed=seed)
    prompts = {0: [5, 9, 2, 7, 1, 8], 1: [3, 3, 4], 2: [11, 12, 13, 14, 15]}
    logits = runner.step(prompts)
    return runner, {s: int(v[-1].argmax()) for s, v in logits.items()}


def reference_run(model, steps, before_step=None):
    """The same steps with nothing carried (state reset before every forward)."""
    runner, last = prefill(model)

    def reset_then(step):
        if before_step is not None:
            before_step(runner, step)
        model.reset_attention_state()
    return decode(runner, last, steps, before_step=reset_then)


def test_carried_steps_equal_uncarried(model):
    runner, last = prefill(model)
    carried = decode(runner, last, 6)
    assert model.__dict__.get("_plan_memory") is not None  # it did carry
    for a, b in zip(carried, reference_run(model, 6)):
        assert torch.equal(a, b)


def test_a_cache_written_between_forwards_stops_the_carry(model):
    def poke(runner, step):
        if step == 3:  # rewrite a block that every later step reads
            block = runner.tables[0][0]
            for key_cache, value_cache in runner.caches.views:
                key_cache[block].mul_(0.5)
                value_cache[block].add_(1.0)

    runner, last = prefill(model)
    got = decode(runner, last, 5, before_step=lambda step: poke(runner, step))
    expected = reference_run(model, 5, before_step=poke)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert not torch.equal(got[4], reference_run(model, 5)[4])  # the poke mattered


def test_a_failed_forward_leaves_nothing_to_carry(model):
    runner, last = prefill(model)
    decode(runner, last, 2)
    assert model.__dict__.get("_plan_memory") is not None
    layer = model.model.layers[1]

    def boom(*_):
        raise RuntimeError("injected")
    handle = layer.register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            runner.step({s: [1] for s in runner.tables})
    finally:
        handle.remove()
    assert model.__dict__.get("_plan_memory") is None


def test_swapping_the_backend_drops_the_carry(model):
    runner, last = prefill(model)
    decode(runner, last, 2)
    model.attention = "sdpa"  # a new backend object
    try:
        assert model._previous_plans(model.attention, list(runner.caches.views)) is None
    finally:
        model.reset_attention_state()

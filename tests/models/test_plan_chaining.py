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


def _count_carried(monkeypatch) -> list:
    """Record what every ``StepAttention.carried_attend`` call returned (None: the public calls)."""
    from servelab.models import llama

    taken, real = [], llama.StepAttention.carried_attend

    def counted(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(llama.StepAttention, "carried_attend", counted)
    return taken


def written(runner) -> list[torch.Tensor]:
    """Every cache tensor's written rows (the sequences' positions so far), in a fixed order."""
    bs = runner.block_size
    slots = [(table[p // bs], p % bs) for s, table in sorted(runner.tables.items())
             for p in range(runner.computed[s])]
    blocks, offsets = (torch.tensor(x) for x in zip(*slots))
    return [t[blocks, offsets].clone() for pair in runner.caches.views for t in pair]


def _count_extending(monkeypatch) -> list:
    """Record whether every ``DecodeKV.attend_extending`` call attended (not None)."""
    from servelab.attention.decode_kv import DecodeKV

    attended, real = [], DecodeKV.attend_extending
    monkeypatch.setattr(DecodeKV, "attend_extending",
                        lambda self, *a: attended.append((out := real(self, *a)) is not None) or out)
    return attended


def test_the_direct_carried_calls_equal_the_public_ones(model, monkeypatch):
    """Carried decode steps: every layer after the first writes and attends through
    ``carried_attend``; the logits and every cache equal a run where it always declines."""
    from servelab.models import llama

    taken = _count_carried(monkeypatch)
    extending = _count_extending(monkeypatch)
    runner, last = prefill(model)
    direct = decode(runner, last, 5)
    caches = written(runner)
    layers = len(model.model.layers)
    assert taken[:layers] == [False] * layers  # the prefill step: nothing carried
    per_step = [taken[i:i + layers] for i in range(layers, len(taken), layers)]
    # The first layer of a step takes the public, checked calls; the others the direct ones.
    assert per_step == [[False] + [True] * (layers - 1)] * 5
    assert sum(extending) >= 4 * (layers - 1)  # the steps after the first extend their buffers
    model.reset_attention_state()
    monkeypatch.setattr(llama.StepAttention, "carried_attend", lambda self, *a, **k: None)
    runner, last = prefill(model)
    public = decode(runner, last, 5)
    for a, b in zip(direct, public):
        assert torch.equal(a, b)
    for a, b in zip(caches, written(runner)):
        assert torch.equal(a, b)


def test_an_overriding_backend_is_never_bypassed(model, monkeypatch):
    """A researcher's backend that overrides the write or the attention gets every layer's call."""
    from servelab.attention.backends import SdpaAttentionBackend

    calls = []

    class Counting(SdpaAttentionBackend):
        name = "counting-sdpa"

        def _paged_attention(self, *args, **kwargs):
            calls.append(1)
            return super()._paged_attention(*args, **kwargs)

    model.attention = Counting()
    try:
        taken = _count_carried(monkeypatch)
        runner, last = prefill(model)
        decode(runner, last, 3)
        assert not any(taken) and len(calls) == 4 * len(model.model.layers)
    finally:
        model.attention = "sdpa"
        model.reset_attention_state()


def test_the_direct_attention_refuses_a_query_of_another_step(model):
    """``DecodeKV.attend_extending`` answers only a query with the step's rows (its kernel reads
    one buffer row per query row): any other count is refused, not read out of bounds."""
    runner, last = prefill(model)
    decode(runner, last, 3)
    decode_kv = model.__dict__["_plan_memory"][2][None].decode_kv
    key_cache, value_cache = runner.caches.views[1]
    heads, head_dim = model.config.num_attention_heads, model.config.head_dim
    try:
        for rows in (2, 4):
            query = torch.zeros(rows, heads, head_dim)
            assert decode_kv.attend_extending(query, key_cache, value_cache, 1.0) is None
        assert decode_kv.attend_extending(torch.zeros(3, heads, head_dim), key_cache, value_cache, 1.0) is not None
    finally:
        model.reset_attention_state()

"""Carried decode K/V through mixed steps (some rows prefill) and rows that join.

The simulated serving loop of ``test_decode_kv.py`` with prompts arriving: a step's rows
are the running sequences in order (each decoding one token, or now and then a chunk of
several) followed by new prompts; sequences finish at random. Every step's attention
through the chained plan must match the float64 reference and equal a fresh (unchained)
plan bit for bit.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_decode_kv import HEADS, Loop, _note

import servelab.attention.decode_kv as decode_kv
from servelab.attention import cpu_decode
from servelab.attention.sdpa import paged_attention, plan_attention
from servelab.reference import paged_attention as reference_attention


def attend_mixed(loop, rows, q_lens, previous=None):
    """The plan of one step of ``rows`` with ``q_lens`` query rows each (their tokens written)."""
    table, seq_lens, _ = loop.metadata(rows)
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    plan = plan_attention(table, seq_lens, qsl, block_size=loop.block_size, chain=True, previous=previous)
    query = loop.query(int(qsl[-1]))
    out = paged_attention(query, loop.key_cache, loop.value_cache, table, seq_lens, qsl, plan=plan)
    expected = reference_attention(query.double(), loop.key_cache.double(), loop.value_cache.double(), table,
                                   seq_lens, qsl)
    tol = {torch.float64: 1e-10, torch.float32: 2e-5}[query.dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    fresh = paged_attention(query, loop.key_cache, loop.value_cache, table, seq_lens, qsl,
                            plan=plan_attention(table, seq_lens, qsl, block_size=loop.block_size, chain=True))
    assert torch.equal(out, fresh), "a carried step must equal a fresh start bit for bit"
    return plan


def add_sequence(loop, length):
    loop.tables.append([])
    loop.lens.append(0)
    for _ in range(length):
        loop.write(len(loop.lens) - 1)
    return len(loop.lens) - 1


@pytest.mark.parametrize("kernel", ["1", "0"], ids=["c-kernel", "torch"])
@settings(max_examples=30, deadline=None)
@given(lens=st.lists(st.integers(4, 30), min_size=1, max_size=6), heads=st.sampled_from(HEADS),
       block_size=st.sampled_from([1, 4, 16]), steps=st.integers(1, 8), headroom=st.sampled_from([0, 3, 64]),
       seed=st.integers(0, 2**16))
def test_mixed_steps_and_joining_rows_match_a_fresh_plan(kernel, lens, heads, block_size, steps, headroom, seed):
    if kernel == "1" and not cpu_decode.available():
        pytest.skip("the C kernel is not built here")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cpu_decode.ENV_SWITCH, kernel)
        patch.setattr(decode_kv, "HEADROOM", headroom)
        loop = Loop(lens, *heads, 16, block_size, seed, num_blocks=4000, dtype=torch.float32)
        rows = list(range(len(lens)))
        plan = attend_mixed(loop, rows, [1] * len(rows))
        for _ in range(steps):
            if len(rows) > 1 and loop.rng.random() < 0.3:  # some sequences finish
                rows = sorted(loop.rng.sample(rows, loop.rng.randrange(1, len(rows))), key=rows.index)
            q_lens = []
            for i in rows:  # mostly one token each, now and then a chunk
                take = loop.rng.choice([1, 1, 1, 1, 2, 3])
                for _ in range(take):
                    loop.write(i)
                q_lens.append(take)
            for _ in range(loop.rng.choice([0, 0, 1, 2])):  # new prompts, after the running rows
                prompt = loop.rng.randrange(2, 24)
                rows.append(add_sequence(loop, prompt))
                q_lens.append(prompt)
            _note(f"rows {rows}, q_lens {q_lens}, lens {[loop.lens[i] for i in rows]}")
            plan = attend_mixed(loop, rows, q_lens, previous=plan)


def test_a_prompt_step_keeps_the_decode_rows_and_the_prompt_joins_without_a_regather(monkeypatch):
    """decode (rows 0-2) -> mixed (0-2 decode, a prompt) -> decode (0-2 and the prompt's row):
    the mixed step extends the decode rows' buffers; the next step gathers only the joining
    row, into the spare rows of the same storage."""
    loop = Loop([12, 7, 20], 4, 2, 16, 4, seed=3, dtype=torch.float32)
    plan = attend_mixed(loop, [0, 1, 2], [1, 1, 1])
    storages = {layer: k.untyped_storage().data_ptr() for layer, (k, _, _) in plan.decode_kv.buffers.items()}
    for i in (0, 1, 2):
        loop.write(i)
    prompt = add_sequence(loop, 9)
    mixed = attend_mixed(loop, [0, 1, 2, prompt], [1, 1, 1, 9], previous=plan)
    assert mixed.decode_kv.extends and mixed.decode_kv.lens.tolist() == [13, 8, 21]
    assert mixed.decode_tokens.tolist() == [0, 1, 2] and mixed.other_groups

    gathered = []
    real = decode_kv.DecodeKV._gather_rows
    monkeypatch.setattr(decode_kv.DecodeKV, "_gather_rows",
                        lambda self, *a: gathered.append(self.lens.shape[0] - a[5]) or real(self, *a))
    for i in (0, 1, 2, prompt):
        loop.write(i)
    joined = attend_mixed(loop, [0, 1, 2, prompt], [1, 1, 1, 1], previous=mixed)
    assert joined.decode_kv.joined and joined.decode_kv._kept == [0, 1, 2]
    layers = len(joined.decode_kv.buffers)
    assert gathered[:layers] == [1] * layers  # one row gathered per layer (then the fresh check's)
    assert {layer: k.untyped_storage().data_ptr() for layer, (k, _, _) in joined.decode_kv.buffers.items()} \
        == storages
    for i in (0, 1, 2, prompt):
        loop.write(i)
    assert attend_mixed(loop, [0, 1, 2, prompt], [1] * 4, previous=joined).decode_kv.extends


def test_no_room_for_joining_rows_regathers_the_layer(monkeypatch):
    monkeypatch.setattr(decode_kv, "ROW_HEADROOM", 0.0)
    loop = Loop([6, 8, 7, 9, 5], 2, 1, 16, 4, seed=4, dtype=torch.float32)
    rows = [0, 1, 2, 3, 4]
    plan = attend_mixed(loop, rows, [1] * 5)  # storage for 5 + 4 rows (at least 4 spare)

    def storages(plan):
        return {k.untyped_storage().data_ptr() for k, _, _ in plan.decode_kv.buffers.values()}

    seen = [storages(plan)]
    for _ in range(2):  # 5 + 3 rows fit the first storage; 11 do not: that step starts afresh
        extra = [add_sequence(loop, 4) for _ in range(3)]
        for i in rows:
            loop.write(i)
        rows = rows + extra
        plan = attend_mixed(loop, rows, [1] * len(rows), previous=plan)
        assert plan.decode_kv.joined
        seen.append(storages(plan))
    assert seen[1] == seen[0] and not seen[2] & seen[1]


def test_rows_sharing_a_prefix_block_are_matched_once():
    """Sequence 1 shares sequence 0's first (full) block and has its length: only 0 continues
    the old row; 1 joins (gathered), and both are right."""
    if not cpu_decode.available():
        pytest.skip("the C kernel is not built here")
    loop = Loop([10], 4, 2, 16, 4, seed=5, dtype=torch.float32)
    plan = attend_mixed(loop, [0], [1])
    loop.write(0)
    loop.tables.append([loop.tables[0][0]])  # the shared prefix block, full
    loop.lens.append(4)
    for _ in range(7):
        loop.write(1)
    assert loop.lens == [11, 11]
    joined = attend_mixed(loop, [0, 1], [1, 1], previous=plan)
    assert joined.decode_kv.joined and joined.decode_kv._kept == [0]

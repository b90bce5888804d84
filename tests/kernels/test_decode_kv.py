"""Carried decode K/V (``plan_attention(chain=True, previous=...)``) against the reference.

A simulated serving loop: sequences grow one token per step in a paged cache
(new blocks taken from a shuffled free list), every unused slot poisoned with
NaN. Each step's attention through the chained plan must match the float64
reference, equal a fresh (unchained) plan bit for bit, and actually extend
the previous step's buffers when the rows are the same (grow them when
outgrown, keep them in place when some rows finished).
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from hypothesis import given, note, settings
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument

import servelab.attention.buckets as buckets
import servelab.attention.decode_kv as decode_kv
import servelab.attention.decode_plan as decode_plan
from servelab.attention import cpu_decode, cpu_kernel_build
import servelab.attention.sdpa as sdpa
from servelab.attention.sdpa import paged_attention, plan_attention
from servelab.reference import paged_attention as reference_attention


class Loop:
    """``n`` sequences in a paged cache of ``num_blocks`` blocks, float64, NaN where unused."""

    def __init__(self, lens, num_q_heads, num_kv_heads, head_size, block_size, seed, num_blocks=None,
                 dtype=torch.float64):
        if num_blocks is None:  # room for every sequence to grow by 16 tokens
            num_blocks = 1 + sum(-(-(n + 16) // block_size) for n in lens)
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.heads = (num_q_heads, num_kv_heads, head_size)
        self.block_size = block_size
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        self.key_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.value_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.free = list(range(1, num_blocks))
        self.rng.shuffle(self.free)
        self.tables: list[list[int]] = [[] for _ in lens]
        self.lens = [0] * len(lens)
        for i, length in enumerate(lens):
            for _ in range(length):
                self.write(i)

    def write(self, i: int) -> None:
        """Append one random K/V row to sequence ``i``."""
        pos = self.lens[i]
        if pos % self.block_size == 0:
            self.tables[i].append(self.free.pop())
        block, offset = self.tables[i][pos // self.block_size], pos % self.block_size
        _, num_kv_heads, head_size = self.heads
        for cache in (self.key_cache, self.value_cache):
            cache[block, offset] = torch.randn(num_kv_heads, head_size, generator=self.gen, dtype=torch.float64)
            # (assigned into the cache's own dtype)
        self.lens[i] += 1

    def metadata(self, rows):
        width = max(len(self.tables[i]) for i in rows) + 1
        table = torch.full((len(rows), width), 10**6, dtype=torch.int32)  # unused entries: out of range
        for r, i in enumerate(rows):
            table[r, : len(self.tables[i])] = torch.tensor(self.tables[i], dtype=torch.int32)
        seq_lens = torch.tensor([self.lens[i] for i in rows], dtype=torch.int32)
        return table, seq_lens, torch.arange(len(rows) + 1, dtype=torch.int32)

    def query(self, n):
        num_q_heads, _, head_size = self.heads
        return torch.randn(n, num_q_heads, head_size, generator=self.gen, dtype=torch.float64).to(self.key_cache.dtype)


def attend(loop, rows, previous=None, chain=True):
    """(out, plan) of one decode step of ``rows`` (their tokens already written)."""
    table, seq_lens, qsl = loop.metadata(rows)
    plan = plan_attention(table, seq_lens, qsl, block_size=loop.block_size, chain=chain, previous=previous)
    query = loop.query(len(rows))
    out = paged_attention(query, loop.key_cache, loop.value_cache, table, seq_lens, qsl, plan=plan)
    expected = reference_attention(query.double(), loop.key_cache.double(), loop.value_cache.double(), table,
                                   seq_lens, qsl)
    tol = {torch.float64: 1e-10, torch.float32: 2e-5}.get(query.dtype, 1e-2)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    fresh = paged_attention(query, loop.key_cache, loop.value_cache, table, seq_lens, qsl,
                            plan=plan_attention(table, seq_lens, qsl, block_size=loop.block_size, chain=True))
    assert torch.equal(out, fresh), "a carried step must equal a fresh start bit for bit"
    return out, plan


HEADS = [(1, 1), (4, 2), (6, 3), (8, 1), (5, 5)]


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=8), heads=st.sampled_from(HEADS),
       head_size=st.sampled_from([4, 16]), block_size=st.sampled_from([1, 2, 4, 8]),
       steps=st.integers(1, 6), headroom=st.sampled_from([0, 3, 64]), overhead=st.sampled_from([0, 16, 512]),
       seed=st.integers(0, 2**16), finish=st.booleans())
def test_carried_steps_match_reference(lens, heads, head_size, block_size, steps, headroom, overhead, seed, finish):
    lens = [max(1, min(n, 4 * min(lens))) for n in lens]  # keep padding under MAX_PADDING
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode_kv, "HEADROOM", headroom)  # small: buffers outgrown, regathered
        patch.setattr(sdpa, "DECODE_BUCKET_OVERHEAD", overhead)  # small: many length buckets
        patch.setattr(buckets, "DECODE_BUCKET_OVERHEAD", overhead)  # (what decode_kv reads)
        run_loop(lens, heads, head_size, block_size, steps, seed, finish=finish)


def test_rows_are_sorted_into_length_buckets(monkeypatch):
    monkeypatch.setattr(buckets, "DECODE_BUCKET_OVERHEAD", 0)
    loop = Loop([30, 3, 17, 3, 25], 4, 2, 8, 4, seed=6)
    rows = list(range(5))
    _, plan = attend(loop, rows)
    carried = plan.decode_kv
    assert carried.order.tolist() == [1, 3, 2, 4, 0] and len(carried.buckets) > 1
    for _ in range(3):
        for i in rows:
            loop.write(i)
        _, plan = attend(loop, rows, previous=plan)
        assert plan.decode_kv.extends and plan.decode_kv.buckets == carried.buckets


@pytest.mark.parametrize("kernel", ["1", "0"], ids=["c-kernel", "torch"])
@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(1, 40), min_size=1, max_size=6),
       heads=st.sampled_from(HEADS + [(9, 3), (16, 2), (18, 2)]), head_size=st.sampled_from([16, 32, 48]),
       block_size=st.sampled_from([1, 4, 16]), steps=st.integers(1, 4), headroom=st.sampled_from([0, 3, 64]),
       seed=st.integers(0, 2**16), finish=st.booleans())
def test_float32_loop_both_formulations(kernel, lens, heads, head_size, block_size, steps, headroom, seed, finish):
    """float32 caches: the C kernel (when buildable) and the torch formulation, each within
    float32 rounding of the float64 reference and carried == fresh bit for bit."""
    if kernel == "1" and not cpu_decode.available():
        if shutil.which(cpu_kernel_build.compiler()) is not None:
            pytest.fail("a C compiler exists but the C kernel did not build (see the warning)")
        pytest.skip("no C compiler: the kernel is not built")
    lens = [max(1, min(n, 4 * min(lens))) for n in lens]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cpu_decode.ENV_SWITCH, kernel)
        patch.setattr(decode_kv, "HEADROOM", headroom)
        plan = run_loop(lens, heads, head_size, block_size, steps, seed, dtype=torch.float32, finish=finish)
    group = heads[0] // heads[1]
    expected = kernel == "1" and group <= cpu_decode.MAX_GROUP
    assert all(flag == expected for _, _, flag in plan.decode_kv.buffers.values())


def _note(text):
    try:
        note(text)
    except InvalidArgument:  # outside a hypothesis test
        pass


def run_loop(lens, heads, head_size, block_size, steps, seed, dtype=torch.float64, finish=False):
    """``steps`` decode steps of the same rows; with ``finish``, before some steps a random
    subset of the rows (never all) finishes, and the rest go on from compacted buffers."""
    loop = Loop(lens, *heads, head_size, block_size, seed, dtype=dtype)
    rows = list(range(len(lens)))
    _, plan = attend(loop, rows)
    assert plan.decode_kv is not None and not plan.decode_kv.extends
    for _ in range(steps):
        left = finish and len(rows) > 1 and loop.rng.random() < 0.5
        if left:
            rows = sorted(loop.rng.sample(rows, loop.rng.randrange(1, len(rows))))
        for i in rows:
            loop.write(i)
        previous = plan
        _, plan = attend(loop, rows, previous=previous)
        _note(f"rows {rows}, lens {loop.lens}, cap {plan.decode_kv.cap}")
        fits = max(loop.lens[i] for i in rows) <= previous.decode_kv.cap
        assert plan.decode_kv.extends == (fits and not left)
        assert plan.decode_kv.grown == (not fits and not left)  # the same rows, outgrown: copied, not gathered
        assert plan.decode_kv.compacted == (fits and left)  # rows left: the rest kept in place
    return plan


def step_without_gather(loop, rows, plan, monkeypatch, why):
    """One decode step of ``rows`` (each written one token longer) chained from ``plan`` while
    ``DecodeKV._gather`` raises ``why``; asserts it equals a fresh plan bit for bit; returns its plan."""
    def no_gather(*args, **kwargs):
        raise AssertionError(f"{why}, not gather from the cache")

    for i in rows:
        loop.write(i)
    table, seq_lens, qsl = loop.metadata(rows)
    with monkeypatch.context() as patch:
        patch.setattr(decode_kv.DecodeKV, "_gather", no_gather)
        chained = plan_attention(table, seq_lens, qsl, block_size=loop.block_size, chain=True, previous=plan)
        query = loop.query(len(rows))
        out = paged_attention(query, loop.key_cache, loop.value_cache, table, seq_lens, qsl, plan=chained)
    fresh = paged_attention(query, loop.key_cache, loop.value_cache, table, seq_lens, qsl,
                            plan=plan_attention(table, seq_lens, qsl, block_size=loop.block_size, chain=True))
    assert torch.equal(out, fresh)
    return chained


@pytest.mark.parametrize("kernel", ["1", "0"], ids=["c-kernel", "torch"])
def test_outgrown_buffers_grow_from_the_old_ones_without_a_gather(kernel, monkeypatch):
    if kernel == "1" and not cpu_decode.available():
        pytest.skip("the C kernel is not built here")
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, kernel)
    monkeypatch.setattr(decode_kv, "HEADROOM", 0)
    loop = Loop([15, 9, 16], 4, 2, 16, 4, seed=7, dtype=torch.float32)
    rows = [0, 1, 2]
    _, plan = attend(loop, rows)
    assert plan.decode_kv.cap == 16 and not plan.decode_kv.grown

    grown = step_without_gather(loop, rows, plan, monkeypatch, "an outgrown step must copy its old buffers")
    assert grown.decode_kv.grown and grown.decode_kv.cap == 32  # max(17 + 0, 1.5 * 16) -> 32 (multiple of 16)
    assert grown.decode_kv._grow_from == {}  # every layer took its old buffers (and let go of them)


@pytest.mark.parametrize("kernel", ["1", "0"], ids=["c-kernel", "torch"])
def test_finished_rows_leave_the_rest_in_place_without_a_gather(kernel, monkeypatch):
    """Two of five rows finish: the next step gathers nothing and allocates no buffer (the
    kept rows move down within the old storage), and equals a fresh plan bit for bit."""
    if kernel == "1" and not cpu_decode.available():
        pytest.skip("the C kernel is not built here")
    monkeypatch.setenv(cpu_decode.ENV_SWITCH, kernel)
    monkeypatch.setattr(buckets, "DECODE_BUCKET_OVERHEAD", 0)
    loop = Loop([30, 3, 17, 5, 25], 4, 2, 16, 4, seed=8, dtype=torch.float32)
    _, plan = attend(loop, [0, 1, 2, 3, 4])
    old = {layer: (k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr())
           for layer, (k, v, _) in plan.decode_kv.buffers.items()}

    rows = [0, 2, 4]  # 1 and 3 finished (the shortest: buffer rows 0 and 1, so every kept row moves)
    kept = step_without_gather(loop, rows, plan, monkeypatch, "rows that go on must keep their buffers")
    assert kept.decode_kv.compacted and kept.decode_kv._compact_from == {}
    assert {layer: (k.untyped_storage().data_ptr(), v.untyped_storage().data_ptr())
            for layer, (k, v, _) in kept.decode_kv.buffers.items()} == old
    for i in rows:  # and the compacted buffers extend like any others
        loop.write(i)
    _, after = attend(loop, rows, previous=kept)
    assert after.decode_kv.extends


def test_grown_cap_is_geometric_within_the_budget(monkeypatch):
    monkeypatch.setattr(decode_kv, "HEADROOM", 64)
    previous = type("Previous", (), {"cap": 320, "bytes": 0})()
    assert decode_plan.grown_cap(previous, 321) == 480  # 1.5 x 320 > 321 + 64
    assert decode_plan.grown_cap(previous, 470) == 544  # at least the context plus the headroom
    previous.bytes = decode_kv.BUDGET_BYTES // 2  # the budget allows 2 x 320 = 640 positions
    monkeypatch.setattr(decode_kv, "GROWTH", 4.0)
    assert decode_plan.grown_cap(previous, 321) == 640
    previous.bytes = decode_kv.BUDGET_BYTES  # no room to grow at all: the headroom still applies
    assert decode_plan.grown_cap(previous, 321) == 400


def test_changed_rows_start_afresh():
    loop = Loop([5, 9, 7], 4, 2, 8, 4, seed=1)
    _, plan = attend(loop, [0, 1, 2])
    for i in (0, 1, 2):
        loop.write(i)
    _, dropped = attend(loop, [0, 2], previous=plan)  # request 1 finished: the others kept in place
    assert not dropped.decode_kv.extends and dropped.decode_kv.compacted
    loop.write(0)
    loop.write(2)
    _, swapped = attend(loop, [2, 0], previous=dropped)  # same requests, other order
    assert not swapped.decode_kv.extends and not swapped.decode_kv.compacted
    loop.write(0)
    loop.write(2)
    _, same = attend(loop, [2, 0], previous=swapped)
    assert same.decode_kv.extends


def test_same_length_is_not_a_continuation():
    """A step re-run at the same lengths (a rolled-back step) must not append twice."""
    loop = Loop([6, 6], 2, 1, 8, 4, seed=2)
    _, plan = attend(loop, [0, 1])
    _, again = attend(loop, [0, 1], previous=plan)
    assert not again.decode_kv.extends


def test_too_much_padding_and_prefills_use_the_gather_groups():
    loop = Loop([1, 1, 1, 1, 2, 80], 2, 1, 8, 4, seed=3)
    rows = list(range(6))
    table, seq_lens, qsl = loop.metadata(rows)  # 6 x 80 padded > MAX_PADDING x 86 real
    assert plan_attention(table, seq_lens, qsl, block_size=4, chain=True).decode_kv is None
    prefill_qsl = torch.tensor([0, 1, 2, 3, 4, 6, 7], dtype=torch.int32)
    prefill = plan_attention(table, seq_lens, prefill_qsl, block_size=4, chain=True)
    assert prefill.decode_kv is None and prefill.groups
    windowed = plan_attention(table[4:], seq_lens[4:], qsl[:3], block_size=4, chain=True, sliding_window=8)
    assert windowed.decode_kv is None
    for subset in (rows, [4, 5]):
        attend(loop, subset)  # still right through the groups


def test_over_budget_layers_fall_back(monkeypatch):
    monkeypatch.setattr(decode_kv, "BUDGET_BYTES", 0)
    loop = Loop([5, 7], 4, 2, 8, 4, seed=4)
    out, plan = attend(loop, [0, 1])
    assert plan.decode_kv is not None and not plan.decode_kv.buffers  # nothing carried
    assert plan.groups  # planned on first need


@pytest.mark.parametrize("kernel", ["1", "0"], ids=["c-kernel", "torch"])
def test_bfloat16_caches_carried(kernel, monkeypatch):
    """bf16 caches, float32 compute: the buffers are float32 (the kernel's layout when it is on),
    the new rows appended through torch (dtype conversion), carried == fresh."""
    monkeypatch.setenv("SERVELAB_CPU_KERNELS", kernel)
    plan = run_loop([5, 20, 9], (6, 3), 16, 4, steps=3, seed=7, dtype=torch.bfloat16)
    assert plan.decode_kv.extends and all(k.dtype == torch.float32 for k, _, _ in plan.decode_kv.buffers.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_caches(dtype):
    loop = Loop([5, 8, 3], 6, 3, 16, 4, seed=5)
    loop.key_cache, loop.value_cache = loop.key_cache.to(dtype), loop.value_cache.to(dtype)
    table, seq_lens, qsl = loop.metadata([0, 1, 2])
    query = loop.query(3).to(dtype)
    plan = plan_attention(table, seq_lens, qsl, block_size=4, chain=True)
    out = paged_attention(query, loop.key_cache, loop.value_cache, table, seq_lens, qsl, plan=plan)
    expected = paged_attention(query, loop.key_cache, loop.value_cache, table, seq_lens, qsl)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kernel", ["1", "0"], ids=["c-kernel", "torch"])
def test_strided_query_rows(kernel, monkeypatch):
    """A query that is a slice of a fused QKV output (rows strided) gives the bits of a contiguous one."""
    monkeypatch.setenv("SERVELAB_CPU_KERNELS", kernel)
    loop = Loop([9, 30, 17], 6, 2, 16, 4, seed=8, dtype=torch.float32)
    table, seq_lens, qsl = loop.metadata([0, 1, 2])
    fused = torch.randn(3, 6 + 2 * 2, 16)  # [T, Hq + 2 Hk, D]
    query = fused[:, :6]
    assert not query.is_contiguous()
    outs = []
    for q in (query, query.contiguous()):
        plan = plan_attention(table, seq_lens, qsl, block_size=4, chain=True)
        outs.append(paged_attention(q, loop.key_cache, loop.value_cache, table, seq_lens, qsl, plan=plan))
    assert torch.equal(outs[0], outs[1])
    expected = reference_attention(query.double(), loop.key_cache.double(), loop.value_cache.double(), table,
                                   seq_lens, qsl)
    torch.testing.assert_close(outs[0].double(), expected, rtol=2e-5, atol=2e-5)

"""Stateful test: HybridKVCacheManager against its reference.

Hypothesis picks a mix of groups (full attention, sliding windows, Mamba;
equal or mixed block sizes), then drives admissions with prefix hits (chunked
prefills), decode steps with lookahead, preemption when the pool is full,
frees and prefix-cache resets on both managers at once, comparing every
observable after every step: hits and their per-group block ids, returned
blocks, the pool's free order, reference counts, the index and the stats.
Invariants are also checked on the fast manager alone (no leak, commit after
compute).
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from servelab.blocks import (
    FullAttentionSpec,
    HybridKVCacheManager,
    MambaSpec,
    SlidingWindowSpec,
    TokenSequence,
    unify_page_sizes,
)
from servelab.reference import HybridKVCacheManager as RefHybrid


def _spec(kind: str):
    if kind == "full":
        return FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=1, dtype=torch.float32)
    if kind == "full2h":  # twice the page: the others' blocks double under unification
        return FullAttentionSpec(block_size=2, num_kv_heads=2, head_size=1, dtype=torch.float32)
    if kind.startswith("sw"):
        return SlidingWindowSpec(block_size=2, num_kv_heads=1, head_size=1, dtype=torch.float32,
                                 sliding_window=int(kind[2:]))
    return MambaSpec(block_size=2, shapes=((1,),), dtypes=(torch.float32,))


KINDS = st.tuples(st.sampled_from(["full", "full2h", "sw3", "mamba"]),
                  st.lists(st.sampled_from(["full", "sw3", "sw4", "sw5", "mamba"]), min_size=1, max_size=2)
                  ).map(lambda t: [t[0], *t[1]])
# Shared system prompts make long prefix hits common; the tails make them end.
SYSTEM = [[0, 1, 0, 1, 1, 0, 0, 1, 1, 1], [1, 1, 0, 0, 1, 0, 1, 1, 0, 1, 0, 0]]
PROMPTS = st.tuples(st.sampled_from(SYSTEM + [[]]), st.lists(st.integers(0, 1), max_size=6)).map(
    lambda t: t[0] + t[1]).filter(bool)


def ids(blocks):
    return tuple([getattr(b, "block_id", b) for b in g] for g in blocks)


class HybridMachine(RuleBasedStateMachine):
    @initialize(kinds=KINDS, num_blocks=st.integers(6, 24), caching=st.booleans(),
                policy=st.sampled_from(["lru", "lfu"]))
    def setup(self, kinds, num_blocks, caching, policy):
        specs = unify_page_sizes([_spec(k) for k in kinds])
        self.fast = HybridKVCacheManager(specs, num_blocks, caching, max_model_len=40, eviction_policy=policy)
        self.ref = RefHybrid(specs, num_blocks, caching, max_model_len=40, eviction_policy=policy)
        self.running: dict[str, TokenSequence] = {}
        self.counter = 0

    def _same(self, a, b):
        assert (a is None) == (b is None)
        if a is not None:
            assert ids(a) == ids(b)

    def _compute(self, r: TokenSequence, n: int) -> None:
        r.num_computed_tokens += n
        self.fast.cache_blocks(r, r.num_computed_tokens)
        self.ref.cache_blocks(r, r.num_computed_tokens)

    @rule(prompt=PROMPTS, chunk=st.integers(1, 16), ahead=st.integers(0, 2))
    def admit(self, prompt, chunk, ahead):
        self.counter += 1
        r = TokenSequence(f"r{self.counter}", prompt, self.fast.block_size)
        hit_f, n_f = self.fast.get_computed_blocks(r)
        hit_r, n_r = self.ref.get_computed_blocks(r)
        assert n_f == n_r and ids(hit_f) == ids(hit_r)
        assert n_f % self.fast.hit_alignment == 0 and n_f <= max(r.num_tokens - 1, 0)
        n = min(r.num_tokens - n_f, chunk)
        new_f = self.fast.allocate_slots(r, n, n_f, hit_f, ahead)
        new_r = self.ref.allocate_slots(r, n, n_r, hit_r, ahead)
        self._same(new_f, new_r)
        if new_f is not None:
            r.num_computed_tokens = n_f
            self.running[r.request_id] = r
            self._compute(r, n)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 1), ahead=st.integers(0, 2), chunk=st.integers(1, 5))
    def step(self, data, token, ahead, chunk):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        r = self.running[rid]
        if r.num_computed_tokens >= r.num_tokens:
            if r.num_tokens >= 40:
                return
            r.append_token_ids([token])
        n = min(r.num_tokens - r.num_computed_tokens, chunk)
        new_f = self.fast.allocate_slots(r, n, 0, None, ahead)
        new_r = self.ref.allocate_slots(r, n, 0, None, ahead)
        self._same(new_f, new_r)
        if new_f is None:  # preempt, as the scheduler would
            self._free(rid)
        else:
            self._compute(r, n)

    def _free(self, rid):
        r = self.running.pop(rid)
        self.fast.free(r)
        self.ref.free(r)
        r.num_computed_tokens = 0

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data):
        self._free(data.draw(st.sampled_from(sorted(self.running))))

    @rule()
    def reset(self):
        assert self.fast.reset_prefix_cache() == self.ref.reset_prefix_cache()

    @invariant()
    def same_state(self):
        if not hasattr(self, "fast"):
            return
        fp, rp = self.fast.block_pool, self.ref.block_pool
        assert fp.free_block_ids() == rp.free_block_ids()
        assert fp.ref_counts() == rp.ref_counts()
        assert set(fp.cached_block_hash_to_block) == set(rp.block_of_hash)
        for rid in self.running:
            assert self.fast.get_block_ids(rid) == self.ref.get_block_ids(rid)
        assert self.fast.prefix_cache_stats == self.ref.prefix_cache_stats
        # No leak: every held block is accounted for by a running request.
        held = sum(1 for c in fp.ref_counts() if c > 0)
        owned = {b for rid in self.running for g in self.fast.get_block_ids(rid) for b in g if b}
        assert held == len(owned)
        # Commit after compute: every indexed held block is within computed tokens.
        for rid, r in self.running.items():
            for g, row in enumerate(self.fast.get_block_ids(rid)):
                bs = self.fast.groups[g].spec.block_size
                for i, b in enumerate(row):
                    if b and fp.blocks[b].block_hash is not None and fp.blocks[b].ref_cnt == 1:
                        assert (i + 1) * bs <= r.num_computed_tokens


HybridMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestHybridStateful = HybridMachine.TestCase

"""The model runner's persistent batch against a from-scratch rebuild.

Every step, the inputs the runner built incrementally (token ids, positions,
slot mapping, block table, seq_lens, query_start_loc) must equal what
``servelab.models.prepare_inputs`` builds from the scheduler's own state
(its requests' tokens and drafts, the KV manager's block ids) — through
chunked prefill, preemption and resume, prefix hits and draft verification.
Logits are computed only for the rows that are sampled."""

import pytest
import torch
from pipeline_helpers import assert_no_leaks, random_prompts

from servelab import Pipeline
from servelab.models import prepare_inputs
from servelab.samplers import SamplingParams


@pytest.mark.parametrize("arch, kwargs", [
    ("llama", dict(block_size=4, num_blocks=20, max_num_batched_tokens=13, long_prefill_token_threshold=6,
                   drafter="ngram", num_speculative_tokens=3)),
    ("mistral", dict(block_size=4, num_blocks=22, max_num_batched_tokens=9)),  # sliding window frees blocks
])
def test_runner_inputs_equal_a_rebuild_from_the_scheduler(tiny, arch, kwargs):
    pipe = Pipeline.from_pretrained(tiny[arch], **kwargs)
    runner, sched, manager = pipe.runner, pipe.scheduler, pipe.kv_cache_manager
    prepare, compute_logits = runner._prepare, runner.model.compute_logits
    seen = {"steps": 0, "tokens": 0, "logit_rows": 0, "drafts": 0, "resumed": 0}

    def checked_prepare(so, batch):
        input_ids, positions, meta, ends = prepare(so, batch)
        tokens, computed, tables = [], [], []
        for rid, c, n in so.iter_scheduled():
            req = sched.requests[rid]
            known = req.all_token_ids + so.scheduled_spec_decode_tokens.get(rid, [])
            tokens.append(known[c:c + n])
            computed.append(c)
            tables.append(manager.get_block_ids(rid)[0])  # one KV-cache group
        ids, pos, want = prepare_inputs(tokens, computed, tables, runner.block_size)
        assert torch.equal(input_ids, ids) and torch.equal(positions, pos)
        assert torch.equal(meta.slot_mapping, want.slot_mapping)
        assert torch.equal(meta.seq_lens, want.seq_lens) and torch.equal(meta.query_start_loc, want.query_start_loc)
        for row, table in enumerate(tables):
            table = table[: meta.block_table.shape[1]]  # lookahead blocks past this step's need are not sent
            got = meta.block_table[row, :len(table)].tolist()
            # A sliding window's released blocks are 0 in the manager's row; the
            # scheduler output never says so, and the window mask never reads them.
            assert [g for g, t in zip(got, table) if t] == [t for t in table if t]
        seen["steps"] += 1
        seen["tokens"] += len(ids)
        seen["drafts"] += len(so.scheduled_spec_decode_tokens)
        seen["resumed"] += sum(so.scheduled_cached_reqs.resumed)
        return input_ids, positions, meta, ends

    def counting_logits(hidden):
        seen["logit_rows"] += hidden.shape[0]
        return compute_logits(hidden)

    runner._prepare = checked_prepare
    runner.model.compute_logits = counting_logits
    try:
        prompts = random_prompts([2, 17, 30, 9, 23], seed=13)
        pipe.generate(prompts, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
        pipe.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=6))  # prefix hits
    finally:
        del runner.model.compute_logits
    assert seen["steps"] > 10 and seen["resumed"] > 0
    assert seen["logit_rows"] < seen["tokens"]  # prompt positions before the last are never projected
    if "drafter" in kwargs:
        assert seen["drafts"] > 0
    assert_no_leaks(pipe)


def test_a_single_group_runner_reads_group_0_and_refuses_several_groups(tiny):
    from servelab.scheduling.output import CachedRequestData, NewRequestData, SchedulerOutput

    runner = Pipeline.from_pretrained(tiny["llama"], block_size=4, num_blocks=20).runner

    def out(rid, block_ids):
        new = NewRequestData(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=1), block_ids, 0)
        return SchedulerOutput([new], CachedRequestData(), {rid: 5}, 5, {}, set(), set())

    runner._update_states(out("a", ([3, 7],)))  # one list per KV-cache group: the row is group 0's
    state = runner.requests["a"]
    assert state.num_blocks == 2 and runner.block_table[state.row, :2].tolist() == [3, 7]
    with pytest.raises(RuntimeError, match="block ids for 2 KV-cache groups reached a single-group model runner"):
        runner._update_states(out("b", ([3, 7], [8])))

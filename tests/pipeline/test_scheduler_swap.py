"""``Pipeline(scheduler=...)``: a registered name, a factory or a ready object; bad ones are named."""

from __future__ import annotations

import pytest

from servelab import Pipeline, SamplingParams
from servelab.blocks import FullAttentionSpec, KVCacheManager
from servelab.models import build_tiny_model, load_model, load_tokenizer
from servelab.scheduling import Scheduler, SchedulerConfig, available_schedulers, register_scheduler

GREEDY = SamplingParams(temperature=0, max_tokens=6)
PROMPTS = ["The cache", "A block table holds"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")
    return path, Pipeline.from_pretrained(path).generate(PROMPTS, GREEDY)


class CountingScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = 0

    def schedule(self):
        self.steps += 1
        return super().schedule()


def test_a_name_a_factory_and_an_object_all_run_the_same_tokens(tiny):
    path, ref = tiny
    register_scheduler("counting", CountingScheduler, override=True)
    assert {"servelab", "vllm", "counting"} <= set(available_schedulers())
    by_name = Pipeline.from_pretrained(path, scheduler="counting")
    by_class = Pipeline.from_pretrained(path, scheduler=CountingScheduler)
    model, config = load_model(path)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=config.num_key_value_heads, head_size=config.head_dim,
                             dtype=model.dtype)
    own = CountingScheduler(SchedulerConfig(max_num_seqs=4, max_model_len=128), KVCacheManager(spec, 32, True))
    by_object = Pipeline(model, load_tokenizer(path), scheduler=own)
    assert by_object.scheduler is own and by_object.kv_cache_manager is own.kv_cache_manager
    assert by_object.num_blocks == 32 and by_object.scheduler_config.max_num_seqs == 4
    for pipe in (by_name, by_class, by_object):
        assert [o.token_ids for o in pipe.generate(PROMPTS, GREEDY)] == [o.token_ids for o in ref]
        assert isinstance(pipe.scheduler, CountingScheduler) and pipe.scheduler.steps > 0


def test_bad_schedulers_are_refused_with_what_is_missing(tiny):
    path, _ = tiny
    with pytest.raises(TypeError, match=r"SchedulerInterface: it lacks abort_request\(\), add_request\(\)"):
        Pipeline.from_pretrained(path, scheduler=object())
    with pytest.raises(ValueError, match="unknown scheduler 'nope'; known: .*'servelab'"):
        Pipeline.from_pretrained(path, scheduler="nope")
    model, config = load_model(path)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=config.num_key_value_heads, head_size=config.head_dim,
                             dtype=model.dtype)
    own = Scheduler(SchedulerConfig(max_model_len=128), KVCacheManager(spec, 32, True))
    with pytest.raises(ValueError, match="pass only the scheduler"):
        Pipeline(model, scheduler=own, kv_cache_manager=KVCacheManager(spec, 32, True))


def test_a_kv_cache_manager_missing_members_is_told_all_of_them(tiny):
    path, _ = tiny
    model, _ = load_model(path)

    class Partial:
        block_size = 16

        def free(self, request):
            pass

    with pytest.raises(TypeError, match=r"kv_cache_manager \(Partial\) does not implement .*KVCacheManagerProtocol: "
                                        r"it lacks allocate_slots\(\), block_pool, cache_blocks\(\)"):
        Pipeline(model, kv_cache_manager=Partial())

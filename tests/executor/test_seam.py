"""The executor seam without worker processes: the default in-process executor, the registry, refusals."""

from __future__ import annotations

import multiprocessing

import pytest

from servelab import Pipeline, SamplingParams
from servelab.cluster.replicas import Replicas
from servelab.executor import Executor, ExecutorDeadError, available_executors, get_executor, register_executor
from servelab.executor.uniproc import UniprocExecutor
from servelab.models import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("seam") / "tiny")


def test_one_rank_runs_in_process_and_close_is_idempotent(tiny):
    params = SamplingParams(temperature=0, max_tokens=6)
    expected = Pipeline.from_pretrained(tiny).generate(["The cache"], params)[0].token_ids
    with Pipeline.from_pretrained(tiny) as pipe:
        assert isinstance(pipe.executor, UniprocExecutor) and pipe.executor.in_process
        assert pipe.runner is pipe.executor.runner  # today's runner, unchanged
        assert pipe.generate(["The cache"], params)[0].token_ids == expected
    pipe.close()  # again: no error
    with pytest.raises(ExecutorDeadError, match="shut down"):
        pipe.executor.execute(None)  # type: ignore[arg-type]
    assert multiprocessing.active_children() == []


def test_registry_takes_names_and_objects_and_refuses_the_rest():
    assert {"uniproc", "multiproc", "ray"} <= set(available_executors())
    executor = UniprocExecutor()
    assert get_executor(executor) is executor
    with pytest.raises(ValueError, match="already registered"):
        register_executor("uniproc", UniprocExecutor)
    with pytest.raises(TypeError, match="servelab.executor.Executor"):
        get_executor(object())
    with pytest.raises(TypeError, match="abstract"):
        Executor()  # type: ignore[abstract]


def test_replicas_refuse_bad_settings_before_any_process_starts(tiny):
    with pytest.raises(ValueError, match="num_replicas=0"):
        Replicas(tiny, 0)
    with pytest.raises(ValueError, match="num_replicas sets"):
        Replicas(tiny, 2, data_parallel_size=2)
    with pytest.raises(TypeError):
        Replicas(tiny, 2, not_a_setting=1)
    assert multiprocessing.active_children() == []


def test_last_stage_of_a_tied_model_keeps_the_embedding_as_its_head(tmp_path):
    """Regression: a later stage replaces the embedding, so a tied head must keep its weight."""
    import torch

    from servelab.executor.parallel_state import ParallelState
    from servelab.executor.sharding import StageInput, split_stages
    from servelab.models import load_model

    model, _ = load_model(build_tiny_model(tmp_path / "tied", tie_word_embeddings=True, num_hidden_layers=3))
    embedding = model.model.embed_tokens.weight.detach().clone()
    stage = split_stages(model, ParallelState.simulated(1, 1, 2))  # rank 1 of 2 stages: the last
    assert isinstance(stage.model.embed_tokens, StageInput) and len(stage.model.layers) == 1
    assert stage.config.num_hidden_layers == 1 and torch.equal(stage.lm_head.weight, embedding)

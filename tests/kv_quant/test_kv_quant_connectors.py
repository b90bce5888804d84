"""Quantized pages through the offload tier: saved and loaded with their in-page scales (or, with
static scales, read with the layer's own), token for token equal to the same quantized pipeline
without the connector, with the tier really serving hits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from servelab import Pipeline, SamplingParams
from servelab.connectors.offload import OffloadConnector
from servelab.models import build_tiny_model, load_model, load_tokenizer

sys.path.insert(0, str(Path(__file__).parents[1] / "connectors"))
from connector_helpers import one_by_one, shared_prefix_prompts  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
SMALL = dict(block_size=4, num_blocks=20, enable_prefix_caching=True, max_num_seqs=2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("kvq-conn") / "tiny", arch="llama")
    return load_model(path)[0], load_tokenizer(path)


@pytest.mark.parametrize("scale", ["token_head", "head"])
def test_offload_moves_quantized_pages_with_their_scales(tiny, scale):
    model, tok = tiny
    prompts = shared_prefix_prompts(8)
    settings = dict(SMALL, kv_cache_dtype="int8", kv_cache_scale=scale)
    reference = one_by_one(Pipeline(model, tok, **settings), prompts, GREEDY)
    conn = OffloadConnector(cpu_blocks=64)
    pipe = Pipeline(model, tok, kv_connector=conn, **settings)
    if scale == "head":
        assert all(len(layer) == 2 for layer in conn.kv_caches)  # static scales are not page tensors
    else:
        assert all(len(layer) == 4 for layer in conn.kv_caches)
    assert one_by_one(pipe, prompts, GREEDY) == reference
    stats = conn.stats()
    assert stats["host"]["hits"] > 0 and stats["failed_loads"] == 0
    conn.shutdown()

"""The KV-connector seam: registry, Pipeline plumbing, argument checks, and a connector
that does nothing leaves outputs and the hot path unchanged."""

from __future__ import annotations

import pytest
from connector_helpers import one_by_one, shared_prefix_prompts

from servelab import Pipeline, SamplingParams
from servelab.connectors import (
    KVConnector,
    KVConnectorMetadata,
    KVTransferResult,
    available_kv_connectors,
    get_kv_connector,
    register_kv_connector,
)
from servelab.connectors.offload import OffloadConnector

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


class Counting(KVConnector):
    """Offers nothing; counts every call of the contract (both roles)."""

    name = "counting"

    def __init__(self):
        super().__init__()
        self.calls = {}

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self._count("get_num_new_matched_tokens")
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        self._count("update_state_after_alloc")

    def build_connector_meta(self, scheduler_output):
        self._count("build_connector_meta")
        return KVConnectorMetadata(step=scheduler_output.step)

    def request_finished(self, request, block_ids):
        self._count("request_finished")
        return False, None

    def start_load_kv(self, **kwargs):
        self._count("start_load_kv")

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        self._count("save_kv_layer")

    def wait_for_save(self):
        self._count("wait_for_save")

    def get_finished(self, finished_req_ids):
        self._count("get_finished")
        return KVTransferResult()


def test_registry_names_and_errors():
    assert {"offload", "pd"} <= set(available_kv_connectors())
    assert isinstance(get_kv_connector("offload", cpu_blocks=8), OffloadConnector)
    with pytest.raises(ValueError, match="unknown kv connector 'nope'.*offload"):
        get_kv_connector("nope")
    with pytest.raises(TypeError, match="lacks"):
        get_kv_connector(object())
    register_kv_connector("counting-test", Counting)
    assert isinstance(get_kv_connector("counting-test"), Counting)
    with pytest.raises(ValueError, match="already registered"):
        register_kv_connector("counting-test", Counting)


def test_bad_options_name_the_argument():
    with pytest.raises(ValueError, match="save='sometimes'"):
        OffloadConnector(save="sometimes")
    with pytest.raises(ValueError, match="cpu_blocks"):
        OffloadConnector(cpu_blocks=0)
    with pytest.raises(ValueError, match="disk_dir"):
        OffloadConnector(disk_blocks=4)


def test_every_method_is_called_and_outputs_are_unchanged(tiny_llama):
    model, tok = tiny_llama
    prompts = shared_prefix_prompts(6)
    kw = dict(block_size=4, num_blocks=20, enable_prefix_caching=True, attention_backend="torch", max_num_seqs=2)
    want = one_by_one(Pipeline(model, tok, **kw), prompts, GREEDY)
    conn = Counting()
    pipe = Pipeline(model, tok, kv_connector=conn, **kw)
    assert pipe.kv_connector is conn and conn.kv_cache_manager is pipe.kv_cache_manager
    assert len(conn.kv_caches) == model.config.num_hidden_layers and conn.layer_groups == [[0, 1]]
    assert one_by_one(pipe, prompts, GREEDY) == want
    for name in ("get_num_new_matched_tokens", "build_connector_meta", "request_finished", "start_load_kv",
                 "save_kv_layer", "wait_for_save", "get_finished"):
        assert conn.calls.get(name), f"{name} was never called"
    assert conn.calls["request_finished"] == len(prompts)  # exactly once per request
    assert "update_state_after_alloc" not in conn.calls  # nothing was offered
    assert pipe.kv_cache_manager.num_free_blocks == pipe.num_blocks - 1


def test_by_name_in_from_pretrained(tmp_path):
    from servelab.models import build_tiny_model

    path = build_tiny_model(tmp_path / "t", arch="llama")
    pipe = Pipeline.from_pretrained(path, kv_connector="offload", block_size=4, num_blocks=16)
    assert isinstance(pipe.kv_connector, OffloadConnector)
    assert pipe.generate([[1, 5, 6, 7, 8, 9]], GREEDY)[0].finish_reason == "length"

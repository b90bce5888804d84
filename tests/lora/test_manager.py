"""The adapter manager's two caches: the host LRU (max_cpu_loras) and the device slots
(max_loras) with activate / deactivate / pin, and what the stacked buffers hold."""

import pytest
import torch

from servelab.lora import LoRARequest
from servelab.lora.apply import wrap_model
from servelab.models import build_tiny_model, load_model


def fake_loader(request, *, max_rank, modules):
    """A deterministic adapter per request (rank 2 on q_proj and down_proj of every layer)."""
    from servelab.lora.peft import LoRAAdapter
    gen = torch.Generator().manual_seed(request.lora_int_id)
    weights = {}
    for name, (fan_in, fan_out) in modules.items():
        if name.endswith(("q_proj", "down_proj")):
            weights[name] = (torch.randn(2, fan_in, generator=gen), torch.randn(fan_out, 2, generator=gen))
    fake_loader.calls.append(request.lora_name)
    return LoRAAdapter(request.lora_name, request.lora_int_id, request.lora_path, 2, 1.0, weights)


@pytest.fixture
def manager(tmp_path):
    model, _ = load_model(build_tiny_model(tmp_path / "m"), pack_weights=False)
    mgr = wrap_model(model, max_loras=2, max_lora_rank=4, max_cpu_loras=3)
    mgr.loader = fake_loader
    fake_loader.calls = []
    return mgr


def req(i):
    return LoRARequest(f"a{i}", i, f"/adapters/a{i}")


def test_activate_fills_free_slots_then_evicts_the_least_recently_used(manager):
    assert manager.activate_adapter(req(1)) == 0 and manager.activate_adapter(req(2)) == 1
    assert manager.lora_index_to_id == [1, 2]
    assert manager.activate_adapter(req(1)) == 0  # already active: touched, no load
    assert manager.activate_adapter(req(3)) == 1  # a2 was the least recently used
    assert manager.lora_index_to_id == [1, 3] and manager.active_adapters() == ["a1", "a3"]
    assert manager.stats.slot_evictions == 1 and fake_loader.calls == ["a1", "a2", "a3"]


def test_pinned_adapters_are_never_evicted_and_no_free_slot_fails(manager):
    manager.activate_adapter(req(1))
    manager.activate_adapter(req(2))
    manager.pin_adapter("a1")
    manager.pin_adapter("a2")
    with pytest.raises(RuntimeError, match="No free lora slots for adapter 'a3'"):
        manager.activate_adapter(req(3))
    assert manager.lora_index_to_id == [1, 2]  # nothing changed
    manager.unpin_adapter("a1")
    assert manager.activate_adapter(req(3)) == 0
    with pytest.raises(ValueError, match="in use by 1 running"):
        manager.remove_adapter("a2")
    with pytest.raises(ValueError, match="not pinned"):
        manager.unpin_adapter("a1")


def test_host_lru_evicts_and_reloads_from_the_path(manager):
    for i in (1, 2, 3):
        manager.add_adapter(req(i))
    manager.add_adapter(req(1))  # touched: a2 is now the least recently used
    manager.add_adapter(req(4))
    assert manager.list_adapters() == ["a3", "a1", "a4"] and manager.stats.host_evictions == 1
    manager.activate_adapter(req(2))  # evicted from the host while it waited: loaded again
    assert fake_loader.calls == ["a1", "a2", "a3", "a4", "a2"]
    assert "a2" in manager.list_adapters() and len(manager.list_adapters()) == 3


def test_host_eviction_prefers_inactive_adapters_and_skips_pinned(manager):
    manager.activate_adapter(req(1))
    manager.pin_adapter("a1")
    manager.add_adapter(req(2))
    manager.add_adapter(req(3))
    manager.add_adapter(req(4))  # a1 is the oldest but active and pinned: a2 goes
    assert manager.list_adapters() == ["a1", "a3", "a4"] and manager.slot_of("a1") == 0


def test_slot_buffers_hold_the_adapter_and_zeros_elsewhere(manager):
    slot = manager.activate_adapter(req(5))
    adapter = manager.add_adapter(req(5))
    qkv = manager.layers["model.layers.0.self_attn.qkv_proj"]
    a, b = adapter.weights["model.layers.0.self_attn.q_proj"]
    q = qkv.slices[0]
    assert torch.equal(qkv.lora_a[slot, :2], a) and not qkv.lora_a[slot, 2:].any()  # k/v rows, padding: 0
    assert torch.equal(qkv.lora_b[slot, :q.size, :2], b) and not qkv.lora_b[slot, q.size:].any()
    assert not qkv.lora_a[1 - slot].any()  # the other slot is empty
    manager.deactivate_adapter("a5")
    assert not qkv.lora_a.any() and not qkv.lora_b.any() and manager.lora_index_to_id == [None, None]


def test_one_name_one_adapter(manager):
    manager.add_adapter(req(1))
    with pytest.raises(ValueError, match="already registered"):
        manager.add_adapter(LoRARequest("a1", 1, "/elsewhere"))
    with pytest.raises(ValueError, match="lora_int_id=1 of adapter 'b' is already adapter 'a1'"):
        manager.add_adapter(LoRARequest("b", 1, "/adapters/b"))


def test_lora_request_fields_are_checked():
    for bad in [dict(lora_name="", lora_int_id=1, lora_path="/p"), dict(lora_name="x", lora_int_id=0, lora_path="/p"),
                dict(lora_name="x", lora_int_id=True, lora_path="/p"),
                dict(lora_name="x", lora_int_id=1, lora_path="")]:
        with pytest.raises(ValueError, match="LoRARequest"):
            LoRARequest(**bad)


def test_wrapping_twice_is_refused(tmp_path):
    model, _ = load_model(build_tiny_model(tmp_path / "m"), pack_weights=False)
    wrap_model(model, max_loras=1, max_lora_rank=4)
    with pytest.raises(ValueError, match="already has LoRA wrappers"):
        wrap_model(model, max_loras=1, max_lora_rank=4)

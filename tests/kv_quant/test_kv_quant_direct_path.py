"""The direct decode path over quantized pages equals the public calls, bit for bit.

On a pure decode step over int8 / float8 pages with the ``"sdpa"`` backend, every layer after the
first writes and attends through ``StepAttention.quantized_attend`` (one C call for int8: the
write and the kernel). These tests hold it to the public ``reshape_and_cache`` +
``paged_attention`` calls it replaces: the logits and every written page and scale must be equal,
it must be taken exactly where documented, and it must decline (writing nothing) elsewhere.
"""

from __future__ import annotations

import pytest
import torch

from servelab.attention import cpu_decode_quant
from servelab.models import allocate_kv_caches, build_tiny_model, load_model, prepare_inputs
from servelab.models.step_attention import StepAttention

pytestmark = pytest.mark.skipif(cpu_decode_quant._library() is None, reason="the C CPU kernels are not built")

LAYERS = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = build_tiny_model(tmp_path_factory.mktemp("direct"), arch="llama", seed=5, hidden_size=96,
                            intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=6,
                            num_key_value_heads=2, head_dim=16)
    model, _ = load_model(path)
    model.attention = "sdpa"
    return model


class Runner:
    """Prompts, then greedy decode steps, over quantized pages (a fixed block assignment)."""

    def __init__(self, model, dtype: str, kv_scale: str, block_size: int = 4) -> None:
        self.model, self.block_size = model, block_size
        self.caches = allocate_kv_caches(model, 64, block_size, dtype=dtype, kv_scale=kv_scale)
        self.caches.buffer.zero_()
        self.tables = {0: [3, 9, 4, 20, 7], 1: [11, 2, 30, 5, 6], 2: [40, 41, 1, 12, 13]}
        self.computed = {0: 0, 1: 0, 2: 0}

    @torch.no_grad()
    def step(self, work: dict[int, list[int]]) -> torch.Tensor:
        seqs = list(work)
        ids, pos, meta = prepare_inputs([work[s] for s in seqs], [self.computed[s] for s in seqs],
                                        [self.tables[s] for s in seqs], self.block_size)
        logits = self.model.compute_logits(self.model(ids, pos, self.caches, meta))
        for s in seqs:
            self.computed[s] += len(work[s])
        return logits

    def run(self, decode_steps: int) -> list[torch.Tensor]:
        prompts = {0: [5, 9, 2, 7, 1, 8], 1: [3, 3, 4], 2: [11, 12, 13, 14, 15, 16, 17]}
        logits = self.step(prompts)
        ends = torch.tensor([len(p) for p in prompts.values()]).cumsum(0) - 1
        last = logits[ends].argmax(-1).tolist()
        out = [logits[ends]]
        for _ in range(decode_steps):
            logits = self.step({s: [t] for s, t in zip(prompts, last)})
            last = logits.argmax(-1).tolist()
            out.append(logits)
        return out


def _record(monkeypatch) -> list[bool]:
    """Whether every ``quantized_attend`` call attended (True) or declined (False)."""
    taken, real = [], StepAttention.quantized_attend

    def counted(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(StepAttention, "quantized_attend", counted)
    return taken


def _record_prepared(monkeypatch) -> list[bool]:
    """Whether every ``quantized_decode_layers.prepare`` call gave prepared layers."""
    from servelab.models import quantized_decode_layers

    taken, real = [], quantized_decode_layers.prepare

    def counted(*args):
        out = real(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(quantized_decode_layers, "prepare", counted)
    return taken


@pytest.fixture
def glued(monkeypatch):
    """The decode glue on (the panel GEMM preferred, as on an AVX-512 machine)."""
    from servelab.models import cpu_gemm

    monkeypatch.setattr(cpu_gemm, "preferred", lambda: True)


@pytest.mark.parametrize("dtype, kv_scale", [("int8", "token_head"), ("int8", "tensor"), ("fp8_e4m3", "token_head"),
                                             ("fp8_e5m2", "head")])
def test_the_direct_calls_equal_the_public_ones(model, monkeypatch, glued, dtype, kv_scale):
    """Three runs of the same steps: the prepared layers (int8 only), each layer's
    ``quantized_attend``, and the public calls alone; the logits and the pages' every byte agree."""
    from servelab.models import quantized_decode_layers

    prepared = _record_prepared(monkeypatch)
    runs = [Runner(model, dtype, kv_scale)]
    logits = [runs[0].run(4)]
    # The prompt step (16 rows: glued too) declines; each decode step prepares its later layers
    # (int8), or declines (float8: no one-call path).
    assert prepared == [False] + [dtype == "int8"] * 4
    monkeypatch.setattr(quantized_decode_layers, "prepare", lambda *a: None)
    taken = _record(monkeypatch)
    runs.append(Runner(model, dtype, kv_scale))
    logits.append(runs[1].run(4))
    # Each decode step: the first layer takes the public, checked calls (quantized_attend declines
    # before they run), the others the direct path.
    assert taken == [False] * LAYERS + ([False] + [True] * (LAYERS - 1)) * 4
    monkeypatch.setattr(StepAttention, "quantized_attend", lambda self, *a, **k: None)
    runs.append(Runner(model, dtype, kv_scale))
    logits.append(runs[2].run(4))
    for run in (0, 1):
        for a, b in zip(logits[run], logits[2]):
            assert torch.equal(a, b), run
        assert torch.equal(runs[run].caches.buffer, runs[2].caches.buffer), run  # pages and scales


def _count_builds(monkeypatch) -> list[int]:
    """How many times the prepared layers' structs were made."""
    from servelab.models import quantized_decode_layers

    builds, real = [], quantized_decode_layers.DirectLayers.__init__

    def counted(self, *args):
        builds.append(1)
        real(self, *args)

    monkeypatch.setattr(quantized_decode_layers.DirectLayers, "__init__", counted)
    return builds


@pytest.mark.parametrize("silu", ["c", "torch"])
def test_the_prepared_layers_are_made_once_and_remade_when_what_they_read_changes(model, monkeypatch, glued, silu):
    """Over int8 pages the layer structs are made at the first decode step and reused; a norm's eps, a
    softmax scale or a weight changed between steps is seen (the structs are made again), and every
    step's logits and pages equal the public calls' under the same changes. ``silu="torch"``: C's
    SiLU refused, so each layer is two C calls with torch's SiLU between them."""
    from servelab.models import cpu_silu, quantized_decode_layers

    if silu == "torch":
        monkeypatch.setattr(cpu_silu, "usable", lambda rows, n: False)
    layers = model.model.layers
    saved = (layers[1].input_layernorm.eps, layers[2].self_attn.scale, layers[2].mlp.down_proj.weight.data)

    def changes(step: int) -> None:  # before decode step `step` (1-based)
        if step == 2:
            layers[1].input_layernorm.eps = 1e-3
        elif step == 3:
            layers[2].self_attn.scale = 0.3
        elif step == 4:
            layers[2].mlp.down_proj.weight.data = saved[2] * 0.5

    def run(runner: Runner) -> list[torch.Tensor]:
        layers[1].input_layernorm.eps, layers[2].self_attn.scale, layers[2].mlp.down_proj.weight.data = saved
        real_step, count = runner.step, [0]

        def stepping(work):
            changes(count[0])
            count[0] += 1
            return real_step(work)

        runner.step = stepping
        try:
            return runner.run(5)
        finally:
            layers[1].input_layernorm.eps, layers[2].self_attn.scale, layers[2].mlp.down_proj.weight.data = saved

    builds, prepared = _count_builds(monkeypatch), _record_prepared(monkeypatch)
    fast = Runner(model, "int8", "token_head")
    got = run(fast)
    assert prepared == [False] + [True] * 5
    assert len(builds) == 4  # the first decode step, then each change's step
    monkeypatch.setattr(quantized_decode_layers, "prepare", lambda *a: None)
    monkeypatch.setattr(StepAttention, "quantized_attend", lambda self, *a, **k: None)
    public = Runner(model, "int8", "token_head")
    want = run(public)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert torch.equal(fast.caches.buffer, public.caches.buffer)


def test_other_caches_or_rows_make_new_structs(model, monkeypatch, glued):
    """The kept structs name the caches they were made for: another runner's caches (the same
    shapes) or another batch size makes them again."""
    builds = _count_builds(monkeypatch)
    first = Runner(model, "int8", "token_head")
    first.run(2)
    assert len(builds) == 1
    second = Runner(model, "int8", "token_head")
    second.run(2)
    assert len(builds) == 2
    second.step({0: [4], 1: [6]})  # two rows instead of three
    assert len(builds) == 3


@pytest.mark.parametrize("silu", ["c", "torch"])
def test_each_step_gets_new_output_rows(model, monkeypatch, glued, silu):
    """The last layer writes a new tensor each step: rows a step handed out (to a hook on the final
    norm, say) are not overwritten by the next step, though the buffers between layers are reused."""
    from servelab.models import cpu_silu, quantized_decode_layers

    if silu == "torch":
        monkeypatch.setattr(cpu_silu, "usable", lambda rows, n: False)
    outputs, real = [], quantized_decode_layers.DirectLayers.run

    def kept(self):
        out = real(self)
        outputs.append((out, out.clone()))
        return out

    monkeypatch.setattr(quantized_decode_layers.DirectLayers, "run", kept)
    Runner(model, "int8", "token_head").run(3)
    assert len(outputs) == 3 and len({out.data_ptr() for out, _ in outputs}) == 3
    for out, copy in outputs:
        assert torch.equal(out, copy)


def test_the_kept_structs_go_with_the_model(tmp_path, glued):
    """The structs are kept per owner (the model's layer list) weakly: a model dropped after its decode
    steps is freed, structs, weights and caches with it."""
    import gc
    import weakref

    from servelab.models import quantized_decode_layers

    path = build_tiny_model(tmp_path, arch="llama", seed=6, hidden_size=96, intermediate_size=128,
                            num_hidden_layers=LAYERS, num_attention_heads=6, num_key_value_heads=2, head_dim=16)
    model, _ = load_model(path)
    model.attention = "sdpa"
    runner = Runner(model, "int8", "token_head")
    runner.run(2)
    kept = quantized_decode_layers._per_thread.prepared
    assert model.model.layers in kept
    gone = weakref.ref(model.model.layers)
    del model, runner
    gc.collect()
    assert gone() is None


def test_a_dropped_pool_is_freed_while_the_model_lives(model, glued):
    """The kept structs hold the cache tensors weakly: a runner (its pool) dropped after decode steps
    is freed at once; the next runner's steps make new structs."""
    import gc
    import weakref

    runner = Runner(model, "int8", "token_head")
    runner.run(2)
    pool = weakref.ref(list(runner.caches.views)[1][0])  # a later layer's K pages, as the structs saw them
    del runner
    gc.collect()
    assert pool() is None
    again = Runner(model, "int8", "token_head")
    assert len(again.run(2)) == 3


def test_timed_attention_gathers_the_c_calls_time_only_inside_its_block(model, glued):
    from servelab.models import quantized_decode_layers

    runner = Runner(model, "int8", "token_head")
    runner.run(1)
    with quantized_decode_layers.timed_attention() as spent:
        runner.step({0: [4], 1: [6], 2: [1]})
        inside = spent[0]
    runner.step({0: [4], 1: [6], 2: [1]})
    assert inside > 0 and spent[0] == inside and quantized_decode_layers._timer is None


def test_the_structs_mirror_the_c_ones_and_the_one_call_needs_c_silu():
    """The ctypes mirror has C's sizes; ``servelab_decode_layers`` refuses (doing nothing) a step
    whose SiLU is torch's."""
    from servelab.models import quantized_decode_layers as qdl

    lib = cpu_decode_quant._library()
    assert qdl._checked(lib) is lib
    step = qdl.StepArgs(silu_in_c=0)
    assert lib.servelab_decode_layers(qdl.ctypes.addressof(step), None, 3) == -4


def test_a_mixed_step_and_an_overriding_view_decline(model, monkeypatch):
    """A step with a prompt row is not a pure decode step; a subclass overriding ``paged_attention``
    (as Gemma 2's softcap view does) keeps its own calls."""
    taken = _record(monkeypatch)
    runner = Runner(model, "int8", "token_head")
    runner.step({0: [5, 9, 2], 1: [3, 3]})
    runner.step({0: [4], 1: [6], 2: [1, 2, 3]})  # two decode rows and a prompt
    assert taken and not any(taken)

    class Overriding(StepAttention):
        calls = 0

        def paged_attention(self, *args, **kwargs):
            Overriding.calls += 1
            return super().paged_attention(*args, **kwargs)

    from servelab.models import llama

    monkeypatch.setattr(llama, "StepAttention", Overriding)
    taken.clear()
    runner.step({0: [4], 1: [6]})
    assert Overriding.calls == LAYERS and not any(taken)


def test_a_layout_the_kernel_refuses_writes_nothing():
    """``write_and_attend`` returns ``None`` before writing when the kernel does not take the
    tensors (here a float64 query): the caller's public calls then do the write once."""
    caches = torch.zeros(4, 4, 2, 16, dtype=torch.int8)
    scales = torch.ones(4, 4, 2)
    step = cpu_decode_quant.DecodeStep(torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                                       None)
    rows = torch.randn(1, 2, 16)
    got = step.write_and_attend(rows, rows, torch.randn(1, 4, 16, dtype=torch.float64), caches, caches.clone(),
                                scales, scales.clone(), torch.tensor([6]), 0.25)
    assert got is None and not caches.any() and bool((scales == 1).all())

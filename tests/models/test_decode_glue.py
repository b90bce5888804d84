"""The glued decode layer (servelab.models.decode_glue) against the unfused modules, bit for bit."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from servelab import Pipeline, SamplingParams
from servelab.models import ModelConfig, cpu_gemm, cpu_silu, decode_glue, tiny_config
from servelab.models.layers import SwiGLUMLP
from servelab.models.linear import set_weight_packing
from servelab.models.llama import LlamaAttention, LlamaForCausalLM
from servelab.models.loader import copy_weights
from servelab.models.tiny import random_weights


def tiny_model(arch: str = "llama", seed: int = 0, **overrides) -> LlamaForCausalLM:
    cfg = tiny_config(arch, **overrides)
    model = LlamaForCausalLM(ModelConfig.from_hf(cfg)).eval()
    copy_weights(model, ((n, t, "memory") for n, t in random_weights(cfg, seed).items()), "memory")
    return model


def run(model, prompts, steps: int, *, glue: bool, monkeypatch, before_step=None) -> tuple[list[torch.Tensor], list, int]:
    """Every step's final hidden states (the LM head's input), the KV caches after ``steps``
    steps, and how many layer calls were glued (``model``: a fresh one per run; ``before_step(i)``
    is called before step ``i``)."""
    # _step_glues: the conditions both decode_glue.parts and decode_glue.step_parts ask first
    monkeypatch.setattr(decode_glue, "_step_glues", real_step_glues if glue else (lambda x: False))
    calls = []
    monkeypatch.setattr(decode_glue, "forward", lambda *a: calls.append(1) or real_forward(*a))
    pipe = Pipeline(model, attention_backend="sdpa", block_size=16, num_blocks=64, max_model_len=256,
                    enable_prefix_caching=False)
    pipe.kv_caches.buffer.zero_()  # unwritten slots hold whatever the allocation did: make them equal
    seen = []
    logits = pipe.model.compute_logits
    monkeypatch.setattr(pipe.model, "compute_logits", lambda h: (seen.append(h.clone()), logits(h))[1])
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    for prompt in prompts:
        pipe.add_request(prompt, params, detokenize=False)
    for i in range(steps):
        if before_step is not None:
            before_step(i)
        pipe.step()
    return seen, [t.clone() for pair in pipe.kv_caches.views for t in pair], len(calls)


real_step_glues, real_forward, real_silu_usable = decode_glue._step_glues, decode_glue.forward, cpu_silu.usable


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(arch=st.sampled_from(["llama", "qwen2", "mistral"]), per_head=st.sampled_from([4, 8, 16]),
       heads_kv=st.sampled_from([(4, 2), (2, 2), (6, 2), (4, 1)]), head_dim=st.sampled_from([8, 16]),
       intermediate=st.integers(8, 100), batch=st.integers(1, 5), threads=st.integers(1, 2),
       seed=st.integers(0, 3), c_silu=st.booleans())
def test_the_glued_layer_equals_the_unfused_modules_bit_for_bit(kernel_library, monkeypatch, arch, per_head,
                                                                  heads_kv, head_dim, intermediate, batch, threads,
                                                                  seed, c_silu):
    """Shapes (hidden = heads x per_head, GQA groups 1-3, Qwen2's q/k/v biases, Mistral's window), batches
    of 1-5 decode rows, 1 and 2 threads, SiLU in C or torch's: every step's hidden states and the K/V
    written are equal."""
    monkeypatch.setattr(cpu_gemm, "preferred", lambda: True)  # the panel GEMM (and so the glue) on any build
    # set in every example (hypothesis shares one monkeypatch between them)
    monkeypatch.setattr(cpu_silu, "usable", real_silu_usable if c_silu else (lambda rows, n: False))
    assert not c_silu or cpu_silu.usable(batch, intermediate), cpu_silu.unavailable_reason()
    heads, kv_heads = heads_kv
    shape = dict(hidden_size=heads * per_head, num_attention_heads=heads, num_key_value_heads=kv_heads,
                 head_dim=head_dim, intermediate_size=intermediate)
    prompts = [[3 + (seed * 7 + i * 13 + j) % 400 for j in range(4 + 9 * i)] for i in range(batch)]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        glued, glued_caches, calls = run(tiny_model(arch, seed, **shape), prompts, 5, glue=True,
                                         monkeypatch=monkeypatch)
        plain, plain_caches, plain_calls = run(tiny_model(arch, seed, **shape), prompts, 5, glue=False,
                                               monkeypatch=monkeypatch)
    finally:
        torch.set_num_threads(previous)
    layers = tiny_config(arch).num_hidden_layers
    prefill_glued = sum(map(len, prompts)) <= cpu_gemm.MAX_ROWS  # a prefill of few rows is glued too
    assert calls == (4 + prefill_glued) * layers and plain_calls == 0
    assert len(glued) == len(plain) == 5
    assert all(torch.equal(a, b) for a, b in zip(glued, plain))
    assert all(torch.equal(a, b) for a, b in zip(glued_caches, plain_caches))


def decode_rows(model, rows: int = 2) -> torch.Tensor:
    return torch.randn(rows, model.config.hidden_size)


def rope_tables(model, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's RoPE tables as ``StepAttention.rope_tables`` makes them: ``[rows, 1, D]`` views."""
    return tuple(torch.randn(rows, model.config.head_dim)[:, None, :] for _ in range(2))


@pytest.fixture
def model(kernel_library, monkeypatch):
    monkeypatch.setattr(cpu_gemm, "preferred", lambda: True)
    return tiny_model()


def test_a_plain_layer_is_glued(model):
    with torch.inference_mode():
        assert decode_glue.parts(model.model.layers[0], decode_rows(model), rope_tables(model, 2),
                                 LlamaAttention) is not None


@pytest.mark.parametrize("case", ["grad", "many_rows", "float64", "no_packing", "not_preferred", "no_library",
                                  "tracing", "module_hook", "global_hook", "swapped_mlp", "odd_rows_layout",
                                  "strided_tables"])
@pytest.mark.parametrize("warm", [False, True], ids=["cold", "after_a_glued_call"])
def test_every_other_case_keeps_the_modules(model, monkeypatch, case, warm):
    """Each condition of decode_glue.parts refuses on its own (the others holding), also when the
    layer was glued before the change (what parts keeps per layer must notice it)."""
    layer, x = model.model.layers[0], decode_rows(model)
    if warm:
        with torch.inference_mode():
            assert decode_glue.parts(layer, x, rope_tables(model, 2), LlamaAttention) is not None
    tables = None
    handles = []
    if case == "many_rows":
        x = decode_rows(model, cpu_gemm.MAX_ROWS + 1)
    elif case == "float64":
        x = x.double()
    elif case == "no_packing":
        set_weight_packing(model, False)
    elif case == "not_preferred":
        monkeypatch.setattr(cpu_gemm, "preferred", lambda: False)
    elif case == "no_library":
        monkeypatch.setattr(decode_glue, "_library", lambda: None)
    elif case == "tracing":
        monkeypatch.setattr(torch._C, "_get_tracing_state", lambda: object())
    elif case == "module_hook":
        handles.append(layer.mlp.down_proj.register_forward_hook(lambda *a: None))
    elif case == "global_hook":
        handles.append(nn.modules.module.register_module_forward_pre_hook(lambda *a: None))
    elif case == "swapped_mlp":
        class MyMLP(SwiGLUMLP):  # a researcher's MLP: its own forward must run
            pass

        mine = MyMLP(model.config.hidden_size, model.config.intermediate_size, False)
        layer.mlp = mine
    elif case == "strided_tables":  # RoPE tables that are not views of contiguous [rows, D]
        tables = tuple(torch.randn(2, 2 * model.config.head_dim)[:, None, ::2] for _ in range(2))
    elif case == "odd_rows_layout":
        x = torch.randn(model.config.hidden_size, 2).t()  # rows not contiguous
    try:
        with torch.inference_mode(case != "grad"):
            assert decode_glue.parts(layer, x, tables or rope_tables(model, x.shape[0]), LlamaAttention) is None
    finally:
        for handle in handles:
            handle.remove()


def test_a_hooked_module_is_called_in_a_pipeline(model, monkeypatch):
    """End to end: a forward hook on one linear layer sees every step (the glue stays off that layer)."""
    seen = []
    model.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, args, out: seen.append(out.shape[0]))
    _, _, calls = run(model, [[5, 6, 7], [9] * 12], 4, glue=True, monkeypatch=monkeypatch)
    assert seen == [15, 2, 2, 2]  # the prefill's 15 rows, then three decode steps of 2
    assert calls == 4  # layer 0 glued on every step (15 rows are few too), layer 1 never


@pytest.mark.parametrize("change", ["in_place", "new_parameter"])
def test_weights_changed_after_glued_steps_are_the_ones_used(kernel_library, monkeypatch, change):
    """A layer glued on earlier steps, then its weights changed (in place, or a new parameter of the
    same shape): the next steps use the new weights, as the modules do."""
    monkeypatch.setattr(cpu_gemm, "preferred", lambda: True)
    prompts = [[5, 6, 7], [9] * 12]

    def edit(model):
        lin = model.model.layers[1].mlp.down_proj
        with torch.no_grad():
            if change == "in_place":
                lin.weight.mul_(-2.0)
            else:
                lin.weight = nn.Parameter(lin.weight.detach() * -2.0, requires_grad=False)

    glued_model, plain_model = tiny_model(), tiny_model()
    run(glued_model, prompts, 2, glue=True, monkeypatch=monkeypatch)  # glued: its parts are kept
    edit(glued_model)
    edit(plain_model)
    glued, _, calls = run(glued_model, prompts, 3, glue=True, monkeypatch=monkeypatch)
    plain, _, _ = run(plain_model, prompts, 3, glue=False, monkeypatch=monkeypatch)
    assert calls == 3 * 2
    assert all(torch.equal(a, b) for a, b in zip(glued, plain))


def test_a_changed_default_dtype_does_not_reach_the_c_buffers(kernel_library, monkeypatch):
    """Under a float64 default dtype the glue still equals the modules: its output buffers are
    float32 whatever the default (a float64 default once made them float64 buffers that the C
    code filled with float32 values)."""
    monkeypatch.setattr(cpu_gemm, "preferred", lambda: True)
    prompts = [[5, 6, 7], [9] * 12]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        glued, _, calls = run(tiny_model(), prompts, 3, glue=True, monkeypatch=monkeypatch)
        plain, _, _ = run(tiny_model(), prompts, 3, glue=False, monkeypatch=monkeypatch)
    finally:
        torch.set_default_dtype(previous)
    assert calls == 3 * 2 and len(glued) == len(plain) == 3  # both layers, every step (few rows)
    assert all(torch.equal(a, b) for a, b in zip(glued, plain))


def test_the_reused_temporaries_follow_inference_mode():
    """The glue's reused temporaries made under inference_mode (a pipeline step) are not handed
    out after it (a model called under no_grad, as the HF oracle tests do): SiLU updates them in
    place, which torch refuses on an inference tensor outside inference mode."""
    with torch.inference_mode():
        inside = decode_glue._scratch(3, 8, 16)
        assert all(t.is_inference() for t in inside)
    with torch.no_grad():
        outside = decode_glue._scratch(3, 8, 16)
        assert not any(t.is_inference() for t in outside)
        torch.nn.functional.silu(outside[2][:, :8], inplace=True)  # what forward does
    with torch.inference_mode():
        assert all(a is b for a, b in zip(decode_glue._scratch(3, 8, 16), inside))  # still reused


@pytest.mark.parametrize("case", ["layer_hook", "subclassed_layer"])
def test_the_model_calls_a_layer_it_cannot_glue_as_a_module(model, monkeypatch, case):
    """The model's loop calls every layer's glue directly (``decode_glue.step_parts``) only when all
    of them glue and are exactly ``LlamaDecoderLayer``: a hook on one decoder layer sees every step,
    and a subclass's own ``forward`` runs on every step."""
    from servelab.models.llama import LlamaDecoderLayer

    seen = []
    layer = model.model.layers[1]
    if case == "layer_hook":
        layer.register_forward_hook(lambda m, args, out: seen.append(out.shape[0]))
    else:
        class Mine(LlamaDecoderLayer):
            def forward(self, *args):
                seen.append(args[0].shape[0])
                return super().forward(*args)

        layer.__class__ = Mine
    hidden, _, calls = run(model, [[5, 6, 7], [9] * 12], 4, glue=True, monkeypatch=monkeypatch)
    assert seen == [15, 2, 2, 2]
    # The other layer glued on every step; the subclass's forward glues itself (it calls the base's).
    assert calls == 4 + (4 if case == "subclassed_layer" else 0)


def test_a_step_with_nothing_changed_asks_no_module_again(kernel_library, monkeypatch):
    """``step_parts`` gives its last answer again while the module tree and the weights are unchanged:
    after the prefill and the first decode step no layer's modules are asked again."""
    monkeypatch.setattr(cpu_gemm, "preferred", lambda: True)
    asked = []
    real_state = decode_glue._layer_state
    monkeypatch.setattr(decode_glue, "_layer_state", lambda *a: asked.append(1) or real_state(*a))
    per_step = []
    run(tiny_model(), [[5, 6, 7], [9] * 12], 5, glue=True, monkeypatch=monkeypatch,
        before_step=lambda i: per_step.append(len(asked)))
    per_step.append(len(asked))
    asked_by_step = [b - a for a, b in zip(per_step, per_step[1:])]
    assert asked_by_step[0] > 0 and asked_by_step[2:] == [0, 0, 0], asked_by_step


class RecordingMLP(SwiGLUMLP):
    """A researcher's MLP: its own forward must run, and it records the rows it saw."""

    seen: list

    def forward(self, x):
        self.seen.append(x.shape[0])
        return super().forward(x)


def _change(model, change: str, seen: list) -> None:
    """One change to layer 1 between two decode steps, as a researcher might make it."""
    layer = model.model.layers[1]
    lin = layer.mlp.down_proj
    if change == "module_hook":
        lin.register_forward_hook(lambda m, args, out: seen.append(out.shape[0]))
    elif change == "pre_hook":
        layer.self_attn.qkv_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    elif change == "swapped_mlp":
        mine = RecordingMLP(model.config.hidden_size, model.config.intermediate_size, False)
        mine.seen = seen
        mine.load_state_dict(layer.mlp.state_dict())
        layer.mlp = mine
    elif change == "mlp_class":
        layer.mlp.__class__ = RecordingMLP
        layer.mlp.seen = seen
    elif change == "no_packing":
        set_weight_packing(model, False)
    elif change == "weight_data":
        lin.weight.data = lin.weight.data * -2.0
    elif change == "weight_in_place":
        with torch.no_grad():
            lin.weight.mul_(-2.0)
    elif change == "strided_norm_weight":  # a layout the C norm does not take: the modules' norm must run
        norm = layer.post_attention_layernorm
        strided = torch.empty(2 * norm.weight.shape[0])[::2]
        strided.copy_(norm.weight.detach() * 1.5)
        norm.weight.data = strided
    elif change == "new_bias":
        lin.bias = nn.Parameter(torch.full((lin.out_features,), 0.25), requires_grad=False)


@pytest.mark.parametrize("change", ["module_hook", "pre_hook", "swapped_mlp", "mlp_class", "no_packing",
                                    "weight_data", "weight_in_place", "strided_norm_weight", "new_bias"])
def test_a_change_between_glued_steps_is_seen_by_the_next_step(kernel_library, monkeypatch, change):
    """After glued decode steps (the step memo set), a change to one layer before the next step: that
    step equals the unfused modules with the same change, bit for bit, and a hook or a researcher's
    module sees it."""
    monkeypatch.setattr(cpu_gemm, "preferred", lambda: True)
    prompts = [[5, 6, 7], [9] * 12]
    runs = {}
    for glue in (True, False):
        model, seen = tiny_model(), []
        hidden, _, calls = run(model, prompts, 5, glue=glue, monkeypatch=monkeypatch,
                               before_step=lambda i, m=model, s=seen: i == 3 and _change(m, change, s))
        runs[glue] = hidden, seen, calls
    (glued, glued_seen, calls), (plain, plain_seen, _) = runs[True], runs[False]
    assert all(torch.equal(a, b) for a, b in zip(glued, plain))
    assert glued_seen == plain_seen
    if change in ("module_hook", "pre_hook", "swapped_mlp", "mlp_class"):
        assert glued_seen == [2, 2]  # the two decode steps after the change
    # 2 layers x 5 steps (the prefill's 15 rows glue too); after the change layer 1 (or, without
    # packing, both) runs its modules
    unglued = {"no_packing": 4, "weight_data": 0, "weight_in_place": 0, "new_bias": 0}.get(change, 2)
    assert calls == 10 - unglued

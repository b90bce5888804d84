"""The other way: vLLM v1 logits processors (a custom one, and vLLM's own min-tokens and
logit-bias processors) inside servelab's ``Sampler``, checked against servelab's own processing
of the same rows. Skipped without vLLM."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.sample.logits_processor import (  # noqa: E402
    BatchUpdate,
    LogitBiasLogitsProcessor,
    LogitsProcessor,
    MinTokensLogitsProcessor,
)

from servelab.integrations.vllm import from_vllm_logits_processor  # noqa: E402
from servelab.integrations.vllm.harness import build_scheduler  # noqa: E402
from servelab.samplers import Sampler, SamplingParams  # noqa: E402
from servelab.samplers.metadata import SamplingMetadata  # noqa: E402
from servelab.samplers.processors import LogitBiasProcessor, MinTokensProcessor  # noqa: E402

V = 64


class OnlyEvenTokens(LogitsProcessor):
    """A vLLM processor (the documented custom pattern): rows whose request asks for
    ``extra_args["even"]`` keep only even token ids; it reads params and outputs from the batch."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.even: dict[int, bool] = {}

    def is_argmax_invariant(self):
        return False

    def update_state(self, batch_update: BatchUpdate | None):
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.even.pop(index, None)
        for index, params, _, _ in batch_update.added:
            self.even[index] = bool((params.extra_args or {}).get("even"))

    def apply(self, logits):
        rows = [i for i, flag in self.even.items() if flag and i < logits.shape[0]]
        if rows:
            logits[rows, 1::2] = float("-inf")
        return logits


@pytest.fixture(scope="module")
def vllm_config():
    return build_scheduler().vllm_config


def metadata(params, outputs):
    return SamplingMetadata.from_requests(params, [[1, 2]] * len(params), outputs, V, torch.device("cpu"),
                                          eos_token_id=3)


def test_a_custom_vllm_processor_runs_in_servelabs_sampler(vllm_config):
    sampler = Sampler(logits_processors=[from_vllm_logits_processor(OnlyEvenTokens, vllm_config=vllm_config)])
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    logits[:, 1] = 100.0  # the unconstrained argmax is odd
    params = [SamplingParams(temperature=0, extra_args={"even": i % 2 == 0}) for i in range(4)]
    out = sampler(logits, metadata(params, [[5]] * 4)).sampled_token_ids.tolist()
    assert out[1] == out[3] == 1 and out[0] % 2 == 0 and out[2] % 2 == 0
    # A second call with other rows: the batch is described afresh (no stale index state).
    again = sampler(logits[:1], metadata([SamplingParams(temperature=0)], [[5]])).sampled_token_ids.tolist()
    assert again == [1]


@pytest.mark.parametrize("vllm_cls, ours", [(MinTokensLogitsProcessor, MinTokensProcessor),
                                             (LogitBiasLogitsProcessor, LogitBiasProcessor)])
def test_vllms_builtin_processors_match_servelabs_own(vllm_cls, ours, vllm_config):
    """vLLM's min-tokens / logit-bias processors inside servelab give exactly what servelab's
    own processor gives on the same rows (min_tokens masks the stop ids; no EOS here)."""
    params = [SamplingParams(temperature=0, min_tokens=3, stop_token_ids=(7, 8), logit_bias={9: 50.0}),
              SamplingParams(temperature=0, min_tokens=1, logit_bias={11: -50.0}),
              SamplingParams(temperature=0, stop_token_ids=(7,), logit_bias={2: 5.0})]
    meta = SamplingMetadata.from_requests(params, [[1, 2]] * 3, [[4], [4, 5], []], V, torch.device("cpu"))
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    theirs = from_vllm_logits_processor(vllm_cls, vllm_config=vllm_config).apply(logits.clone(), meta)
    expected = ours().apply(logits.clone(), meta)
    assert not torch.equal(expected, logits)  # the check can fail
    assert torch.equal(theirs, expected)


def test_wrong_objects_are_refused():
    with pytest.raises(TypeError, match="LogitsProcessor"):
        from_vllm_logits_processor(int)
    with pytest.raises(TypeError, match="LogitsProcessor"):
        from_vllm_logits_processor(object())

"""SamplingMetadata construction, penalties, constraints and logits processors, on hand-computed cases."""

import pytest
import torch

from servelab.samplers import Sampler, SamplingMetadata, SamplingParams
from servelab.samplers.penalties import apply_penalties, token_counts
from servelab.samplers.processors import bad_word_bans

NEG_INF = float("-inf")


def metadata(params, outputs=None, prompts=None, vocab_size=6, **kwargs):
    outputs = outputs if outputs is not None else [[] for _ in params]
    prompts = prompts if prompts is not None else [[] for _ in params]
    return SamplingMetadata.from_requests(params, prompts, outputs, vocab_size, **kwargs)


def test_metadata_leaves_unused_features_out():
    md = metadata([SamplingParams(temperature=0), SamplingParams()])
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert md.repetition_penalties is None and md.prompt_token_ids is None
    assert md.allowed_token_mask is None and md.max_num_logprobs is None
    assert md.greedy_rows == (0,) and not md.all_greedy and not md.all_random
    assert md.seeded_rows == {}


def test_metadata_pads_token_ids_with_vocab_size_and_builds_masks():
    params = [SamplingParams(frequency_penalty=0.1, seed=7, top_k=3, logprobs=2),
              SamplingParams(allowed_token_ids=[1, 4], logprobs=0)]
    md = metadata(params, outputs=[[1, 2, 2], []], prompts=[[3], [0, 5]])
    assert md.output_token_ids.tolist() == [[1, 2, 2], [6, 6, 6]]
    assert md.prompt_token_ids.tolist() == [[3, 6], [0, 5]]
    assert md.top_k.tolist() == [3, -1] and md.top_k.dtype == torch.int32
    assert md.allowed_token_mask.tolist() == [[True] * 6, [False, True, False, False, True, False]]
    assert md.max_num_logprobs == 2
    assert md.seeded_rows == {0: (7, 3)}  # seed 7 at step 3 (three tokens generated)
    first, again = md.generators()[0], md.generators()[0]
    assert torch.equal(torch.rand(4, generator=first), torch.rand(4, generator=again))  # fresh each call
    assert md.generator_list()[1] is None


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        ({"prompt_token_ids": [[1]]}, ValueError, r"prompt_token_ids has 1 entries but there are 2"),
        ({"output_token_ids": [[1], [6]]}, ValueError, r"output_token_ids\[1\] holds token id 6; valid: \[0, 6\)"),
        ({"output_token_ids": [[1], [1.0]]}, TypeError, r"output_token_ids\[1\] holds 1.0"),
        ({"vocab_size": 0}, ValueError, r"vocab_size = 0"),
        ({"eos_token_id": 9}, ValueError, r"eos_token_id = 9"),
        ({"sampling_params": [SamplingParams(), "greedy"]}, TypeError, r"sampling_params\[1\] must be a SamplingParams"),
        ({"sampling_params": [SamplingParams(), SamplingParams(stop_token_ids=[8])]}, ValueError,
         r"stop_token_ids holds token id 8"),
    ],
)
def test_metadata_rejects_bad_batches(kwargs, error, pattern):
    args = {"sampling_params": [SamplingParams(), SamplingParams()], "prompt_token_ids": [[1], [2]],
            "output_token_ids": [[], []], "vocab_size": 6}
    args.update(kwargs)
    with pytest.raises(error, match=pattern):
        SamplingMetadata.from_requests(**args)


def test_penalties_match_the_openai_vllm_definitions_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    # token 0 only in the prompt, 1 twice and 2 once in the output, 3 and 4 nowhere.
    prompt = torch.tensor([[0, 5]])
    output = torch.tensor([[1, 1, 2]])
    out = apply_penalties(logits, prompt, output, torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25]))
    expected = [
        2.0 / 2,  # repetition only (prompt): positive logit divided
        -1.0 * 2 - 0.5 * 2 - 0.25,  # negative logit multiplied, then frequency x2 and presence
        0.5 / 2 - 0.5 * 1 - 0.25,
        3.0,
        -2.0,
    ]
    assert out.tolist() == [pytest.approx(expected, abs=0)]
    assert logits.tolist() == [[2.0, -1.0, 0.5, 3.0, -2.0]]  # not modified in place
    assert token_counts(torch.tensor([[1, 1, 5, 5]]), 5).tolist() == [[0, 2, 0, 0, 0]]


def test_sampler_applies_penalties_before_greedy_and_before_temperature():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    prompts, outputs = [[0]], [[0]]
    greedy = metadata([SamplingParams(temperature=0, presence_penalty=0.2)], outputs, prompts, vocab_size=4)
    assert Sampler()(logits, greedy).sampled_token_ids.tolist() == [1]  # 3.0 - 0.2 < 2.9
    hot = metadata([SamplingParams(temperature=2.0, repetition_penalty=1.5)], outputs, prompts, vocab_size=4)
    probs = Sampler().compute_probs(logits, hot)
    expected = torch.softmax(torch.tensor([3.0 / 1.5, 2.9, 0.0, -1.0]) / 2.0, dim=-1)
    torch.testing.assert_close(probs[0], expected)


def test_min_tokens_masks_stop_tokens_and_eos_until_reached():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0], [5.0, 4.0, 3.0, 0.0], [5.0, 4.0, 3.0, 0.0]])
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1]),
              SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1]),
              SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)]
    md = metadata(params, outputs=[[3], [3, 3], [3]], vocab_size=4, eos_token_id=0)
    # Row 0: EOS (0) and stop token 1 masked -> 2. Row 1 reached min_tokens. Row 2 ignores EOS.
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [2, 0, 0]


def test_logit_bias_and_allowed_tokens_and_bad_words():
    logits = torch.zeros(3, 6)
    logits[:, 5] = 1.0
    params = [SamplingParams(temperature=0, logit_bias={2: 1.5}),
              SamplingParams(temperature=0, allowed_token_ids=[0, 3]),
              SamplingParams(temperature=0, bad_words_token_ids=[[5], [4, 1, 3]])]
    md = metadata(params, outputs=[[], [], [4, 1]])
    processed = Sampler()._apply_argmax_changing(logits, md)
    assert processed[0].tolist() == [0.0, 0.0, 1.5, 0.0, 0.0, 1.0]
    assert processed[1].tolist() == [0.0, NEG_INF, NEG_INF, 0.0, NEG_INF, NEG_INF]
    assert processed[2].tolist() == [0.0, 0.0, 0.0, NEG_INF, 0.0, NEG_INF]
    assert Sampler()(logits, md).sampled_token_ids.tolist() == [2, 0, 0]


def test_bad_word_prefix_must_match_the_latest_output_tokens():
    params = [SamplingParams(bad_words_token_ids=[[4, 1, 3]])] * 3
    md = metadata(params, outputs=[[4, 1, 2], [1], [2, 4, 1]])
    assert bad_word_bans(md) == [(2, 3)]


class BanTokenZeroWhenAsked:
    """A researcher's processor: reads its switch from extra_args; can change the argmax."""

    argmax_invariant = False

    def apply(self, logits, metadata):
        rows = [row for row, p in enumerate(metadata.params) if (p.extra_args or {}).get("ban_zero")]
        logits = logits.clone()
        logits[rows, 0] = NEG_INF
        return logits


class RecordScaledLogits:
    """An argmax-invariant processor; records what it saw (after temperature)."""

    argmax_invariant = True

    def __init__(self):
        self.seen = []

    def apply(self, logits, metadata):
        self.seen.append(logits.clone())
        return logits


def test_custom_processors_plug_in_without_editing_the_sampler():
    recorder = RecordScaledLogits()
    sampler = Sampler([BanTokenZeroWhenAsked(), recorder])
    logits = torch.tensor([[4.0, 1.0, 0.0], [4.0, 1.0, 0.0]])
    greedy = metadata([SamplingParams(temperature=0, extra_args={"ban_zero": True}), SamplingParams(temperature=0)],
                      vocab_size=3)
    assert sampler(logits, greedy).sampled_token_ids.tolist() == [1, 0]
    assert recorder.seen == []  # step 8 never runs for an all-greedy batch
    hot = metadata([SamplingParams(temperature=2.0, top_k=1)], vocab_size=3)
    assert sampler(logits[:1], hot).sampled_token_ids.tolist() == [0]
    torch.testing.assert_close(recorder.seen[0], logits[:1] / 2.0)


def test_sampler_rejects_bad_processors_and_mismatched_logits():
    with pytest.raises(TypeError, match="argmax_invariant as a bool"):
        Sampler([type("NoFlag", (), {"apply": lambda self, logits, md: logits})()])
    with pytest.raises(TypeError, match="no apply"):
        Sampler([object()])
    with pytest.raises(ValueError, match="unknown sampling backend 'cuda'; known: 'auto', 'torch', 'triton'"):
        Sampler(backend="cuda")
    md = metadata([SamplingParams()])
    with pytest.raises(ValueError, match=r"logits has shape \(1, 5\) but the metadata describes \(1, 6\)"):
        Sampler()(torch.zeros(1, 5), md)
    with pytest.raises(TypeError, match="metadata must be a SamplingMetadata"):
        Sampler()(torch.zeros(1, 6), {"temperature": 1.0})

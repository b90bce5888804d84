"""Structured outputs through the whole pipeline on a tiny checkpoint.

Random weights make the unconstrained model babble; every constrained output
must still parse / match / be one of the choices, for greedy and seeded
sampling, with prefix caching on, under preemption and with n-gram
speculation, while a free request in the same batch is unaffected.
"""

from __future__ import annotations

import json
import re

import pytest

from servelab import Pipeline, SamplingParams, StructuredOutputsParams
from servelab.models import build_tiny_model

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
          "required": ["ok", "n"], "additionalProperties": False}
REGEX = r"[a-c]{2}-[0-9]"
CHOICES = ["alpha", "beta", "gamma delta"]
PROMPTS = ["The cache line was", "A block table maps", "Greedy decoding picks", "The scheduler admits"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama")


def check(text: str, kind: str) -> None:
    if kind == "json":
        value = json.loads(text)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and value["n"] in (1, 2, 3)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


CONSTRAINTS = {"json": StructuredOutputsParams(json=SCHEMA), "regex": StructuredOutputsParams(regex=REGEX),
               "choice": StructuredOutputsParams(choice=CHOICES)}


def run(pipe, kinds, **params):
    batch = [SamplingParams(max_tokens=48, structured_outputs=CONSTRAINTS[k], **params) for k in kinds]
    return pipe.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))], batch)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7)], ids=["greedy", "seeded"])
def test_every_output_follows_its_grammar(tiny, sampling, one_torch_thread):
    pipe = Pipeline.from_pretrained(tiny, enable_prefix_caching=True)
    kinds = ["json", "regex", "choice"] * 2
    for kind, out in zip(kinds, run(pipe, kinds, **sampling)):
        assert out.finish_reason == "stop", (kind, out.text, out.error)
        check(out.text, kind)
    assert pipe.kv_cache_manager.num_free_blocks == pipe.num_blocks - 1


def test_free_request_in_the_same_batch_is_unaffected(tiny, one_torch_thread):
    pipe = Pipeline.from_pretrained(tiny)
    free = SamplingParams(temperature=0, max_tokens=12)
    alone = pipe.generate([PROMPTS[3]], free)[0].token_ids
    mixed = pipe.generate([PROMPTS[0], PROMPTS[3]],
                          [SamplingParams(temperature=0, max_tokens=48, structured_outputs=CONSTRAINTS["json"]),
                           free])
    check(mixed[0].text, "json")
    assert mixed[1].token_ids == alone


def test_speculation_and_preemption_keep_greedy_output(tiny, one_torch_thread):
    kinds = ["json", "regex", "choice", "json"]
    plain = [o.token_ids for o in run(Pipeline.from_pretrained(tiny), kinds, temperature=0)]
    speculative = Pipeline.from_pretrained(tiny, drafter="ngram", num_speculative_tokens=3)
    assert [o.token_ids for o in run(speculative, kinds, temperature=0)] == plain
    small = Pipeline.from_pretrained(tiny, num_blocks=12, block_size=4, max_num_batched_tokens=16)
    outs = run(small, kinds, temperature=0)
    assert [o.token_ids for o in outs] == plain
    assert small.last_run_metrics.num_preemptions > 0
    assert small.kv_cache_manager.num_free_blocks == small.num_blocks - 1


def test_bad_grammar_fails_only_its_request(tiny, one_torch_thread):
    pipe = Pipeline.from_pretrained(tiny)
    outs = pipe.generate(PROMPTS[:2], [SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        regex="[a-")), SamplingParams(temperature=0, max_tokens=4)])
    assert outs[0].finish_reason == "error" and "does not compile" in outs[0].error
    assert outs[1].finish_reason == "length"
    assert len(pipe.structured) == 0


def test_grammar_refused_without_tokenizer_and_with_ignore_eos(tiny):
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=CONSTRAINTS["regex"])
    with pytest.raises(TypeError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})

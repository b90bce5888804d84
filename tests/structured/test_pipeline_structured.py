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


# A prompt that spells the constrained outputs' shapes: the n-gram drafter finds continuations in it.
ECHO = 'Answers: {"ok": true, "n": 2} cc-3 gamma delta; again: {"ok": true, "n": 2} cc-3 gamma delta; again:'


def run(pipe, kinds, prompts=PROMPTS, **params):
    batch = [SamplingParams(max_tokens=48, structured_outputs=CONSTRAINTS[k], **params) for k in kinds]
    return pipe.generate([prompts[i % len(prompts)] for i in range(len(kinds))], batch)


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
    prompts = [ECHO, *PROMPTS[1:]]
    reference = Pipeline.from_pretrained(tiny)
    plain_echo = [o.token_ids for o in run(reference, kinds, prompts, temperature=0)]
    speculative = Pipeline.from_pretrained(tiny, drafter="ngram", num_speculative_tokens=3)
    assert [o.token_ids for o in run(speculative, kinds, prompts, temperature=0)] == plain_echo
    metrics = speculative.last_run_metrics  # the grammar really met drafts: some proposed, some accepted
    assert metrics.num_draft_tokens > 0 and metrics.num_accepted_tokens > 0, metrics.table()
    plain = [o.token_ids for o in run(reference, kinds, temperature=0)]
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


def test_unenforced_keywords_are_reported_and_violations_marked(tiny, one_torch_thread):
    """``not`` is not enforced by the backend: the request says so when added (a warning, and the list on
    the output), and ``validate=True`` marks the finished output that violates it; an enforced schema
    reports nothing and validates."""
    pytest.importorskip("jsonschema")
    pipe = Pipeline.from_pretrained(tiny)
    never = StructuredOutputsParams(json={"type": "string", "maxLength": 8, "not": {"type": "string"}}, validate=True)
    fine = StructuredOutputsParams(json=SCHEMA, validate=True)
    with pytest.warns(UserWarning, match=r"does not enforce 1 keyword.*not at /: ignored"):
        outs = pipe.generate(PROMPTS[:3], [SamplingParams(temperature=0, max_tokens=48, structured_outputs=c)
                                           for c in (never, fine)] + [SamplingParams(max_tokens=2)])
    assert outs[0].finish_reason == "stop" and outs[0].structured_unenforced == ["not at /: ignored"]
    assert outs[0].structured_violations and outs[0].structured_violations[0].startswith("not at /:")
    assert outs[1].finish_reason == "stop" and outs[1].structured_unenforced == []
    assert outs[1].structured_violations == []
    assert outs[2].structured_unenforced is None and outs[2].structured_violations is None

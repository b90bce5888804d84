"""Real-world schemas: every finished output is strict JSON and valid, or was flagged up front.

58 schemas from JSONSchemaBench (tests/structured/data/README.md), each run
once on the tiny model (random weights: the grammar alone shapes the output)
in one batch, seeded sampling. For every output that finishes with
``"stop"``: strict ``json.loads`` (no raw control characters, no NaN) must
succeed, and either ``jsonschema`` validates it or the request's
``structured_unenforced`` names the violated keyword (no silent violation).
``StructuredOutputsParams(validate=True)`` must mark exactly the outputs
that do not validate.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from servelab import Pipeline, SamplingParams, StructuredOutputsParams
from servelab.models import build_tiny_model

pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

DATA = Path(__file__).parent / "data" / "jsonschemabench_sample.json"
MAX_TOKENS = 256  # the tiny model's strings run long; 256 lets ~80% of the sample finish


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", arch="llama")


def strict_loads(text: str):
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)  # json.loads is strict about control characters by default


def violated_keywords(schema, value) -> set[str]:
    validator = jsonschema.validators.validator_for(schema)(schema)
    return {error.validator for error in validator.iter_errors(value)}


@pytest.fixture(scope="module")
def outputs(tiny, one_torch_thread):
    entries = json.loads(DATA.read_text())["schemas"]
    pipe = Pipeline.from_pretrained(tiny, max_num_seqs=len(entries))
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS,
                             structured_outputs=StructuredOutputsParams(json=e["schema"], validate=True))
              for i, e in enumerate(entries)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = pipe.generate(["{"] * len(entries), params)
    return entries, outs, caught


def test_no_silent_violation(outputs):
    entries, outs, _ = outputs
    assert len(entries) == 58
    errors = [(e["id"], o.error) for e, o in zip(entries, outs) if o.finish_reason == "error"]
    assert not errors  # every schema of the sample compiles
    finished = [(e, o) for e, o in zip(entries, outs) if o.finish_reason == "stop"]
    assert len(finished) >= 40, len(finished)  # the check below is not vacuous
    silent, flagged_and_violated = [], 0
    for entry, out in finished:
        value = strict_loads(out.text)
        violated = violated_keywords(entry["schema"], value)
        assert bool(out.structured_violations) == bool(violated), (entry["id"], out.structured_violations)
        flagged = {u.split(" at ")[0] for u in out.structured_unenforced}
        if violated - flagged:
            silent.append((entry["id"], sorted(violated), out.structured_unenforced))
        flagged_and_violated += bool(violated)
    assert not silent


def test_flags_are_reported_once_per_request_when_added(outputs):
    entries, outs, caught = outputs
    flagged = [o for o in outs if o.structured_unenforced]
    assert flagged and all(o.structured_unenforced is not None for o in outs)
    messages = [str(w.message) for w in caught if "does not enforce" in str(w.message)]
    assert len(messages) == len(flagged)
    for out in flagged:
        assert any(f"request {out.request_id!r}" in m and out.structured_unenforced[0] in m for m in messages)

"""Structured outputs on real-world schemas: violations with and without the schema pre-pass.

The 58 JSONSchemaBench schemas of ``tests/structured/data`` (license and
attribution in its README), each run ``--seeds`` times on the tiny model
(random weights, seeded sampling, one batch), twice: ``xgrammar-raw`` (the
schema converted as given, no pre-pass, no control-character fix: the
backend before hardening) and ``xgrammar+prepass`` (the shipped path). For
every output finishing with ``"stop"``: strict ``json.loads`` failures, schema
violations (``jsonschema``), and *silent* violations (a violated keyword the
request did not report when it was added). Quality, not speed, but recorded
like any benchmark: rows in ``bench/results/results.csv`` (component
``structured``, metrics ``finished_stop``, ``violations``,
``silent_violations``, ``json_failures``).

    python bench/structured_schemas.py [--seeds 4] [--max-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import append_rows, make_row  # noqa: E402

from servelab import Pipeline, SamplingParams, StructuredOutputsParams  # noqa: E402
from servelab.models import build_tiny_model  # noqa: E402
from servelab.samplers.structured import xgrammar_backend  # noqa: E402
from servelab.samplers.structured.validation import parse_strict_json  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "tests" / "structured" / "data" / "jsonschemabench_sample.json"


def raw_grammar(params: StructuredOutputsParams):
    """The conversion before hardening: the schema as given, bounded strings as the converter writes them."""
    return xgrammar_backend.xgr.Grammar.from_json_schema(json.dumps(params.schema), any_whitespace=False,
                                                         strict_mode=params.strict)


def count(path: Path, seeds: int, max_tokens: int, raw: bool) -> dict[str, int]:
    import jsonschema

    entries = json.loads(DATA.read_text())["schemas"] * seeds
    saved = xgrammar_backend.json_schema_grammar, xgrammar_backend.XGrammarBackend.audit
    if raw:
        xgrammar_backend.json_schema_grammar = raw_grammar
        xgrammar_backend.XGrammarBackend.audit = lambda self, params: None
    try:
        pipe = Pipeline.from_pretrained(path, max_num_seqs=64)
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=e["schema"]))
                  for i, e in enumerate(entries)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            outs = pipe.generate(["{"] * len(entries), params)
    finally:
        xgrammar_backend.json_schema_grammar, xgrammar_backend.XGrammarBackend.audit = saved
    counts = dict(finished_stop=0, errors=0, json_failures=0, violations=0, silent_violations=0)
    for entry, out in zip(entries, outs):
        counts["errors"] += out.finish_reason == "error"
        if out.finish_reason != "stop":
            continue
        counts["finished_stop"] += 1
        try:
            value = parse_strict_json(out.text)
        except ValueError:
            counts["json_failures"] += 1
            counts["silent_violations"] += not out.structured_unenforced
            continue
        schema = entry["schema"]
        violated = {e.validator for e in jsonschema.validators.validator_for(schema)(schema).iter_errors(value)}
        flagged = {u.split(" at ")[0] for u in out.structured_unenforced or []}
        counts["violations"] += bool(violated)
        counts["silent_violations"] += bool(violated - flagged)
        if violated - flagged:
            print(f"  silent: {entry['id']} violates {sorted(violated)}; flagged {sorted(flagged)}: {out.text[:200]!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prepass-only", action="store_true", help="skip the raw conversion")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    path = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", arch="llama")
    rows = []
    for name, raw in (("xgrammar-raw", True), ("xgrammar+prepass", False))[1 if args.prepass_only else 0:]:
        counts = count(path, args.seeds, args.max_tokens, raw)
        print(name, counts)
        for metric, value in counts.items():
            rows.append(make_row("structured", name, metric, "outputs", value,
                                 params={"schemas": 58, "seeds": args.seeds, "max_tokens": args.max_tokens,
                                         "model": "tiny-llama", "temperature": 1.0, "threads": 1}))
    append_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

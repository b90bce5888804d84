"""The speculative-decoding study: chains vs token trees, n-gram vs layer-skip drafting.

    python bench/spec_decode.py                      # SmolLM2-135M, 1 thread, full grid
    python bench/spec_decode.py --repeats 1 --max-tokens 40 --prompts-per-kind 2   # the recorded run
    python bench/spec_decode.py --quick              # a small grid (the notebook's)
    python bench/spec_decode.py --model tiny         # the embedded random-weight model (no checkpoint)

For every prompt kind (summarise a passage, chat, code completion: see
``bench/data/spec_decode_prompts.py``) and configuration — no speculation,
n-gram chain, n-gram tree, layer-skip chain, layer-skip tree at several node
budgets — each prompt is generated alone (batch 1, greedy, ``max_tokens``
tokens, EOS ignored so every configuration emits the same tokens; greedy
output is identical with and without speculation, checked here). Measured per
configuration and kind:

- ``accepted_per_step``: mean accepted draft tokens per target step that
  verified drafts (the papers' "accepted length" minus the bonus token);
- ``draft_ms_per_step`` / ``verify_ms_per_step``: wall time per target step
  spent in the drafter, and in the rest of the step (target forward,
  verification, bookkeeping);
- ``tokens_per_s``: end-to-end output tokens per second, p20/p50/p80 over the
  prompts x repeats; ``speedup``: its median over the no-speculation median.

Configurations are interleaved (every configuration once per repeat) so drift
on a shared machine hits all alike. Rows go to ``bench/results/results.csv``
(component ``spec_decode``); ``--plot`` draws ``bench/results/spec_decode.png``
from the latest rows. Wall-clock times on a shared machine are noisy: read the
p20..p80 ranges, not the medians alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from data.spec_decode_prompts import CHAT_TEMPLATE_KINDS, KINDS  # noqa: E402
from results_io import append_rows, make_row, percentiles  # noqa: E402

from servelab import Pipeline, SamplingParams  # noqa: E402
from servelab.models import build_tiny_model, load_model, load_tokenizer  # noqa: E402
from servelab.samplers.drafters import LayerSkipDrafter, get_drafter  # noqa: E402


@dataclass(frozen=True)
class Config:
    name: str  # implementation column: none, ngram-chain, ngram-tree, layer_skip-chain, layer_skip-tree
    budget: int = 0  # num_speculative_tokens (node budget)
    num_layers: int = 0  # layer-skip exit layer

    def drafter(self, model):
        if self.name == "none":
            return None
        if self.name == "ngram-chain":
            return get_drafter("ngram")
        if self.name == "ngram-tree":
            return get_drafter("ngram_tree")
        tree = "dynamic" if self.name.endswith("tree") else None
        return LayerSkipDrafter(self.num_layers, tree=tree, model=model)

    def params(self) -> dict:
        out = {"budget": self.budget}
        if self.num_layers:
            out["num_layers"] = self.num_layers
        return out


def grid(quick: bool, num_layers: int) -> list[Config]:
    configs = [Config("none")]
    budgets = (4, 8) if quick else (2, 4, 8)
    tree_budgets = (4, 8) if quick else (4, 8, 16)
    configs += [Config("ngram-chain", k) for k in budgets]
    configs += [Config("ngram-tree", k) for k in tree_budgets]
    if not quick:
        configs += [Config("layer_skip-chain", k, num_layers) for k in (2, 4)]
        configs += [Config("layer_skip-tree", k, num_layers) for k in (4, 8)]
    return configs


@dataclass
class Tally:
    tokens_per_s: list[float] = field(default_factory=list)
    draft_s: float = 0.0
    total_s: float = 0.0
    verify_steps: int = 0
    steps: int = 0
    accepted: int = 0


class TimedDrafter:
    """Wraps a drafter to add up the time spent in ``propose_for_requests``."""

    def __init__(self, inner):
        self.inner, self.seconds, self.proposals = inner, 0.0, 0

    def propose_for_requests(self, requests):
        start = time.perf_counter()
        try:
            out = self.inner.propose_for_requests(requests)
        finally:
            self.seconds += time.perf_counter() - start
        self.proposals += sum(1 for p in out if p.token_ids)  # each non-empty one is verified next step
        return out

    def release(self, req_id):
        self.inner.release(req_id)

    def propose_with_probs(self, token_ids, k):
        return self.inner.propose_with_probs(token_ids, k)


def run_one(model, tokenizer, config: Config, prompt: list[int], max_tokens: int, tally: Tally) -> list[int]:
    drafter = config.drafter(model)
    timed = TimedDrafter(drafter) if drafter is not None else None
    settings = dict(drafter=timed, num_speculative_tokens=config.budget, verifier="tree") if timed else {}
    pipe = Pipeline(model, tokenizer, max_num_seqs=1, **settings)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    out = pipe.generate([prompt], params)[0]
    elapsed = time.perf_counter() - start
    m = pipe.last_run_metrics
    tally.tokens_per_s.append(len(out.token_ids) / elapsed)
    tally.total_s += elapsed
    tally.steps += m.num_steps
    if timed is not None:
        tally.draft_s += timed.seconds
        tally.accepted += m.num_accepted_tokens
        tally.verify_steps += timed.proposals
    return out.token_ids


def encode(tokenizer, kind: str, text: str) -> list[int]:
    if kind in CHAT_TEMPLATE_KINDS and getattr(tokenizer, "chat_template", None):
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer.encode(chat, add_special_tokens=False)
    return tokenizer.encode(text)


def study(model_name: str, quick: bool, repeats: int, max_tokens: int, num_layers: int | None,
          write: bool = True, prompts_per_kind: int = 3, only_kinds: tuple[str, ...] = ()) -> list[dict]:
    torch.set_num_threads(1)
    if model_name == "smollm2":
        from servelab.models.hub import fetch_smollm2

        path = fetch_smollm2()
    else:
        path = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny-spec-study", arch="llama")
    model, config = load_model(path, attention="sdpa")
    model.check_inputs = False
    tokenizer = load_tokenizer(path)
    num_layers = num_layers or max(1, config.num_hidden_layers // 2)
    configs = grid(quick, num_layers)
    kinds = {kind: [encode(tokenizer, kind, text) for text in texts] for kind, texts in KINDS.items()}
    kinds = {kind: prompts[:1 if quick else prompts_per_kind] for kind, prompts in kinds.items()
             if not only_kinds or kind in only_kinds}
    rows = []
    for kind, prompts in kinds.items():
        print(f"{kind}: {len(prompts)} prompts x {len(configs)} configurations", flush=True)
        tallies = {c: Tally() for c in configs}
        reference: dict[int, list[int]] = {}
        for _ in range(repeats):
            for p, prompt in enumerate(prompts):
                for c in configs:  # interleaved: every configuration once per prompt and repeat
                    got = run_one(model, tokenizer, c, prompt, max_tokens, tallies[c])
                    if reference.setdefault(p, got) != got:
                        raise AssertionError(f"{c} changed the greedy output of {kind} prompt {p}")
        kind_rows = _rows(kind, tallies, model_name, repeats, max_tokens, len(prompts))
        if write:  # per kind, so an interrupted study keeps what it measured
            append_rows(kind_rows)
        rows += kind_rows
        print(f"{kind}: done", flush=True)
    return rows


def _rows(kind: str, tallies: dict[Config, Tally], model_name: str, repeats: int, max_tokens: int,
          num_prompts: int) -> list[dict]:
    base = statistics.median(tallies[Config("none")].tokens_per_s)
    rows = []
    for c, t in tallies.items():
        params = dict(c.params(), kind=kind, model=model_name, threads=1, max_tokens=max_tokens,
                      prompts=num_prompts, repeats=repeats, verifier="tree" if c.name != "none" else None)
        pc = percentiles(t.tokens_per_s)
        p20, p50, p80 = pc["p20"], pc["p50"], pc["p80"]
        row = dict(component="spec_decode", implementation=c.name, params=params)
        rows.append(make_row(metric="tokens_per_s", unit="tok/s", value=p50, p20=p20, p50=p50, p80=p80, **row))
        rows.append(make_row(metric="speedup", unit="x", value=p50 / base, **row))
        if c.name == "none":
            continue
        steps = max(t.verify_steps, 1)
        rows.append(make_row(metric="accepted_per_step", unit="tokens", value=t.accepted / steps, **row))
        rows.append(make_row(metric="draft_ms_per_step", unit="ms", value=1e3 * t.draft_s / t.steps, **row))
        rows.append(make_row(metric="verify_ms_per_step", unit="ms", value=1e3 * (t.total_s - t.draft_s) / t.steps,
                             **row))
    return rows


def plot(path: Path | None = None, model_name: str = "smollm2") -> Path:
    """Draw the latest study rows: per prompt kind, accepted tokens per step and speed-up vs budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from plot import latest
    from results_io import RESULTS_CSV, read_rows

    rows = [r for r in latest(read_rows()) if r["component"] == "spec_decode" and r["params"]["model"] == model_name]
    kinds = [k for k in KINDS if any(r["params"]["kind"] == k for r in rows)]
    fig, axes = plt.subplots(2, len(kinds), figsize=(4 * len(kinds), 6), squeeze=False)
    for col, kind in enumerate(kinds):
        for row_index, metric in enumerate(("accepted_per_step", "speedup")):
            ax = axes[row_index][col]
            for impl in ("ngram-chain", "ngram-tree", "layer_skip-chain", "layer_skip-tree"):
                sel = sorted((r["params"]["budget"], r["value"]) for r in rows
                             if r["implementation"] == impl and r["metric"] == metric and r["params"]["kind"] == kind)
                if sel:
                    ax.plot(*zip(*sel), marker="o", label=impl)
            if metric == "speedup":
                ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_title(f"{kind}: {metric}")
            ax.set_xlabel("node budget (num_speculative_tokens)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"speculative decoding on {model_name}, batch 1, 1 thread, greedy")
    fig.tight_layout()
    path = path or RESULTS_CSV.parent / "spec_decode.png"
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--quick", action="store_true", help="the small grid (one prompt per kind)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-layers", type=int, default=None, help="layer-skip exit layer (default: half)")
    parser.add_argument("--prompts-per-kind", type=int, default=3)
    parser.add_argument("--kinds", default="", help="comma-separated subset of code,summarise,chat")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to results.csv")
    parser.add_argument("--plot", action="store_true", help="only draw bench/results/spec_decode.png from the rows")
    args = parser.parse_args(argv)
    if args.plot:
        print(plot(model_name=args.model))
        return 0
    rows = study(args.model, args.quick, args.repeats, args.max_tokens, args.num_layers, write=not args.no_write,
                 prompts_per_kind=args.prompts_per_kind, only_kinds=tuple(filter(None, args.kinds.split(","))))
    for row in rows:
        print(row["implementation"], row["params"], row["metric"], round(row["value"], 3))
    return 0


if __name__ == "__main__":
    sys.exit(main())

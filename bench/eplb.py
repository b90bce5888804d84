"""EPLB study: recorded expert loads, rank balance before/after rebalancing, ours vs vLLM's DefaultEplbPolicy.

    python bench/eplb.py                      # record loads, compare (vLLM side when its env exists)
    python bench/eplb.py --vllm-python .ci-venv/vllm/bin/python --samples 200
    python bench/plot.py --component eplb --param replicas

1. **Recorded loads**: a tiny random Qwen3-MoE (64 experts, top-8, 4 layers) serves
   text prompts (this repository's docs, tokenized by its tokenizer) through the
   pipeline with EPLB recording only (no rearrangement); each step's per-layer
   logical load ``[L, E]`` is one recorded load, the whole run's sum another.
   Rows: per layer, max/mean expert load of the run (``expert_load_skew``).
2. **Random loads**: ``rand() ** alpha`` per expert (alpha 2, 4, 8: from mild to
   heavy skew), integer-rounded like token counts.
3. **Balance**: for each load and placement setting (64 experts on 8 ranks;
   replica budgets 64/72/80/96; flat and hierarchical 8 groups over 2 nodes),
   max / mean rank load (each expert's load split evenly over its replicas) of
   the identity placement, of ``servelab.moe.rebalance_experts`` and of vLLM's
   ``DefaultEplbPolicy.rebalance_experts`` on the same input; both policies timed
   in the same process, interleaved (the vLLM environment's interpreter, where it
   exists: ``bash ci/vllm-cpu/setup.sh .ci-venv/vllm``). Rows: the mean ratio
   per implementation, the fraction of inputs where ours is worse than vLLM's
   (``worse_than_vllm_frac``), and host milliseconds per call (p20/p50/p80).

Every timed row records ``os.getloadavg()`` (the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SETTINGS = [  # (replicas, groups, nodes, ranks) for 64 logical experts
    (64, 1, 1, 8), (72, 1, 1, 8), (80, 1, 1, 8), (96, 1, 1, 8), (80, 8, 2, 8), (96, 8, 2, 8),
]
EXPERTS, LAYERS = 64, 4


def record_loads(steps_cap: int = 96) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per-step logical loads ``[L, E]`` and their sum, from the tiny MoE model serving the docs' text."""
    from servelab import Pipeline, SamplingParams
    from servelab.models import build_tiny_model
    from servelab.moe import enable_eplb

    path = build_tiny_model(Path(tempfile.mkdtemp()) / "moe", arch="qwen3_moe", num_experts=EXPERTS,
                            num_experts_per_tok=8, moe_intermediate_size=32, num_hidden_layers=LAYERS)
    pipe = Pipeline.from_pretrained(path, enable_prefix_caching=False)
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    words = " ".join(f.read_text() for f in files if f.is_file()).split()
    prompts = [" ".join(words[i:i + 48]) for i in range(0, min(len(words), 48 * 24), 48)]
    state = enable_eplb(pipe.model, window_size=steps_cap, rearrange_interval=10**9)
    pipe.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    steps = min(state.window_step, steps_cap)
    per_step = []
    for i in range(steps):
        logical = torch.zeros(LAYERS, EXPERTS, dtype=torch.int64)
        logical.scatter_add_(1, state.physical_to_logical_map, state.expert_load_window[i])
        if int(logical.sum()):
            per_step.append(logical.float())
    return per_step, state.logical_load().float()


def random_loads(samples: int, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    alphas = (2.0, 4.0, 8.0)
    return [(f"zipf{alphas[i % 3]:g}", (torch.rand(LAYERS, EXPERTS, generator=gen) ** alphas[i % 3] * 4096).round())
            for i in range(samples)]


def compare(loads: list[tuple[str, torch.Tensor]], with_vllm: bool) -> list[dict]:
    """Per (load, setting): the three balances and the two host times (run in one process)."""
    from servelab.moe import rank_load_balance, rebalance_experts

    vllm_policy = None
    if with_vllm:
        from vllm.distributed.eplb.policy.default import DefaultEplbPolicy
        vllm_policy = DefaultEplbPolicy.rebalance_experts
    out = []
    for workload, weight in loads:
        for replicas, groups, nodes, ranks in SETTINGS:
            identity = (torch.arange(replicas) % EXPERTS).expand(LAYERS, replicas).contiguous()
            ident_cnt = torch.stack([torch.bincount(r, minlength=EXPERTS) for r in identity])
            row = {"workload": workload, "replicas": replicas, "groups": groups, "nodes": nodes, "ranks": ranks,
                   "identity": float(rank_load_balance(weight, identity, ident_cnt, ranks).mean())}
            t0 = time.perf_counter()
            phy2log, _, logcnt = rebalance_experts(weight, replicas, groups, nodes, ranks)
            row["servelab_ms"] = (time.perf_counter() - t0) * 1e3
            row["servelab"] = float(rank_load_balance(weight, phy2log, logcnt, ranks).mean())
            if vllm_policy is not None:
                t0 = time.perf_counter()
                theirs = vllm_policy(weight, replicas, groups, nodes, ranks)
                row["vllm_ms"] = (time.perf_counter() - t0) * 1e3
                cnt = torch.stack([torch.bincount(r, minlength=EXPERTS) for r in theirs])
                row["vllm"] = float(rank_load_balance(weight, theirs, cnt, ranks).mean())
            out.append(row)
    return out


def worker(path: str) -> None:
    """``--worker``: read loads, compare (vLLM included when importable), write JSON beside them."""
    data = torch.load(path)
    try:
        import vllm  # noqa: F401
        with_vllm = True
    except ImportError:
        with_vllm = False
    result = compare(list(zip(data["names"], data["loads"])), with_vllm)
    Path(path + ".json").write_text(json.dumps({"rows": result, "with_vllm": with_vllm}))


def _summarize(rows: list[dict], loadavg: tuple[float, ...], vllm_version: str | None) -> list[dict]:
    from results_io import append_rows, make_row, percentiles

    out = []
    kinds = sorted({("recorded" if r["workload"].startswith("recorded") else "random", r["replicas"], r["groups"],
                     r["nodes"], r["ranks"]) for r in rows})
    for kind, replicas, groups, nodes, ranks in kinds:
        sel = [r for r in rows if (("recorded" if r["workload"].startswith("recorded") else "random"), r["replicas"],
                                   r["groups"], r["nodes"], r["ranks"]) == (kind, replicas, groups, nodes, ranks)]
        params = {"workload": kind, "experts": EXPERTS, "layers": LAYERS, "replicas": replicas, "groups": groups,
                  "nodes": nodes, "ranks": ranks, "inputs": len(sel)}
        extra = {"vllm": vllm_version} if vllm_version else None
        for impl in ("identity", "servelab", "vllm"):
            if impl in sel[0]:
                value = sum(r[impl] for r in sel) / len(sel)
                out.append(make_row("eplb", impl, "max_mean_rank_load", "ratio", value, params=params,
                                    extra_versions=extra))
        for impl in ("servelab", "vllm"):
            key = f"{impl}_ms"
            if key in sel[0]:
                pct = percentiles([r[key] for r in sel])
                out.append(make_row("eplb", impl, "host_time", "ms", pct["p50"], **pct,
                                    params={**params, "loadavg": [round(x, 2) for x in loadavg]},
                                    extra_versions=extra))
        if "vllm" in sel[0]:
            worse = sum(r["servelab"] > r["vllm"] * (1 + 1e-9) for r in sel) / len(sel)
            out.append(make_row("eplb", "servelab", "worse_than_vllm_frac", "fraction", worse, params=params,
                                extra_versions=extra))
    append_rows(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=120, help="random loads (default 120)")
    parser.add_argument("--vllm-python", default=str(REPO / ".ci-venv/vllm/bin/python"),
                        help="interpreter of the vLLM environment (skipped when missing)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    torch.set_num_threads(1)
    per_step, total = record_loads()
    skew = [float(total[layer].max() / total[layer].mean()) for layer in range(LAYERS)]
    from results_io import append_rows, make_row
    append_rows([make_row("eplb", "tiny_qwen3_moe", "expert_load_skew", "max/mean", s,
                          params={"layer": layer, "experts": EXPERTS, "steps": len(per_step)})
                 for layer, s in enumerate(skew)])
    print(f"recorded {len(per_step)} step loads; per-layer max/mean expert load: {[round(s, 2) for s in skew]}")
    loads = [("recorded_total", total)] + [(f"recorded_step{i}", w) for i, w in enumerate(per_step)]
    loads += random_loads(args.samples)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "loads.pt")
        torch.save({"names": [n for n, _ in loads], "loads": [w for _, w in loads]}, path)
        python = args.vllm_python if Path(args.vllm_python).exists() else sys.executable
        loadavg = os.getloadavg()
        subprocess.run([python, __file__, "--worker", path], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        result = json.loads(Path(path + ".json").read_text())
    version = None
    if result["with_vllm"]:
        version = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                                 text=True).stdout.strip() or None
    rows = _summarize(result["rows"], loadavg, version)
    for row in rows:
        print(row["implementation"], row["metric"], row["params"], round(row["value"], 4))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

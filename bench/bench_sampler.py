"""CPU microbenchmarks of the sampler and the rejection sampler.

    pytest bench/bench_sampler.py --benchmark-only --benchmark-group-by=group
    python bench/bench_sampler.py            # table + bench/results/sampler_cpu.png

Both modes append rows to ``bench/results/results.csv`` (component
``sampler``): the pytest mode one time row per benchmark (``bench/conftest.py``),
the script mode one ``rows_per_s`` row per grid point.

The PyTorch path (what CPU users run) is timed at vocab 32k and 152k for
batches 1-256 (the CPU grid stops at 64 for 152k: one [256, 152k] float32
tensor is 155 MB and the reference sorts it). Each case is a typical random
request: temperature 0.8, top-k 50, top-p 0.9, a repetition penalty and 64
previous tokens. Throughput is rows (requests) per second.

The Triton kernels appear only at a tiny shape under ``TRITON_INTERPRET=1``,
next to the reference at the same shape: the interpreter's timings say nothing
about a GPU and are there for the relative shape. GPU timings come from
``bench/gpu/run_all.py`` (section ``bench/gpu/sec_sampling.py``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

# Kernels are decorated at import: choose the interpreter before importing them.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from servelab import reference  # noqa: E402
from servelab.samplers import Sampler, SamplingMetadata, SamplingParams  # noqa: E402

VOCABS = {"32k": 32_000, "152k": 151_936}
CPU_BATCHES = {"32k": [1, 8, 64, 256], "152k": [1, 8, 64]}
TINY_VOCAB, TINY_BATCHES = 1024, [1, 4]
RESULTS = Path(__file__).parent / "results"
RESULTS_COMPONENT = "sampler"


def sampler_case(batch: int, vocab_size: int, seed: int = 0):
    """``(sampler, logits, metadata)`` for ``batch`` typical random requests."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab_size, generator=gen) * 4
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1)] * batch
    history = torch.randint(0, vocab_size, (batch, 64), generator=gen).tolist()
    metadata = SamplingMetadata.from_requests(params, [h[:32] for h in history], [h[32:] for h in history], vocab_size)
    return logits, metadata


def sampling_op_case(batch: int, vocab_size: int, seed: int = 0):
    """Arguments of ``top_k_top_p_sample`` for ``batch`` rows (top-k 50, top-p 0.9)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab_size, generator=gen) * 4
    noise = torch.empty(batch, vocab_size).exponential_(generator=gen)
    return logits, torch.full((batch,), 50), torch.full((batch,), 0.9), None, noise


def rejection_case(batch: int, vocab_size: int, k: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(batch * (k + 1), vocab_size, generator=gen) * 3, dim=-1)
    draft = torch.softmax(torch.randn(batch * k, vocab_size, generator=gen) * 3, dim=-1)
    drafts = torch.randint(0, vocab_size, (batch * k,), generator=gen)
    return drafts, [k] * batch, target, draft


# --- pytest-benchmark ---------------------------------------------------------


def _record_rows_per_s(benchmark, rows: int) -> None:
    stats = getattr(benchmark, "stats", None)  # None under --benchmark-disable
    if stats is not None:
        benchmark.extra_info["rows_per_s"] = rows / stats.stats.median


@pytest.mark.parametrize("vocab", list(VOCABS))
@pytest.mark.parametrize("batch", [1, 8, 64, 256])
def test_reference_sampler(benchmark, vocab, batch):
    if batch not in CPU_BATCHES[vocab]:
        pytest.skip(f"CPU grid stops at {max(CPU_BATCHES[vocab])} for vocab {vocab}")
    benchmark.group = f"Sampler.forward, torch backend (cpu), vocab {vocab}"
    benchmark.extra_info.update(implementation="torch", metric="sampler_forward")
    logits, metadata = sampler_case(batch, VOCABS[vocab])
    sampler = Sampler(backend="torch")
    benchmark(sampler, logits, metadata)
    _record_rows_per_s(benchmark, batch)


@pytest.mark.parametrize("batch", [8, 64])
def test_reference_rejection_sample(benchmark, batch):
    benchmark.group = "rejection_sample reference (cpu), vocab 32k, k=4"
    benchmark.extra_info.update(implementation="reference", metric="rejection_sample")
    args = rejection_case(batch, VOCABS["32k"])
    benchmark(reference.rejection_sample, *args, generator=torch.Generator().manual_seed(0), check_inputs=False)
    _record_rows_per_s(benchmark, batch)


@pytest.mark.parametrize("impl", ["reference", "kernel"])
@pytest.mark.parametrize("batch", TINY_BATCHES)
def test_tiny_sampling_op(benchmark, impl, batch):
    """top_k_top_p_sample at a tiny shape: reference vs kernel under the interpreter (relative cost only)."""
    if impl == "kernel" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("set TRITON_INTERPRET=1 (or run on a GPU with bench/gpu/run_all.py)")
    module = _op_module(impl)
    benchmark.group = f"top_k_top_p_sample tiny (vocab {TINY_VOCAB}): reference vs interpreted kernel"
    benchmark.extra_info.update(implementation="triton-interpreter" if impl == "kernel" else "reference")
    args = sampling_op_case(batch, TINY_VOCAB)
    benchmark.pedantic(module.top_k_top_p_sample, args=args, kwargs={"check_inputs": False}, rounds=3, iterations=1)


def _op_module(impl: str):
    if impl == "kernel":
        from servelab.kernels import sampling

        return sampling
    from servelab.reference import sampling

    return sampling


# --- script mode: a table and a plot --------------------------------------------


def _timed_seconds(fn, repeats: int) -> list[float]:
    fn()  # warm up (allocator, first-call overheads)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _grid_row(impl: str, vocab: str, batch: int, times: list[float]) -> dict:
    seconds = statistics.median(times)
    return {"impl": impl, "vocab": vocab, "batch": batch, "ms": seconds * 1e3, "rows_per_s": batch / seconds,
            "rates": [batch / t for t in times]}


def run_grid() -> list[dict]:
    rows = []
    sampler = Sampler(backend="torch")
    for vocab, batches in CPU_BATCHES.items():
        for batch in batches:
            logits, metadata = sampler_case(batch, VOCABS[vocab])
            times = _timed_seconds(lambda: sampler(logits, metadata), repeats=3 if batch >= 64 else 5)
            rows.append(_grid_row("Sampler (torch)", vocab, batch, times))
    for impl in ("reference", "kernel"):
        if impl == "kernel" and os.environ.get("TRITON_INTERPRET") != "1":
            continue
        module = _op_module(impl)
        for batch in TINY_BATCHES:
            args = sampling_op_case(batch, TINY_VOCAB)
            times = _timed_seconds(lambda: module.top_k_top_p_sample(*args, check_inputs=False), repeats=3)
            label = "op reference" if impl == "reference" else "op kernel (interpreter)"
            rows.append(_grid_row(label, f"{TINY_VOCAB}", batch, times))
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'impl':<26}{'vocab':>8}{'batch':>7}{'ms':>12}{'rows/s':>12}")
    for row in rows:
        print(f"{row['impl']:<26}{row['vocab']:>8}{row['batch']:>7}{row['ms']:>12.3f}{row['rows_per_s']:>12.1f}")


def save_plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for vocab in CPU_BATCHES:
        points = [r for r in rows if r["impl"] == "Sampler (torch)" and r["vocab"] == vocab]
        left.plot([r["batch"] for r in points], [r["rows_per_s"] for r in points], marker="o", label=f"vocab {vocab}")
    left.set(xscale="log", yscale="log", xlabel="batch (requests)", ylabel="rows / s",
             title="Sampler.forward, torch backend, CPU")
    left.legend()
    for label in ("op reference", "op kernel (interpreter)"):
        points = [r for r in rows if r["impl"] == label]
        if points:
            right.plot([r["batch"] for r in points], [r["rows_per_s"] for r in points], marker="o", label=label)
    right.set(yscale="log", xlabel="batch (rows)", ylabel="rows / s",
              title=f"top_k_top_p_sample, vocab {TINY_VOCAB} (relative only)")
    right.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> int:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = run_grid()
    print_table(rows)
    plot_path = RESULTS / "sampler_cpu.png"
    save_plot(rows, plot_path)
    print(f"plot: {plot_path}")
    record_rows(rows)
    return 0


def record_rows(rows: list[dict]) -> None:
    """One ``rows_per_s`` row per grid point into ``bench/results/results.csv``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from results_io import append_rows, make_row, percentiles

    # Same implementation names and metric stems as the pytest mode's rows.
    names = {"Sampler (torch)": ("torch", "sampler_forward_rows_per_s"),
             "op reference": ("reference", "tiny_sampling_op_rows_per_s"),
             "op kernel (interpreter)": ("triton-interpreter", "tiny_sampling_op_rows_per_s")}
    append_rows([make_row("sampler", names[r["impl"]][0], names[r["impl"]][1], "rows/s", r["rows_per_s"],
                          params={"vocab": r["vocab"], "batch": r["batch"]}, **percentiles(r["rates"]))
                 for r in rows])


if __name__ == "__main__":
    sys.exit(main())

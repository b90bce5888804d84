"""GPU section: sampling and verification kernels against their PyTorch references.

Called by ``bench/gpu/run_all.py`` as ``run(ctx)``; ``ctx`` (attributes or keys)
gives ``device`` and ``copy_gbps`` (the device-to-device copy bandwidth the
runner measured), and when present ``bench(fn) -> ms``, ``smoke`` (run tiny
sizes on CPU under the interpreter) and ``time_left() -> s``. Returns one row per (case, impl) with keys ``section, case,
impl, ms, gbps, frac_copy_bw, vs_peer, check``:

- ``ms``: ``ctx.bench`` (else the median of CUDA-event timings after warm-up);
  the noise tensors are drawn outside the timed region (both implementations
  take them as inputs).
- ``gbps``: minimum traffic / time. Sampling: one read of the logits and of
  the noise. Rejection: per request one target row, one draft row and one
  noise row (what the final sample must read). ``frac_copy_bw`` = gbps / copy_gbps.
- ``vs_peer``: on kernel rows, reference ms / kernel ms (speedup over the
  torch reference on the same GPU); None on reference rows.
- ``check``: kernel vs reference on fresh random data, same noise. Sampling:
  fraction of rows giving the same token (the GPU's fast ``exp`` can move a
  near-tie, so < 1.0 is possible; below 0.999 is flagged FAIL). Rejection:
  exact equality ("exact" or "FAIL n/B mismatched"). bf16 logits are checked
  natively (no interpreter workaround on a GPU).

Cases: vocab 32k and 152k, batch 1-256; top-k 50 + top-p 0.9 + min-p 0.01 for
sampling; k = 4 drafts with draft probabilities for rejection; plus the whole
``Sampler.forward`` with each backend.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

SECTION = "sampling"
VOCABS = {"32k": 32_000, "152k": 151_936}
BATCHES = (1, 16, 64, 256)
NUM_DRAFTS = 4


def _ctx(ctx: object, name: str, default: object = None) -> object:
    if isinstance(ctx, dict):
        return ctx.get(name, default)
    return getattr(ctx, name, default)


def _time_ms(fn: Callable[[], object], warmup: int = 3, iters: int = 15) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _row(case: str, impl: str, ms: float | None, bytes_moved: float | None, copy_gbps: float | None,
         vs_peer: float | None, check: str | None) -> dict:
    gbps = bytes_moved / (ms * 1e-3) / 1e9 if ms and bytes_moved else None
    frac = gbps / copy_gbps if gbps is not None and copy_gbps else None
    return {"section": SECTION, "case": case, "impl": impl, "ms": ms, "gbps": gbps, "frac_copy_bw": frac,
            "vs_peer": vs_peer, "check": check}


def _sampling_rows(device: torch.device, vocab_name: str, vocab: int, batch: int, copy_gbps: float | None,
                   bench: Callable[[Callable[[], object]], float]) -> list[dict]:
    from servelab import kernels, reference

    gen = torch.Generator(device=device).manual_seed(1000 * batch + vocab)
    logits = torch.randn(batch, vocab, device=device, generator=gen) * 4
    noise = torch.empty(batch, vocab, device=device).exponential_(generator=gen)
    top_k = torch.full((batch,), 50, device=device)
    top_p = torch.full((batch,), 0.9, device=device)
    min_p = torch.full((batch,), 0.01, device=device)
    args = (logits, top_k, top_p, min_p, noise)
    case = f"top_k_top_p_sample v{vocab_name} b{batch}"
    expected = reference.top_k_top_p_sample(*args, check_inputs=False)
    match = (kernels.top_k_top_p_sample(*args, check_inputs=False) == expected).float().mean().item()
    bf16 = logits.to(torch.bfloat16)
    bf16_args = (bf16, top_k, top_p, min_p, noise)
    bf16_match = (kernels.top_k_top_p_sample(*bf16_args, check_inputs=False)
                  == reference.top_k_top_p_sample(*bf16_args, check_inputs=False)).float().mean().item()

    def verdict(fraction: float) -> str:
        return f"{'ok' if fraction >= 0.999 else 'FAIL'} match {fraction:.4f}"

    bytes_moved = 2 * batch * vocab * 4
    ref_ms = bench(lambda: reference.top_k_top_p_sample(*args, check_inputs=False))
    ker_ms = bench(lambda: kernels.top_k_top_p_sample(*args, check_inputs=False))
    bf16_ms = bench(lambda: kernels.top_k_top_p_sample(*bf16_args, check_inputs=False))
    return [
        _row(case, "torch", ref_ms, bytes_moved, copy_gbps, None, None),
        _row(case, "triton", ker_ms, bytes_moved, copy_gbps, ref_ms / ker_ms, verdict(match)),
        _row(case, "triton-bf16", bf16_ms, batch * vocab * 6, copy_gbps, ref_ms / bf16_ms, verdict(bf16_match)),
    ]


def _rejection_rows(device: torch.device, vocab_name: str, vocab: int, batch: int, copy_gbps: float | None,
                    bench: Callable[[Callable[[], object]], float]) -> list[dict]:
    from servelab import kernels, reference

    gen = torch.Generator(device=device).manual_seed(7 * batch + vocab)
    target = torch.softmax(torch.randn(batch * (NUM_DRAFTS + 1), vocab, device=device, generator=gen) * 3, dim=-1)
    draft = torch.softmax(target[: batch * NUM_DRAFTS] + 0.3 * torch.rand(batch * NUM_DRAFTS, vocab, device=device,
                                                                        generator=gen), dim=-1)
    drafts = torch.multinomial(draft, 1, generator=gen).squeeze(1)
    counts = [NUM_DRAFTS] * batch
    case = f"rejection_sample v{vocab_name} b{batch} k{NUM_DRAFTS}"

    def call(module):
        return module.rejection_sample(drafts, counts, target, draft,
                                       generator=torch.Generator(device=device).manual_seed(3), check_inputs=False)

    expected, actual = call(reference), call(kernels)
    mismatched = int((expected != actual).any(dim=1).sum())
    check = "exact" if mismatched == 0 else f"FAIL {mismatched}/{batch} mismatched"
    bytes_moved = 3 * batch * vocab * 4
    ref_ms = bench(lambda: call(reference))
    ker_ms = bench(lambda: call(kernels))
    return [
        _row(case, "torch", ref_ms, bytes_moved, copy_gbps, None, None),
        _row(case, "triton", ker_ms, bytes_moved, copy_gbps, ref_ms / ker_ms, check),
    ]


def _sampler_rows(device: torch.device, vocab_name: str, vocab: int, batch: int, copy_gbps: float | None,
                  bench: Callable[[Callable[[], object]], float]) -> list[dict]:
    from servelab.samplers import Sampler, SamplingMetadata, SamplingParams

    gen = torch.Generator(device=device).manual_seed(batch)
    logits = torch.randn(batch, vocab, device=device, generator=gen) * 4
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1, seed=i)
              for i in range(batch)]
    history = torch.randint(0, vocab, (batch, 64), generator=torch.Generator().manual_seed(batch)).tolist()
    metadata = SamplingMetadata.from_requests(params, [h[:32] for h in history], [h[32:] for h in history],
                                              vocab, device)
    case = f"Sampler.forward v{vocab_name} b{batch} (seeded, penalties)"
    tokens = {b: Sampler(backend=b)(logits, metadata).sampled_token_ids for b in ("torch", "triton")}
    match = (tokens["torch"] == tokens["triton"]).float().mean().item()
    ms = {b: bench(lambda b=b: Sampler(backend=b)(logits, metadata)) for b in ("torch", "triton")}
    return [
        _row(case, "torch", ms["torch"], None, copy_gbps, None, None),
        _row(case, "triton", ms["triton"], None, copy_gbps, ms["torch"] / ms["triton"],
             f"{'ok' if match >= 0.999 else 'FAIL'} match {match:.4f}"),
    ]


def run(ctx: object) -> list[dict]:
    device = torch.device(_ctx(ctx, "device", "cuda"))
    copy_gbps = _ctx(ctx, "copy_gbps")
    copy_gbps = float(copy_gbps) if copy_gbps else None
    smoke = bool(_ctx(ctx, "smoke", False))
    if smoke:  # --cpu-smoke: the same code on CPU tensors under the interpreter, tiny sizes
        vocabs, batches = {"300": 300}, (1, 3)
    elif device.type != "cuda" or not torch.cuda.is_available():
        return [_row("all", "-", None, None, copy_gbps, None, f"skipped: needs a CUDA device, got {device}")]
    else:
        vocabs, batches = VOCABS, BATCHES
    bench = _ctx(ctx, "bench") or _time_ms
    time_left = _ctx(ctx, "time_left") or (lambda: float("inf"))
    rows: list[dict] = []
    for builder in (_sampling_rows, _rejection_rows, _sampler_rows):
        for vocab_name, vocab in vocabs.items():
            for batch in batches:
                name = f"{builder.__name__.strip('_').replace('_rows', '')} v{vocab_name} b{batch}"
                if time_left() < 20:
                    rows.append(_row(name, "-", None, None, copy_gbps, None, "skipped: time budget spent"))
                    continue
                try:
                    rows.extend(builder(device, vocab_name, vocab, batch, copy_gbps, bench))
                except Exception as error:  # one failing case must not hide the others
                    rows.append(_row(name, "triton", None, None, copy_gbps, None,
                                     f"FAIL {type(error).__name__}: {error}"))
    return rows

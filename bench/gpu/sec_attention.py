"""GPU section: paged attention, KV-cache write and state merge (see run_all.py).

1. checks: each kernel against its reference on fresh random data (bf16
   natively, plus fp16/fp32, odd head sizes, windows, softcap, split-KV);
2. decode grid: batch x context, 32 query / 8 KV heads, head 128, bf16,
   block 16, against SDPA on the same problem unpaged (and FlexAttention /
   FlashInfer when importable);
3. prefill, chunked prefill and a mixed batch against SDPA;
4. cache write and merge bandwidth against their torch references;
5. target rows: decode b64 x 4096 at >= 75% of copy bandwidth and no slower
   than SDPA; prefill within 1.5x of SDPA.

Timing rows: ``vs_peer`` = peer ms / triton ms (> 1: Triton is faster).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

SECTION = "attention"
HQ, HKV, HEAD, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16
DECODE_BATCHES = (1, 4, 16, 64, 256)
DECODE_CONTEXTS = (512, 2048, 4096, 8192, 32768)
MAX_DECODE_TOKENS = 2 * 1024 * 1024  # batch x context cap: 8 GiB of bf16 K+V; trims 256 x 32k etc.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 2e-4}  # rtol = atol


def _row(case, impl, ms=None, gbps=None, vs_peer=None, check=None, **extra):
    return dict(section=SECTION, case=case, impl=impl, ms=ms, gbps=gbps, frac_copy_bw=None,
                vs_peer=vs_peer, check=check, **extra)


def _paged_batch(query_lens, seq_lens, *, hq, hkv, head, block, dtype, device, gen, fused=False):
    """Random paged batch with shuffled blocks; ``fused`` makes K/V views of one vLLM-style buffer."""
    blocks = [-(-s // block) for s in seq_lens]
    num_blocks = sum(blocks) + 1
    if fused:
        buf = torch.randn(num_blocks, hkv, block, 2 * head, device=device, generator=gen).to(dtype)
        key_cache, value_cache = buf.transpose(1, 2).split(head, dim=-1)
    else:
        key_cache = torch.randn(num_blocks, block, hkv, head, device=device, generator=gen).to(dtype)
        value_cache = torch.randn(num_blocks, block, hkv, head, device=device, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(blocks):
        table[i, :n] = order[used: used + n]
        used += n
    query = torch.randn(sum(query_lens), hq, head, device=device, generator=gen).to(dtype)
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32, device=device)
    starts[1:] = torch.tensor(query_lens, device=device).cumsum(0)
    return query, key_cache, value_cache, table, torch.tensor(seq_lens, dtype=torch.int32, device=device), starts


def _compare(case, actual, expected, dtype):
    tol = TOLERANCE[dtype]
    if torch.isnan(actual).any():
        return _row(case, "triton", check="FAIL NaN in output")
    err = (actual.float() - expected.float()).abs()
    excess = (err - (tol + tol * expected.float().abs())).max().item()
    status = "pass" if excess <= 0 else "FAIL"
    return _row(case, "triton", check=f"{status} max_abs_err={err.max().item():.2e} tol={tol:g}")


def _checks(ctx, kernels, reference):
    gen = torch.Generator(device=ctx.device).manual_seed(1234)
    small = ctx.smoke
    mixed = ([1, 1, 37, 200, 1], [1500, 17, 300, 200, 4096]) if not small else ([1, 1, 9, 20], [70, 17, 40, 20])
    heads = dict(hq=HQ, hkv=HKV) if not small else dict(hq=4, hkv=2)
    cases = [
        ("mixed bf16 h128 b16 split=auto", mixed, dict(head=128, block=16, dtype=torch.bfloat16), {}),
        ("mixed bf16 h128 b16 split=1", mixed, dict(head=128, block=16, dtype=torch.bfloat16), dict(num_splits=1)),
        ("mixed bf16 h128 b16 split=4", mixed, dict(head=128, block=16, dtype=torch.bfloat16), dict(num_splits=4)),
        ("window+softcap bf16 h80 b32", mixed, dict(head=80, block=32, dtype=torch.bfloat16),
         dict(sliding_window=64, softcap=30.0)),
        ("fused-kv fp16 h96 b8 non-causal", mixed, dict(head=96, block=8, dtype=torch.float16, fused=True),
         dict(causal=False)),
        ("fp16 h256 b64 window=1", mixed, dict(head=256, block=64, dtype=torch.float16), dict(sliding_window=1)),
        ("fp32 h64 b128 split=3", mixed, dict(head=64, block=128, dtype=torch.float32), dict(num_splits=3)),
    ]
    rows = []
    for name, (q_lens, s_lens), shape, options in cases:
        batch = _paged_batch(q_lens, s_lens, **heads, **shape, device=ctx.device, gen=gen)
        out = torch.full_like(batch[0], float("nan"))  # unwritten elements stay NaN
        kernels.paged_attention(*batch, out=out, **options)
        options.pop("num_splits", None)
        rows.append(_compare(f"check paged_attention {name}", out, reference.paged_attention(*batch, **options),
                             shape["dtype"]))

    # KV-cache write: a copy, so exact; -1 slots must leave NaN behind.
    tokens = 64 if small else 4096
    num_blocks = tokens // BLOCK + 4
    k_cache = torch.full((num_blocks, BLOCK, heads["hkv"], HEAD), float("nan"), dtype=DTYPE, device=ctx.device)
    v_cache, k_ref, v_ref = k_cache.clone(), k_cache.clone(), k_cache.clone()
    key = torch.randn(tokens, heads["hkv"], HEAD, device=ctx.device, generator=gen).to(DTYPE)
    value = torch.randn(tokens, heads["hkv"], HEAD, device=ctx.device, generator=gen).to(DTYPE)
    slots = torch.randperm(num_blocks * BLOCK, device=ctx.device, generator=gen)[:tokens]
    slots[::7] = -1
    kernels.reshape_and_cache(key, value, k_cache, v_cache, slots)
    reference.reshape_and_cache(key, value, k_ref, v_ref, slots)
    same = all(torch.equal(torch.nan_to_num(a, nan=7.0), torch.nan_to_num(b, nan=7.0))
               for a, b in ((k_cache, k_ref), (v_cache, v_ref)))
    rows.append(_row("check reshape_and_cache bf16", "triton", check="pass exact" if same else "FAIL differs"))

    # Merge with some empty (-inf) partials.
    out_a = torch.randn(tokens, heads["hq"], HEAD, device=ctx.device, generator=gen).to(DTYPE)
    out_b = torch.randn(tokens, heads["hq"], HEAD, device=ctx.device, generator=gen).to(DTYPE)
    lse_a = 3 * torch.randn(tokens, heads["hq"], device=ctx.device, generator=gen)
    lse_b = 3 * torch.randn(tokens, heads["hq"], device=ctx.device, generator=gen)
    lse_a[::5] = -math.inf
    lse_b[::10] = -math.inf
    merged, merged_lse = kernels.merge_attn_states(out_a, lse_a, out_b, lse_b)
    expected, expected_lse = reference.merge_attn_states(out_a, lse_a, out_b, lse_b)
    row = _compare("check merge_attn_states bf16", merged, expected, DTYPE)
    lse_ok = torch.allclose(merged_lse, expected_lse, rtol=1e-5, atol=1e-5)
    if not lse_ok:
        row["check"] = "FAIL lse differs"
    rows.append(row)
    return rows


def _sdpa_variants(q, k, v, **kwargs):
    """Ways to run SDPA on grouped KV heads: native ``enable_gqa`` (newer torch) and
    K/V expanded to every query head ahead of time (reads ``group`` times more).
    The fastest that works is the peer."""
    group = q.shape[1] // k.shape[1]
    variants = {"gqa": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)}
    if group > 1:
        k_all, v_all = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        variants["expanded"] = lambda: F.scaled_dot_product_attention(q, k_all, v_all, **kwargs)
    else:
        variants["plain"] = lambda: F.scaled_dot_product_attention(q, k, v, **kwargs)
    return variants


def _time_best_sdpa(ctx, variant_sets, ours_ms, rows, case, bytes_moved):
    """Time each SDPA variant (all sub-calls of a case together); keep the fastest."""
    best = None
    errors = []
    for label in ("gqa", "expanded", "plain"):
        calls = [v[label] for v in variant_sets if label in v]
        if len(calls) != len(variant_sets):
            continue

        def run_all(calls=calls):
            for call in calls:
                call()

        try:
            ms = ctx.bench(run_all)
        except Exception as error:  # noqa: BLE001 - e.g. no enable_gqa in this torch
            errors.append(f"{label}: {type(error).__name__}")
            continue
        if best is None or ms < best[0]:
            best = (ms, label)
    if best is None:
        rows.append(_row(case, "sdpa (dense)", check=f"peer error: {'; '.join(errors)[:100]}"))
        return None
    rows.append(_row(case, f"sdpa (dense, {best[1]})", ms=best[0], gbps=bytes_moved / (best[0] * 1e-3) / 1e9))
    return best[0] / ours_ms


class _Peers:
    """Optional peers, resolved once; failures become notes, not section failures."""

    def __init__(self, ctx):
        self.flex = None
        self.flashinfer = None
        if ctx.smoke:
            return
        try:
            from torch.nn.attention.flex_attention import flex_attention

            self.flex = torch.compile(flex_attention, dynamic=False)
        except Exception:  # noqa: BLE001 - optional peer
            self.flex = None
        try:
            import flashinfer

            self.flashinfer = flashinfer
        except Exception:  # noqa: BLE001 - optional peer
            self.flashinfer = None


def _flashinfer_decode(flashinfer, query, key_cache, value_cache, table, seq_lens):
    """A FlashInfer paged decode over the same cache, or raise."""
    batch = table.shape[0]
    pages = (seq_lens + BLOCK - 1) // BLOCK
    indptr = torch.zeros(batch + 1, dtype=torch.int32, device=query.device)
    indptr[1:] = pages.cumsum(0)
    indices = torch.cat([table[i, : int(pages[i])] for i in range(batch)])
    last = (seq_lens - 1) % BLOCK + 1
    workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=query.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(indptr, indices, last.to(torch.int32), HQ, HKV, HEAD, BLOCK, data_type=query.dtype)
    return lambda: wrapper.run(query, (key_cache, value_cache))


def _time_peer(ctx, name, fn, ours_ms, rows, case, bytes_moved=None, extra=None):
    try:
        ms = ctx.bench(fn)
    except Exception as error:  # noqa: BLE001 - a peer failing is reported, not fatal
        rows.append(_row(case, name, check=f"peer error: {type(error).__name__}: {str(error)[:80]}"))
        return None
    gbps = bytes_moved / (ms * 1e-3) / 1e9 if bytes_moved else None
    rows.append(_row(case, name, ms=ms, gbps=gbps, **(extra or {})))
    return ms / ours_ms


def _decode_grid(ctx, kernels):
    from servelab.kernels.paged_attention import choose_num_splits
    from servelab.kernels._triton_utils import sm_count

    hq, hkv, head = (HQ, HKV, HEAD) if not ctx.smoke else (4, 2, 32)
    batches = DECODE_BATCHES if not ctx.smoke else (1, 2)
    contexts = DECODE_CONTEXTS if not ctx.smoke else (32, 48)
    grid = [(b, c) for b in batches for c in contexts if b * c <= MAX_DECODE_TOKENS]
    max_tokens = max(b * c for b, c in grid)
    num_blocks = max_tokens // BLOCK
    # One big cache reused by every case; blocks handed out in a random order.
    key_cache = torch.empty(num_blocks, BLOCK, hkv, head, dtype=DTYPE, device=ctx.device).normal_()
    value_cache = torch.empty_like(key_cache).normal_()
    order = torch.randperm(num_blocks, device=ctx.device).to(torch.int32)
    peers = _Peers(ctx)
    flex_cases = {(64, 4096), (1, 32768), (256, 2048)}
    rows = []
    elem = key_cache.element_size()
    for batch, context in grid:
        if ctx.time_left() < 150:
            rows.append(_row(f"decode b{batch} ctx{context}", "triton", check="skipped: time budget"))
            continue
        case = f"decode b{batch} ctx{context}"
        table = order[: batch * context // BLOCK].view(batch, context // BLOCK)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=ctx.device)
        starts = torch.arange(batch + 1, dtype=torch.int32, device=ctx.device)
        query = torch.randn(batch, hq, head, dtype=DTYPE, device=ctx.device)
        out = torch.empty_like(query)
        moved = 2 * batch * context * hkv * head * elem + 2 * query.numel() * elem + table.numel() * 4
        splits = choose_num_splits(batch, batch, hkv, context, sm_count(ctx.device))
        ours = ctx.bench(lambda: kernels.paged_attention(query, key_cache, value_cache, table, seq_lens, starts,
                                                         out=out, check_inputs=False))
        ratios = {}
        dense_k = torch.randn(batch, hkv, context, head, dtype=DTYPE, device=ctx.device)
        dense_v = torch.randn_like(dense_k)
        dense_q = query.view(batch, hq, 1, head)
        ratios["sdpa"] = _time_best_sdpa(ctx, [_sdpa_variants(dense_q, dense_k, dense_v)], ours, rows, case, moved)
        if peers.flex is not None and (batch, context) in flex_cases and ctx.time_left() > 240:
            ratios["flex"] = _time_peer(ctx, "flex_attention (dense)",
                                        lambda: peers.flex(dense_q, dense_k, dense_v, enable_gqa=True),
                                        ours, rows, case, moved)
        if peers.flashinfer is not None:
            try:
                fi = _flashinfer_decode(peers.flashinfer, query, key_cache, value_cache, table, seq_lens)
                ratios["flashinfer"] = _time_peer(ctx, "flashinfer (paged)", fi, ours, rows, case, moved)
            except Exception as error:  # noqa: BLE001
                rows.append(_row(case, "flashinfer (paged)", check=f"peer error: {str(error)[:80]}"))
        del dense_k, dense_v
        vs = ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items() if v is not None) or None
        rows.append(_row(case, f"triton (splits={splits})", ms=ours, gbps=moved / (ours * 1e-3) / 1e9,
                         vs_peer=vs, sdpa_ratio=ratios.get("sdpa")))
        if splits > 1:
            unsplit = ctx.bench(lambda: kernels.paged_attention(query, key_cache, value_cache, table, seq_lens,
                                                                starts, out=out, num_splits=1, check_inputs=False))
            rows.append(_row(case, "triton (splits=1)", ms=unsplit, gbps=moved / (unsplit * 1e-3) / 1e9,
                             vs_peer=f"auto split {unsplit / ours:.2f}x"))
    return rows


def _prefill_like(ctx, kernels):
    """Fresh prefills, a chunked prefill and a mixed batch, each against SDPA."""
    hq, hkv, head = (HQ, HKV, HEAD) if not ctx.smoke else (4, 2, 32)
    shrink = 64 if ctx.smoke else 1  # --cpu-smoke: same cases, 64x shorter
    cases = {
        "prefill 1x4096": ([4096], [4096]),
        "prefill 4x2048": ([2048] * 4, [2048] * 4),
        "chunked 512 after 3584": ([512], [4096]),
        "mixed 60 decodes@4096 + 512 after 2048": ([1] * 60 + [512], [4096] * 60 + [2560]),
    }
    gen = torch.Generator(device=ctx.device).manual_seed(99)
    rows = []
    for case, (q_lens, s_lens) in cases.items():
        if ctx.time_left() < 90:
            rows.append(_row(case, "triton", check="skipped: time budget"))
            continue
        q_lens = [max(1, q // shrink) for q in q_lens]
        s_lens = [max(q, s // shrink) for q, s in zip(q_lens, s_lens)]
        if ctx.smoke:
            q_lens, s_lens = q_lens[-3:], s_lens[-3:]
        batch = _paged_batch(q_lens, s_lens, hq=hq, hkv=hkv, head=head, block=BLOCK, dtype=DTYPE,
                             device=ctx.device, gen=gen)
        out = torch.empty_like(batch[0])
        ours = ctx.bench(lambda: kernels.paged_attention(*batch, out=out, check_inputs=False))
        # Causal FLOPs: query t of a sequence with context c sees c + t + 1 keys.
        flops = sum(4 * hq * head * (q * (s - q) + q * (q + 1) / 2) for q, s in zip(q_lens, s_lens))
        moved = sum(2 * s * hkv * head * 2 + 2 * q * hq * head * 2 for q, s in zip(q_lens, s_lens))
        dense = [(torch.randn(1, hq, q, head, dtype=DTYPE, device=ctx.device),
                  torch.randn(1, hkv, s, head, dtype=DTYPE, device=ctx.device),
                  torch.randn(1, hkv, s, head, dtype=DTYPE, device=ctx.device)) for q, s in zip(q_lens, s_lens)]

        # Decodes batched into one call, as a dense engine would; other sequences one call each.
        decodes = [d for d in dense if d[0].shape[2] == 1]
        variant_sets = []
        if decodes:
            variant_sets.append(_sdpa_variants(*(torch.cat([d[j] for d in decodes]) for j in range(3))))
        for q, k, v in dense:
            if q.shape[2] == 1:
                continue
            if q.shape[2] == k.shape[2]:
                variant_sets.append(_sdpa_variants(q, k, v, is_causal=True))
            else:  # chunk: causal aligned to the bottom-right (the chunk's own positions)
                mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(
                    k.shape[2] - q.shape[2])
                variant_sets.append(_sdpa_variants(q, k, v, attn_mask=mask))
        ratio = _time_best_sdpa(ctx, variant_sets, ours, rows, case, moved)
        rows.append(_row(case, "triton", ms=ours, gbps=moved / (ours * 1e-3) / 1e9,
                         vs_peer=f"sdpa {ratio:.2f}x" if ratio else None, sdpa_ratio=ratio,
                         tflops=flops / (ours * 1e-3) / 1e12))
        del dense, decodes, variant_sets
    return rows


def _cache_ops(ctx, kernels, reference):
    tokens = 16384 if not ctx.smoke else 64
    hkv, hq = (HKV, HQ) if not ctx.smoke else (2, 4)
    rows = []
    num_blocks = tokens // BLOCK + 1
    key_cache = torch.zeros(num_blocks, BLOCK, hkv, HEAD, dtype=DTYPE, device=ctx.device)
    value_cache = torch.zeros_like(key_cache)
    key = torch.randn(tokens, hkv, HEAD, dtype=DTYPE, device=ctx.device)
    slots = torch.randperm(num_blocks * BLOCK, device=ctx.device)[:tokens]
    moved = 4 * key.numel() * key.element_size() + slots.numel() * 8
    case = f"reshape_and_cache {tokens} tokens"
    ours = ctx.bench(lambda: kernels.reshape_and_cache(key, key, key_cache, value_cache, slots, check_inputs=False))
    ratio = _time_peer(ctx, "torch reference", lambda: reference.reshape_and_cache(
        key, key, key_cache, value_cache, slots, check_inputs=False), ours, rows, case, moved)
    rows.append(_row(case, "triton", ms=ours, gbps=moved / (ours * 1e-3) / 1e9,
                     vs_peer=f"torch {ratio:.2f}x" if ratio else None))

    out_a = torch.randn(tokens, hq, HEAD, dtype=DTYPE, device=ctx.device)
    out_b, lse_a, lse_b = torch.randn_like(out_a), torch.randn(tokens, hq, device=ctx.device), \
        torch.randn(tokens, hq, device=ctx.device)
    moved = 3 * out_a.numel() * out_a.element_size() + 3 * lse_a.numel() * 4
    case = f"merge_attn_states {tokens} tokens"
    ours = ctx.bench(lambda: kernels.merge_attn_states(out_a, lse_a, out_b, lse_b, check_inputs=False))
    ratio = _time_peer(ctx, "torch reference", lambda: reference.merge_attn_states(
        out_a, lse_a, out_b, lse_b, check_inputs=False), ours, rows, case, moved)
    rows.append(_row(case, "triton", ms=ours, gbps=moved / (ours * 1e-3) / 1e9,
                     vs_peer=f"torch {ratio:.2f}x" if ratio else None))
    return rows


def _targets(rows, copy_gbps):
    """The issue's targets, as rows that say met / not met (never FAIL: they are goals)."""
    out = []
    # The automatically split row is the one carrying sdpa_ratio.
    decode = [r for r in rows if r["case"] == "decode b64 ctx4096" and "sdpa_ratio" in r and r["ms"]]
    if decode:
        r = decode[0]
        frac = r["gbps"] / copy_gbps
        out.append(_row("TARGET decode b64 ctx4096 >= 75% copy bw", "triton", gbps=r["gbps"],
                        check=f"{'met' if frac >= 0.75 else 'not met'} ({frac:.0%})"))
        if r.get("sdpa_ratio"):
            out.append(_row("TARGET decode b64 ctx4096 no slower than SDPA", "triton",
                            check=f"{'met' if r['sdpa_ratio'] >= 1 else 'not met'} (sdpa/triton {r['sdpa_ratio']:.2f})"))
    for r in rows:
        if str(r["case"]).startswith("prefill") and r["impl"] == "triton" and r.get("sdpa_ratio"):
            out.append(_row(f"TARGET {r['case']} within 1.5x of SDPA", "triton",
                            check=f"{'met' if r['sdpa_ratio'] >= 1 / 1.5 else 'not met'} "
                                  f"(triton/sdpa {1 / r['sdpa_ratio']:.2f})"))
    return out


def run(ctx) -> list[dict]:
    from servelab import kernels, reference

    rows = _checks(ctx, kernels, reference)
    rows += _decode_grid(ctx, kernels)
    rows += _prefill_like(ctx, kernels)
    rows += _cache_ops(ctx, kernels, reference)
    rows += _targets(rows, ctx.copy_gbps)
    return rows

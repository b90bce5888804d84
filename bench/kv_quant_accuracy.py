"""Accuracy of quantized KV pages: every ``kv_cache_dtype`` x ``kv_cache_scale`` against ``"auto"``.

For each setting the model runs teacher-forced over a real English text
(``bench/data/kv_quant_text.txt``, the PSF-licensed Python Language Reference chapter, see its
ATTRIBUTION file) in sequences of ``--seq-len`` tokens, each one forward over the paged cache, so
every position attends to quantized K/V (its own step's too: the write comes first). Every sequence
starts as the tokenizer starts a text (:func:`text_sequences`: Gemma's ``<bos>``, nothing for
SmolLM2). Recorded per
setting (rows ``component=kv_quant_accuracy``):

- ``ppl`` and ``ppl_ratio`` (perplexity over ``"auto"``'s);
- ``kl_mean``: mean KL(p_auto || p_quant) of the next-token distributions;
- ``top1_agreement``: share of positions whose argmax equals ``"auto"``'s;
- with ``--greedy`` (the ``"token_head"`` settings and calibrated int8 ``"head"``): ``greedy_equal``
  out of 16 demo prompts (32 greedy tokens through the Pipeline, ``"sdpa"``), and for each differing prompt the ``"auto"`` model's top-2 logit margin
  at the first differing token (``near_tie_margins``: a near-tie when < 0.05).

Static scales (``"tensor"``, ``"head"``) are measured twice: at 1.0 (vLLM's default) and
calibrated on the 16 demo prompts (not the evaluation text), ``calibrate_kv_scales``. With
``--key-smoothing ALPHA`` the ``"token_head"`` settings are measured again on a copy of the model
whose keys are smoothed (``smooth_model_keys``, calibrated on the same demo prompts; rows with
``key_smoothing=ALPHA``).

Usage: ``python bench/kv_quant_accuracy.py [--model smollm2] [--greedy] [--key-smoothing 0.5]
[--kv-dtypes int8,fp8_e4m3] [--scales token_head]``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from results_io import append_rows, make_row  # noqa: E402
from text_accuracy import text_metrics  # noqa: E402

from servelab.blocks.kv_quant import get_kv_cache_dtype, kv_cache_storage  # noqa: E402
from servelab.models import allocate_kv_caches, load_model, load_tokenizer, prepare_inputs  # noqa: E402
from servelab.pipeline.kv_calibration import calibrate_key_smoothing, measure_kv_amax, smooth_model_keys  # noqa: E402

TEXT = Path(__file__).parent / "data" / "kv_quant_text.txt"
DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2")
SETTINGS = [(d, s, c) for d in DTYPES for s, c in
            (("token_head", False), ("head", False), ("head", True), ("tensor", False), ("tensor", True))]


def model_path(name: str) -> Path:
    from servelab.models import hub

    if name == "smollm2":
        return hub.fetch_smollm2()
    if name == "gemma3-270m":
        return hub.fetch_gemma3_270m()
    return Path(name)


@torch.no_grad()
def sequence_logits(model, tokens: list[int], kv_cache_dtype: str, kv_scale: str | None,
                    static: torch.Tensor | None, block_size: int = 16) -> torch.Tensor:
    """float32 logits ``[len(tokens), vocab]``: one forward over a fresh cache of the setting."""
    num_blocks = -(-len(tokens) // block_size) + 1
    dtype, granularity = kv_cache_storage(kv_cache_dtype, kv_scale, model.dtype)
    caches = allocate_kv_caches(model, num_blocks, block_size, dtype=dtype, kv_scale=granularity)
    if caches.static_scales is not None and static is not None:
        caches.static_scales.copy_(static)
    ids, pos, meta = prepare_inputs([tokens], [0], [list(range(1, num_blocks))], block_size)
    model.reset_attention_state()
    return model.compute_logits(model(ids, pos, caches, meta)).float()


def text_sequences(tokenizer, text: str, seq_len: int, max_tokens: int | None) -> list[list[int]]:
    """``text``'s tokens in sequences of ``seq_len``, each beginning with what the tokenizer puts before
    any text (``tokenizer.encode("")``: Gemma's ``<bos>``, nothing for SmolLM2), then the next chunk.

    Why: a chunk cut from the middle of the token stream has no ``<bos>``, and Gemma 3 without it is
    out of distribution (its first position turns into an attention sink of its own: "auto" perplexity
    86 instead of 21 on the second 256 tokens here), which inflated the quantized settings' KL up to
    15x. ``max_tokens`` caps the text's tokens (the prefix included once)."""
    prefix = list(tokenizer.encode(""))
    body = list(tokenizer.encode(text))
    if prefix and body[: len(prefix)] == prefix:
        body = body[len(prefix):]
    if max_tokens is not None:
        body = body[: max(max_tokens - len(prefix), 0)]
    step = seq_len - len(prefix)
    if step <= 16:
        raise ValueError(f"--seq-len {seq_len} leaves {step} text tokens per sequence after the tokenizer's "
                         f"{len(prefix)} prefix tokens; valid: more than {16 + len(prefix)}")
    return [prefix + body[i:i + step] for i in range(0, len(body) - 1, step) if len(body[i:i + step]) > 16]


def demo_token_prompts(tokenizer) -> list[list[int]]:
    from servelab.cli.demo import demo_prompts

    prompts = demo_prompts(tokenizer, random.Random(0), 16)  # token lists, or texts without a chat template
    return [list(tokenizer.encode(p)) if isinstance(p, str) else p for p in prompts]


def greedy_agreement(path: Path, kv_cache_dtype: str, kv_scale: str | None, static: torch.Tensor | None,
                     reference: list[list[int]] | None, prompts, smoothing: float | None = None
                     ) -> tuple[list[list[int]], int]:
    from servelab import Pipeline, SamplingParams

    settings = {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype, "kv_cache_scale": kv_scale}
    pipe = Pipeline.from_pretrained(path, max_num_seqs=16, **settings)
    if static is not None and pipe.kv_caches.static_scales is not None:
        pipe.kv_caches.static_scales.copy_(static)
    if smoothing is not None:
        calibrate_key_smoothing(pipe, prompts, alpha=smoothing)
    outs = [o.token_ids for o in pipe.generate(prompts, SamplingParams(temperature=0, max_tokens=32))]
    equal = len(outs) if reference is None else sum(a == b for a, b in zip(outs, reference))
    return outs, equal


@torch.no_grad()
def near_tie_margins(model, prompts, reference: list[list[int]], outs: list[list[int]]) -> list[float]:
    """For each prompt whose output differs: ``"auto"``'s top-2 logit margin where it first differs."""
    margins = []
    for prompt, ref, out in zip(prompts, reference, outs):
        first = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), None)
        if first is None:
            continue
        tokens = list(prompt) + ref[:first]
        logits = sequence_logits(model, tokens, "auto", None, None)[-1]
        top = torch.topk(logits, 2).values
        margins.append(round(float(top[0] - top[1]), 4))
    return margins


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--greedy", action="store_true", help="also greedy agreement on the 16 demo prompts")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="evaluate on the text's first tokens only (a large vocabulary's logits are big)")
    parser.add_argument("--key-smoothing", type=float, default=None, metavar="ALPHA",
                        help="also the token_head settings with keys smoothed (alpha in [0, 1]; default: not run)")
    parser.add_argument("--kv-dtypes", default=",".join(DTYPES), help="formats to measure (default: all three)")
    parser.add_argument("--scales", default="token_head,head,tensor", help="granularities to measure (default: all)")
    args = parser.parse_args()
    path = model_path(args.model)
    model, _ = load_model(path)
    tokenizer = load_tokenizer(path)
    seqs = text_sequences(tokenizer, TEXT.read_text(), args.seq_len, args.max_tokens)
    prompts = demo_token_prompts(tokenizer)
    amax = measure_kv_amax(model, prompts)
    ref = [sequence_logits(model, s, "auto", None, None) for s in seqs]
    base = text_metrics(ref, ref, seqs)
    rows, load = [], os.getloadavg()[0]
    common = {"model": args.model, "text_tokens": base["tokens"], "seq_len": args.seq_len}
    rows.append(make_row("kv_quant_accuracy", "auto", "ppl", "ppl", base["ppl"], params=dict(common, kv_cache_dtype="auto")))
    print(f"auto ppl={base['ppl']:.4f} over {base['tokens']} tokens", flush=True)
    greedy_ref = None
    if args.greedy:
        greedy_ref, _ = greedy_agreement(path, "auto", None, None, None, prompts)
    dtypes, scales = args.kv_dtypes.split(","), args.scales.split(",")
    settings = [(d, s, c, None) for d, s, c in SETTINGS if d in dtypes and s in scales]
    smoothed = None
    if args.key_smoothing is not None:
        smoothed, _ = load_model(path)
        smooth_model_keys(smoothed, prompts, alpha=args.key_smoothing)
        settings += [(d, "token_head", False, args.key_smoothing) for d in DTYPES if d in dtypes]
    for dtype, scale, calibrated, smoothing in settings:
        static = None
        if scale != "token_head":
            a = amax.amax(dim=2, keepdim=True).expand_as(amax) if scale == "tensor" else amax
            fmt = get_kv_cache_dtype(dtype)
            static = torch.where(a > 0, a / fmt.max_value, torch.ones_like(a)) if calibrated else torch.ones_like(a)
        start = time.perf_counter()
        got = [sequence_logits(model if smoothing is None else smoothed, s, dtype, scale, static) for s in seqs]
        m = text_metrics(ref, got, seqs)
        params = dict(common, kv_cache_dtype=dtype, kv_cache_scale=scale,
                      scales="token" if scale == "token_head" else ("calibrated" if calibrated else "1.0"))
        if smoothing is not None:
            params["key_smoothing"] = smoothing
        for metric, unit, value in (("ppl", "ppl", m["ppl"]), ("ppl_ratio", "ratio", m["ppl"] / base["ppl"]),
                                    ("kl_mean", "nats", m["kl_mean"]), ("top1_agreement", "fraction",
                                                                        m["top1_agreement"])):
            rows.append(make_row("kv_quant_accuracy", dtype, metric, unit, value, params=params))
        line = (f"{dtype:9s} {scale:10s} {params['scales']:10s} "
                f"{'' if smoothing is None else f'smooth={smoothing} '}ppl={m['ppl']:.4f} "
                f"ratio={m['ppl'] / base['ppl']:.5f} kl={m['kl_mean']:.2e} top1={m['top1_agreement']:.4f}")
        if args.greedy and (scale == "token_head" or (calibrated and scale == "head" and dtype == "int8")):
            outs, equal = greedy_agreement(path, dtype, scale, static, greedy_ref, prompts, smoothing)
            margins = near_tie_margins(model, prompts, greedy_ref, outs)
            rows.append(make_row("kv_quant_accuracy", dtype, "greedy_equal", "prompts", equal,
                                 params=dict(params, prompts=16, max_tokens=32, near_tie_margins=margins,
                                             loadavg=load)))
            line += f" greedy={equal}/16 margins={margins}"
        print(line, f"({time.perf_counter() - start:.0f} s)", flush=True)
    append_rows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())

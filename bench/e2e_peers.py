"""The engines of ``bench/e2e.py``: how each one is loaded and serves a batch or an online stream.

- servelab: ``Pipeline.generate`` (batch) or ``add_request`` / ``step`` as requests arrive;
- ``transformers``: left-padded batched ``generate`` (online: fixed batches, a streamer for timing);
- ``transformers-cb``: transformers' continuous batching (``generate_batch``; online, the
  manager behind it, requests added as they arrive), ``paged|sdpa`` attention.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from pathlib import Path

import torch


def load_hf(path: Path, attention: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention).eval()


def load_hf_cb(path: Path):
    """A second copy for continuous batching (``paged|sdpa``: the paged cache the manager drives)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # "the paged| prefix is no longer needed"
        return load_hf(path, "paged|sdpa")


def cb_configs(max_tokens: int, max_requests: int, max_context: int, num_requests: int):
    """(GenerationConfig, ContinuousBatchingConfig): greedy, EOS never matched, exactly
    ``max_tokens`` new tokens unless a request says otherwise; a KV cache that holds
    ``max_requests`` contexts of ``max_context`` tokens, 2048 tokens per batch (servelab's
    ``max_num_batched_tokens``)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    generation = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    page = 256
    blocks = max_requests * -(-max_context // page) + 4
    return generation, ContinuousBatchingConfig(page_size=page, num_blocks=blocks, max_batch_tokens=2048,
                                                max_requests_per_batch=max_requests)


def make_pipeline(path: Path, max_num_seqs: int, max_model_len: int):
    from servelab import Pipeline

    return Pipeline.from_pretrained(path, attention_backend="sdpa", max_num_seqs=max_num_seqs,
                                    max_num_batched_tokens=2048, max_model_len=max_model_len,
                                    enable_prefix_caching=False)


def hf_generate_batch(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' continuous batching over all prompts; tokens in prompt order."""
    generation, cb = cb_configs(max_tokens, len(prompts), max(map(len, prompts)) + max_tokens, len(prompts))
    with torch.inference_mode():
        out = model.generate_batch(prompts, generation_config=generation, continuous_batching_config=cb,
                                   progress_bar=False, warmup=False)
    return [o.generated_tokens for o in out.values()]


def hf_generate(model, prompts: list[list[int]], max_tokens: int, streamer=None) -> list[list[int]]:
    """Left-padded batched greedy generate of exactly ``max_tokens`` tokens per prompt."""
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0, streamer=streamer)
    return [row[longest:].tolist() for row in out]


# ---- online workload --------------------------------------------------------------------------

def online_requests(n: int, rate: float, seed: int, vocab: int) -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt ids, output tokens): Poisson arrivals; lognormal lengths
    (prompt median 48, output median 32, sigma 0.8; clipped to [4, 512] / [2, 256])."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        plen = min(max(int(rng.lognormvariate(math.log(48), 0.8)), 4), 512)
        olen = min(max(int(rng.lognormvariate(math.log(32), 0.8)), 2), 256)
        out.append((t, [rng.randrange(3, min(vocab, 500)) for _ in range(plen)], olen))
    return out


def _latency_stats(arrival, first, last, lengths) -> dict:
    ttft = [f - a for a, f in zip(arrival, first)]
    tpot = [(l_ - f) / (n - 1) for f, l_, n in zip(first, last, lengths) if n > 1]
    return dict(ttft_p50=statistics.median(ttft), ttft_p90=statistics.quantiles(ttft, n=10)[8],
                tpot_p50=statistics.median(tpot), throughput=sum(lengths) / (max(last) - min(arrival)))


def serve_online_servelab(pipe, requests) -> dict:
    from servelab.samplers import SamplingParams

    start = time.perf_counter()
    pending = list(range(len(requests)))
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    index: dict[str, int] = {}
    while pending or pipe.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and requests[pending[0]][0] <= now:
            i = pending.pop(0)
            _, prompt, olen = requests[i]
            rid = pipe.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=olen, ignore_eos=True),
                                   detokenize=False)
            index[rid] = i
        if not pipe.has_unfinished_requests():
            time.sleep(max(requests[pending[0]][0] - now, 0.0))
            continue
        for event in pipe.step():
            stamp = time.perf_counter() - start
            if event.new_token_ids:
                first.setdefault(event.request_id, stamp)
                last[event.request_id] = stamp
    order = sorted(index, key=index.get)
    return _latency_stats([requests[index[r]][0] for r in order], [first[r] for r in order],
                          [last[r] for r in order], [requests[index[r]][2] for r in order])


class _Stamps:
    """A transformers streamer recording when each generation step's tokens arrive."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:  # the first call carries the prompt
            self.prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def serve_online_hf(model, requests, batch_size: int) -> dict:
    start = time.perf_counter()
    arrival, first, last, lengths = [], [], [], []
    for b in range(0, len(requests), batch_size):
        chunk = requests[b:b + batch_size]
        wait = chunk[-1][0] - (time.perf_counter() - start)
        if wait > 0:
            time.sleep(wait)
        stamps = _Stamps()
        hf_generate(model, [p for _, p, _ in chunk], max(o for _, _, o in chunk), streamer=stamps)
        for a, _, olen in chunk:
            arrival.append(a)
            first.append(stamps.times[0] - start)
            last.append(stamps.times[olen - 1] - start)
            lengths.append(olen)
    return _latency_stats(arrival, first, last, lengths)


def serve_online_hf_cb(model, requests) -> dict:
    """transformers' continuous batching manager, each request added when it arrives (its
    generation loop runs in the manager's thread); TTFT / TPOT from per-token timestamps."""
    generation, cb = cb_configs(max(o for _, _, o in requests), 64,
                                max(len(p) + o for _, p, o in requests), len(requests))
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=cb)
    with torch.inference_mode():
        manager.start()
        start = time.perf_counter()
        try:
            for i, (arrival, prompt, olen) in enumerate(requests):
                wait = arrival - (time.perf_counter() - start)
                if wait > 0:
                    time.sleep(wait)
                manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=olen, record_timestamps=True)
            done: dict[str, object] = {}
            while len(done) < len(requests):
                result = manager.get_result(timeout=60)
                if result is None:
                    raise RuntimeError("transformers' continuous batching stopped answering")
                if result.is_finished():
                    done[result.request_id] = result
        finally:
            manager.stop(block=True)
    outs = [done[f"r{i}"] for i in range(len(requests))]
    if any(len(o.generated_tokens) != olen for o, (_, _, olen) in zip(outs, requests)):
        raise RuntimeError("transformers' continuous batching returned the wrong number of tokens")
    return _latency_stats([a for a, _, _ in requests], [o.timestamps[0] - start for o in outs],
                          [o.timestamps[-1] - start for o in outs], [olen for _, _, olen in requests])

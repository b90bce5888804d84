"""``PipelineConfig``: the one place every setting of a :class:`~servelab.Pipeline` has its default.

Five frozen sections and top-level settings::

    PipelineConfig(
        cache=CacheConfig(block_size=16, num_blocks=None, enable_prefix_caching=True,
                          kv_cache_memory_bytes=None, eviction_policy="lru", kv_cache_groups="auto",
                          kv_cache_dtype="auto", kv_cache_scale=None),
        scheduler=SchedulingConfig(policy="fcfs", max_num_seqs=256, max_num_batched_tokens=2048,
                                   long_prefill_token_threshold=0, max_model_len=None,
                                   enable_chunked_prefill=True),
        speculative=SpeculativeConfig(drafter=None, num_speculative_tokens=0, verifier="rejection"),
        lora=LoRAConfig(enable_lora=False, max_loras=1, max_lora_rank=16, max_cpu_loras=None),
        parallel=ParallelConfig(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1,
                                distributed_executor_backend=None, enable_expert_parallel=False),
        attention_backend="auto", seed=0, max_logprobs=20, grammar_backend="xgrammar", quantization="auto")

Every setting has one name in every layer (``enable_prefix_caching`` here, in
``Pipeline(...)`` and in ``from_pretrained(...)``; the block layer's
constructor keeps its positional ``enable_caching`` parameter for vLLM
parity). ``Pipeline(model, block_size=8, policy="sjf")`` is
``Pipeline(model, config=PipelineConfig.from_kwargs(block_size=8, policy="sjf"))``;
the flat names are the section fields (:func:`flat_names` lists them).
The scheduler's :class:`~servelab.scheduling.SchedulerConfig` is derived from
this object (:meth:`PipelineConfig.scheduler_config`), and the scheduling
section's defaults are ``SchedulerConfig``'s own (one set of defaults for the
pipeline, a standalone ``Scheduler`` and the simulator).

Every field is checked when the object is built, naming the field, the
value and what is valid: ``TypeError`` for a wrong type (``seed=1.5``) or an
unknown setting name, ``ValueError`` for a value out of range
(``kv_cache_memory_bytes=-5``). Names of registered pieces (policies, verifiers, drafters, attention
backends, eviction policies) are checked when the pipeline looks them up,
so this module imports nothing heavy.

``attention_backend="auto"`` resolves, for the model the pipeline runs:
``"sdpa"`` when the model is on the CPU and the SDPA backend supports it
(dtype, head size, sliding window: ``backend.supports(...)``), ``"triton"``
when the model is on CUDA and the Triton backend supports it, else
``"torch"`` (the references, which run everything).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from servelab._internal.validation import check_bool, check_int

__all__ = ["CacheConfig", "LoRAConfig", "ParallelConfig", "PipelineConfig", "SchedulerConfig", "SchedulingConfig",
           "SpeculativeConfig", "flat_names"]


def _int(section: str, name: str, value: object, minimum: int, *, optional: bool = False) -> None:
    """``TypeError`` for a non-int (``1.5``, ``"x"``, ``True``), ``ValueError`` below ``minimum``."""
    if optional and value is None:
        return
    try:
        check_int(f"{section}.{name}", value, min_value=minimum)
    except TypeError:
        raise TypeError(f"{section}.{name}={value!r} is a {type(value).__name__}; valid: an int >= {minimum}"
                        + (" or None" if optional else "")) from None


def _bool(section: str, name: str, value: object) -> None:
    check_bool(f"{section}.{name}", value)


def _name_or_object(section: str, name: str, value: object, *, optional: bool = False) -> None:
    """A registry name (non-empty str) or an object implementing the piece's protocol."""
    if optional and value is None:
        return
    if isinstance(value, str) and not value.strip():
        raise ValueError(f"{section}.{name}={value!r} is invalid; valid: a registered name or an object")
    if value is None or isinstance(value, (bool, int, float)):
        raise TypeError(f"{section}.{name}={value!r} is invalid; valid: a registered name or an object"
                        + (" (or None)" if optional else ""))


# ---- the scheduler's limits: servelab's one set of scheduling defaults ----------------------

def _check_sched_int(name: str, value: object, minimum: int) -> None:
    check_int(f"SchedulerConfig.{name}", value, min_value=minimum)


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one ``schedule()`` call (the defaults are servelab's only ones;
    see the module docstring).

    Attributes:
        max_num_batched_tokens: token budget of one step (prompt chunks,
            decode tokens and draft tokens together).
        max_num_seqs: most requests running at once (a model runner's batch
            slots).
        max_model_len: longest sequence (prompt + output) a request may reach;
            longer prompts are rejected by ``add_request``, and output stops
            with finish reason ``"length"`` when it is reached.
        enable_chunked_prefill: split prompts over steps. When False a prompt
            is computed in one step, so the budget must hold the longest one
            (``max_num_batched_tokens >= max_model_len``).
        long_prefill_token_threshold: most tokens one request gets per step
            (0: no cap). Keeps one long prompt from taking a whole step while
            decodes wait behind it. Needs chunked prefill.
        num_speculative_tokens: drafts per request and step (0: no speculative
            decoding). Each running request is given this many lookahead KV
            slots so a drafter can write its draft tokens' KV.
        max_loras: most distinct LoRA adapters among running requests (0: no
            limit; a pipeline with ``enable_lora`` sets its ``max_loras``); see
            :mod:`servelab.scheduling.lora_slots`.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    num_speculative_tokens: int = 0
    max_loras: int = 0

    def __post_init__(self) -> None:
        _check_sched_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_sched_int("max_loras", self.max_loras, 0)
        _check_sched_int("max_num_seqs", self.max_num_seqs, 1)
        _check_sched_int("max_model_len", self.max_model_len, 1)
        _check_sched_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _check_sched_int("num_speculative_tokens", self.num_speculative_tokens, 0)
        check_bool("SchedulerConfig.enable_chunked_prefill", self.enable_chunked_prefill)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"SchedulerConfig.max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.max_model_len} with enable_chunked_prefill=False, so a long prompt "
                "could never be scheduled; raise max_num_batched_tokens, lower max_model_len or enable "
                "chunked prefill"
            )
        if not self.enable_chunked_prefill and self.long_prefill_token_threshold:
            raise ValueError(
                f"SchedulerConfig.long_prefill_token_threshold={self.long_prefill_token_threshold} splits prompts, "
                "which enable_chunked_prefill=False forbids; set it to 0 or enable chunked prefill"
            )


KV_CACHE_GROUPS = ("auto", "uniform")
#: ``kv_cache_dtype`` values (vLLM's names): ``"auto"`` stores the model's dtype; ``"fp8"`` is
#: ``"fp8_e4m3"``. What each means for pages and kernels: :mod:`servelab.blocks.kv_quant`.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
#: ``kv_cache_scale`` granularities: one scale per layer (``"tensor"``), per KV head (``"head"``), or per
#: token and KV head written beside the data (``"token_head"``). None: the dtype's default.
KV_CACHE_SCALES = ("tensor", "head", "token_head")


def _kv_cache_dtypes() -> tuple[str, ...]:
    """:data:`KV_CACHE_DTYPES` and any page format registered since
    (:func:`servelab.blocks.kv_quant.register_kv_cache_dtype`)."""
    from servelab.blocks.kv_quant import available_kv_cache_dtypes

    return tuple(dict.fromkeys((*KV_CACHE_DTYPES, *available_kv_cache_dtypes())))


def _choice(section: str, name: str, value: object, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise (TypeError if not isinstance(value, str) else ValueError)(
            f"{section}.{name}={value!r} is invalid; valid: {', '.join(map(repr, valid))}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache.

    Attributes:
        block_size: tokens per KV block.
        num_blocks: pool size, null block included (>= 2). None: sized by the
            pipeline from ``max_num_seqs``, ``max_model_len`` and a memory
            budget (see :func:`servelab.pipeline.sizing.default_num_blocks`).
        enable_prefix_caching: reuse the KV of full blocks whose token prefix
            was computed before (hash lookup on admission).
        kv_cache_memory_bytes: memory budget of the default pool (> 0); None:
            derived from the model size and the free memory (see
            :func:`servelab.pipeline.sizing.default_kv_cache_budget`).
        eviction_policy: which cached free block is reused first: a name
            (``"lru"``, the default) or an eviction-policy object.
        kv_cache_groups: how layers of different kinds share the cache.
            ``"auto"`` (default): when the model's layers differ (Gemma 2's
            alternating sliding-window / full layers, a Qwen2 config with
            ``max_window_layers``), a
            :class:`~servelab.blocks.HybridKVCacheManager` with one KV-cache
            group per kind and one block table per group, so sliding layers
            hold only their window's blocks; one group otherwise.
            ``"uniform"``: one full-attention group for every layer, the
            windows applied as masks only (every block kept). With several
            groups a pool block is one page in ``group_size`` layers (not in
            every layer), so the same ``num_blocks`` is less memory and a
            request holds blocks in each group (see
            :mod:`servelab.pipeline.hybrid`; the default pool spends the
            same bytes either way).
        kv_cache_dtype: what the pages store (:data:`KV_CACHE_DTYPES`):
            ``"auto"`` (the model's dtype), ``"fp8"``/``"fp8_e4m3"``,
            ``"fp8_e5m2"``, ``"int8"`` (quantized with scales; the attention
            backend dequantizes as it reads and refuses a dtype it cannot read).
        kv_cache_scale: scale granularity of a quantized cache
            (:data:`KV_CACHE_SCALES`); None: the dtype's default.
    """

    block_size: int = 16
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None
    eviction_policy: Any = "lru"
    kv_cache_groups: str = "auto"
    kv_cache_dtype: str = "auto"
    kv_cache_scale: str | None = None

    def __post_init__(self) -> None:
        _choice("CacheConfig", "kv_cache_dtype", self.kv_cache_dtype, _kv_cache_dtypes())
        if self.kv_cache_scale is not None:
            _choice("CacheConfig", "kv_cache_scale", self.kv_cache_scale, KV_CACHE_SCALES)
            if self.kv_cache_dtype == "auto":
                raise ValueError(f"CacheConfig.kv_cache_scale={self.kv_cache_scale!r} is given with "
                                 "kv_cache_dtype='auto', whose pages hold no scales; choose a quantized "
                                 f"kv_cache_dtype ({', '.join(map(repr, KV_CACHE_DTYPES[1:]))}) or leave the scale out")
        if self.kv_cache_groups not in KV_CACHE_GROUPS:
            raise (TypeError if not isinstance(self.kv_cache_groups, str) else ValueError)(
                f"CacheConfig.kv_cache_groups={self.kv_cache_groups!r} is invalid; valid: "
                f"{', '.join(map(repr, KV_CACHE_GROUPS))}")
        _int("CacheConfig", "block_size", self.block_size, 1)
        _int("CacheConfig", "num_blocks", self.num_blocks, 2, optional=True)
        _bool("CacheConfig", "enable_prefix_caching", self.enable_prefix_caching)
        _int("CacheConfig", "kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1, optional=True)
        _name_or_object("CacheConfig", "eviction_policy", self.eviction_policy)
        if self.num_blocks is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError(f"CacheConfig.num_blocks={self.num_blocks} and kv_cache_memory_bytes="
                             f"{self.kv_cache_memory_bytes} were both given, and each sizes the pool; give one")


@dataclass(frozen=True)
class SchedulingConfig:
    """Scheduling limits and policy (the source of ``scheduling.SchedulerConfig``;
    every limit's default is ``SchedulerConfig``'s, so there is one set of defaults).

    Attributes:
        policy: scheduling policy name (``"fcfs"``, ``"priority"``, ``"sjf"``,
            ``"vtc"``) or a ``SchedulingPolicy`` object (one per pipeline).
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step (prompt chunks,
            decodes and drafts together).
        long_prefill_token_threshold: most tokens one request gets per step
            (0: no cap).
        max_model_len: longest sequence (prompt + output); None: the model's
            ``max_position_embeddings``.
        enable_chunked_prefill: split long prompts over steps.
    """

    policy: Any = "fcfs"
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    long_prefill_token_threshold: int = SchedulerConfig.long_prefill_token_threshold
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = SchedulerConfig.enable_chunked_prefill

    def __post_init__(self) -> None:
        _name_or_object("SchedulingConfig", "policy", self.policy)
        _int("SchedulingConfig", "max_num_seqs", self.max_num_seqs, 1)
        _int("SchedulingConfig", "max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _int("SchedulingConfig", "long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _int("SchedulingConfig", "max_model_len", self.max_model_len, 1, optional=True)
        _bool("SchedulingConfig", "enable_chunked_prefill", self.enable_chunked_prefill)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding.

    Attributes:
        drafter: None (off), ``"ngram"``, a draft checkpoint folder (same
            tokenizer) or a ``Drafter`` object.
        num_speculative_tokens: drafts per request and step; >= 1 exactly
            when a drafter is given.
        verifier: how drafts are accepted: ``"rejection"`` (default, exact),
            ``"typical"``, ``"tree"``, or a ``Verifier`` object.
    """

    drafter: Any = None
    num_speculative_tokens: int = 0
    verifier: Any = "rejection"

    def __post_init__(self) -> None:
        _int("SpeculativeConfig", "num_speculative_tokens", self.num_speculative_tokens, 0)
        _name_or_object("SpeculativeConfig", "verifier", self.verifier)
        if self.drafter is not None:
            _name_or_object("SpeculativeConfig", "drafter", self.drafter)
        if (self.drafter is None) != (self.num_speculative_tokens == 0):
            raise ValueError(
                f"SpeculativeConfig.drafter={self.drafter!r} with num_speculative_tokens="
                f"{self.num_speculative_tokens}: speculative decoding needs both a drafter ('ngram', a "
                "draft-model folder or a Drafter) and num_speculative_tokens >= 1, or neither")

    @property
    def enabled(self) -> bool:
        return self.drafter is not None


@dataclass(frozen=True)
class LoRAConfig:
    """Serving LoRA adapters on the base model (:mod:`servelab.lora`; vLLM's names).

    Attributes:
        enable_lora: wrap the model's linear layers so requests can name an
            adapter (``LoRARequest``); False refuses requests that do.
        max_loras: adapter slots active at once, so the most distinct adapters
            in one step (the scheduler keeps a step within it).
        max_lora_rank: largest adapter rank accepted (the slots' buffer width).
        max_cpu_loras: adapters kept loaded on the host (an LRU); None: ``max_loras``.
    """

    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        _bool("LoRAConfig", "enable_lora", self.enable_lora)
        _int("LoRAConfig", "max_loras", self.max_loras, 1)
        _int("LoRAConfig", "max_lora_rank", self.max_lora_rank, 1)
        _int("LoRAConfig", "max_cpu_loras", self.max_cpu_loras, 1, optional=True)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"LoRAConfig.max_cpu_loras={self.max_cpu_loras} is below max_loras={self.max_loras}; "
                             "every active adapter is also held on the host, so valid: max_cpu_loras >= max_loras")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over processes (:mod:`servelab.executor`; vLLM's names).

    Attributes:
        tensor_parallel_size: ranks each layer is split over (column/row-parallel).
        pipeline_parallel_size: stages the layers are split into.
        data_parallel_size: whole replicas behind a router.
        distributed_executor_backend: a registered executor name (``"uniproc"``,
            ``"multiproc"``, ``"ray"``) or an executor object; None: ``"uniproc"``
            for one rank, else ``"multiproc"``.
        enable_expert_parallel: shard a MoE model's experts over the tensor-parallel
            ranks instead of splitting each expert.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: Any = None
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        _int("ParallelConfig", "tensor_parallel_size", self.tensor_parallel_size, 1)
        _int("ParallelConfig", "pipeline_parallel_size", self.pipeline_parallel_size, 1)
        _int("ParallelConfig", "data_parallel_size", self.data_parallel_size, 1)
        _name_or_object("ParallelConfig", "distributed_executor_backend", self.distributed_executor_backend,
                        optional=True)
        _bool("ParallelConfig", "enable_expert_parallel", self.enable_expert_parallel)

    @property
    def world_size(self) -> int:
        """Ranks of one replica: ``tensor_parallel_size * pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size


_SECTIONS = {"cache": CacheConfig, "scheduler": SchedulingConfig, "speculative": SpeculativeConfig,
             "lora": LoRAConfig, "parallel": ParallelConfig}
_TOP_LEVEL = ("attention_backend", "seed", "max_logprobs", "grammar_backend", "quantization")


def flat_names() -> dict[str, str]:
    """Flat setting name -> the section holding it (``"top"`` for top-level settings)."""
    names = {f.name: section for section, cls in _SECTIONS.items() for f in dataclasses.fields(cls)}
    names.update((name, "top") for name in _TOP_LEVEL)
    return names


@dataclass(frozen=True)
class PipelineConfig:
    """Every setting of a pipeline, with its default (see the module docstring).

    Attributes:
        cache, scheduler, speculative: the sections.
        attention_backend: ``"auto"`` (see the module docstring), a backend
            name (``"torch"``, ``"sdpa"``, ``"triton"``) or a backend object.
        seed: base seed of random-sampling requests that bring no seed of
            their own (None: torch's global RNG). An int.
        max_logprobs: most ``SamplingParams.logprobs`` a request may ask for.
        grammar_backend: compiles the grammars of structured-output requests:
            a registered name (``"xgrammar"``, the default; imported only when
            a request carries a grammar) or a ``GrammarBackend`` object.
        quantization: the model's weight format (:mod:`servelab.quantization`):
            ``"auto"`` (what the checkpoint holds: a GGUF file keeps its
            blocks), None / ``"none"`` (float weights), a registered method
            (``"int8"``, ``"w4a16"``) applied to a float model, or a structured
            spec with ``targets`` and ``ignore``.
    """

    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulingConfig = field(default_factory=SchedulingConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    attention_backend: Any = "auto"
    seed: int | None = 0
    max_logprobs: int = 20
    grammar_backend: Any = "xgrammar"
    quantization: Any = "auto"

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            value = getattr(self, name)
            if not isinstance(value, cls):
                raise TypeError(f"PipelineConfig.{name} must be a {cls.__name__}, got {type(value).__name__}")
        _name_or_object("PipelineConfig", "attention_backend", self.attention_backend)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"PipelineConfig.seed={self.seed!r} is a {type(self.seed).__name__}; valid: an int "
                            "or None")
        _int("PipelineConfig", "max_logprobs", self.max_logprobs, 0)
        _name_or_object("PipelineConfig", "grammar_backend", self.grammar_backend)
        if self.quantization is not None and not isinstance(self.quantization, str) \
                and not hasattr(self.quantization, "resolve") and not isinstance(self.quantization, dict):
            raise TypeError(f"PipelineConfig.quantization={self.quantization!r} is invalid; valid: 'auto', None, "
                            "'none', a registered method name ('int8', 'w4a16', ...), a dict spec or a QuantSpec")

    @classmethod
    def from_kwargs(cls, **settings: Any) -> PipelineConfig:
        """A config from flat names: ``PipelineConfig.from_kwargs(block_size=8, verifier="typical")``."""
        return cls().replace(**settings)

    def replace(self, **settings: Any) -> PipelineConfig:
        """A copy with flat settings (``block_size=...``) or whole sections (``cache=...``) replaced.

        Unknown names raise ``TypeError`` listing the valid ones; values are
        checked as on construction.
        """
        names = flat_names()
        unknown = sorted(set(settings) - set(names) - set(_SECTIONS))
        if unknown:
            raise TypeError(f"unknown setting(s) {', '.join(map(repr, unknown))}; valid: "
                            f"{', '.join(sorted(names))} (or a whole section: {', '.join(_SECTIONS)})")
        sections = {name: settings.get(name, getattr(self, name)) for name in _SECTIONS}
        per_section: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        top: dict[str, Any] = {}
        for name, value in settings.items():
            where = names.get(name)
            if where == "top":
                top[name] = value
            elif where is not None:
                per_section[where][name] = value
        for name, changes in per_section.items():
            if changes:
                if not isinstance(sections[name], _SECTIONS[name]):
                    break  # __post_init__ below names the bad section
                sections[name] = dataclasses.replace(sections[name], **changes)
        return dataclasses.replace(self, **sections, **top)

    def to_flat(self) -> dict[str, Any]:
        """Every setting by its flat name (``from_kwargs(**c.to_flat()) == c``)."""
        out: dict[str, Any] = {}
        for name in _SECTIONS:
            section = getattr(self, name)
            out.update((f.name, getattr(section, f.name)) for f in dataclasses.fields(section))
        out.update((name, getattr(self, name)) for name in _TOP_LEVEL)
        return out

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The :class:`~servelab.scheduling.SchedulerConfig` of this config, with
        ``max_model_len`` resolved against the model (the pipeline does that)."""
        s = self.scheduler
        return SchedulerConfig(
            max_num_batched_tokens=s.max_num_batched_tokens, max_num_seqs=s.max_num_seqs,
            max_model_len=max_model_len, enable_chunked_prefill=s.enable_chunked_prefill,
            long_prefill_token_threshold=s.long_prefill_token_threshold,
            num_speculative_tokens=self.speculative.num_speculative_tokens,
            max_loras=self.lora.max_loras if self.lora.enable_lora else 0)

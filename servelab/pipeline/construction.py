"""How a :class:`~servelab.pipeline.Pipeline` is built, in order (see :mod:`servelab.pipeline.setup`).

``Pipeline.__init__`` calls these steps top to bottom, each reading the config resolved by the
first one and the parts built before it: the config, the model (its steps applied), the executor
when the model lives in worker processes, the KV cache manager and paged buffers with the
attention backend, the KV connector, the scheduler, and the sampler, verifier, drafter and runner.
Kept apart from the request and step methods so the build order reads in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


from servelab.config import PipelineConfig
from servelab.connectors import get_kv_connector
from servelab.executor.driver import start_executor
from servelab.models import allocate_kv_caches
from servelab.pipeline.hybrid import HybridModelRunner, allocate_group_kv_caches
from servelab.pipeline.runner import ModelRunner
from servelab.pipeline.setup import (
    attach_attention,
    build_drafter,
    build_kv_cache_manager,
    build_scheduler,
    check_attention,
    check_manager,
    resolve_max_model_len,
)
from servelab._internal.conformance import check_conforms
from servelab.blocks.interfaces import KVCacheManagerProtocol
from servelab.samplers import Sampler, SamplerProtocol, SamplingParams
from servelab.samplers.structured import StructuredOutputManager
from servelab.samplers.verifiers import get_verifier
from servelab.scheduling import RequestOutput, SchedulerConfig, SchedulerInterface

_CACHE_SETTINGS = ("block_size", "num_blocks", "enable_prefix_caching", "kv_cache_memory_bytes", "eviction_policy",
                   "kv_cache_groups")


class PipelineConstruction:
    """The construction steps of :class:`~servelab.pipeline.Pipeline` (a mixin: they set its attributes)."""

    @staticmethod
    def _resolve_config(config: Any, settings: dict[str, Any], kv_cache_manager: Any) -> PipelineConfig:
        if config is None:
            config = PipelineConfig()
        elif not isinstance(config, PipelineConfig):
            raise TypeError(f"config must be a servelab.PipelineConfig, got {type(config).__name__}")
        given = sorted(set(settings) & set(_CACHE_SETTINGS))
        if kv_cache_manager is not None and given:
            raise ValueError(f"{', '.join(given)} given together with kv_cache_manager; the manager's own block "
                             "size, pool and caching are used, so leave these settings out")
        if kv_cache_manager is not None:  # the manager's pool is the config's: resolved here, once
            check_conforms(kv_cache_manager, KVCacheManagerProtocol, "kv_cache_manager")
            settings = {**settings, "block_size": kv_cache_manager.block_size,
                        "num_blocks": kv_cache_manager.block_pool.num_blocks, "kv_cache_memory_bytes": None,
                        "enable_prefix_caching": bool(kv_cache_manager.enable_caching)}
        return config.replace(**settings)

    def _attach_model(self, model: Any, tokenizer: Any, clock: Callable[[], float]) -> None:
        if not hasattr(model, "compute_logits") or not hasattr(model, "config"):
            raise TypeError(f"model must be a servelab LlamaForCausalLM, got {type(model).__name__}")
        if not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {clock!r}")
        cfg = model.config
        self.model, self.tokenizer, self.model_config, self.clock = model, tokenizer, cfg, clock
        self.vocab_size: int = cfg.vocab_size
        eos = tuple(cfg.eos_token_ids)
        self.eos_token_id: int | None = eos[0] if eos else None
        self._extra_eos = eos[1:]
        self.seed = self.config.seed
        self._default_params: SamplingParams | None = None
        self._pending: list[RequestOutput] = []  # outputs an interrupted step could not deliver
        self.num_speculative_tokens = self.config.speculative.num_speculative_tokens
        model.check_inputs = False  # prompts are validated here, once, not in every forward

    def _build_kv_cache(self, manager: KVCacheManagerProtocol | None) -> None:
        """The KV cache manager (given or built), the paged buffers, the attention backend."""
        model = self.model
        self.max_model_len = resolve_max_model_len(self.config, model, manager)
        if manager is None:
            manager = build_kv_cache_manager(self.config, model, self.max_model_len)
        else:
            check_manager(manager, model)
        self.kv_cache_manager = manager
        self.block_size, self.num_blocks = manager.block_size, manager.block_pool.num_blocks
        self.attention_backend = attach_attention(model, self.config.attention_backend, self.block_size)
        groups = getattr(manager, "groups", None)  # a group manager: one block table per group (pipeline.hybrid)
        self.kv_cache_groups = tuple(groups) if groups is not None else None
        if not self.executor.in_process:  # each rank allocates its own pages (servelab.executor.worker)
            no_caches: Any = None
            self.kv_caches, self.kv_cache_bytes = no_caches, 0
            return
        if self.kv_cache_groups is not None:
            self.kv_caches = allocate_group_kv_caches(self.kv_cache_groups, model.config.num_hidden_layers,
                                                      self.num_blocks, device=model.device)
        else:
            self.kv_caches = allocate_kv_caches(model, self.num_blocks, self.block_size,
                                                dtype=getattr(manager.spec, "dtype", None),
                                                kv_scale=getattr(manager.spec, "kv_scale", None))
        self.kv_cache_bytes = int(self.kv_caches.buffer.numel() * self.kv_caches.buffer.element_size()) \
            if hasattr(self.kv_caches, "buffer") else 0
        check_attention(model, self.kv_caches.views[0][0])

    def _bind_kv_connector(self, kv_connector: Any) -> Any:
        """The KV connector (by name or object), bound to this pipeline's manager and paged caches."""
        if kv_connector is None:
            return None
        connector = get_kv_connector(kv_connector)
        connector.bind_kv_cache_manager(self.kv_cache_manager)
        num_layers = self.model.config.num_hidden_layers
        groups = [list(g.layer_indices) for g in self.kv_cache_groups] if self.kv_cache_groups is not None \
            else [list(range(num_layers))]
        connector.register_kv_caches(self.kv_caches.views, groups)
        return connector

    def _build_scheduler(self, scheduler: SchedulerInterface | str | Callable[..., SchedulerInterface]) -> None:
        """The scheduler (see ``scheduler`` in the class docstring), with the
        ``SchedulerConfig`` derived from :attr:`config`."""
        self.scheduler_config = self.config.scheduler_config(self.max_model_len)
        self.scheduler = build_scheduler(scheduler, self.scheduler_config, self.kv_cache_manager,
                                         self.config.scheduler.policy, self.clock)
        # a scheduler that owns the allocation (vLLM's) reports KV usage through its own view
        self.kv_cache_manager = getattr(self.scheduler, "kv_cache_manager", self.kv_cache_manager)
        own_config = getattr(self.scheduler, "config", None)
        if isinstance(own_config, SchedulerConfig):  # a ready object brings its own limits
            self.scheduler_config = own_config
        if self.kv_connector is not None:  # its scheduler side runs in the scheduler
            attach = getattr(self.scheduler, "attach_kv_connector", None)
            if attach is None:
                raise ValueError(f"kv_connector needs a scheduler with KV-connector states (servelab's); "
                                 f"{type(self.scheduler).__name__} has no attach_kv_connector")
            attach(self.kv_connector)

    def _build_runner(self, sampler: SamplerProtocol | None) -> None:
        """Sampler, verifier, drafter, and the model runner that calls them."""
        spec = self.config.speculative
        self.sampler = sampler if sampler is not None else Sampler()
        check_conforms(self.sampler, SamplerProtocol, "sampler")
        self.verifier = get_verifier(spec.verifier)
        self.drafter = build_drafter(self.config, self.model, block_size=self.block_size,
                                     num_blocks=self.num_blocks, max_num_seqs=self.scheduler_config.max_num_seqs,
                                     vocab_size=self.vocab_size)
        eos = () if self.eos_token_id is None else (self.eos_token_id, *self._extra_eos)
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, eos,
                                                  backend=self.config.grammar_backend)
        if not self.executor.in_process:  # the workers' runners, driven by the executor
            proxy: Any = start_executor(self.executor, self)
            self.runner = proxy
            self.kv_cache_bytes = self.executor.kv_cache_bytes
            return
        runner_cls: type[ModelRunner] | type[HybridModelRunner] = ModelRunner
        extra: dict[str, Any] = {}
        if self.kv_cache_groups is not None:  # one block table and metadata per KV-cache group
            runner_cls, extra = HybridModelRunner, {"groups": self.kv_cache_groups}
        self.runner = runner_cls(self.model, self.kv_caches, self.block_size, max_model_len=self.max_model_len,
                                  **extra, sampler=self.sampler, drafter=self.drafter, verifier=self.verifier,
                                  num_speculative_tokens=spec.num_speculative_tokens,
                                  max_num_reqs=self.scheduler_config.max_num_seqs, eos_token_id=self.eos_token_id,
                                  structured=self.structured, kv_connector=self.kv_connector)
        if self.kv_cache_groups is None:  # one sliding-window spec: its released blocks are nulled in the table
            self.runner.sliding_window = getattr(getattr(self.kv_cache_manager, "spec", None), "sliding_window", None)
        self.executor.start(self.runner)

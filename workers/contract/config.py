"""Engine configuration: frozen dataclasses, validated in one place (``EngineConfig.__post_init__``).

Every check raises ValueError with a message that names the field and says what to change. There
are no environment-variable switches for behaviour: everything a run does is in these objects.

- ModelConfig: which model, in which dtype, on which device, how long a sequence may be.
- CacheConfig: KV block size, how much memory the paged KV cache gets, prefix caching.
- ParallelConfig: tensor-parallel size, executor kind, placement of the TP ranks.
- SchedulerConfig: per-step token budget and batch size, scheduling policy, admission limits.
- EngineConfig: the four above plus engine-level limits (queue bound, stall watchdog).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
EXECUTORS = ("auto", "local", "ray")
RAY_TRANSPORTS = ("auto", "actor", "compiled", "socket")
POLICIES = ("fcfs", "priority")
BLOCK_SIZES = (8, 16, 32, 64)
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")     # names of kernels.kv_quant.KV_CACHE_DTYPES, plus auto
QUANTIZATIONS = ("auto", "none", "int8", "fp8")     # workers.quantization resolves them with the checkpoint's
CPU_GEMMS = ("auto", "c", "amx", "onednn", "mkl")          # kernels.cpu_choice.PRODUCTS
TASKS = ("generate", "embed", "score")              # cluster/pooling.py: what a model is served for
POOLING_TYPES = ("last", "mean")                    # workers/runner/pooling.py


def option(default, help: str):
    """A config field with its help text (``metadata["help"]``): deploy/serve/options.py turns every field
    into a build_app arg and a CLI flag with this text."""
    return field(default=default, metadata={"help": help})


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


@dataclass(frozen=True)
class ModelConfig:
    model: str = option("default", "'default' (embedded SmolLM2-135M-Instruct), a Hugging Face model folder, or "
                                   "a repo id (org/name) already in the local Hugging Face cache")
    dtype: str = option("auto", "auto | float32 | float16 | bfloat16 (auto: bfloat16 on CUDA and on CPUs with AMX or "
                                          "AVX512-BF16, float32 on other CPUs)")
    device: str = option("auto", "auto | cpu | cuda")
    max_model_len: int | None = option(None, "longest prompt + output (default: the model's max_position_embeddings)")
    tokenizer: str | None = option(None, "a separate tokenizer folder (default: the model folder)")
    enforce_eager: bool = option(False, "run decode steps layer by layer: on CUDA instead of replaying the CUDA "
                                        "graphs captured at start-up (one per batch-size bucket; TP=1 only), on "
                                        "CPU instead of the one C call over every layer (TP=1, dense Llama-style "
                                        "models)")
    cpu_packed_weights: bool = option(True, "CPU, float32/bfloat16: keep a copy of each weight packed for "
                                            "pagedray's C GEMM (AVX-512 or AVX2) or oneDNN's and multiply with it "
                                            "(faster linear layers; as much memory again as the weights)")
    cpu_gemm: str = option("auto", "CPU linear products: auto (each weight shape and row count runs the product "
                                   "timed fastest on this CPU at load, the C GEMM or AMX product unless another "
                                   "is more than 5% faster, cached on disk; PAGEDRAY_CPU_GEMM in the "
                                   "environment overrides auto) | c (pagedray's C GEMM, AVX-512) | amx (pagedray's AMX "
                                   "product, bfloat16 on a CPU with AMX) | onednn (oneDNN's "
                                   "packed product; AMX where the CPU has it) | mkl (float32: F.linear)")
    quantization: str = option("auto", "weights: auto (as the checkpoint is: full precision, or GPTQ / AWQ / FP8 "
                                       "read from it) | none | int8 | fp8 (8 bits per weight, one scale per output "
                                       "row, rounded at load from a full-precision checkpoint); dequantized to the "
                                       "compute dtype when loaded on CPU; kept packed on CUDA")
    cpu_keep_freed_memory: bool = option(True, "CPU: glibc malloc keeps freed memory for the next step instead of "
                                               "returning it to the OS (no page faults on each step's activations; "
                                               "resident memory stays at its peak)")
    enable_lora: bool = option(False, "serve LoRA adapters of this model (PEFT folders: adapter_config.json + "
                                      "adapter_model.safetensors; q/k/v/o and gate/up/down targets); a request "
                                      "names one (LLM: lora_request; HTTP: its model name; more adapters load at "
                                      "run time through POST /v1/load_lora_adapter)")
    max_loras: int = option(4, "LoRA: adapters resident on the ranks at once; a request whose adapter finds no free "
                               "slot waits until one is")
    max_lora_rank: int = option(16, "LoRA: the largest adapter rank accepted (every slot is this wide)")
    max_cpu_loras: int | None = option(None, "LoRA: adapters kept read in host memory on each rank (read on a "
                                             "thread beside the steps; the least recently wanted goes first), so "
                                             "that one evicted from its slot loads again without reading its "
                                             "files; at least max_loras (default: max_loras)")
    lora_modules: str | None = option(None, "LoRA: adapters served by name, 'name=folder[,name=folder...]' (every "
                                            "rank reads the folder)")
    task: str = option("generate", "what the model is served for: generate (completions and chat) | embed (an "
                                   "embedding model, e.g. Qwen3-Embedding: /v1/embeddings, LLM.embed) | score (a "
                                   "yes/no reranker, e.g. Qwen3-Reranker: /v1/rerank, /score, LLM.score). Every task "
                                   "also answers the others' requests; it sets which the HTTP server advertises")
    pooling_type: str = option("last", "embeddings: last (the last token's final hidden state: Qwen3-Embedding, "
                                       "decoder embedders) | mean (the mean over the input's tokens)")
    embed_normalize: bool = option(True, "embeddings: L2-normalize each vector (after any Matryoshka truncation)")

    def validate(self) -> None:
        _require(isinstance(self.model, str) and self.model != "",
                 "model: give a Hugging Face model folder or 'default'")
        _require(self.dtype in DTYPES, f"dtype: must be one of {DTYPES}, got {self.dtype!r}")
        _require(self.device in DEVICES, f"device: must be one of {DEVICES}, got {self.device!r}")
        _require(self.quantization in QUANTIZATIONS,
                 f"quantization: must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        _require(self.cpu_gemm in CPU_GEMMS, f"cpu_gemm: must be one of {CPU_GEMMS}, got {self.cpu_gemm!r}")
        _require(self.task in TASKS, f"task: must be one of {TASKS}, got {self.task!r}")
        _require(self.pooling_type in POOLING_TYPES,
                 f"pooling_type: must be one of {POOLING_TYPES}, got {self.pooling_type!r}")
        _require(isinstance(self.embed_normalize, bool),
                 f"embed_normalize: must be true or false, got {self.embed_normalize!r}")
        _require(isinstance(self.enforce_eager, bool),
                 f"enforce_eager: must be true or false, got {self.enforce_eager!r}")
        _require(isinstance(self.cpu_packed_weights, bool),
                 f"cpu_packed_weights: must be true or false, got {self.cpu_packed_weights!r}")
        _require(isinstance(self.cpu_keep_freed_memory, bool),
                 f"cpu_keep_freed_memory: must be true or false, got {self.cpu_keep_freed_memory!r}")
        _require(self.max_model_len is None or (isinstance(self.max_model_len, int) and self.max_model_len > 0),
                 f"max_model_len: must be a positive integer or None, got {self.max_model_len!r}")
        _require(isinstance(self.enable_lora, bool), f"enable_lora: must be true or false, got {self.enable_lora!r}")
        _require(type(self.max_loras) is int and 1 <= self.max_loras <= 256,   # noqa: E721
                 f"max_loras: must be an integer in [1, 256], got {self.max_loras!r}")
        _require(type(self.max_lora_rank) is int and 1 <= self.max_lora_rank <= 512,   # noqa: E721
                 f"max_lora_rank: must be an integer in [1, 512], got {self.max_lora_rank!r}")
        _require(self.max_cpu_loras is None or (type(self.max_cpu_loras) is int   # noqa: E721
                                                and self.max_cpu_loras >= self.max_loras),
                 f"max_cpu_loras: must be an integer >= max_loras ({self.max_loras}), got {self.max_cpu_loras!r}")
        modules = self.lora_module_paths()
        _require(not modules or self.enable_lora, "lora_modules: set enable_lora to serve adapters")

    def lora_module_paths(self) -> dict[str, str]:
        """``lora_modules`` as {name: folder} (ValueError naming the entry when it is malformed)."""
        if self.lora_modules is None:
            return {}
        _require(isinstance(self.lora_modules, str), f"lora_modules: must be a string, got {self.lora_modules!r}")
        modules: dict[str, str] = {}
        for entry in self.lora_modules.split(","):
            name, sep, path = entry.strip().partition("=")
            _require(bool(sep and name.strip() and path.strip()),
                     f"lora_modules: entry {entry.strip()!r} is not name=folder")
            _require(name.strip() not in modules, f"lora_modules: adapter {name.strip()!r} is named twice")
            modules[name.strip()] = path.strip()
        return modules


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = option(16, "KV block size in tokens (8, 16, 32, 64)")
    kv_cache_gib: float = option(1.0, "CPU: KV cache memory per rank, GiB")
    gpu_memory_utilization: float = option(0.90, "CUDA: fraction of the device memory for weights + activations + KV")
    num_blocks: int | None = option(None, "force an exact number of KV blocks (default: decided from memory)")
    enable_prefix_caching: bool = option(True, "reuse KV blocks of shared prompt prefixes")
    kv_cache_dtype: str = option("auto", "KV cache storage: auto (the model's dtype) | int8 | fp8_e4m3 (8-bit rows, "
                                         "each with a float16 scale: about twice the sequences per byte; fp8_e4m3 "
                                         "takes a checkpoint's k_scale / v_scale where present)")
    watermark: float = option(0.01, "fraction of KV blocks kept free when admitting (avoids instant preemption)")
    kv_pin_ttl_s: float = option(300.0, "session pins: a session's (prompt_cache_key / X-Session-Id) blocks of its "
                                        "last prompt and output are evicted last for this many seconds")
    kv_pin_max_fraction: float = option(0.5, "session pins: at most this fraction of the KV blocks pinned in all "
                                             "(0: no pins); the sessions pinned longest ago make room first")
    kv_offload_gib: float = option(0.0, "second KV tier per rank: a cached prefix block evicted from the KV cache is "
                                        "saved here (files in kv_offload_path; on CUDA without a path, pinned host "
                                        "memory) and loaded back when a prompt reaches it again; 0: off")
    kv_offload_path: str | None = option(None, "second KV tier: the folder of its files (one sub-folder per rank; "
                                               "default: a temporary folder, removed at shutdown; on CUDA the "
                                               "default is pinned host memory instead of files)")
    hybrid_prefix_states: int = option(16, "hybrid models (Qwen3.5 / 3.6): recurrent-state snapshots the prefix "
                                           "cache keeps, each the state of its linear-attention layers at the end "
                                           "of a cached block (a prefix hit needs one; each costs one "
                                           "sequence's state memory per rank); 0: prefix caching off for them")
    warm_prefix_tokens: int = option(8192, "prefix-cache warm-up, in tokens of the most reused prefixes: a new "
                                           "engine replica prefills a running one's before taking traffic, a "
                                           "rebuilt TP group its own from before (0: off)")
    kv_peer_pull: bool = option(True, "serving with several engine replicas: a replica that gets a prompt whose "
                                      "cached prefix a peer holds copies the peer's KV blocks instead of "
                                      "computing them, when its measured pull cost beats its measured prefill "
                                      "cost (warm scale-up pulls too)")

    @property
    def num_state_snapshots(self) -> int:
        """State snapshots a hybrid model's prefix cache keeps (block_manager/state_pool.py): the engine's block
        manager hands out this many slots past the seats, and every rank allocates them."""
        return self.hybrid_prefix_states if self.enable_prefix_caching else 0

    def validate(self) -> None:
        _require(self.block_size in BLOCK_SIZES,
                 f"block_size: must be one of {BLOCK_SIZES}, got {self.block_size!r}")
        _require(self.kv_cache_gib > 0, f"kv_cache_gib: must be > 0, got {self.kv_cache_gib!r}")
        _require(0 < self.gpu_memory_utilization <= 1,
                 f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization!r}")
        _require(self.num_blocks is None or (isinstance(self.num_blocks, int) and self.num_blocks >= 2),
                 f"num_blocks: must be None or an integer >= 2, got {self.num_blocks!r}")
        _require(0 <= self.watermark < 0.5, f"watermark: must be in [0, 0.5), got {self.watermark!r}")
        _require(not isinstance(self.kv_pin_ttl_s, bool) and isinstance(self.kv_pin_ttl_s, (int, float))
                 and self.kv_pin_ttl_s > 0, f"kv_pin_ttl_s: must be a number > 0, got {self.kv_pin_ttl_s!r}")
        _require(not isinstance(self.kv_pin_max_fraction, bool) and isinstance(self.kv_pin_max_fraction, (int, float))
                 and 0 <= self.kv_pin_max_fraction <= 1,
                 f"kv_pin_max_fraction: must be in [0, 1], got {self.kv_pin_max_fraction!r}")
        _require(not isinstance(self.kv_offload_gib, bool) and isinstance(self.kv_offload_gib, (int, float))
                 and self.kv_offload_gib >= 0, f"kv_offload_gib: must be a number >= 0, got {self.kv_offload_gib!r}")
        _require(type(self.hybrid_prefix_states) is int and self.hybrid_prefix_states >= 0,   # noqa: E721
                 f"hybrid_prefix_states: must be an integer >= 0, got {self.hybrid_prefix_states!r}")
        _require(type(self.warm_prefix_tokens) is int and self.warm_prefix_tokens >= 0,   # noqa: E721
                 f"warm_prefix_tokens: must be an integer >= 0, got {self.warm_prefix_tokens!r}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES,
                 f"kv_cache_dtype: must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = option(1, "tensor-parallel ranks per replica")
    executor: str = option("auto", "auto (TP=1: in-process, TP>1: Ray) | local (the model in this process) | "
                                   "ray (a Ray worker actor per TP rank)")
    placement_strategy: str = option("PACK", "placement of the TP ranks' bundles when the engine creates its "
                                             "own placement group (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD)")
    ray_transport: str = option("auto", "how plans reach the Ray ranks: auto (socket when every rank runs on "
                                        "the engine's node, else actor) | actor (plain actor calls, idle ranks "
                                        "sleep) | compiled (Ray compiled graph: a shorter round trip, but its "
                                        "ranks busy-poll while idle) | socket (a TCP connection per rank beside "
                                        "Ray: short round trips, nobody polls)")
    threads_per_worker: int | None = option(None, "torch threads per TP rank on CPU (default: cores // TP size)")
    max_rank_restarts: int = option(3, "times a dead TP rank may be recovered from (rebuild the group, re-admit "
                                       "the running sequences); 0: fail in-flight requests instead")

    def validate(self) -> None:
        _require(isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
                 f"tensor_parallel_size: must be an integer >= 1, got {self.tensor_parallel_size!r}")
        _require(self.executor in EXECUTORS, f"executor: must be one of {EXECUTORS}, got {self.executor!r}")
        _require(self.ray_transport in RAY_TRANSPORTS,
                 f"ray_transport: must be one of {RAY_TRANSPORTS}, got {self.ray_transport!r}")
        _require(self.placement_strategy in PLACEMENT_STRATEGIES,
                 f"placement_strategy: must be one of {PLACEMENT_STRATEGIES}, got {self.placement_strategy!r}")
        _require(not (self.executor == "local" and self.tensor_parallel_size > 1),
                 "executor: 'local' runs a single in-process worker; use executor='ray' (or 'auto') "
                 "for tensor_parallel_size > 1")
        _require(self.threads_per_worker is None or self.threads_per_worker >= 1,
                 f"threads_per_worker: must be None or >= 1, got {self.threads_per_worker!r}")
        _require(isinstance(self.max_rank_restarts, int) and not isinstance(self.max_rank_restarts, bool)
                 and self.max_rank_restarts >= 0,
                 f"max_rank_restarts: must be an integer >= 0 (0 disables recovery), got {self.max_rank_restarts!r}")

    @property
    def use_ray(self) -> bool:
        return self.executor == "ray" or (self.executor == "auto" and self.tensor_parallel_size > 1)


TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
DEFAULT_TENANT = "default"   # the tenant of requests that name none (no tenants table, or the admin api_key)


@dataclass(frozen=True)
class TenantConfig:
    """One tenant of an engine's fair share (cluster/fair_share.py). Its API keys live with the ingress only
    (deploy/serve/tenants.py): the engine knows tenants by name."""

    name: str
    weight: float = 1.0                     # its share of the KV pool, the seats and the compute, relative to others
    max_kv_fraction: float = 1.0            # at most this fraction of the replica's KV blocks in use at once
    max_queued_requests: int | None = None  # its requests waiting for admission; beyond it they are refused (429)

    def validate(self) -> None:
        _require(isinstance(self.name, str) and TENANT_NAME.fullmatch(self.name) is not None,
                 f"tenants: a tenant name must be 1-64 letters, digits, '_', '.' or '-', got {self.name!r}")
        where = f"tenants.{self.name}"
        _require(not isinstance(self.weight, bool) and isinstance(self.weight, (int, float)) and 0 < self.weight <= 1e6,
                 f"{where}.weight: must be a number in (0, 1e6], got {self.weight!r}")
        _require(not isinstance(self.max_kv_fraction, bool) and isinstance(self.max_kv_fraction, (int, float))
                 and 0 < self.max_kv_fraction <= 1,
                 f"{where}.max_kv_fraction: must be in (0, 1], got {self.max_kv_fraction!r}")
        _require(self.max_queued_requests is None or (type(self.max_queued_requests) is int   # noqa: E721
                                                      and self.max_queued_requests >= 1),
                 f"{where}.max_queued_requests: must be an integer >= 1 or unset, got {self.max_queued_requests!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = option(128, "sequences per step")
    max_num_batched_tokens: int = option(2048, "tokens per step (chunked prefill)")
    policy: str = option("fcfs", "fcfs | priority")
    max_queued_requests: int = option(1024, "requests waiting for admission; beyond it they are refused "
                                             "(HTTP 429)")
    async_scheduling: bool = option(False, "schedule step N+1 while step N runs (one step queued ahead of the "
                                           "workers; outputs unchanged); TP=1 only")
    num_speculative_tokens: int = option(0, "speculative decoding: tokens proposed per decode step by prompt "
                                            "lookup (n-gram) and verified in the same forward (0: off; outputs "
                                            "unchanged; not with async_scheduling)")
    prompt_lookup_min: int = option(2, "speculative decoding: the shortest suffix (in tokens) matched against "
                                       "the sequence's earlier tokens")
    prompt_lookup_max: int = option(4, "speculative decoding: the longest suffix matched (tried first)")
    speculative_model: str | None = option(None, "speculative decoding: a small model folder with the target's "
                                                 "vocabulary that proposes the drafts instead of prompt lookup "
                                                 "(greedy, sharded over the same TP ranks, its own paged KV "
                                                 "cache under the same block ids)")
    tenants: tuple[TenantConfig, ...] = option((), "fair share among tenants (cluster/fair_share.py): admission and "
                                                   "preemption by weighted share instead of queue order across "
                                                   "tenants, per-tenant KV caps and queue limits; served as the "
                                                   "'tenants' option, which also maps API keys to tenants")
    max_prefill_tokens: int = option(0, "the most prompt (prefill) tokens a step carries, decodes not counted "
                                        "(0: only max_num_batched_tokens bounds them); with tenants they go in "
                                        "fair-share order. Lower: shorter steps, so a new request of a tenant "
                                        "under its share waits out less and running streams stall less, at some "
                                        "cost in prefill throughput")

    def validate(self) -> None:
        _require(self.max_num_seqs >= 1, f"max_num_seqs: must be >= 1, got {self.max_num_seqs!r}")
        _require(self.max_num_batched_tokens >= 1,
                 f"max_num_batched_tokens: must be >= 1, got {self.max_num_batched_tokens!r}")
        _require(self.policy in POLICIES, f"policy: must be one of {POLICIES}, got {self.policy!r}")
        _require(self.max_queued_requests >= 1,
                 f"max_queued_requests: must be >= 1, got {self.max_queued_requests!r}")
        _require(isinstance(self.async_scheduling, bool),
                 f"async_scheduling: must be true or false, got {self.async_scheduling!r}")
        _require(type(self.num_speculative_tokens) is int and 0 <= self.num_speculative_tokens <= 16,   # noqa: E721
                 f"num_speculative_tokens: must be an integer in [0, 16], got {self.num_speculative_tokens!r}")
        _require(type(self.prompt_lookup_min) is int and self.prompt_lookup_min >= 1,   # noqa: E721
                 f"prompt_lookup_min: must be an integer >= 1, got {self.prompt_lookup_min!r}")
        _require(type(self.prompt_lookup_max) is int and self.prompt_lookup_max >= self.prompt_lookup_min,  # noqa: E721
                 f"prompt_lookup_max: must be an integer >= prompt_lookup_min ({self.prompt_lookup_min}), got "
                 f"{self.prompt_lookup_max!r}")
        _require(self.speculative_model is None or (isinstance(self.speculative_model, str) and self.speculative_model),
                 f"speculative_model: must be a model folder or None, got {self.speculative_model!r}")
        _require(self.speculative_model is None or self.num_speculative_tokens > 0,
                 "num_speculative_tokens: set it above 0 to use speculative_model")
        _require(not (self.num_speculative_tokens and self.async_scheduling),
                 "num_speculative_tokens: speculative decoding needs async_scheduling off (a step's accepted "
                 "tokens decide the next step's inputs)")
        _require(isinstance(self.tenants, tuple) and all(isinstance(t, TenantConfig) for t in self.tenants),
                 f"tenants: must be a tuple of TenantConfig, got {self.tenants!r:.80}")
        _require(type(self.max_prefill_tokens) is int and self.max_prefill_tokens >= 0,   # noqa: E721
                 f"max_prefill_tokens: must be an integer >= 0, got {self.max_prefill_tokens!r}")
        for tenant in self.tenants:
            tenant.validate()
        names = [t.name for t in self.tenants]
        _require(len(set(names)) == len(names), f"tenants: a tenant is named twice in {names}")

    def tenant(self, name: str | None) -> TenantConfig | None:
        """The configured tenant ``name`` (None: the default tenant, which exists whenever any tenant is
        configured); None when there is no such tenant."""
        name = DEFAULT_TENANT if name is None else name
        found = next((t for t in self.tenants if t.name == name), None)
        return TenantConfig(name) if found is None and name == DEFAULT_TENANT and self.tenants else found


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    step_timeout_s: float = option(60.0, "a step running longer than this plus step_timeout_per_token_s x its "
                                         "tokens marks the engine unhealthy (2x: every stream ends with an error)")
    step_timeout_per_token_s: float = option(0.02, "the step time limit's allowance per token scheduled in the step "
                                                   "(a long prefill may take longer than a decode step)")
    seed: int = option(0, "seed of the sampling noise of requests without their own seed")
    stream_interval: int = option(1, "serving streams send a request's new tokens every this many steps "
                                     "(its first and last output at once); more steps per message cost the "
                                     "front end less CPU and make streams burstier")
    idle_batch_wait_ms: float = option(3.0, "an idle serving engine that receives a request starts its first "
                                            "step once no other request has arrived for this long (at most 8x "
                                            "this in all; 16x while the replacements of requests that just "
                                            "finished arrive), so a burst of arrivals is prefilled in one step "
                                            "(0: start at once)")

    def __post_init__(self) -> None:
        self.model.validate()
        self.cache.validate()
        self.parallel.validate()
        self.scheduler.validate()
        _require(self.step_timeout_s > 0, f"step_timeout_s: must be > 0, got {self.step_timeout_s!r}")
        _require(self.step_timeout_per_token_s >= 0,
                 f"step_timeout_per_token_s: must be >= 0, got {self.step_timeout_per_token_s!r}")
        _require(type(self.stream_interval) is int and self.stream_interval >= 1,   # noqa: E721
                 f"stream_interval: must be an integer >= 1, got {self.stream_interval!r}")
        _require(isinstance(self.idle_batch_wait_ms, (int, float)) and not isinstance(self.idle_batch_wait_ms, bool)
                 and 0 <= self.idle_batch_wait_ms <= 1000,
                 f"idle_batch_wait_ms: must be a number of milliseconds in [0, 1000], got {self.idle_batch_wait_ms!r}")
        _require(not (self.model.enable_lora and self.scheduler.speculative_model is not None),
                 "enable_lora: not with speculative_model (the draft model would run without the adapters)")
        _require(not (self.cache.kv_offload_gib > 0 and self.scheduler.speculative_model is not None),
                 "kv_offload_gib: not with speculative_model (the draft model's cache has no second tier)")
        _require(not self.scheduler.async_scheduling or self.parallel.tensor_parallel_size == 1,
                 "async_scheduling: needs tensor_parallel_size 1 (the ranks would need the sampled ids of the "
                 f"step still running), got tensor_parallel_size={self.parallel.tensor_parallel_size}")
        if self.model.max_model_len is not None and self.cache.num_blocks is not None:
            capacity = self.cache.num_blocks * self.cache.block_size
            _require(self.model.max_model_len <= capacity,
                     f"max_model_len: {self.model.max_model_len} tokens do not fit in num_blocks="
                     f"{self.cache.num_blocks} x block_size={self.cache.block_size}; lower max_model_len "
                     "or raise num_blocks")

    def step_limit_s(self, num_tokens: int) -> float:
        """How long a step that schedules ``num_tokens`` tokens may run before it counts as stalled."""
        return self.step_timeout_s + self.step_timeout_per_token_s * num_tokens


# EngineConfig's sections by field name (the engine's keyword routing and deploy/serve/options.py read it)
SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "parallel": ParallelConfig, "scheduler": SchedulerConfig}

"""LLM: the offline batch API.

    from pagedray.cluster import LLM, SamplingParams
    llm = LLM("default", tensor_parallel_size=2, max_num_seqs=64)
    results = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))
    results[0].outputs[0].text, .token_ids, .finish_reason

Keyword arguments are routed by name to the config dataclasses (``ModelConfig``, ``CacheConfig``,
``ParallelConfig``, ``SchedulerConfig``, then ``EngineConfig``'s own fields); an unknown name is a
ValueError. ``generate`` feeds requests as the bounded waiting queue allows, steps the engine until
all are done (a tqdm bar counts finished requests) and returns results in input order, with
``params.n`` outputs each. Strings are tokenized with the model's tokenizer (its default special
tokens, as ``tokenizer(text)`` does); token-id lists are used as given. Output text is decoded with
``skip_special_tokens=True``; it is None when the model folder has no tokenizer. ``embed`` and ``score`` run
pooling requests (cluster/pooling.py): embeddings, and a yes/no reranker's scores.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from pagedray.workers.contract.config import SECTIONS, EngineConfig
from pagedray.workers.contract.lora_request import LoRARequest
from pagedray.workers.contract.sampling_params import SamplingParams

from .engine import Engine
from .outputs import EngineDeadError
from .pooling import PoolingSettings, Scorer, embedding_params, finish_embedding, rerank_prompt

_SECTIONS = tuple(SECTIONS.items())


@dataclass
class SampleOutput:
    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    logprobs: list | None = None


@dataclass
class GenerationResult:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[SampleOutput] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0
    # params.prompt_logprobs set: one TokenLogprob per prompt token (None for the first)
    prompt_logprobs: list | None = None
    # a pooling request (params.pooling): the pooled hidden state and its pooling_token_ids' logits
    pooled: list[float] | None = None
    pooled_logits: list[float] | None = None


@dataclass
class EmbeddingResult:
    prompt: str | None
    prompt_token_ids: list[int]
    embedding: list[float]


@dataclass
class ScoreResult:
    index: int                 # the document's position in the list given
    document: str
    score: float               # in [0, 1]: P(yes) of a yes/no reranker, or its classifier head's (cluster/pooling.py)


def build_engine_config(model: str = "default", tensor_parallel_size: int = 1, dtype: str = "auto",
                        **engine_kwargs) -> EngineConfig:
    """Routes keyword arguments to the config sections; ValueError naming an unknown argument."""
    sections: dict[str, dict] = {"model": {"model": model, "dtype": dtype},
                                 "parallel": {"tensor_parallel_size": tensor_parallel_size}}
    top = {f.name for f in dataclasses.fields(EngineConfig)} - {name for name, _ in _SECTIONS}
    top_kwargs = {}
    for key, value in engine_kwargs.items():
        section = next((name for name, cls in _SECTIONS
                        if key in {f.name for f in dataclasses.fields(cls)}), None)
        if section is not None:
            sections.setdefault(section, {})[key] = value
        elif key in top:
            top_kwargs[key] = value
        else:
            raise ValueError(f"{key}: not a known engine setting (see pagedray.workers.contract.config)")
    parts = {name: cls(**sections.get(name, {})) for name, cls in _SECTIONS}
    return EngineConfig(**parts, **top_kwargs)


class LLM:
    def __init__(self, model: str = "default", tensor_parallel_size: int = 1, dtype: str = "auto",
                 **engine_kwargs) -> None:
        self.config = build_engine_config(model, tensor_parallel_size, dtype, **engine_kwargs)
        self.engine = Engine(self.config)
        self._next_id = 0
        self._lora_folders = self.config.model.lora_module_paths()   # one folder per adapter name
        self._scorer: Scorer | None = None    # built by the first score()

    def _tokenizer_or_none(self):
        try:
            return self.engine.tokenizer
        except (OSError, ValueError, TypeError):
            return None

    def _normalize(self, prompts, params) -> tuple[list, list[SamplingParams]]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts: give a string, a list of strings or a list of token-id lists")
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if not isinstance(params, (list, tuple)) or len(params) != len(prompts):
            raise ValueError(f"params: give one SamplingParams or a list of {len(prompts)} (one per prompt)")
        return list(prompts), list(params)

    def _loras(self, lora_request, count: int) -> list:
        """One adapter (or None) per prompt; ValueError for a name already given with another folder."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * count
        elif not isinstance(lora_request, (list, tuple)) or len(lora_request) != count:
            raise ValueError(f"lora_request: give one LoRARequest, None, or a list of {count} (one per prompt)")
        else:
            loras = list(lora_request)
        folders = dict(self._lora_folders)
        for lora in loras:
            if isinstance(lora, LoRARequest) and folders.setdefault(lora.name, lora.path) != lora.path:
                raise ValueError(f"lora_request: adapter {lora.name!r} is already served from "
                                 f"{folders[lora.name]}, not {lora.path}")
        return loras

    def _encode(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            tokenizer = self._tokenizer_or_none()
            if tokenizer is None:
                raise ValueError("prompts: this model folder has no tokenizer; pass token-id lists")
            return prompt, list(tokenizer(prompt).input_ids)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompts: each prompt must be a string or a list of token ids, got {prompt!r:.60}")

    def generate(self, prompts, params: SamplingParams | list | None = None, use_tqdm: bool = True,
                 lora_request: LoRARequest | list | None = None) -> list[GenerationResult]:
        """``lora_request``: one adapter for every prompt, or a list with one per prompt (None: the base model);
        needs ``enable_lora``."""
        prompts, params = self._normalize(prompts, params)
        loras = self._loras(lora_request, len(prompts))
        encoded = [self._encode(p) for p in prompts]
        ids = [f"llm-{self._next_id + i}" for i in range(len(prompts))]
        self._next_id += len(prompts)
        for (_, token_ids), p, lora in zip(encoded, params, loras):  # validate all before adding any
            self.engine.validate(token_ids, p, lora=lora)
        self._lora_folders.update((lora.name, lora.path) for lora in loras if lora is not None)
        results = {rid: GenerationResult(text, token_ids, [SampleOutput(i, [], None, None) for i in range(p.n)])
                   for rid, (text, token_ids), p in zip(ids, encoded, params)}
        self._run(list(zip(ids, encoded, params, loras)), results, use_tqdm)
        tokenizer = self._tokenizer_or_none()
        for result in results.values():
            for sample in result.outputs:
                if tokenizer is not None:
                    sample.text = tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        return [results[rid] for rid in ids]

    def embed(self, prompts, normalize: bool | None = None, dimensions: int | None = None,
              pooling_type: str | None = None, use_tqdm: bool = True,
              lora_request: LoRARequest | list | None = None) -> list[EmbeddingResult]:
        """Embeddings of ``prompts`` (strings or token-id lists; cluster/pooling.py): the final hidden state pooled
        ``pooling_type`` (default: the ``pooling_type`` option), truncated to ``dimensions`` (Matryoshka models
        only) and L2-normalized unless ``normalize`` is False (default: the ``embed_normalize`` option)."""
        model = self.config.model
        normalize = model.embed_normalize if normalize is None else normalize
        if not isinstance(normalize, bool):
            raise ValueError(f"normalize: must be true or false, got {normalize!r}")
        params = embedding_params(pooling_type or model.pooling_type)
        matryoshka = self.engine.model_info.matryoshka
        if dimensions is not None:   # checked before anything runs
            finish_embedding([0.0] * self.engine.model_info.hidden_size, False, dimensions, matryoshka)
        results = self.generate(prompts, params, use_tqdm, lora_request)
        return [EmbeddingResult(r.prompt, r.prompt_token_ids, finish_embedding(r.pooled, normalize, dimensions,
                                                                                matryoshka)) for r in results]

    def score(self, query: str, documents: list[str], instruction: str | None = None,
              use_tqdm: bool = True) -> list[ScoreResult]:
        """A reranker's relevance of each document to ``query`` (Qwen3-Reranker's template; a yes/no reranker's
        score, or a sequence-classification checkpoint's head: cluster/pooling.py), in the documents' order."""
        if not isinstance(query, str) or not query:
            raise ValueError("query: must be a non-empty string")
        if not isinstance(documents, (list, tuple)) or not documents or not all(isinstance(d, str) for d in documents):
            raise ValueError("documents: must be a non-empty list of strings")
        tokenizer = self._tokenizer_or_none()
        if tokenizer is None:
            raise ValueError("model: this model folder has no tokenizer, which scoring needs")
        if self._scorer is None:
            self._scorer = Scorer(PoolingSettings.of(self.config.model, self.engine.model_info), tokenizer)
        prompts = [rerank_prompt(query, document, instruction) for document in documents]
        results = self.generate(prompts, self._scorer.params, use_tqdm)
        return [ScoreResult(i, document, self._scorer.score(r))
                for i, (document, r) in enumerate(zip(documents, results))]

    def _run(self, todo: list, results: dict[str, GenerationResult], use_tqdm: bool) -> None:
        from tqdm.auto import tqdm

        engine = self.engine
        limit = self.config.scheduler.max_queued_requests
        todo.reverse()
        with tqdm(total=len(results), disable=not use_tqdm, desc="generate", unit="req") as bar:
            while todo or engine.has_unfinished_requests():
                while todo and engine.scheduler.num_waiting < limit:
                    rid, (_, token_ids), p, lora = todo.pop()
                    engine.add(rid, token_ids, p, validated=True, lora=lora)   # checked in generate()
                for out in engine.step():
                    result = results[out.request_id]
                    if out.num_cached_prompt_tokens:
                        result.num_cached_prompt_tokens = out.num_cached_prompt_tokens
                    if out.prompt_logprobs is not None:
                        result.prompt_logprobs = out.prompt_logprobs
                    if out.pooled is not None:
                        result.pooled, result.pooled_logits = out.pooled, out.pooled_logits
                    for completion in out.outputs:
                        sample = result.outputs[completion.index]
                        sample.token_ids.extend(completion.token_ids)
                        if completion.logprobs is not None:
                            sample.logprobs = (sample.logprobs or []) + completion.logprobs
                        if completion.finish_reason is not None:
                            sample.finish_reason = completion.finish_reason
                    if out.error is not None:
                        raise EngineDeadError(out.error)
                    if out.finished:
                        bar.update(1)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

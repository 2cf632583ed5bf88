"""Pooling requests, the front half: what an embedding or a rerank score asks of the engine and what is done with
the engine's result (``RequestOutput.pooled`` / ``pooled_logits``; the worker's half is
workers/runner/pooling.py). Shared by ``LLM.embed`` / ``LLM.score`` and the HTTP API (deploy/openai/embeddings.py).

- An embedding is the final hidden state pooled ``pooling_type`` ("last": the last token's, as Qwen3-Embedding and
  other decoder embedders use; "mean": over every input token), truncated to ``dimensions`` when asked
  (Matryoshka: only for a model whose config declares it) and then L2-normalized when ``normalize``. The
  model's instruction format (Qwen3-Embedding's "Instruct: ...\\nQuery: ...") is the client's to apply.
- A rerank score is a yes/no reranker's (Qwen3-Reranker): the query and the document go into its prompt
  template, and the score is P("yes") against "no" at the last position: sigmoid(logit_yes - logit_no), what
  the model card computes as the softmax over the two logits.
- A sequence-classification checkpoint (``*ForSequenceClassification``: a ``score`` head of ``num_labels`` rows
  instead of the LM head, as rerankers converted from yes/no models ship) takes the same prompt; its score is the
  head applied to the last token's hidden state (``ClassifierHead``, read from the checkpoint by the front, in
  float64): sigmoid of the one logit, or with two labels the second one's softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedray.workers.contract.sampling_params import SamplingParams

# Qwen3-Reranker's prompt: its system turn, the user turn with the instruction, query and document, and an empty
# thinking block before the answer
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                 "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass(frozen=True)
class PoolingSettings:
    """What a served model's pooling endpoints need to know (its ModelConfig and model info)."""

    task: str = "generate"        # ModelConfig.task
    pooling_type: str = "last"
    embed_normalize: bool = True
    matryoshka: bool = False      # its config declares Matryoshka embeddings: ``dimensions`` may truncate
    hidden_size: int = 0
    num_labels: int = 0           # a sequence-classification checkpoint's score head outputs (0: none)
    model_path: str = ""

    @classmethod
    def of(cls, model_config, model_info) -> PoolingSettings:
        return cls(model_config.task, model_config.pooling_type, model_config.embed_normalize, model_info.matryoshka,
                   model_info.hidden_size, model_info.num_labels, str(model_info.path))


def embedding_params(pooling_type: str) -> SamplingParams:
    """The engine request of an embedding: a prefill pooled ``pooling_type``."""
    return SamplingParams(max_tokens=1, temperature=0, pooling=pooling_type, speculative=False)


def score_params(yes_id: int, no_id: int) -> SamplingParams:
    """The engine request of a yes/no score: the logits of "yes" and "no" at the prompt's last position."""
    return SamplingParams(max_tokens=1, temperature=0, pooling="last", pooling_token_ids=(yes_id, no_id),
                          speculative=False)


def finish_embedding(vector: list[float], normalize: bool, dimensions: int | None = None,
                     matryoshka: bool = False) -> list[float]:
    """The pooled hidden state as the embedding returned: its first ``dimensions`` values (ValueError naming
    ``dimensions`` unless the model is ``matryoshka`` and 1 <= dimensions <= its size), L2-normalized when asked."""
    if dimensions is not None:
        if not matryoshka:
            raise ValueError("dimensions: this model does not declare Matryoshka embeddings (is_matryoshka or "
                             "matryoshka_dimensions in its config.json), so its vectors cannot be truncated")
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= len(vector):
            raise ValueError(f"dimensions: must be an integer in [1, {len(vector)}], got {dimensions!r}")
        vector = vector[:dimensions]
    if not normalize:
        return list(vector)
    norm = math.sqrt(sum(value * value for value in vector))
    return [value / norm for value in vector] if norm > 0 else list(vector)


def rerank_prompt(query: str, document: str, instruction: str | None = None) -> str:
    """The reranker's prompt for one (query, document) pair."""
    return (f"{RERANK_PREFIX}<Instruct>: {instruction or RERANK_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}{RERANK_SUFFIX}")


def yes_no_score(logits: list[float]) -> float:
    """P(yes) from the [yes, no] logits: sigmoid(yes - no)."""
    diff = logits[0] - logits[1]
    return 1.0 / (1.0 + math.exp(-diff)) if diff >= 0 else math.exp(diff) / (1.0 + math.exp(diff))


class ClassifierHead:
    """The ``score`` head of a sequence-classification checkpoint ([num_labels, hidden]), as float64."""

    def __init__(self, model_path: str, num_labels: int, hidden_size: int) -> None:
        from pagedray.workers.weights.weight_loader import CheckpointReader

        if num_labels not in (1, 2):
            raise ValueError(f"model: a score head of {num_labels} labels is not a relevance score (1 or 2 labels)")
        with CheckpointReader(model_path) as reader:
            self.weight = reader.read("score.weight", expect_shape=[num_labels, hidden_size]).double()

    def score(self, hidden: list[float]) -> float:
        import torch

        logits = (self.weight @ torch.tensor(hidden, dtype=torch.float64)).tolist()   # [num_labels]
        return yes_no_score([logits[0], 0.0]) if len(logits) == 1 else yes_no_score([logits[1], logits[0]])


class Scorer:
    """How one model scores (query, document) pairs: the engine request of a pair's prompt, and the score of its
    finished output (``pooled`` / ``pooled_logits``): a yes/no reranker's logits, or a classifier head's."""

    def __init__(self, settings: PoolingSettings, tokenizer) -> None:
        if settings.num_labels:
            self.head: ClassifierHead | None = ClassifierHead(settings.model_path, settings.num_labels,
                                                              settings.hidden_size)
            self.params = embedding_params("last")
        else:
            self.head, self.params = None, score_params(*yes_no_ids(tokenizer))

    def score(self, output) -> float:
        return self.head.score(output.pooled) if self.head is not None else yes_no_score(output.pooled_logits)


def yes_no_ids(tokenizer) -> tuple[int, int]:
    """The ids of "yes" and "no" in ``tokenizer`` (each must be one token); ValueError when not."""
    ids = []
    for word in ("yes", "no"):
        token_id = tokenizer.convert_tokens_to_ids(word)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(f"model: its tokenizer has no single token {word!r}: it is not a yes/no reranker")
        ids.append(int(token_id))
    return ids[0], ids[1]

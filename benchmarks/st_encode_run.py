"""One timed ``SentenceTransformer.encode`` run, executed by the sentence-transformers venv's Python
(``benchmarks/embeddings.py``, the peer of pagedray's embeddings).

Reads one JSON object on stdin: ``model`` (a folder), ``texts``, ``warm_up`` (texts encoded once before),
``batch_size``, ``pooling`` (sentence-transformers' pooling mode: "lasttoken" or "mean") and ``vectors`` (whether to
send the vectors back). Builds the model from its
modules (a plain-text transformer, the pooling, L2 normalization; loading outside the timing), warms up with one batch,
then times ``encode`` over every text and prints one line ``RESULT_PREFIX`` + JSON (seconds, and the vectors when
asked). Imports nothing of pagedray's.
"""

import json
import sys
import time

RESULT_PREFIX = "pagedray-st-encode-result: "


def main() -> None:
    job = json.load(sys.stdin)
    from sentence_transformers import SentenceTransformer, models

    # plain text in, last_hidden_state out: sentence-transformers 6 otherwise wraps each text in the model's chat
    # template (a system prompt and turn markers: other vectors, longer inputs) when the tokenizer has one
    transformer = models.Transformer(job["model"], modality_config={"text": {"method": "forward",
                                                                           "method_output_name": "last_hidden_state"}},
                                     module_output_name="token_embeddings")
    tokenizer = transformer.tokenizer
    if tokenizer.pad_token is None:      # decoder tokenizers often have none; batches need one
        tokenizer.pad_token = tokenizer.eos_token
    pooling = models.Pooling(transformer.get_word_embedding_dimension(), pooling_mode=job["pooling"])
    model = SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu")
    model.encode(job["warm_up"], batch_size=job["batch_size"])
    start = time.perf_counter()
    vectors = model.encode(job["texts"], batch_size=job["batch_size"], convert_to_numpy=True)
    seconds = time.perf_counter() - start
    result = {"seconds": seconds, "vectors": vectors.tolist() if job["vectors"] else None}
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

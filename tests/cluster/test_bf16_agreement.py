"""bfloat16 (what dtype "auto" picks on CPUs with AMX / AVX512-BF16) against transformers in bfloat16.

Bit-equality is not expected in bfloat16: the two run the same arithmetic in another order and every
matmul output is rounded to 8 bits of mantissa. What must hold is that greedy tokens are equal up to
the first position where transformers' own top two logits are within bfloat16 rounding of each other
(a near-tie either side may break), and the sequences are compared only up to there (after it they
continue from different prefixes). The bound is 8 bfloat16 ulps of the top logit: at a top logit of
16-32 that is 1.0.

Measured on the 2-core AMD EPYC VM (avx512_bf16), 16 prompts x 32 tokens: 6 prompts equal over all 32
tokens, 293 of 512 positions equal before the first divergence; the ten divergences had HF-side
margins of 0 to 0.625 (0 to 5 ulps of the top logit); four were negative, i.e. transformers' own full
forward over the prefix preferred pagedray's token to the one its incremental ``generate`` chose.
Since the linear layers run ``kernels.cpu_gemm`` (2026-11-26, 16 other prompts x 32 tokens): 9 prompts
equal throughout and 368 of 512 positions before the first divergence, oneDNN's products 10 and 383
in the same run. The margin is signed: when short prompts began to run through the C decode kernel
(``reference.ROW_CHUNK_MAX``, then 16), "Q: What is 12 times 7?" followed transformers for 19 tokens and then
took <|im_end|>, which transformers' full forward over that prefix prefers by 4.75 (log-probability
-0.016 against -4.77) while its incremental ``generate`` took the newline.
"""

import math

import torch
from pagedray.cluster import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "Explain photosynthesis in one sentence.", "Q: What is 12 times 7?\nA:", "SELECT name FROM"]
MAX_TOKENS = 24
ULPS = 8


def bf16_ulp(x: float) -> float:
    """The spacing of bfloat16 numbers at |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


def test_bf16_greedy_equals_transformers_bf16_up_to_near_ties(default_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    llm = LLM(default_model_path, dtype="bfloat16", num_blocks=128, block_size=16, threads_per_worker=1)
    try:
        assert llm.engine.dtype == "bfloat16"
        results = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                               use_tqdm=False)
    finally:
        llm.shutdown()
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.bfloat16).eval()
    equal_positions = 0
    for prompt, result in zip(PROMPTS, results):
        ids = tokenizer(prompt).input_ids
        ours = result.outputs[0].token_ids
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, pad_token_id=0)
        theirs = out[0, len(ids):].tolist()
        assert len(ours) == len(theirs) == MAX_TOKENS
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), MAX_TOKENS)
        equal_positions += first
        if first == MAX_TOKENS:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([ids + theirs[:first]])).logits[0, -1].float()
        # how much transformers' full forward prefers its token to ours; negative: it prefers ours (its own
        # incremental bf16 generate drifted from its full forward), which is no evidence against us
        margin = logits[theirs[first]].item() - logits[ours[first]].item()
        bound = ULPS * bf16_ulp(logits.max().item())
        assert margin <= bound, (f"{prompt!r}: token {first} differs (ours {ours[first]}, transformers "
                                 f"{theirs[first]}) with a logit margin {margin:.3f} > {bound:.3f}")
    assert equal_positions > 0

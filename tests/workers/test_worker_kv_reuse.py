"""KV reuse paths give the same tokens as transformers: prefill split into chunks, sequences that start
with ``num_computed_tokens > 0`` (prefix-cache hits on blocks another sequence filled), and
copy-on-write block copies applied before the forward."""

from __future__ import annotations

from helpers.hf_oracle import hf_greedy_each
from helpers.worker_setup import engine_config, local_driver
from pagedray.workers.contract.sampling_params import SamplingParams
from pagedray.workers.contract.wire import NewSequence, RunningDelta, StepPlan
from pagedray.workers.worker import Worker

GREEDY = SamplingParams(temperature=0.0)


def test_prompt_split_into_many_prefill_chunks(tiny_model_path):
    path = tiny_model_path("llama")
    prompt = list(range(10, 47))  # 37 tokens -> chunks of 5 over blocks of 8: chunks straddle blocks
    _, driver = local_driver(path, token_budget=5, max_chunk=5)
    out = driver.generate([prompt], 16)
    chunks = [n.num_scheduled_tokens for p in driver.plans for n in p.new_seqs] + \
             [r.num_scheduled_tokens for p in driver.plans[:8] for r in p.running]
    assert chunks[:8] == [5, 5, 5, 5, 5, 5, 5, 2]
    assert out == hf_greedy_each(path, [prompt], 16)


def test_prefix_cache_hits_start_after_computed_tokens(tiny_model_path):
    path = tiny_model_path("qwen2")
    shared = list(range(100, 130))                       # 30 tokens: 3 full blocks of 8
    first, second, third = shared + [7, 8, 9], shared + [40, 41], shared[:20] + [3]
    _, driver = local_driver(path, token_budget=64, max_chunk=64, enable_prefix_caching=True)
    a, b = driver.run([driver.add(first, 24), driver.add(second, 24)])  # b hits a's live blocks
    (c,) = driver.run([driver.add(third, 24)])                           # c hits blocks a/b freed
    assert (a.num_cached_at_admission, b.num_cached_at_admission, c.num_cached_at_admission) == (0, 24, 16)
    new_seqs = [n for p in driver.plans for n in p.new_seqs]
    assert [n.num_computed_tokens for n in new_seqs] == [0, 24, 16]
    assert [a.output, b.output, c.output] == hf_greedy_each(path, [first, second, third], 24)


def _step(worker, step_id, new=(), running=(), copies=()):
    result = worker.execute(StepPlan(step_id, new_seqs=list(new), running=list(running),
                                     block_copies=list(copies)))
    return {s.seq_id: s.token_id for s in result.sampled}


def test_block_copy_before_forward(tiny_model_path):
    """Seq 1 shares seq 0's full block 0 and gets a copy (1 -> 2) of its half-filled block 1 in the
    same plan; it recomputes only its last prompt token, writing into the private copy while seq 0
    keeps writing into block 1. Both must continue exactly like transformers."""
    path = tiny_model_path("llama")
    prompt = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]  # 12 tokens: block 0 full, block 1 half
    worker = Worker(engine_config(path, num_blocks=8, block_size=8))
    worker.init_kv_cache(8)
    tokens = {0: [], 1: []}
    first = _step(worker, 0, new=[NewSequence(0, prompt, [], 0, 12, [0, 1, 3], GREEDY)])
    tokens[0].append(first[0])
    sampled = _step(worker, 1, new=[NewSequence(1, prompt, [], 11, 1, [0, 2, 4], GREEDY)],
                    running=[RunningDelta(0, 1, [], first[0])], copies=[(1, 2)])
    for step in range(2, 8):
        for seq_id, token in sampled.items():
            tokens[seq_id].append(token)
        sampled = _step(worker, step, running=[RunningDelta(s, 1, [], tokens[s][-1]) for s in (0, 1)])
    for seq_id, token in sampled.items():
        tokens[seq_id].append(token)
    expected = hf_greedy_each(path, [prompt], len(tokens[0]))[0]
    assert len(tokens[0]) == 8 and len(tokens[1]) == 7
    assert tokens[0] == expected
    assert tokens[1] == expected[: len(tokens[1])]

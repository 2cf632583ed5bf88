"""Abort soak (AsyncEngine + LocalExecutor, tiny Llama, 48-block KV pool, 24-token step budget so
prefills are chunked): 30% of the requests are ended early at random moments (queued, mid-prefill,
mid-decode, preempted) by explicit abort, task cancellation or closing the stream. After drain: every
block free with ref count 0, no sequence left in the BlockManager or in the worker's mirror, and every
request that was not aborted got exactly the tokens of an undisturbed run (aborted ones got a prefix
of them). 200 requests in CI, 2,000 in the slow test."""

import asyncio
import collections
import logging

import pytest
from abort_soak import make_workload, run_soak, soak_config
from pagedray.cluster import LLM
from pagedray.cluster.async_engine import AsyncEngine
from pagedray.workers.contract.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _reference(path, workload):
    llm = LLM(path, block_size=8, num_blocks=1024, max_num_seqs=64)
    try:
        params = [SamplingParams(temperature=0, max_tokens=m) for _, m in workload]
        results = llm.generate([p for p, _ in workload], params, use_tqdm=False)
        return [r.outputs[0].token_ids for r in results]
    finally:
        llm.shutdown()


def _soak(path, num, seed):
    workload = make_workload(num, seed)
    expected = _reference(path, workload)
    engine = AsyncEngine(soak_config(path))
    try:
        result = asyncio.run(run_soak(engine, workload, abort_fraction=0.3, seed=seed))
        inner = engine.engine
        bm = inner.block_manager
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks and bm.sequence_ids() == []
        assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))
        assert inner.executor.worker.num_sequences() == 0
        assert engine.num_in_flight == 0 and not inner.has_unfinished_requests()
        assert inner.stats().num_preemptions_total > 0
        for i, tokens in enumerate(expected):
            rid = str(i)
            got = result.tokens[rid]
            if result.finish.get(rid) in (None, "abort"):
                assert rid in result.planned, f"request {rid} ended early without being aborted"
                assert got == tokens[:len(got)], f"aborted request {rid}: tokens are not a prefix"
            else:
                assert got == tokens, f"request {rid} differs from the undisturbed run"
        reasons = collections.Counter(result.finish.get(str(i)) for i in range(num))
        logger.warning("abort soak n=%d: %d planned aborts, states at abort %s, finish reasons %s (None: "
                       "stream closed/cancelled), preemptions %d, tokens %d", num, len(result.planned),
                       dict(result.abort_states), dict(reasons), inner.stats().num_preemptions_total,
                       inner.stats().num_generation_tokens_total)
        return result
    finally:
        engine.shutdown()


@pytest.mark.timeout(300)
def test_abort_soak_200_requests_leaves_nothing_behind(tiny_llama_path):
    result = _soak(tiny_llama_path, 200, seed=7)
    for state in ("queued", "prefill", "decode", "preempted"):
        assert result.abort_states[state] > 0, dict(result.abort_states)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_abort_soak_2000_requests_hits_every_state(tiny_llama_path):
    result = _soak(tiny_llama_path, 2000, seed=11)
    for state in ("queued", "prefill", "decode", "preempted"):
        assert result.abort_states[state] > 0, dict(result.abort_states)

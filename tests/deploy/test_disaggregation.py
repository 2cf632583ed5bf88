"""Prefill/decode disaggregation (deploy/serve/disaggregation.py) with served engines in one process: a prompt runs
on the prefill engine to its first token, its blocks move to the decode engine, which computes only the rest
of the prompt's last block and samples on. Every stream, greedy and seeded, equals one engine's run; a request
done at its first token never reaches the decode side; a lost prefill replica or blocks that cannot be imported
leave the request to the decode engine, with the same tokens."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

from pagedray.cluster.outputs import RequestOutput
from pagedray.deploy.serve.disaggregation import DisaggregatedEngineClient
from pagedray.deploy.serve.failover import FailoverEngineClient
from pagedray.deploy.serve.served_engine import ServedEngine
from pagedray.workers.contract.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from pagedray.workers.contract.sampling_params import SamplingParams
from ray.exceptions import RayActorError

BLOCK = 8
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=17, max_tokens=10, ignore_eos=True)


def _engine(path) -> ServedEngine:
    return ServedEngine(EngineConfig(model=ModelConfig(model=path, dtype="float32"),
                                     cache=CacheConfig(block_size=BLOCK, num_blocks=64),
                                     parallel=ParallelConfig(executor="local", threads_per_worker=1)))


class PrefillHandle:
    """A streaming handle to one prefill replica; ``lost``: its actor died before answering."""

    def __init__(self, engine: ServedEngine, lost: bool = False) -> None:
        async def prefill(*args):
            if lost:
                raise RayActorError()
            self.calls += 1
            async for item in engine.prefill(*args):
                yield item if isinstance(item, RequestOutput) else self.spoil(item)
        self.calls, self.spoil = 0, lambda export: export
        self.prefill = SimpleNamespace(remote=prefill)

    def options(self, stream: bool):
        assert stream
        return self


async def _collect(stream) -> tuple[list[int], list]:
    tokens, outs = [], []
    async for out in stream:
        outs.append(out)
        tokens += out.outputs[0].token_ids if out.outputs else []
    return tokens, outs


def _prompt(seed: int, length: int = 29) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 500) for _ in range(length)]


def _run(path, params: SamplingParams, prompt: list[int], lost: bool = False, spoil=None):
    async def main():
        single, prefill, decode = _engine(path), _engine(path), _engine(path)
        try:
            expected, _ = await _collect(single.generate("single", prompt, params))
            handle = PrefillHandle(prefill, lost)
            if spoil is not None:
                handle.spoil = spoil
            client = DisaggregatedEngineClient(handle, FailoverEngineClient(decode))
            tokens, outs = await _collect(client.generate("req", prompt, params))
            return expected, tokens, outs, handle.calls, await prefill.stats(), await decode.stats()
        finally:
            for engine in (single, prefill, decode):
                await engine.close()
    return asyncio.run(main())


def test_disaggregated_streams_equal_one_engines_greedy_and_seeded(tiny_llama_path):
    for params, seed in ((GREEDY, 1), (SEEDED, 2)):
        prompt = _prompt(seed)
        expected, tokens, outs, calls, prefill_stats, decode_stats = _run(tiny_llama_path, params, prompt)
        assert tokens == expected and calls == 1
        assert outs[0].prompt_token_ids == prompt and all(o.prompt_token_ids is None for o in outs[1:])
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
        assert prefill_stats.num_running == prefill_stats.num_waiting == 0     # stopped after its first output
        # the decode engine computed the prompt's last partial block and the resumed token, nothing more
        assert decode_stats.num_computed_tokens_total <= len(prompt) % BLOCK + 1 + params.max_tokens
        assert decode_stats.prefix_hit_tokens_total == len(prompt) // BLOCK * BLOCK


def test_a_request_done_at_its_first_token_never_reaches_the_decode_side(tiny_llama_path):
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    expected, tokens, outs, calls, _, decode_stats = _run(tiny_llama_path, params, _prompt(3))
    assert tokens == expected and len(tokens) == 1 and outs[-1].finished and calls == 1
    assert decode_stats.num_requests_finished_total == 0


def test_a_lost_prefill_replica_leaves_the_request_to_the_decode_side(tiny_llama_path):
    expected, tokens, _, calls, _, decode_stats = _run(tiny_llama_path, SEEDED, _prompt(4), lost=True)
    assert tokens == expected and calls == 0 and decode_stats.prefix_hit_tokens_total == 0


def test_blocks_that_cannot_be_imported_are_computed_with_the_same_tokens(tiny_llama_path):
    def truncated(export):     # shards of the wrong size (bytes, or refs when a Ray runs in this process)
        export.shards = [b"\x00" * 5 for _ in export.shards]
        return export

    expected, tokens, _, calls, _, decode_stats = _run(tiny_llama_path, GREEDY, _prompt(5), spoil=truncated)
    assert tokens == expected and calls == 1 and decode_stats.prefix_hit_tokens_total == 0

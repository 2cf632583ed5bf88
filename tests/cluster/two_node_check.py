"""Run as a script (its own Ray cluster, separate from the test session's): TP=2 over two simulated
nodes (ray.cluster_utils.Cluster, one CPU each, SPREAD placement, plain actor-call transport).
Then the last prompt's cached blocks move (cluster/kv_transfers.py) from that TP group, gathered across the
two nodes, through the object store, to a TP=1 engine whose rank runs on a third node (heads re-sharded),
which runs the prompt again from its prefix cache.
Prints one JSON line: {"tokens": [...], "nodes": [...], "leaks": [...], "moved": {...}}."""

import json
import sys

import ray
from ray.cluster_utils import Cluster
from ray.util import placement_group_table


def main(model_path: str, prompts_json: str, max_tokens: int) -> None:
    from pagedray.cluster.engine import Engine
    from pagedray.cluster.llm import build_engine_config
    from pagedray.cluster.ray_executor import RayExecutor
    from pagedray.workers.contract.sampling_params import SamplingParams

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    config = build_engine_config(model_path, tensor_parallel_size=2, dtype="float32", block_size=8, num_blocks=128,
                                 executor="ray", placement_strategy="SPREAD")
    executor = RayExecutor(config, transport="actor")
    engine = Engine(config, executor=executor)
    try:
        prompts = json.loads(prompts_json)
        for i, prompt in enumerate(prompts):
            engine.add(str(i), prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
        tokens = {str(i): [] for i in range(len(prompts))}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] += [t for c in out.outputs for t in c.token_ids]
        bundle_nodes = placement_group_table(executor.placement.placement_group)["bundles_to_node_id"]
        result = {"tokens": [tokens[str(i)] for i in range(len(prompts))],
                  "nodes": [bundle_nodes[i] for i in executor.placement.bundle_indices],   # each rank's node
                  "leaks": executor.num_sequences(),
                  "moved": move_to_a_third_node(cluster, engine, model_path, prompts[-1], max_tokens)}
    finally:
        engine.shutdown()
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(result))


def move_to_a_third_node(cluster, source, model_path: str, prompt: list[int], max_tokens: int) -> dict:
    from pagedray.cluster.engine import Engine
    from pagedray.cluster.llm import build_engine_config
    from pagedray.cluster.ray_executor import RayExecutor
    from pagedray.workers.contract.sampling_params import SamplingParams

    cluster.add_node(num_cpus=1)
    config = build_engine_config(model_path, tensor_parallel_size=1, dtype="float32", block_size=8, num_blocks=128,
                                 executor="ray")
    executor = RayExecutor(config, transport="actor")
    target = Engine(config, executor=executor)
    try:
        export = source.export_prefix(prompt)
        export.shards = ray.get([ray.put(shard) for shard in export.shards])
        moved = target.import_prefix(export)
        target.add("moved", prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
        tokens, cached = [], 0
        while target.has_unfinished_requests():
            for out in target.step():
                tokens += [t for c in out.outputs for t in c.token_ids]
                cached = max(cached, out.num_cached_prompt_tokens)
        node = placement_group_table(executor.placement.placement_group)["bundles_to_node_id"][
            executor.placement.bundle_indices[0]]
        return {"shards": len(export.shards), "moved": moved, "cached": cached, "tokens": tokens, "node": node}
    finally:
        target.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))

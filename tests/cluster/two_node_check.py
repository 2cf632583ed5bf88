"""Run as a script (its own Ray cluster, separate from the test session's): TP=2 over two simulated
nodes (ray.cluster_utils.Cluster, one CPU each, SPREAD placement, plain actor-call transport).
Prints one JSON line: {"tokens": [...], "nodes": [...], "leaks": [...]}."""

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
                  "leaks": executor.num_sequences()}
    finally:
        engine.shutdown()
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))

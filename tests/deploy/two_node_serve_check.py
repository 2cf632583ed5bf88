"""Run as a script (its own Ray cluster, separate from the test session's): the YAML app with 2 engine
replicas on two simulated nodes (ray.cluster_utils.Cluster: a head without CPUs for Serve's controller,
proxy and the ingress; two nodes of 2 CPUs, each fitting one replica's placement group), then one node
is removed. Prints one JSON line with what the test checks (test_multinode_slow.py).

Steps: deploy ``deploy/serve/serve.yaml``'s app (its args, with a small KV cache and 2 replicas) through
``serve.run``; a shared-prefix workload (the cached tokens each request reports); each long request of
``LONG`` once without streaming (its undisturbed text), then all four as streams in flight (greedy and
seeded, completions and chat; two per replica: the router sends each to the less-loaded one); remove the
node of one replica; read the streams to their end (the ingress continues the lost ones on the other
replica: deploy/serve/failover.py); wait (hang guard) until Serve runs 1 engine replica; send new
requests.

The ingress replica asks for no CPU, so Ray may place it on either replica's node. The node removed is
the engine replica's node that does not hold the ingress, and Serve's HTTP proxy runs on the head only:
losing the node of the ingress or of the proxy a stream passes through cuts that stream at the
connection (no SSE event can be sent), which is a different failure.
"""

import json
import pathlib
import sys
import threading
import time

import httpx
import ray
import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # tests/: the helpers
from helpers.serve_fixtures import failovers_total  # noqa: E402
from pagedray.deploy.cli.main import free_port
from ray.cluster_utils import Cluster

SHARED = ("You are a careful assistant for a small bakery. Answer in one short sentence, name the product, "
          "give its price in euros and never invent products that are not on the menu of the day. ")
HANG_GUARD_S = 300.0
LONG = [("/v1/completions", {"prompt": "Count to a thousand:", "temperature": 0}),
        ("/v1/completions", {"prompt": "List every animal you know:", "temperature": 0.9, "seed": 3}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Describe a forest."}], "temperature": 0}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Write a poem."}], "temperature": 0.8,
                                  "seed": 7})]


def text_of(choice: dict) -> str:
    """A choice's text: a completion's text, a chat message's content, or a chunk's delta content."""
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("message") or choice.get("delta") or {}).get("content") or ""


def stream(url: str, path: str, body: dict, out: dict, started: threading.Event) -> None:
    events = []
    try:
        with httpx.Client(base_url=url, timeout=HANG_GUARD_S, trust_env=False) as client:
            with client.stream("POST", path, json={**body, "stream": True}) as response:
                out["status"] = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        started.set()
    except httpx.HTTPError as exc:
        out["transport_error"] = repr(exc)
    started.set()
    out["done"] = bool(events) and events[-1] == "[DONE]"
    out["error_event"] = any(e.startswith('{"error"') for e in events)
    chunks = [json.loads(e) for e in events if e.startswith('{"id"')]
    out["chunks"] = len(chunks)
    out["text"] = "".join(text_of(c["choices"][0]) for c in chunks if c["choices"])
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    out["finish_reason"] = reasons[-1] if reasons else None


def replica_nodes(app: str) -> dict[str, int]:
    """Engine replica placement groups by node id: {node_id: groups}."""
    nodes: dict[str, int] = {}
    for group in ray.util.placement_group_table().values():
        if group["state"] == "CREATED" and len(group["bundles"]) == 2:
            node = group["bundles_to_node_id"][0]
            nodes[node] = nodes.get(node, 0) + 1
    return nodes


def ingress_nodes(app: str) -> set[str]:
    """Node ids of the app's live ingress replicas."""
    from pagedray.deploy.serve.ingress import INGRESS_DEPLOYMENT_NAME
    from ray.util.state import list_actors

    name = f"ServeReplica:{app}:{INGRESS_DEPLOYMENT_NAME}"
    return {actor.node_id for actor in list_actors(filters=[("state", "=", "ALIVE")]) if actor.class_name == name}


def running_engine_replicas(app: str) -> int:
    from ray import serve

    return serve.status().applications[app].deployments["PagedEngine"].replica_states.get("RUNNING", 0)


def main(model_path: str) -> None:
    from pagedray.deploy.serve.app import build_app
    from ray import serve

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=2) for _ in range(2)]
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    result: dict = {}
    try:
        yaml_path = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "serve" / "serve.yaml"
        spec = yaml.safe_load(yaml_path.read_text())
        app_spec = spec["applications"][0]
        args = {**app_spec["args"], "model": model_path, "dtype": "float32", "num_replicas": 2, "num_blocks": 64,
                "max_model_len": 512, "max_num_seqs": 4, "threads_per_worker": 1}
        port = free_port()
        # one HTTP proxy, on the head: the simulated nodes share one IP, so proxies on every node would all
        # take connections on this port, and a connection held by the removed node's proxy would drop
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name=app_spec["name"], route_prefix=app_spec["route_prefix"])
        url = f"http://127.0.0.1:{port}"
        placement = replica_nodes(app_spec["name"])
        result["replicas_per_node"] = sorted(placement.values())

        with httpx.Client(base_url=url, timeout=HANG_GUARD_S, trust_env=False) as client:
            result["cached_tokens"] = [
                client.post("/v1/completions", json={"prompt": SHARED + q, "max_tokens": 2, "temperature": 0})
                .json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                for q in ("Bread?", "Cake?", "Tea?", "Pies?")]

        bodies = [(path, {**body, "max_tokens": 200, "ignore_eos": True}) for path, body in LONG]
        with httpx.Client(base_url=url, timeout=HANG_GUARD_S, trust_env=False) as client:
            result["expected"] = [text_of(client.post(path, json=body).json()["choices"][0]) for path, body in bodies]
            result["failovers_before"] = failovers_total(client)
        outs = [{} for _ in bodies]
        starts = [threading.Event() for _ in bodies]
        threads = [threading.Thread(target=stream, args=(url, path, body, out, ev), daemon=True)
                   for (path, body), out, ev in zip(bodies, outs, starts)]
        for thread, started in zip(threads, starts):
            thread.start()
            assert started.wait(HANG_GUARD_S)
        front = ingress_nodes(app_spec["name"])
        result["ingress_found"] = len(front) == 1
        victim = next(n for n in nodes if n.node_id in placement and n.node_id not in front)
        cluster.remove_node(victim, allow_graceful=False)
        for thread in threads:
            thread.join(HANG_GUARD_S)
        result["streams"] = outs

        deadline = time.monotonic() + HANG_GUARD_S
        while running_engine_replicas(app_spec["name"]) != 1 and time.monotonic() < deadline:
            time.sleep(1.0)
        result["running_after"] = running_engine_replicas(app_spec["name"])
        with httpx.Client(base_url=url, timeout=HANG_GUARD_S, trust_env=False) as client:
            result["after_statuses"] = [
                client.post("/v1/completions", json={"prompt": f"Say {i}:", "max_tokens": 2}).status_code
                for i in range(5)]
            result["failovers_after"] = failovers_total(client)
        serve.delete(app_spec["name"])
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])

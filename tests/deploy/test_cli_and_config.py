"""CLI parsing and dispatch, build_app argument checking, and the shipped serve.yaml (no Serve started)."""

from __future__ import annotations

import pathlib
import sys
import threading
import types

import pytest
import yaml
from pagedray.deploy.cli import main as cli
from pagedray.deploy.cli import shutdown, startup
from pagedray.deploy.serve.app import build_app, engine_config, parse_args
from pagedray.deploy.serve.engine_deployment import placement_bundles
from pagedray.deploy.serve.options import OPTIONS, option_default

YAML_PATH = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "serve" / "serve.yaml"


def test_serve_options_map_to_build_app_args():
    ns = cli.build_parser().parse_args(
        ["serve", "--model", "/models/x", "--tensor-parallel-size", "2", "--kv-cache-gib", "0.5",
         "--no-enable-prefix-caching", "--port", "9001", "--api-key", "k", "--max-queued-requests", "7",
         "--threads-per-worker", "1", "--executor", "ray"])
    assert cli.serve_args(ns) == {"model": "/models/x", "tensor_parallel_size": 2, "kv_cache_gib": 0.5,
                                  "threads_per_worker": 1, "executor": "ray",
                                  "enable_prefix_caching": False, "api_key": "k", "max_queued_requests": 7}
    assert (ns.host, ns.port, ns.name) == ("127.0.0.1", 9001, "pagedray")


def test_engine_config_from_args():
    config = engine_config(parse_args({"tensor_parallel_size": 2, "block_size": 32, "max_queued_requests": 9,
                                       "max_model_len": 512, "enable_prefix_caching": False,
                                       "threads_per_worker": 3}))
    assert config.parallel.tensor_parallel_size == 2 and config.parallel.use_ray
    assert engine_config(parse_args({})).parallel.use_ray                   # worker actors, also at TP=1
    assert not engine_config(parse_args({"executor": "local"})).parallel.use_ray   # in the replica's process
    assert config.parallel.threads_per_worker == 3
    assert engine_config(parse_args({})).parallel.threads_per_worker is None
    assert config.cache.block_size == 32 and not config.cache.enable_prefix_caching
    assert config.scheduler.max_queued_requests == 9 and config.model.max_model_len == 512


@pytest.mark.parametrize("args, field", [({"modle": "x"}, "modle"), ({"block_size": 7}, "block_size"),
                                         ({"tensor_parallel_size": "2"}, "tensor_parallel_size"),
                                         ({"num_replicas": 0}, "num_replicas"),
                                         ({"threads_per_worker": 0}, "threads_per_worker"),
                                         ({"executor": "mpi"}, "executor"),
                                         ({"executor": "local", "tensor_parallel_size": 2}, "executor"),
                                         ({"max_queued_requests": 0}, "max_queued_requests"),
                                         ({"request_router": "random"}, "request_router"),
                                         ({"router_max_imbalance": -1}, "router_max_imbalance"),
                                         ({"engine_in_ingress": True, "request_router": "cache_aware"},
                                          "request_router"),
                                         ({"rebalance_threshold": -1}, "rebalance_threshold"),
                                         ({"rebalance_threshold": 2, "request_router": "serve", "num_replicas": 2},
                                          "rebalance_threshold"),
                                         ({"rebalance_threshold": 2, "engine_in_ingress": True},
                                          "rebalance_threshold"),
                                         ({"models": [{"task": "embed"}]}, r"models\[0\]"),
                                         ({"models": [{"model": "/m", "api_key": "k"}]}, r"models\[0\]\.api_key"),
                                         ({"models": [{"model": "/m", "task": "chat"}]}, r"models\[0\]\.task"),
                                         ({"models": [{"model": "/m"}, {"model": "/m"}]}, "models: two models"),
                                         ({"models": [{"model": "/m"}], "engine_in_ingress": True},
                                          "engine_in_ingress"),
                                         ({"models": [{"model": "/m"}], "prefill_replicas": 1}, "prefill_replicas")])
def test_build_app_rejects_bad_args_naming_the_field(args, field):
    with pytest.raises(ValueError, match=field):
        build_app(args)


def test_placement_bundles_one_per_rank_plus_replica():
    assert placement_bundles(1, use_gpu=False) == [{"CPU": 1.0}, {"CPU": 1.0}]
    assert placement_bundles(2, use_gpu=True) == [{"CPU": 1.0}, {"GPU": 1.0}, {"GPU": 1.0}]
    assert placement_bundles(1, use_gpu=False, in_process=True) == [{"CPU": 1.0}]
    assert placement_bundles(1, use_gpu=True, in_process=True) == [{"CPU": 1.0, "GPU": 1.0}]


def test_loadtest_is_dispatched_lazily(monkeypatch):
    seen = []
    fake = types.ModuleType("pagedray.deploy.loadtest")
    fake.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, "pagedray.deploy.loadtest", fake)
    assert cli.main(["loadtest", "--url", "http://127.0.0.1:1", "--n", "2"]) == 3
    assert seen == [["--url", "http://127.0.0.1:1", "--n", "2"]]


def test_fetch_model_prints_the_model_folder(default_model_path, capsys):
    assert cli.main(["fetch-model"]) == 0
    assert capsys.readouterr().out.strip() == default_model_path


def test_serve_yaml_is_a_valid_serve_config():
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load(YAML_PATH.read_text())
    schema = ServeDeploySchema.model_validate(config)
    assert schema.http_options.host == "127.0.0.1"
    (app,) = schema.applications
    assert app.import_path == "pagedray.deploy.app:build_app"
    assert app.args["model"] == "default"
    build_app(app.args)  # the embedded args pass build_app's checks
    # the file shows the options users set first at their defaults: each default lives in options.py
    # and the config dataclasses only, so a changed default cannot leave the shipped file behind
    defaults = {option.name: option_default(option) for option in OPTIONS}
    differing = {name: value for name, value in app.args.items()
                 if name not in ("model", "num_replicas") and value != defaults[name]}
    assert differing == {}


def test_generate_prints_transformers_greedy_text(default_model_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt, max_tokens = "The capital of France is", 6
    assert cli.main(["generate", prompt, "--model", default_model_path, "--max-tokens", str(max_tokens),
                     "--num-blocks", "64", "--dtype", "float32"]) == 0
    printed = capsys.readouterr().out
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
    expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert printed == expected + "\n"


def test_local_ray_declares_enough_logical_cpus_for_every_replica_and_rank():
    """Each engine replica reserves its placement-group bundles (the replica + one per TP rank); the
    ingress of a split layout reserves none; autoscaling counts max_replicas (issue #32: with
    --num-replicas 2 the second replica was never scheduled on a 2-core machine)."""
    from pagedray.deploy.cli.startup import app_resources, local_ray_num_cpus

    def cpus(args, cores=2):
        return local_ray_num_cpus(app_resources(build_app({"device": "cpu", **args}))["CPU"], cores=cores)

    assert cpus({}) == 2                                               # engine in the ingress: 1 + 1 rank
    assert cpus({"tensor_parallel_size": 2}) == 3
    assert cpus({"num_replicas": 2}) == 4                              # 2 x (replica + rank)
    assert cpus({"num_replicas": 2, "tensor_parallel_size": 2}) == 6
    assert cpus({"num_replicas": 3, "executor": "local"}) == 3         # in-process: one bundle per replica
    assert cpus({"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}}) == 6
    assert cpus({"num_replicas": 2, "engine_in_ingress": True}) == 4
    assert cpus({"num_replicas": 2}, cores=16) == 16                   # never fewer than the cores
    assert app_resources(build_app({"device": "cpu", "num_replicas": 2}))["GPU"] == 0


def test_gpus_beyond_the_machines_are_refused_before_anything_starts():
    from pagedray.deploy.cli.startup import OptionError, app_resources, check_gpus

    needed = app_resources(build_app({"device": "cuda", "num_replicas": 2, "tensor_parallel_size": 2}))
    assert needed["GPU"] == 4
    check_gpus(needed["GPU"], gpus=4)
    check_gpus(0, gpus=0)
    with pytest.raises(OptionError, match="need 4 GPUs .* this machine has 2"):
        check_gpus(needed["GPU"], gpus=2)


def test_direct_ingress_follows_serves_rule_and_pins_the_port():
    from pagedray.deploy.cli.main import LOCAL_RAY_ENV, direct_ingress_env, uses_direct_ingress

    assert uses_direct_ingress(LOCAL_RAY_ENV)   # a Ray started by the CLI: clients reach the replica itself
    assert not uses_direct_ingress({})          # Serve's default: the proxy
    assert not uses_direct_ingress({**LOCAL_RAY_ENV, "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"})
    assert uses_direct_ingress({"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1"})
    # Serve's port range is [min, max): exactly the one port asked for
    assert direct_ingress_env(8000) == {"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "8000",
                                        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "8001"}


def test_autoscaling_config_reaches_the_engine_deployment_and_bad_ones_name_the_field():
    from pagedray.deploy.cli import main as cli
    from pagedray.deploy.serve.app import build_app

    scaling = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8}
    ingress = build_app({"autoscaling_config": scaling})._bound_deployment
    engine = ingress.init_args[0]._bound_deployment
    config = engine._deployment_config.autoscaling_config
    assert (config.min_replicas, config.max_replicas, config.target_ongoing_requests) == (1, 3, 8.0)
    assert ingress.max_ongoing_requests == 3 * build_app({})._bound_deployment.max_ongoing_requests
    for bad, message in [({"min_replicas": 3, "max_replicas": 2}, "autoscaling_config"),
                         ({"max_replica": 2}, r"autoscaling_config: unknown keys \['max_replica'\]"),
                         ({"max_replicas": "many"}, r"autoscaling_config\.max_replicas")]:
        with pytest.raises(ValueError, match=message):
            build_app({"autoscaling_config": bad})
    with pytest.raises(ValueError, match="num_replicas: give either"):
        build_app({"autoscaling_config": scaling, "num_replicas": 2})
    ns = cli.build_parser().parse_args(["serve", "--autoscaling-config", '{"max_replicas": 2}'])
    assert cli.serve_args(ns) == {"autoscaling_config": {"max_replicas": 2}}
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--autoscaling-config", "[2]"])


def test_the_cache_aware_router_is_used_where_there_is_a_choice_of_replicas():
    from pagedray.deploy.routing.router import PREFIX_SUMMARY_BLOCKS, CacheAwareRouter
    from pagedray.deploy.serve.app import build_app

    def engine(args):
        return build_app(args)._bound_deployment.init_args[0]._bound_deployment

    def engine_router(args):
        return engine(args)._deployment_config.request_router_config

    default_router = engine_router({"engine_in_ingress": False}).request_router_class   # one replica: Serve's
    assert "CacheAwareRouter" not in str(default_router)
    for args in ({"num_replicas": 2}, {"autoscaling_config": {"max_replicas": 2}}, {"request_router": "cache_aware"}):
        config = engine_router({**args, "block_size": 32, "router_max_imbalance": 3})
        assert config.get_request_router_class() is CacheAwareRouter, args
        assert config.request_router_kwargs == {"block_size": 32, "max_imbalance": 3}
        assert engine(args).init_kwargs == {"prefix_summary_blocks": PREFIX_SUMMARY_BLOCKS,
                                            "rebalance_threshold": 0}, args
    assert engine(
        {"num_replicas": 2, "rebalance_threshold": 3}).init_kwargs["rebalance_threshold"] == 3   # rebalance.py
    assert engine_router({"num_replicas": 2, "request_router": "serve"}).request_router_class == default_router
    # Serve's router reads no prefix summary: its replicas build none
    for args in ({"num_replicas": 2, "request_router": "serve"}, {"engine_in_ingress": False}):
        assert engine(args).init_kwargs == {"prefix_summary_blocks": 0, "rebalance_threshold": 0}, args


def test_engine_in_ingress_gives_the_ingress_the_engines_replicas_and_placement():
    from pagedray.deploy.serve.app import build_app
    from pagedray.workers.contract.config import EngineConfig

    split = build_app({"num_replicas": 2})._bound_deployment
    engine = split.init_args[0]._bound_deployment
    merged = build_app({"num_replicas": 2, "engine_in_ingress": True})._bound_deployment
    assert isinstance(merged.init_args[0], EngineConfig)
    assert merged._deployment_config.num_replicas == 2
    assert merged._replica_config.placement_group_bundles == engine._replica_config.placement_group_bundles
    assert merged._replica_config.ray_actor_options["num_cpus"] == 1
    assert merged.max_ongoing_requests == engine.max_ongoing_requests



def test_the_engine_runs_in_the_ingress_by_default_only_with_a_single_replica():
    """engine_in_ingress unset: in the ingress for one replica; a deployment of its own (routed to by the
    ingress) with several replicas, autoscaling or the cache-aware router asked for; given: as given."""
    from pagedray.deploy.serve.app import build_app
    from pagedray.workers.contract.config import EngineConfig

    def in_ingress(args):
        return isinstance(build_app(args)._bound_deployment.init_args[0], EngineConfig)

    assert in_ingress({}) and in_ingress({"request_router": "serve"})
    assert not in_ingress({"num_replicas": 2})
    assert not in_ingress({"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}})
    assert not in_ingress({"request_router": "cache_aware"})
    assert not in_ingress({"engine_in_ingress": False})
    assert in_ingress({"num_replicas": 2, "engine_in_ingress": True})
    assert cli.build_parser().parse_args(["serve"]).engine_in_ingress is None
    assert cli.build_parser().parse_args(["serve", "--no-engine-in-ingress"]).engine_in_ingress is False


def test_ctrl_c_exit_status_is_0_once_the_app_answers_and_130_during_start_up():
    asked = []

    def probe(answer):
        return lambda host, port: asked.append((host, port)) or answer

    assert cli.interrupted_status(True, "127.0.0.1", 8000, probe(False)) == 0 and asked == []
    assert cli.interrupted_status(False, "127.0.0.1", 8000, probe(True)) == 0   # serving before serve.run returned
    assert cli.interrupted_status(False, "0.0.0.0", 8001, probe(False)) == 130
    assert asked == [("127.0.0.1", 8000), ("0.0.0.0", 8001)]


def test_health_probe_reads_the_served_port():
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        # a generous timeout: the bound only ends a hang, the local server answers at once
        assert cli.answers_health("0.0.0.0", port, timeout_s=60)
        assert cli.answers_health("127.0.0.1", port, timeout_s=60)
    finally:
        server.shutdown()
        server.server_close()
    assert not cli.answers_health("127.0.0.1", port)   # nothing listens there any more


@pytest.fixture
def nothing_may_start(monkeypatch):
    """``pagedray serve`` with Ray, Serve and the model fetch replaced by failures: a bad option must be
    refused before any of them. The private Ray's environment the CLI sets is restored afterwards."""
    from pagedray.deploy.serve.loopback import LOOPBACK_RAY_ENV

    for name in LOOPBACK_RAY_ENV:
        monkeypatch.setenv(name, "0")

    def started(*args, **kwargs):
        raise AssertionError("something started before the options were checked")

    monkeypatch.setattr(cli, "_start_or_join_ray", started)
    monkeypatch.setattr(cli, "_prepare_model", started)


@pytest.mark.parametrize("argv, message", [
    (["--max-num-seqs", "-5"], "--max-num-seqs: must be >= 1, got -5"),
    (["--block-size", "7"], "--block-size: must be one of (8, 16, 32, 64), got 7"),
    (["--max-queued-requests", "0"], "--max-queued-requests: must be >= 1, got 0"),
    (["--num-replicas", "0"], "--num-replicas: must be >= 1, got 0"),
    (["--port", "99999"], "argument --port: must be in 1-65535, got 99999"),
    (["--port", "0"], "argument --port: must be in 1-65535, got 0"),
    (["--model", "/nonexistent/model"], "--model: '/nonexistent/model' is not a folder"),
    (["--model", "a/b..c"], "--model: 'a/b..c' is neither a folder nor a valid Hugging Face repo id"),
    (["--kv-cache-gib", "100000", "--device", "cpu"], "--kv-cache-gib: 100000 GiB per rank x 1 rank(s)"),
])
def test_bad_serve_options_are_one_usage_error_before_anything_starts(argv, message, nothing_may_start, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith("pagedray serve: error: " + message), err


def test_kv_cache_memory_counts_every_rank_of_every_replica():
    from pagedray.deploy.cli.startup import OptionError, check_kv_cache_memory

    config = engine_config(parse_args({"kv_cache_gib": 2.0, "tensor_parallel_size": 2, "device": "cpu"}))
    check_kv_cache_memory(config, replicas=2, available=8 * 2**30)     # 2 GiB x 2 ranks x 2 replicas
    with pytest.raises(OptionError, match=r"2 GiB per rank x 4 rank\(s\) = 8.0 GiB .* \(7.9 GiB\)"):
        check_kv_cache_memory(config, replicas=2, available=int(7.9 * 2**30))
    forced = engine_config(parse_args({"kv_cache_gib": 2.0, "num_blocks": 64, "device": "cpu"}))
    check_kv_cache_memory(forced, replicas=1, available=1)             # num_blocks sizes it instead
    on_gpu = engine_config(parse_args({"kv_cache_gib": 2.0, "device": "cuda"}))
    check_kv_cache_memory(on_gpu, replicas=1, available=1)             # a CPU-only setting


def test_an_existing_model_folder_and_a_joined_cluster_pass_the_local_checks(tmp_path, nothing_may_start):
    """A folder with config.json passes the model check (its weights are the replica's to load); with
    --address the replicas may run on other nodes, so neither the folder nor the memory is checked here."""
    (tmp_path / "config.json").write_text("{}")
    startup.check_model_folder(str(tmp_path))
    startup.check_model_folder("default")
    cli.check_serve_options(cli.build_parser().parse_args(
        ["serve", "--model", "/elsewhere/model", "--kv-cache-gib", "100000", "--address", "auto"]))
    with pytest.raises(startup.OptionError, match="--model: folder .* has no config.json"):
        startup.check_model_folder(str(tmp_path / ".."))


def test_bad_generate_options_are_one_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["generate", "hi", "--block-size", "7"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == "pagedray generate: error: --block-size: must be one of (8, 16, 32, 64), got 7"


class FakeRayAndServe:
    """Stand-ins for ``ray`` and ``ray.serve`` as ``shutdown.stop_serving`` uses them, recording the calls;
    ``in_flight``: what successive ``requests_in_flight`` calls answer (the last one repeats)."""

    def __init__(self, monkeypatch, in_flight, interrupt_delete=False):
        self.calls = []
        ray = types.ModuleType("ray")
        ray.shutdown = lambda: self.calls.append("ray.shutdown")
        serve = types.ModuleType("ray.serve")

        def delete(name, _blocking=True):
            self.calls.append(f"serve.delete({name}, blocking={_blocking})")
            if interrupt_delete:
                raise KeyboardInterrupt

        def count(name):
            self.calls.append(f"in_flight({name})")
            return in_flight.pop(0) if len(in_flight) > 1 else in_flight[0]

        serve.delete = delete
        serve.get_app_handle = lambda name: types.SimpleNamespace(drain=types.SimpleNamespace(
            remote=lambda timeout_s: self.calls.append(f"drain({name}, {timeout_s:g})")))
        ray.serve = serve
        monkeypatch.setitem(sys.modules, "ray", ray)
        monkeypatch.setitem(sys.modules, "ray.serve", serve)
        monkeypatch.setattr(shutdown, "requests_in_flight", count)
        monkeypatch.setattr(shutdown.signal, "signal", lambda signum, handler: None)   # the test's own handlers stay
        monkeypatch.setattr(shutdown.time, "sleep", lambda seconds: self.calls.append("sleep"))


def test_an_idle_private_ray_is_torn_down_without_waiting_for_serve_delete(monkeypatch):
    """Issue #32: an idle server took 34-39 s to exit on SIGTERM, most of it in serve.delete (Serve holds a
    direct-ingress replica open for 30 s for load balancers, and each replica sleeps out a shutdown loop)."""
    fake = FakeRayAndServe(monkeypatch, in_flight=[0])
    shutdown.stop_serving("app", private=True, serve_started=True, grace_s=20)
    assert fake.calls == ["in_flight(app)", "ray.shutdown"]


def test_requests_in_flight_are_let_finish_before_the_private_ray_stops(monkeypatch):
    fake = FakeRayAndServe(monkeypatch, in_flight=[2, 2, 1, 0])
    shutdown.stop_serving("app", private=True, serve_started=True, grace_s=20)
    # drained first, DRAIN_LEAD_S before Serve's kill: what is left ends with its last chunk, not a cut
    assert fake.calls == ["in_flight(app)", "drain(app, 19)", "serve.delete(app, blocking=False)", "in_flight(app)",
                          "sleep", "in_flight(app)", "sleep", "in_flight(app)", "ray.shutdown"]
    fake = FakeRayAndServe(monkeypatch, in_flight=[1, None])   # None: every replica is gone
    shutdown.stop_serving("app", private=True, serve_started=True, grace_s=0.5)
    assert fake.calls == ["in_flight(app)", "drain(app, 0)", "serve.delete(app, blocking=False)", "in_flight(app)",
                          "ray.shutdown"]


def test_the_wait_for_requests_in_flight_ends_at_graceful_shutdown_s(monkeypatch):
    fake = FakeRayAndServe(monkeypatch, in_flight=[1])   # a stream that never ends
    clock = iter(range(0, 1000, 5))                         # each look at the clock: 5 s later
    monkeypatch.setattr(shutdown.time, "monotonic", lambda: next(clock))
    shutdown.stop_serving("app", private=True, serve_started=True, grace_s=20)
    # deadline 0 + 20 + DRAIN_MARGIN_S: the clock reads 5, 10, 15, 20 below it, then 25
    assert fake.calls.count("sleep") == 4 and fake.calls[-1] == "ray.shutdown"


def test_requests_that_cannot_be_counted_get_serves_own_drain(monkeypatch):
    fake = FakeRayAndServe(monkeypatch, in_flight=[None])
    shutdown.stop_serving("app", private=True, serve_started=True, grace_s=20)
    assert fake.calls == ["in_flight(app)", "serve.delete(app, blocking=True)", "ray.shutdown"]


@pytest.mark.timeout(120)
def test_a_ray_whose_gcs_is_gone_gives_an_unknown_count_not_a_hang(monkeypatch):
    """A GCS that died (the OOM killer, ``ray stop`` from another shell) left ``pagedray serve`` stuck in
    "stopping ..." for ever: ``list_named_actors`` has no timeout. The count is now "unknown"."""
    gone = threading.Event()
    ray = types.ModuleType("ray")
    util = types.ModuleType("ray.util")
    util.list_named_actors = lambda all_namespaces: gone.wait()   # never answers
    ray.util = util
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.util", util)
    try:
        assert shutdown.requests_in_flight("app", timeout_s=0.05) is None
    finally:
        gone.set()


@pytest.mark.timeout(120)
def test_a_delete_that_never_returns_is_given_up_after_graceful_shutdown_s(monkeypatch, capsys):
    fake = FakeRayAndServe(monkeypatch, in_flight=[None])
    gone = threading.Event()
    recorded_delete = sys.modules["ray.serve"].delete
    monkeypatch.setattr(sys.modules["ray.serve"], "delete", lambda name: (recorded_delete(name), gone.wait()))
    monkeypatch.setattr(shutdown, "DRAIN_MARGIN_S", 0.05)
    try:
        shutdown.stop_serving("app", private=True, serve_started=True, grace_s=0)
    finally:
        gone.set()
    assert fake.calls == ["in_flight(app)", "serve.delete(app, blocking=True)", "ray.shutdown"]
    assert "did not finish deleting 'app' within 0.05 s: stopping Ray" in capsys.readouterr().out


def test_within_gives_the_result_or_the_calls_own_error():
    assert shutdown.within(lambda: 7, 60) == 7
    with pytest.raises(ZeroDivisionError):
        shutdown.within(lambda: 1 / 0, 60)


def test_a_second_signal_cuts_the_wait_but_still_stops_the_private_ray(monkeypatch, capsys):
    fake = FakeRayAndServe(monkeypatch, in_flight=[None], interrupt_delete=True)
    shutdown.stop_serving("app", private=True, serve_started=True, grace_s=20)
    assert fake.calls == ["in_flight(app)", "serve.delete(app, blocking=True)", "ray.shutdown"]
    assert "second signal" in capsys.readouterr().out


def test_a_joined_cluster_only_loses_the_app_and_a_start_up_stopped_early_only_the_ray(monkeypatch):
    fake = FakeRayAndServe(monkeypatch, in_flight=[0])
    shutdown.stop_serving("app", private=False, serve_started=True, grace_s=20)
    assert fake.calls == ["serve.delete(app, blocking=True)"]   # another cluster's Ray is never stopped
    fake.calls.clear()
    shutdown.stop_serving("app", private=True, serve_started=False, grace_s=20)
    assert fake.calls == ["ray.shutdown"]


def test_a_private_ray_holds_no_direct_ingress_replica_open_for_load_balancers():
    """Serve keeps a stopping direct-ingress replica open 30 s by default, for an external load balancer to
    deregister it; a private single-host Ray has none (serve.delete with a request in flight then takes
    as long as the request, up to graceful_shutdown_s)."""
    assert cli.LOCAL_RAY_ENV["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "0"


def test_serve_run_as_the_program_exits_without_the_interpreters_teardown(monkeypatch):
    """Only the command itself (argv from sys.argv, a private Ray) ends with exit_now; a caller of main()
    with its own argv, and a joined cluster, get the status returned."""
    exits = []
    monkeypatch.setattr(cli, "run_serve", lambda ns: 3)
    monkeypatch.setattr(cli, "exit_now", exits.append)
    monkeypatch.setattr(sys, "argv", ["pagedray", "serve"])
    cli.main()
    assert exits == [3]
    assert cli.main(["serve"]) == 3 and exits == [3]
    monkeypatch.setattr(sys, "argv", ["pagedray", "serve", "--address", "auto"])
    assert cli.main() == 3 and exits == [3]


def test_tenants_give_the_engine_its_policy_and_the_ingress_the_keys():
    from pagedray.deploy.serve.app import build_app
    from pagedray.workers.contract.config import TenantConfig

    table = {"acme": {"api_keys": ["sk-a"], "weight": 3}, "beta": {"api_keys": ["sk-b"], "max_kv_fraction": 0.25}}
    ingress = build_app({"tenants": table})._bound_deployment
    config = ingress.init_args[0]
    assert config.scheduler.tenants == (TenantConfig("acme", weight=3), TenantConfig("beta", max_kv_fraction=0.25))
    assert sorted(ingress.init_kwargs["tenant_keys"].values()) == ["acme", "beta"]
    assert "sk-a" not in repr(config)
    split = build_app({"tenants": table, "num_replicas": 2})._bound_deployment
    assert split.init_args[0]._bound_deployment.init_args[0].scheduler.tenants == config.scheduler.tenants
    with pytest.raises(ValueError, match="tenants.beta.weight"):
        build_app({"tenants": {"beta": {"api_keys": ["k"], "weight": -1}}})


def test_models_get_an_engine_deployment_each_behind_one_ingress():
    from pagedray.deploy.serve.app import build_app

    app = build_app({"models": [{"model": "/models/embedder", "task": "embed", "num_replicas": 2,
                                 "served_model_name": "emb"}]})
    ingress = app._bound_deployment
    first = ingress.init_args[0]._bound_deployment             # the first model leaves the ingress: a deployment
    (entry,) = ingress.init_kwargs["models"]
    second = entry["engine"]._bound_deployment
    assert (first.name, second.name) == ("PagedEngine", "PagedEngine-1")
    assert entry["model"] == "/models/embedder" and entry["served_model_name"] == "emb"
    assert second._deployment_config.num_replicas == 2
    assert second.init_args[0].model.task == "embed" and first.init_args[0].model.task == "generate"
    assert {d.name for d in startup._bound_deployments(app)} == {"OpenAIIngress", "PagedEngine", "PagedEngine-1"}


def test_the_cli_takes_several_models_as_repeated_model_flags():
    ns = cli.build_parser().parse_args(["serve", "--model", "/a", "--model", "/b", "--models",
                                        '[{"model": "/c", "task": "embed"}]'])
    assert cli.serve_args(ns) == {"model": "/a", "models": [{"model": "/c", "task": "embed"}, {"model": "/b"}]}
    assert cli.serve_args(cli.build_parser().parse_args(["serve", "--model", "/a"])) == {"model": "/a"}


def test_serve_says_on_the_terminal_what_a_hybrid_model_changes(tiny_model_path, capsys):
    from pagedray.deploy.cli.main import _note_hybrid

    _note_hybrid(tiny_model_path("qwen3.5"))
    assert "Qwen3_5ForCausalLM keeps a recurrent state per sequence in 3 of its 4 layers: a prefix-cache hit needs " \
        "a snapshot of that state (--hybrid-prefix-states" in capsys.readouterr().out
    _note_hybrid(tiny_model_path("qwen3"))
    _note_hybrid("/no/such/folder")               # the replica reports a bad folder, not this note
    assert capsys.readouterr().out == ""


def test_every_subcommand_prints_its_help_with_the_options_text(capsys):
    """argparse %-formats help strings: an option's help with a bare % (cpu_gemm's "more than 5% faster")
    once made ``pagedray serve --help`` crash with a TypeError."""
    parser = cli.build_parser()
    [subcommands] = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    assert "serve" in subcommands.choices
    for name, sub in subcommands.choices.items():
        text = sub.format_help()
        assert text.startswith("usage:"), name
    assert "more than 5% faster" in " ".join(subcommands.choices["serve"].format_help().split())

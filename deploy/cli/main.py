"""The ``pagedray`` command line.

    pagedray serve [--model default] [--tensor-parallel-size 1] [--host 127.0.0.1] [--port 8000] ...
        fetches the default model if needed, starts a private local Ray instance (or joins the
        cluster given by ``--address``, e.g. ``auto`` after ``ray start --head``), deploys the Serve
        application (build_app), prints the URL and blocks until Ctrl-C or SIGTERM, then removes the
        app and stops a private Ray. An option value that cannot work is argparse's one-line error and
        exit status 2 before anything starts; a replica that fails to start ends the command at once
        with the replica's exception, a hint and exit status 1 (deploy/cli/startup.py).
    pagedray generate "prompt" [--max-tokens 64] [--temperature 0] [--chat] ...
        one offline generation through the ``LLM`` API (no Ray Serve), printed to stdout.
    pagedray fetch-model [--cache-dir DIR]
        fetches and converts the default model once; prints its folder.
    pagedray deploy [CONFIG] [--address auto] [--timeout-s 900]
        ``ray start --head`` (unless ``--address``), ``serve deploy CONFIG`` (default: the packaged
        serve.yaml) with Ray's token auth handled, then waits until the app answers /health
        (deploy/cli/cluster_deploy.py); the cluster keeps running.
    pagedray loadtest ...
        the cluster load tester (pagedray.deploy.loadtest), arguments passed through.

The flags come from the one list of options (options.py): ``serve`` has all of them (build_app's
``args``), ``generate`` the engine's; options left unset keep the defaults there.

Decisions: docs/design/deploy.md, ``pagedray.deploy.cli.main``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

from ..serve.loopback import LOOPBACK_NODE_IP, LOOPBACK_RAY_ENV
from ..serve.options import OPTIONS, cli_type, engine_config, engine_options, llm_kwargs
from .cluster_deploy import answers_health, run_deploy
from .ray_env import LOCAL_RAY_ENV
from .shutdown import stop_on_signals, stop_serving
from .startup import (
    OptionError,
    app_resources,
    check_gpus,
    check_kv_cache_memory,
    check_model_folder,
    checked_options,
    deploy_and_watch,
    local_ray_num_cpus,
)

APP_NAME = "pagedray"
PACKAGED_CONFIG = Path(__file__).resolve().parents[1] / "serve" / "serve.yaml"


def _json_of(kind: type, name: str):
    """An argparse type: JSON text whose value is a ``kind`` (``name``: what the error calls it)."""
    def parse(text: str):
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
        if not isinstance(value, kind):
            raise argparse.ArgumentTypeError(f"must be a JSON {name}")
        return value
    return parse


json_object = _json_of(dict, "object")   # dict options
json_list = _json_of(list, "array")      # list options


def port_number(text: str) -> int:
    """argparse type of ``--port``: a TCP port, 1-65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer port 1-65535, got {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 1-65535, got {port}")
    return port


def _add_options(parser: argparse.ArgumentParser, options, repeatable: tuple[str, ...] = ()) -> None:
    """One flag per option (options.py), default None: an option left unset keeps build_app's default. A
    ``repeatable`` option's flag may be given several times (a list of its values)."""
    for option in options:
        kind = cli_type(option)
        text = option.help.replace("%", "%%")       # argparse %-formats help strings ("5% faster" is "% f")
        if option.name in repeatable:
            parser.add_argument(option.flag, type=kind, action="append", default=None,
                                help=text + " (repeat the flag for several)")
        elif kind is list:
            parser.add_argument(option.flag, type=json_list, default=None, help=text + " (JSON)")
        elif kind is dict:
            parser.add_argument(option.flag, type=json_object, default=None, help=text + " (JSON)")
        elif kind is bool:
            parser.add_argument(option.flag, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            parser.add_argument(option.flag, type=kind, default=None, help=text)


def generate_options() -> list:
    """``generate``'s engine flags: all but the engine's seed (its own --seed is the request's)."""
    return [o for o in engine_options() if o.name != "seed"]


def _given(ns: argparse.Namespace, options) -> dict:
    return {o.name: getattr(ns, o.name) for o in options if getattr(ns, o.name) is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedray", description="paged-KV LLM serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)

    serve_p = sub.add_parser("serve", help="deploy the OpenAI-compatible server on Ray Serve")
    _add_options(serve_p, OPTIONS, repeatable=("model",))
    serve_p.add_argument("--host", default="127.0.0.1", help="HTTP host (default 127.0.0.1)")
    serve_p.add_argument("--port", type=port_number, default=8000, help="HTTP port, 1-65535 (default 8000)")
    serve_p.add_argument("--address", default=None,
                         help="join this Ray cluster ('auto': the one `ray start --head` started here); "
                              "default: start a private local Ray for this command")
    serve_p.add_argument("--name", default=APP_NAME, help="Serve application name")
    serve_p.set_defaults(usage_error=serve_p.error)

    gen_p = sub.add_parser("generate", help="generate once with the offline LLM API")
    gen_p.add_argument("prompt", help="the prompt text")
    _add_options(gen_p, generate_options())
    gen_p.add_argument("--max-tokens", type=int, default=64)
    gen_p.add_argument("--temperature", type=float, default=0.0)
    gen_p.add_argument("--seed", type=int, default=None)
    gen_p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen_p.set_defaults(usage_error=gen_p.error)

    deploy_p = sub.add_parser("deploy", help="ray start --head + serve deploy a Serve config, then wait for it")
    deploy_p.add_argument("config", nargs="?", default=str(PACKAGED_CONFIG),
                          help="a Serve config file (default: the packaged serve.yaml: the default model on "
                               "127.0.0.1:8000)")
    deploy_p.add_argument("--address", default=None,
                          help="deploy onto this running cluster ('auto' or its dashboard URL) instead of "
                               "starting one with `ray start --head`")
    deploy_p.add_argument("--timeout-s", type=float, default=900.0,
                          help="how long to wait for /health (default 900: the first start fetches the model)")

    fetch_p = sub.add_parser("fetch-model", help="fetch and convert the default model")
    fetch_p.add_argument("--cache-dir", default=None, help="where to keep it (default: user cache dir)")

    sub.add_parser("loadtest", help="load-test a running server (see pagedray loadtest --help)",
                   add_help=False)
    return parser


def serve_args(ns: argparse.Namespace) -> dict:
    """build_app args from parsed ``serve`` options (only those given). ``--model`` given several times: the first
    is the app's model, each other one an entry of ``models`` (after those of ``--models``)."""
    args = _given(ns, OPTIONS)
    models = args.pop("model", None) or []
    if models:
        args["model"] = models[0]
    if len(models) > 1:
        args["models"] = list(args.get("models") or []) + [{"model": m} for m in models[1:]]
    return args


def check_serve_options(ns: argparse.Namespace):
    """Every ``serve`` option before anything starts (OptionError). With a private Ray, everything runs on
    this machine: the model folder must exist here and the KV caches must fit in its memory; with
    ``--address`` the replicas may run on other nodes, which are theirs to check. The parsed build_app args."""
    from ..serve.app import parse_models  # imports Ray: after a private Ray's environment is set

    parsed, config, replicas = checked_options(serve_args(ns))
    if not ns.address:
        check_model_folder(parsed.model)
        check_kv_cache_memory(config, replicas)
        for model in parse_models(parsed):      # each model's own folder and KV caches (checked one at a time)
            check_model_folder(model.model)
            scaling = model.autoscaling_config
            check_kv_cache_memory(engine_config(model), model.num_replicas if scaling is None
                                  else scaling.get("max_replicas", model.num_replicas))
    return parsed


def uses_direct_ingress(environ) -> bool:
    """Whether Serve's direct ingress is on in ``environ`` (Serve's rule: on in throughput mode unless
    ``RAY_SERVE_ENABLE_DIRECT_INGRESS`` says otherwise)."""
    default = "1" if environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED", "0").lower() in ("1", "true") else "0"
    return environ.get("RAY_SERVE_ENABLE_DIRECT_INGRESS", default).lower() in ("1", "true")


def direct_ingress_env(port: int) -> dict[str, str]:
    """Serve's port range for ingress replicas' own HTTP servers, narrowed to ``port`` alone (the
    range's upper end is exclusive)."""
    return {"RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(port),
            "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(port + 1)}


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (the OS picks it; another process may take it before it is bound)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _start_or_join_ray(address: str | None, num_cpus: int, port: int = 8000, api_key: str | None = None) -> bool:
    """Join the cluster at ``address``, or start a private local one with ``num_cpus`` logical CPUs
    (``local_ray_num_cpus``) whose ingress replica serves ``port`` itself when direct ingress is on, and
    whose HTTP servers ask for ``api_key`` on Serve's ``/-/routes`` (``http/guard.py``'s ``guard_env``). True when
    started here."""
    from ..http.guard import guard_env

    if address:
        import ray

        ray.init(address=address, log_to_driver=False)
        return False
    for name, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(name, value)
    if uses_direct_ingress(os.environ):
        os.environ.update(direct_ingress_env(port))
    os.environ.update(guard_env(api_key))
    import ray  # LOOPBACK_RAY_ENV is set by run_serve before Ray's first import, when it is read

    ray.init(address="local", num_cpus=num_cpus, log_to_driver=False,
             _node_ip_address=LOOPBACK_NODE_IP, dashboard_host=LOOPBACK_NODE_IP)
    return True


def _prepare_model(model: str | None) -> None:
    """Fetch and convert the default model here, with its errors on this terminal, before any replica
    needs it (replicas on this machine then find it in the cache)."""
    if (model or "default") == "default":
        from pagedray.workers.weights.default_model import (
            DEFAULT_MODEL_NAME,
            default_cache_dir,
            ensure_default_model,
            is_complete,
        )

        if not is_complete(default_cache_dir() / DEFAULT_MODEL_NAME):
            print("fetching and converting the default model (once; ~1-2 minutes) ...", flush=True)
        ensure_default_model()
        return
    _note_hybrid(model)


def _note_hybrid(model: str) -> None:
    """Say on this terminal what a hybrid model changes (cluster/hybrid.py; its replicas log it too)."""
    from pagedray.workers.models.model_info import model_info
    from pagedray.workers.weights.default_model import resolve_model_path

    try:
        info = model_info(resolve_model_path(model))
    except (ValueError, OSError):
        return          # the replica reports what is wrong with the folder, with its own exception
    if info.hybrid:
        print(f"note: {info.architecture} keeps a recurrent state per sequence in {info.num_linear_layers} of its "
              f"{info.num_hidden_layers} layers: a prefix-cache hit needs a snapshot of that state "
              "(--hybrid-prefix-states of them per replica); speculative decoding, the second KV tier and KV moves "
              "between replicas are off for it, and LoRA adapters reach its full-attention layers and MLPs only",
              flush=True)


def run_serve(ns: argparse.Namespace) -> int:
    if not ns.address:   # a private Ray (loopback.py): Ray reads this when it is first imported
        os.environ.update(LOOPBACK_RAY_ENV)
    from ray import serve

    from ..serve.app import build_app, parse_models

    parsed = check_serve_options(ns)   # OptionError (exit status 2) before anything starts
    app = build_app(serve_args(ns))
    needed = app_resources(app)
    if not ns.address:
        check_gpus(needed["GPU"])
    stop_on_signals()   # from here SIGTERM and Ctrl-C stop everything started, start-up included
    status, serve_started = 1, False  # status 1 until the app is up
    try:
        for model in {parsed.model, *(m.model for m in parse_models(parsed))}:
            _prepare_model(model)
        started_ray = _start_or_join_ray(ns.address, local_ray_num_cpus(needed["CPU"]), ns.port, ns.api_key)
        stop_on_signals()   # again: ray.init sets a SIGTERM handler of its own (sys.exit: no clean-up)
        direct = started_ray and uses_direct_ingress(os.environ)
        serve.start(http_options={"host": ns.host, "port": free_port(ns.host) if direct else ns.port})
        serve_started = True
        failure = deploy_and_watch(lambda: serve.run(app, name=ns.name, route_prefix="/"),
                                   lambda: serve.status().applications.get(ns.name))
        if failure is not None:
            print(failure.report(), file=sys.stderr, flush=True)
            return 1
        status = 0
        print(f"pagedray is serving at http://{ns.host}:{ns.port}/v1 (Serve app {ns.name!r}); Ctrl-C stops it",
              flush=True)
        while True:
            time.sleep(0.5)  # short naps: a signal caught by another thread is acted on promptly
    except KeyboardInterrupt:
        print("stopping ...", flush=True)
        status = interrupted_status(status == 0, ns.host, ns.port)
    finally:
        stop_serving(ns.name, private=not ns.address, serve_started=serve_started,
                      grace_s=parsed.graceful_shutdown_s)
    return status


def interrupted_status(deployed: bool, host: str, port: int, probe=answers_health) -> int:
    """Exit status of a Ctrl-C: 0 once the app serves, 130 when it stopped a start-up. The app can answer
    before ``serve.run`` returns (the engine in the ingress replica is ready before Serve's controller
    marks the app running), so a Ctrl-C in that window asks ``/health`` (``probe``) before saying 130."""
    return 0 if deployed or probe(host, port) else 130


def run_generate(ns: argparse.Namespace) -> int:
    given = _given(ns, generate_options())
    _, config, _ = checked_options(given)   # OptionError (exit status 2) before the model loads
    check_model_folder(ns.model)
    check_kv_cache_memory(config, replicas=1)
    from pagedray.cluster import LLM, SamplingParams

    llm = LLM(**llm_kwargs(given))
    prompt: str | list[int] = ns.prompt
    if ns.chat:
        tokenizer = llm.engine.tokenizer
        text = tokenizer.apply_chat_template([{"role": "user", "content": ns.prompt}],
                                             add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, seed=ns.seed)
    result = llm.generate([prompt], params, use_tqdm=False)[0]
    print(result.outputs[0].text)
    return 0


def run_fetch_model(ns: argparse.Namespace) -> int:
    from pagedray.workers.weights.default_model import ensure_default_model

    print(ensure_default_model(ns.cache_dir))
    return 0


def exit_now(status: int) -> None:
    """End the process with ``status`` at once, after flushing its output: no interpreter teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: list[str] | None = None) -> int:
    """The command line; ``argv`` None: this process is the command (the console script, ``python -m``).

    Decision: run as the program, ``serve`` with a private Ray ends with ``exit_now`` once that Ray is
    stopped: the interpreter's teardown of the native modules it loaded (Ray's core worker, gRPC, torch)
    took seconds more, which a supervisor that sends SIGTERM and then SIGKILL counts against the exit."""
    as_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "loadtest":
        from pagedray.deploy.loadtest import main as loadtest_main

        return loadtest_main(argv[1:])
    ns = build_parser().parse_args(argv)
    handlers = {"serve": run_serve, "generate": run_generate, "fetch-model": run_fetch_model,
                "deploy": lambda ns: run_deploy(ns.config, ns.address, ns.timeout_s)}
    try:
        status = handlers[ns.command](ns)
    except OptionError as exc:   # raised by the checks before anything starts
        ns.usage_error(str(exc))   # argparse's: usage, "pagedray serve: error: ...", exit status 2
        raise   # not reached: usage_error exits
    if as_program and ns.command == "serve" and not ns.address:
        exit_now(status)
    return status


if __name__ == "__main__":
    sys.exit(main())

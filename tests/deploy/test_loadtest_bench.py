"""benchmarks.serving's bookkeeping (no servers started): system commands (the peer at its defaults, the
tuned peer only on request), the values taken from a load summary, the ratios per round against the
peer's best variant, the offline and floor ratios, the table, the private Ray of pagedray servers."""

import pytest
from pagedray.deploy.loadtest.prompts import parse_length_range, synthetic_prompts

from benchmarks import rounds
from benchmarks.serving import (
    FLOOR,
    OFFLINE,
    PEER,
    PEER_TUNED,
    build_metrics,
    build_parser,
    build_ratios,
    load_values,
    port_is_free,
    system_specs,
    wait_port_free,
    warm_up_prompts,
)


def summary(tok_s, ttft_p99, e2e_mean=1000.0, duration=8.0):
    stats = {"mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0}
    return {"completed": 32, "failed": 0, "output_tok_per_s": tok_s, "req_per_s": tok_s / 64,
            "duration_s": duration, "ttft_ms": {**stats, "p99": ttft_p99}, "tpot_ms": stats, "itl_ms": stats,
            "e2e_ms": {**stats, "mean": e2e_mean}}


def test_the_peer_runs_at_its_defaults_and_the_tuned_peer_only_on_request():
    args = build_parser().parse_args([])
    assert args.peer_tuned is False and args.rounds == 3 and args.out == "benchmarks/results/serving.json"
    peer, tuned, tp2 = system_specs([PEER, PEER_TUNED, "pagedray-tp2"], "/models/m", 18000, args)
    assert peer.command[:4] == ["transformers", "serve", "/models/m", "--continuous-batching"]
    assert not [flag for flag in peer.command if flag.startswith("--cb-")]
    assert tuned.command[:len(peer.command)] == peer.command
    assert tuned.command[len(peer.command):] == ["--cb-num-blocks", "32", "--cb-max-batch-tokens", "1024"]
    assert peer.model_name == "/models/m" and tuned.model_name == "/models/m"
    assert tp2.command[tp2.command.index("--tensor-parallel-size") + 1] == "2" and tp2.model_name is None
    assert "serve" in tp2.command and tp2.tensor_parallel_size == 2
    (in_ingress,) = system_specs(["pagedray-tp1-ei-si4"], "/models/m", 18000, args)
    assert "--engine-in-ingress" in in_ingress.command and "--executor" not in in_ingress.command
    assert in_ingress.command[in_ingress.command.index("--stream-interval") + 1] == "4"
    assert "--dtype" not in in_ingress.command                      # pagedray's default: dtype auto
    (kv8,) = system_specs(["pagedray-tp1-kv8"], "/models/m", 18000, args)
    assert kv8.command[-2:] == ["--kv-cache-dtype", "int8"]
    (kvfp8,) = system_specs(["pagedray-tp1-kvfp8"], "/models/m", 18000, args)
    assert kvfp8.command[-2:] == ["--kv-cache-dtype", "fp8_e4m3"]
    (gemm,) = system_specs(["pagedray-tp1-gemmc-bf16"], "/models/m", 18000, args)
    assert gemm.command[-2:] == ["--cpu-gemm", "c"] and gemm.command[gemm.command.index("--dtype") + 1] == "bfloat16"
    bf16, fp32 = system_specs(["pagedray-tp1-bf16", "pagedray-tp1-fp32"], "/models/m", 18000, args)
    assert bf16.command[bf16.command.index("--dtype") + 1] == "bfloat16"
    assert fp32.command[fp32.command.index("--dtype") + 1] == "float32"
    with pytest.raises(ValueError, match="systems"):
        system_specs(["vllm-bf16"], "/m", 1, args)


def test_vllm_runs_at_its_defaults_with_both_cores_and_in_float32_with_both_cores(monkeypatch):
    monkeypatch.setenv("PAGEDRAY_VLLM_VENV", "/venvs/vllm")
    args = build_parser().parse_args([])
    default, bind, fp32 = system_specs(["vllm", "vllm-bind", "vllm-fp32"], "/models/m", 18000, args)
    assert default.command == ["/venvs/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server", "--model",
                               "/models/m", "--host", "127.0.0.1", "--port", "18000",
                               "--gpu-memory-utilization", "0.5"]
    assert fp32.command == default.command + ["--dtype", "float32"]
    assert default.env["VLLM_HOST_IP"] == "127.0.0.1" and "VLLM_CPU_OMP_THREADS_BIND" not in default.env
    assert fp32.env["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-") and default.model_name is None
    assert bind.command == default.command and bind.env["VLLM_CPU_OMP_THREADS_BIND"].startswith("0-")


def test_pagedray_gets_a_ratio_against_each_vllm_variant_and_their_best():
    ratios = build_ratios(["pagedray-tp1", "vllm", "vllm-fp32"], build_metrics([]))
    assert [(q.name, q.peers) for q in ratios] == [
        ("pagedray-tp1 / vllm", ("vllm",)), ("pagedray-tp1 / vllm-fp32", ("vllm-fp32",)),
        ("pagedray-tp1 / vllm best", ("vllm", "vllm-fp32"))]


def test_the_measured_choice_gets_a_ratio_against_the_same_server_with_one_product_forced():
    ratios = build_ratios(["pagedray-tp1", "pagedray-tp1-gemmc", "pagedray-tp1-fp32", "pagedray-tp1-gemmc-fp32"],
                          build_metrics([]))
    assert [(q.name, q.peers) for q in ratios] == [
        ("pagedray-tp1 / pagedray-tp1-gemmc", ("pagedray-tp1-gemmc",)),
        ("pagedray-tp1-fp32 / pagedray-tp1-gemmc-fp32", ("pagedray-tp1-gemmc-fp32",))]


def test_a_system_at_a_git_commit_runs_that_commits_code_and_gets_a_before_after_ratio(tmp_path):
    args = build_parser().parse_args([])
    root = tmp_path / "root"
    after, before = system_specs(["pagedray-tp1-bf16", "pagedray-tp1-bf16@abc123"], "/models/m", 18000, args,
                                 {"abc123": root})
    assert after.env is None and before.env == {"PYTHONPATH": str(root)}
    assert before.command == after.command and before.tensor_parallel_size == 1
    with pytest.raises(KeyError):   # a REF without a checkout is a bug in the caller, not a silent 'after'
        system_specs(["pagedray-tp1@def456"], "/models/m", 18000, args, {"abc123": root})
    ratios = build_ratios(["pagedray-tp1-bf16", "pagedray-tp1-bf16@abc123", "vllm"], build_metrics([]))
    assert [(q.name, q.peers) for q in ratios] == [
        ("pagedray-tp1-bf16 / vllm", ("vllm",)),
        ("pagedray-tp1-bf16 / pagedray-tp1-bf16@abc123", ("pagedray-tp1-bf16@abc123",))]


def test_load_values_flatten_the_closed_loop_and_the_sweep():
    closed = summary(35.0, 500.0, e2e_mean=2000.0, duration=16.0)
    values = load_values(closed, [summary(5.0, 700.0), summary(6.0, 900.0)], [0.1, 0.2])
    assert values["output_tok_per_s"] == 35.0 and values["ttft_ms_p99"] == 500.0 and values["completed"] == 32
    assert values["mean_in_flight"] == pytest.approx(32 * 2.0 / 16.0)   # Little's law
    assert values["sweep_0.1_ttft_ms_p99"] == 700.0 and values["sweep_0.2_ttft_ms_p99"] == 900.0
    keys = {m.key for m in build_metrics([0.1, 0.2])}
    assert set(values) <= keys and "sweep_0.2_e2e_ms_p99" in keys


def _runs(values_by_system: dict[str, list[dict]]) -> list[rounds.Run]:
    quiet = (0.1, 0.1, 0.1)
    return [rounds.Run(name, i, values, quiet, quiet)
            for name, per_round in values_by_system.items() for i, values in enumerate(per_round)]


def test_pagedray_is_divided_by_the_best_peer_variant_of_each_round():
    metrics = build_metrics([])
    names = ["pagedray-tp1", PEER, PEER_TUNED, OFFLINE, FLOOR]
    ratios = build_ratios(names, metrics)
    runs = _runs({
        "pagedray-tp1": [load_values(summary(60.0, 1500.0), [], []) for _ in range(3)],
        PEER: [load_values(summary(t, ttft), [], []) for t, ttft in ((10.0, 7500.0), (12.0, 5000.0), (8.0, 6000.0))],
        PEER_TUNED: [load_values(summary(t, ttft), [], []) for t, ttft in ((20.0, 3000.0), (6.0, 6000.0),
                                                                            (8.0, 7500.0))],
        OFFLINE: [{"output_tok_per_s": 75.0}] * 3,
        FLOOR: [{"output_tok_per_s": 150.0}] * 3})
    result = rounds.summarize(runs, metrics, ratios, cpus=2)["ratios"]
    vs_peer = result["pagedray-tp1 / peer best"]
    # tok/s: best peer per round 20, 12, 8 -> 3, 5, 7.5; TTFT p99: best (lowest) 3000, 5000, 6000
    assert (vs_peer["output_tok_per_s"]["median"], vs_peer["output_tok_per_s"]["min"],
            vs_peer["output_tok_per_s"]["max"]) == (5.0, 3.0, 7.5)
    assert vs_peer["ttft_ms_p99"]["median"] == pytest.approx(0.3)
    assert vs_peer["ttft_ms_p99"]["max"] == pytest.approx(0.5)
    assert "completed" not in vs_peer and "failed" not in vs_peer   # counts are not divided
    assert set(result["serving pagedray-tp1 / offline"]) == {"output_tok_per_s"}
    assert result["serving pagedray-tp1 / offline"]["output_tok_per_s"]["median"] == pytest.approx(0.8)
    assert result["pagedray-tp1 / floor"]["output_tok_per_s"]["median"] == pytest.approx(0.4)
    assert result[f"{OFFLINE} / floor"]["output_tok_per_s"]["median"] == pytest.approx(0.5)
    assert {q.name for q in ratios} == {"pagedray-tp1 / peer best", "serving pagedray-tp1 / offline",
                                        "pagedray-tp1 / floor", "peer / floor", "peer-tuned / floor",
                                        "offline / floor"}
    table = rounds.format_table(runs, metrics, ratios, cpus=2)
    tok_row = next(line for line in table.splitlines()
                   if line.startswith("pagedray-tp1 / peer best") and "output tok/s" in line)
    assert tok_row.split()[-2:] == ["5.00x", "[3.00-7.50]"]


def test_without_the_tuned_peer_the_ratio_is_against_the_peer_alone():
    ratios = build_ratios(["pagedray-tp1", PEER], build_metrics([]))
    assert [(q.name, q.peers) for q in ratios] == [("pagedray-tp1 / peer", (PEER,))]


def _llama_folder(path, heads, kv_heads):
    from transformers import LlamaConfig

    LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=8 * heads,
                intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=heads, num_key_value_heads=kv_heads).save_pretrained(path)
    return str(path)


def test_skip_reason_uses_the_workers_head_split_check(tmp_path):
    from benchmarks.serving import skip_reason

    args = build_parser().parse_args([])
    smollm_like = _llama_folder(tmp_path / "m9x3", heads=9, kv_heads=3)
    peer, tp1, tp2 = system_specs(["peer", "pagedray-tp1", "pagedray-tp2"], smollm_like, 1, args)
    assert skip_reason(peer, smollm_like) is None and skip_reason(tp1, smollm_like) is None
    reason = skip_reason(tp2, smollm_like)
    assert reason is not None and "tensor_parallel_size=2" in reason and "num_attention_heads=9" in reason
    splittable = _llama_folder(tmp_path / "m8x4", heads=8, kv_heads=4)
    assert skip_reason(tp2, splittable) is None


def test_pagedray_servers_get_a_private_local_ray_and_the_peer_does_not(tmp_path, monkeypatch):
    import os
    import sys

    from benchmarks.serving import RunningServer, SystemSpec

    monkeypatch.setenv("RAY_ADDRESS", "auto")
    monkeypatch.delenv("RAY_OVERRIDE_RESOURCES", raising=False)
    show_env = [sys.executable, "-c",
                "import os; print(os.environ['RAY_ADDRESS'], os.path.isdir(os.environ.get('RAY_TMPDIR', '-')), "
                "os.environ.get('RAY_OVERRIDE_RESOURCES', '-').replace(' ', ''))"]
    outputs = {}
    for name, tp in (("pagedray-tp1", 1), ("peer", None)):
        with RunningServer(SystemSpec(name, show_env, None, tp), 1, tmp_path / f"{name}.log", 3) as server:
            assert server.proc.wait(timeout=60) == 0
            ray_tmp = server._ray_tmp.name
        outputs[name] = (tmp_path / f"{name}.log").read_text().split()
        assert not os.path.exists(ray_tmp)  # the private folder is removed on exit
    assert outputs["pagedray-tp1"] == ["local", "True", '{"CPU":3}']
    assert outputs["peer"] == ["auto", "False", "-"]


def test_a_stopped_servers_port_is_waited_for_until_it_is_free():
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert not port_is_free(port)
        assert wait_port_free(port, timeout_s=0.0) is False      # still held: gives up at the deadline
    assert port_is_free(port) and wait_port_free(port, timeout_s=0.0) is True


def test_the_warm_up_sends_none_of_the_loads_prompts():
    """A warm-up with the load's own prompts would leave them in pagedray's prefix cache (and hardly in vLLM's)."""
    args = build_parser().parse_args(["--input-len", "8:120", "--num-requests", "32"])
    load = synthetic_prompts(args.num_requests, parse_length_range(args.input_len, "input_len"),
                             parse_length_range(args.output_len, "output_len"), args.seed)
    warm_up = warm_up_prompts(args)
    assert len(warm_up) == 2
    assert not {p.prompt for p in warm_up} & {p.prompt for p in load}
    assert warm_up_prompts(args) == warm_up        # seeded: every server gets the same warm-up

"""bench_serving's bookkeeping (no servers started): system commands, ratios against the peer, the table."""

import pytest
from pagedray.deploy.bench_serving import build_parser, comparison_table, ratios, system_specs


def summary(tok_s, ttft_p99):
    stats = {"mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0}
    return {"completed": 32, "failed": 0, "output_tok_per_s": tok_s, "req_per_s": tok_s / 64,
            "ttft_ms": {**stats, "p99": ttft_p99}, "tpot_ms": stats, "itl_ms": stats, "e2e_ms": stats}


def test_ratios_and_table_divide_by_the_peer():
    results = {"peer": {"load": summary(10.0, 2000.0)}, "pagedray-tp1": {"load": summary(35.0, 500.0)},
               "pagedray-tp2": {"error": "RuntimeError: did not start"}}
    out = ratios(results)
    assert out == {"pagedray-tp1": {"output_tok_per_s_x": pytest.approx(3.5), "ttft_p99_x": pytest.approx(0.25)}}
    table = comparison_table(results, out)
    lines = table.splitlines()
    assert lines[0].split() == ["metric", "peer", "pagedray-tp1", "pagedray-tp1", "/", "peer"]
    tok_row = next(line for line in lines if line.startswith("output tok/s"))
    assert tok_row.split()[-3:] == ["10.0", "35.0", "3.50x"]
    assert next(line for line in lines if line.startswith("TTFT p99")).split()[-1] == "0.25x"
    assert "pagedray-tp2" not in table


def test_system_specs_build_the_commands():
    args = build_parser().parse_args([])
    peer, tp2 = system_specs(["peer", "pagedray-tp2"], "/models/m", 18000, args)
    assert peer.command[:4] == ["transformers", "serve", "/models/m", "--continuous-batching"]
    assert peer.model_name == "/models/m" and "--cb-num-blocks" in peer.command
    assert tp2.command[tp2.command.index("--tensor-parallel-size") + 1] == "2" and tp2.model_name is None
    with pytest.raises(ValueError, match="systems"):
        system_specs(["vllm"], "/m", 1, args)


def _llama_folder(path, heads, kv_heads):
    from transformers import LlamaConfig

    LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=8 * heads,
                intermediate_size=16, num_hidden_layers=1,
                num_attention_heads=heads, num_key_value_heads=kv_heads).save_pretrained(path)
    return str(path)


def test_skip_reason_uses_the_workers_head_split_check(tmp_path):
    from pagedray.deploy.bench_serving import skip_reason

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

    from pagedray.deploy.bench_serving import RunningServer, SystemSpec

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

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

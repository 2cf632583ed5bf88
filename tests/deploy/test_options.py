"""One list of served options (deploy/serve/options.py): every engine setting is an option or a documented
exception, and build_app's args, the CLI flags and docs/configuration.md's table all follow the list."""

import dataclasses
import pathlib
import re

import pytest
from pagedray.cluster.llm import build_engine_config
from pagedray.deploy.cli import main as cli
from pagedray.deploy.serve.app import parse_args
from pagedray.deploy.serve.options import (
    DOC_BEGIN,
    DOC_END,
    NOT_OPTIONS,
    OPTIONS,
    AppArgs,
    engine_config,
    engine_options,
    llm_kwargs,
    option_default,
    options_markdown,
    write_options_doc,
)
from pagedray.workers.contract.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig

CONFIGURATION_DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "parallel": ParallelConfig, "scheduler": SchedulerConfig}
# a value other than the default for each engine option, valid together
NON_DEFAULTS = {"model": "/models/x", "tokenizer": "/tok", "dtype": "float16", "device": "cpu", "max_model_len": 256,
                "quantization": "int8",
                "block_size": 32, "kv_cache_gib": 0.5, "gpu_memory_utilization": 0.5, "num_blocks": 64,
                "enable_prefix_caching": False, "kv_cache_dtype": "int8", "watermark": 0.02, "tensor_parallel_size": 2,
                "executor": "auto",
                "ray_transport": "compiled", "threads_per_worker": 1, "max_rank_restarts": 0, "max_num_seqs": 8,
                "max_num_batched_tokens": 512, "policy": "priority", "max_queued_requests": 7,
                "step_timeout_s": 30.0, "step_timeout_per_token_s": 0.5, "seed": 5, "stream_interval": 4,
                "idle_batch_wait_ms": 7.5,
                "enforce_eager": True, "cpu_packed_weights": False, "cpu_keep_freed_memory": False,
                "cpu_gemm": "onednn",
                "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 5,
                "speculative_model": "/models/draft", "max_prefill_tokens": 96, "warm_prefix_tokens": 0,
                "hybrid_prefix_states": 3,
                "kv_pin_ttl_s": 60.0,
                "kv_pin_max_fraction": 0.25, "kv_peer_pull": False, "task": "embed", "pooling_type": "mean",
                "embed_normalize": False}
# options whose non-default value conflicts with one above (async_scheduling needs tensor_parallel_size 1, LoRA
# and the second KV tier no speculative_model)
NON_DEFAULTS_ALONE = {"async_scheduling": True, "enable_lora": True, "max_loras": 2, "max_lora_rank": 8,
                      "max_cpu_loras": 3, "lora_modules": "sql=/adapters/sql", "kv_offload_gib": 0.5,
                      "kv_offload_path": "/tmp/tier"}


def engine_settings() -> set[str]:
    paths = {f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    return paths | {f.name for f in dataclasses.fields(EngineConfig) if f.name not in SECTIONS}


def test_every_config_field_has_help_and_is_an_option_or_a_documented_exception():
    for path in engine_settings():
        section, _, name = path.rpartition(".")
        owner = SECTIONS[section] if section else EngineConfig
        assert next(f for f in dataclasses.fields(owner) if f.name == name).metadata.get("help"), path
    served = {o.config for o in engine_options()}
    assert served | set(NOT_OPTIONS) == engine_settings()
    assert not served & set(NOT_OPTIONS)
    assert len({o.name for o in OPTIONS}) == len(OPTIONS)


def test_app_args_are_the_options_with_the_engines_defaults():
    assert list(AppArgs.model_fields) == [o.name for o in OPTIONS]
    defaults = parse_args({})
    config = EngineConfig()
    for option in engine_options():
        section, _, name = option.config.rpartition(".")
        engine_default = getattr(getattr(config, section) if section else config, name)
        if option.name == "executor":
            assert getattr(defaults, option.name) == "ray" != engine_default   # the one served difference
        else:
            assert getattr(defaults, option.name) == engine_default == option_default(option), option.name


def test_every_engine_option_reaches_its_config_field_from_yaml_args_and_from_llm():
    assert set(NON_DEFAULTS) | set(NON_DEFAULTS_ALONE) == {o.name for o in engine_options()}
    for values in (NON_DEFAULTS, NON_DEFAULTS_ALONE):
        from_args = engine_config(parse_args(values))
        from_llm = build_engine_config(**llm_kwargs(values))     # what LLM(...) builds from the same values
        for config in (from_args, from_llm):
            for option in engine_options():
                if option.name not in values:
                    continue
                section, _, name = option.config.rpartition(".")
                got = getattr(getattr(config, section) if section else config, name)
                assert got == values[option.name], option.name
    assert llm_kwargs({"max_queued_requests": 7, "policy": "priority", "api_key": "k"}) == {
        "max_queued_requests": 7, "policy": "priority"}


def test_cli_flags_follow_the_options():
    parser = cli.build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    generate = parser._subparsers._group_actions[0].choices["generate"]
    serve_flags = {s for a in serve._actions for s in a.option_strings}
    generate_flags = {s for a in generate._actions for s in a.option_strings}
    assert {o.flag for o in OPTIONS} <= serve_flags
    assert {o.flag for o in engine_options()} - {"--seed"} <= generate_flags
    assert "--api-key" not in generate_flags
    ns = parser.parse_args(["serve", "--policy", "priority", "--gpu-memory-utilization", "0.5",
                            "--no-enable-prefix-caching", "--max-rank-restarts", "0", "--ray-transport", "compiled"])
    assert cli.serve_args(ns) == {"policy": "priority", "gpu_memory_utilization": 0.5, "enable_prefix_caching": False,
                                  "max_rank_restarts": 0, "ray_transport": "compiled"}


def test_the_configuration_doc_holds_the_generated_options_table():
    """docs/configuration.md's table is generated from OPTIONS (names, defaults, help): a stale one fails
    here; ``python -m pagedray.deploy.serve.options docs/configuration.md`` rewrites it."""
    text = CONFIGURATION_DOC.read_text()
    assert f"{DOC_BEGIN}\n{options_markdown()}\n{DOC_END}" in text
    table = options_markdown()
    assert all(f"| `{option.name}` | " in table for option in OPTIONS)
    assert "| `block_size` | 16 | " in table and "| `max_queued_requests` | 1024 | serve, CLI, `LLM` | " in table


def test_the_options_doc_writer_replaces_only_the_table(tmp_path):
    doc = tmp_path / "configuration.md"
    doc.write_text(f"intro\n{DOC_BEGIN}\n| stale |\n{DOC_END}\nnotes\n")
    assert write_options_doc(doc) is True and write_options_doc(doc) is False
    assert doc.read_text() == f"intro\n{DOC_BEGIN}\n{options_markdown()}\n{DOC_END}\nnotes\n"
    (tmp_path / "plain.md").write_text("no table here\n")
    with pytest.raises(ValueError, match="path: .* has no generated options table"):
        write_options_doc(tmp_path / "plain.md")


README = CONFIGURATION_DOC.parents[1] / "README.md"


def _readme_value(text: str) -> object:
    text = text.strip().strip("`")
    if text in ("none", "the model's"):
        return None
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def test_the_readme_options_show_the_options_defaults():
    """The README's short table repeats defaults for a newcomer: each must be the option's own."""
    by_name = {o.name: o for o in OPTIONS}
    lines = README.read_text().split("\n")
    start = lines.index("| option | default | meaning |") + 2
    checked = 0
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        names_cell, defaults_cell = line.split("|")[1:3]
        names = re.findall(r"`(\w+)`", names_cell)
        defaults = re.split(r" / |, ", defaults_cell.strip())
        assert len(names) == len(defaults), line
        for name, default in zip(names, defaults):
            if name in by_name:
                assert _readme_value(default) == option_default(by_name[name]), (name, default)
                checked += 1
    assert checked >= 10

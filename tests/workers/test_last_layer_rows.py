"""The last decoder layer finishes only the sampling rows (LastLayerRows): which rows it keeps, that it
really keeps only those, and that the tokens and logits stay those of the full forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.hf_oracle import hf_greedy_each
from helpers.worker_setup import local_driver
from pagedray.workers.runner.input_batch import kept_seqs
from pagedray.workers.runner.model_runner import ModelRunner

PROMPTS = [[5, 17, 33, 8, 99, 120, 7], list(range(3, 40)), [200, 201, 4], list(range(60, 80))]
NEW_TOKENS = 24


def _kept(logits, cu):
    kept = kept_seqs(np.array(logits, dtype=np.int32), np.array(cu, dtype=np.int32))
    return None if kept is None else (kept.seqs.tolist(), kept.cu_seqlens_q.tolist(), kept.max_query_len)


def test_kept_sequences_are_those_that_sample():
    # seq 1 is a prompt chunk that does not end its prompt: it samples nothing
    assert _kept([3, 9], [0, 4, 7, 10]) == ([0, 2], [0, 1, 2], 1)
    # drafts being verified: the last 3 rows of seq 0 sample, then seq 1's one token
    assert _kept([2, 3, 4, 5], [0, 5, 6]) == ([0, 1], [0, 3, 4], 3)
    # nothing samples: the last layer only stores keys and values
    assert _kept([], [0, 4, 9]) == ([], [0], 0)


def test_nothing_is_left_out_when_every_row_samples_or_rows_are_not_a_suffix():
    assert _kept([0, 1, 2], [0, 1, 2, 3]) is None          # a decode step
    assert _kept([1], [0, 4]) is None                      # not the chunk's last row
    assert _kept([0, 3], [0, 4]) is None                   # a gap before the last row
    assert _kept([3, 3], [0, 4, 6]) is None                # a row counted twice


def _watch_steps(workers, monkeypatch) -> list[tuple[int, int, list[int], list[int]]]:
    """Per step of any of ``workers``: (tokens, sampling rows, rows its first layer's MLP took, rows its last
    layer's MLP took)."""
    seen: dict[str, list[int]] = {"first": [], "last": []}
    for worker in workers:
        for name, layer in (("first", worker.model.layers[0]), ("last", worker.model.layers[-1])):
            layer.mlp.register_forward_pre_hook(lambda _m, args, _n=name: seen[_n].append(args[0].shape[0]))
    steps = []
    forward = ModelRunner.forward

    def spy(self, inputs, *args):
        seen["first"].clear()
        seen["last"].clear()
        output = forward(self, inputs, *args)
        steps.append((inputs.input_ids.shape[0], inputs.logits_indices.shape[0], list(seen["first"]),
                      list(seen["last"])))
        return output

    monkeypatch.setattr(ModelRunner, "forward", spy)
    return steps


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe", "gpt-oss"])
def test_last_layer_runs_only_sampling_rows_and_tokens_stay_exact(kind, tiny_model_path, monkeypatch):
    path = tiny_model_path(kind)
    mixed, alone = (local_driver(path, token_budget=24, max_chunk=16) for _ in range(2))
    steps = _watch_steps([mixed[0], alone[0]], monkeypatch)
    assert mixed[1].generate(PROMPTS, NEW_TOKENS) == hf_greedy_each(path, PROMPTS, NEW_TOKENS)
    long_prompt = [list(range(3, 60))]          # alone, in chunks of 16: its first three steps sample nothing
    assert alone[1].generate(long_prompt, NEW_TOKENS) == hf_greedy_each(path, long_prompt, NEW_TOKENS)
    for tokens, sampling, first, last in steps:
        if sampling < tokens:      # (a decode step may run its layers in one C call, past the hooks)
            assert first == [tokens]
            assert last == ([sampling] if sampling else [])     # nothing samples: the last MLP does not run
    assert any(0 < sampling < tokens for tokens, sampling, _, _ in steps)     # a prompt's last chunk with others
    assert any(sampling == 0 for _, sampling, _, _ in steps)                  # a chunk that does not end its prompt


def test_logits_equal_the_full_forward(tiny_model_path, monkeypatch):
    """Same plans with the last layer over every row: the sampled logits agree to float32 rounding."""
    path = tiny_model_path("llama")
    logits = {}
    for prune in (True, False):
        worker, driver = local_driver(path, token_budget=24, max_chunk=16)
        monkeypatch.setattr(type(worker.model), "takes_last_layer_rows", prune)
        captured = []
        forward = ModelRunner.forward

        def spy(self, inputs, *args, _forward=forward, _captured=captured):
            output = _forward(self, inputs, *args)
            if output.logits is not None:
                _captured.append(output.logits.clone())
            return output

        monkeypatch.setattr(ModelRunner, "forward", spy)
        driver.generate(PROMPTS, NEW_TOKENS)
        logits[prune] = captured
        monkeypatch.undo()
    assert len(logits[True]) == len(logits[False]) > 0
    for pruned, full in zip(logits[True], logits[False]):
        torch.testing.assert_close(pruned, full, rtol=1e-5, atol=1e-5)

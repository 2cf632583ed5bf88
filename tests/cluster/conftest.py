"""Fixtures of the cluster tests: a tiny random Llama folder (fast breadth) and transformers' model of it
(the oracle: ``helpers.hf_oracle.hf_greedy``). EOS is ``helpers.tiny_models.TINY_LLAMA_EOS``."""

import pytest
from helpers.hf_oracle import load_hf_model
from helpers.tiny_models import save_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_llama_path):
    return load_hf_model(tiny_llama_path)

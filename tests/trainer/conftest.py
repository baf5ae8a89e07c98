"""Shared fixtures of the trainer tests: a tiny random model in the Hugging Face format."""

import pytest

from pat_workers.engine.tiny import make_tiny_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), family="llama", preset="test", seed=5)

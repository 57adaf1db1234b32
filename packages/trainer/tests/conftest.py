import pytest

from prime_rl.common.testing import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A 2-layer Qwen3 (hidden 128, head_dim 64) with a byte-level BPE tokenizer and a chat template."""
    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3", seed=0)

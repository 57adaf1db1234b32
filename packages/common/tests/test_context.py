"""Sequence lengths of an rl run checked at config time: seq_len, max_model_len, max_tokens, the model's context."""

import json

import pytest

from prime_rl.common.config import ConfigError, load_config
from prime_rl.common.config.context import ModelContext, fit_max_model_len, read_model_context
from prime_rl.common.config.orchestrator import OrchestratorConfig
from prime_rl.common.config.rl import RLConfig


def model_dir(tmp_path, name="m", tokenizer_max=None, **hf):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_attention_heads": 4, **hf}))
    if tokenizer_max is not None:
        (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": tokenizer_max}))
    return d


def test_read_model_context(tmp_path):
    assert read_model_context(model_dir(tmp_path, "plain", max_position_embeddings=40960)) == ModelContext(
        40960, "max_position_embeddings=40960"
    )
    linear = model_dir(tmp_path, "linear", max_position_embeddings=4096, rope_scaling={"type": "linear", "factor": 4})
    assert read_model_context(linear).max_len == 16384
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert read_model_context(
        model_dir(tmp_path, "yarn", max_position_embeddings=131072, rope_scaling=yarn)
    ).max_len == (131072)  # YaRN's max_position_embeddings is already scaled (as vLLM reads it)
    short = model_dir(tmp_path, "tok", tokenizer_max=2048, max_position_embeddings=4096)
    assert read_model_context(short) == ModelContext(2048, "tokenizer model_max_length=2048")
    assert read_model_context(model_dir(tmp_path, "none")) is None
    assert read_model_context(tmp_path / "missing") is None


CONTEXT = ModelContext(4096, "max_position_embeddings=4096")


@pytest.mark.parametrize(
    "max_model_len, seq_len, trainer_seq_len, max_tokens, allow_long, expected",
    [
        (None, 2048, 2048, 256, False, 2048),  # unset: seq_len
        (None, 8192, 8192, 256, False, 4096),  # ... capped at the model's context (a row packs several samples)
        (1024, 8192, 8192, 256, False, 1024),
        (4096, 2048, 2048, 256, False, "inference.vllm.max_model_len=4096 is above seq_len=2048: .* dropped"),
        (8192, 8192, 8192, 256, False, r"max_model_len=8192 is above the model's max_position_embeddings=4096 "),
        (8192, 8192, 8192, 256, True, 8192),  # VLLM_ALLOW_LONG_MAX_MODEL_LEN=1
        (256, 2048, 2048, 300, False, "sampling.max_tokens=300 leaves no room for a prompt in .*max_model_len=256"),
        (None, 8192, 8192, 5000, False, r"max_tokens=5000 leaves no room .* max_position_embeddings=4096 tokens"),
        (None, 2048, 1024, 256, False, r"orchestrator.seq_len=2048 but trainer.data.seq_len=1024"),
    ],
)
def test_fit_max_model_len(max_model_len, seq_len, trainer_seq_len, max_tokens, allow_long, expected):
    args = (max_model_len, seq_len, trainer_seq_len, max_tokens, CONTEXT, allow_long)
    if isinstance(expected, int):
        assert fit_max_model_len(*args) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            fit_max_model_len(*args)


def test_rl_config_fits_max_model_len_and_names_the_keys(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    name = str(model_dir(tmp_path, max_position_embeddings=4096))
    cfg = load_config(RLConfig, ["--model.name", name, "--seq-len", "1024"])
    assert cfg.inference.vllm.max_model_len == 1024 and cfg.orchestrator.seq_len == cfg.trainer.data.seq_len == 1024
    assert cfg.orchestrator.max_model_len == 1024 and cfg.orchestrator.max_sample_len == 1024
    cfg = load_config(RLConfig, ["--model.name", name, "--seq-len", "65536"])
    assert cfg.inference.vllm.max_model_len == 4096
    # multi-turn rollouts stop where the server does, not at seq_len (vLLM answers 400 past max_model_len)
    assert cfg.orchestrator.max_model_len == cfg.orchestrator.max_sample_len == 4096
    with pytest.raises(
        ConfigError, match=r"max_model_len=8192 .* \(inference.vllm.max_model_len from --inference.vllm.max-model-len "
    ):
        load_config(RLConfig, ["--model.name", name, "--seq-len", "8192", "--inference.vllm.max-model-len", "8192"])
    allowed = ["--inference.env-vars", '{"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}']
    cfg = load_config(
        RLConfig, ["--model.name", name, "--seq-len", "8192", "--inference.vllm.max-model-len", "8192", *allowed]
    )
    assert cfg.inference.vllm.max_model_len == 8192


def test_orchestrator_max_sample_len():
    assert OrchestratorConfig(seq_len=1024).max_sample_len == 1024
    assert OrchestratorConfig(seq_len=1024, max_model_len=512).max_sample_len == 512
    assert OrchestratorConfig(seq_len=1024, max_model_len=4096).max_sample_len == 1024

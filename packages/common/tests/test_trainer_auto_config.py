"""`model.offload` / `model.ac` / `model.ac_offloading` = "auto" (the defaults) next to the forms that worked before,
and `data.micro_batch_tokens` of the RL trainer."""

import pytest

from prime_rl.common.config import load_config
from prime_rl.common.config.base import ConfigError
from prime_rl.common.config.rl import RLConfig
from prime_rl.common.config.rl_trainer import RLDataConfig, RLTrainerConfig
from prime_rl.common.config.trainer import ACConfig, SFTConfig


def _sft(*flags: str) -> SFTConfig:
    return load_config(SFTConfig, ["--model.name", "m", "--data.type", "fake", *flags])


def test_defaults_are_auto():
    model = _sft().model
    assert (model.offload, model.ac, model.ac_offloading) == ("auto", "auto", "auto")


def test_explicit_forms_parse_as_before(tmp_path):
    model = _sft("--model.ac", "None", "--model.ac-offloading", "None", "--model.offload", "optimizer").model
    assert model.ac is None and model.ac_offloading is None and model.offload == "optimizer"
    assert _sft("--no-model.ac").model.ac is None
    assert _sft("--model.ac").model.ac == ACConfig()  # a bare flag: full AC with its defaults
    model = _sft("--model.ac.mode", "selective", "--model.ac.freq", "2").model
    assert model.ac.mode == "selective" and model.ac.freq == 2
    assert _sft("--model.ac-offloading.max-inflight-activations", "3").model.ac_offloading.max_inflight_activations == 3
    assert _sft("--model.offload", "auto", "--model.ac", "auto").model.ac == "auto"
    with pytest.raises(ConfigError, match="offload"):
        _sft("--model.offload", "sometimes")
    toml = tmp_path / "rl.toml"
    toml.write_text('[model]\nname = "m"\n\n[trainer.model.ac]\nmode = "selective"\n')
    rl = load_config(RLConfig, ["@", str(toml)])
    assert rl.trainer.model.ac.mode == "selective" and rl.trainer.model.offload == "auto"
    toml.write_text('[model]\nname = "m"\n\n[trainer.model]\nac = "None"\noffload = "full"\n')
    rl = load_config(RLConfig, ["@", str(toml)])
    assert rl.trainer.model.ac is None and rl.trainer.model.offload == "full"


def test_micro_batch_tokens():
    assert RLDataConfig().micro_batch_tokens == "auto" and RLDataConfig().tokens_per_forward == 8192
    assert RLDataConfig(seq_len=16384).tokens_per_forward == 16384  # never less than one row
    assert RLDataConfig(micro_batch_tokens=4096).tokens_per_forward == 4096
    assert RLDataConfig(micro_batch_tokens=None).tokens_per_forward is None  # one forward per received row
    cfg = load_config(RLTrainerConfig, ["--model.name", "m", "--data.micro-batch-tokens", "None"])
    assert cfg.data.micro_batch_tokens is None
    cfg = load_config(RLTrainerConfig, ["--model.name", "m", "--data.micro-batch-tokens", "32768"])
    assert cfg.data.micro_batch_tokens == 32768
    with pytest.raises(ConfigError, match="micro_batch_tokens=1 must be >= 2"):
        load_config(RLTrainerConfig, ["--model.name", "m", "--data.micro-batch-tokens", "1"])
    # one forward per row: context parallelism cuts each row into cp equal slices
    none = ["--model.name", "m", "--data.micro-batch-tokens", "None", "--data.seq-len", "2048"]
    with pytest.raises(ConfigError, match=r"model.cp=3: .* data.seq_len=2048 .*; use data.seq_len=2049 or a"):
        load_config(RLTrainerConfig, [*none, "--model.cp", "3"])
    load_config(RLTrainerConfig, [*none, "--model.cp", "2"])
    load_config(RLTrainerConfig, [*none[:2], "--data.seq-len", "2048", "--model.cp", "3"])  # padded forwards

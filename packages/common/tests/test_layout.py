"""Parallel layout checked at config time: `sft --dry-run` fails on a layout the GPUs would refuse later."""

import json
import warnings

import pytest

from prime_rl.common.config import ConfigError, ConfigWarning, load_config
from prime_rl.common.config.layout import LayoutError, ModelShape, check_batch, check_layout, read_model_shape
from prime_rl.common.config.trainer import SFTConfig, TrainerModelConfig


def model_dir(tmp_path, heads=16, kv_heads=8, experts=0):
    d = tmp_path / f"m{heads}-{kv_heads}-{experts}"
    d.mkdir()
    cfg = {"model_type": "qwen3_moe" if experts else "qwen3", "num_attention_heads": heads}
    cfg |= {"num_key_value_heads": kv_heads} | ({"num_experts": experts} if experts else {})
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def test_read_model_shape(tmp_path):
    assert read_model_shape(model_dir(tmp_path, 16, 8, 64)) == ModelShape(16, 8, 64)
    assert read_model_shape(tmp_path / "missing") is None
    # Nemotron-H: Mamba-2 layers from layers_block_type (transformers>=5), else from hybrid_override_pattern
    nemotron = {"model_type": "nemotron_h", "num_attention_heads": 32, "num_key_value_heads": 2}
    for extra, mamba in [({"hybrid_override_pattern": "M*M-"}, True), ({"hybrid_override_pattern": "*-*-"}, False),
                         ({"layers_block_type": ["linear_attention", "full_attention"]}, True)]:  # fmt: skip
        d = tmp_path / f"nemotron-{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(nemotron | extra))
        assert read_model_shape(d) == ModelShape(32, 2, 0, mamba=mamba)


@pytest.mark.parametrize(
    "kwargs, world, shape, match",
    [
        ({"dp_replicate": 3}, 4, None, "model.dp_replicate=3 must divide the trainer's 4 ranks .*; use 1, 2 or 4"),
        ({"cp": 7}, 1, None, r"model.cp=7 must divide the 1 rank of an FSDP island .*; use 1 or add ranks"),
        ({"cp": 2, "dp_replicate": 2}, 2, None, "model.cp=2 must divide the 1 rank of an FSDP island"),
        ({"cp": 3}, 3, ModelShape(16, 8, 0), "model.cp=3 must divide the model's num_attention_heads=16; use 1, 2"),
        ({"cp": 4}, 4, ModelShape(16, 2, 0), None),  # cp a multiple of the KV heads: they are replicated
        ({"cp": 4}, 4, ModelShape(12, 3, 0), r"num_key_value_heads=3 or be a multiple of it .*; use 1, 3, 6 or 12$"),
        ({"cp": 2}, 2, ModelShape(32, 2, 0, mamba=True), r"model.cp=2: .* Mamba-2 .*; use model.cp=1"),
        ({"cp": 1}, 2, ModelShape(32, 2, 0, mamba=True), None),
        ({"ep": 3}, 4, ModelShape(16, 8, 64), "model.ep=3 must divide the model's 64 experts"),
        ({"ep": 8}, 4, ModelShape(16, 8, 64), "model.ep=8 must divide the 4 ranks of an FSDP island"),
        ({"ep": 4}, 4, ModelShape(16, 8, 64), None),
        ({"cp": 7}, None, None, None),  # rank count unknown, model unknown: nothing to check
    ],
)
def test_check_layout(kwargs, world, shape, match):
    model = TrainerModelConfig(name="m", **kwargs)
    if match is None:
        check_layout(model, world, shape)
    else:
        with pytest.raises(LayoutError, match=match):
            check_layout(model, world, shape)


def test_ep_on_a_dense_model_warns():
    with pytest.warns(ConfigWarning, match="model.ep=2 has no effect: m is a dense model"):
        check_layout(TrainerModelConfig(name="m", ep=2), 2, ModelShape(16, 8, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_layout(TrainerModelConfig(name="m", ep=2), 2, None)  # model unknown: no claim either way


def test_check_batch():
    check_batch(8, 2, 4)
    with pytest.raises(LayoutError, match=r"data.batch_size=6 must be a multiple of data.micro_batch_size=4 x 1 "):
        check_batch(6, 4, 1)


def test_sft_config_checks_layout_and_batch_against_num_gpus(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    name = model_dir(tmp_path)
    base = ["--model.name", name, "--data.type", "fake"]
    with pytest.raises(ConfigError, match=r"model.cp=3 must divide .* \(from --model.cp on the command line\)"):
        load_config(SFTConfig, [*base, "--model.cp", "3"])
    with pytest.raises(ConfigError, match="data.batch_size=6 must be a multiple of data.micro_batch_size=1 x 4"):
        load_config(SFTConfig, [*base, "--data.batch-size", "6", "--deployment.num-gpus", "4"])
    load_config(SFTConfig, [*base, "--data.batch-size", "6"])  # no num_gpus, no $WORLD_SIZE: the launch decides
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="data.batch_size=6 must be a multiple"):
        load_config(SFTConfig, [*base, "--data.batch-size", "6"])


def test_sft_config_refuses_cp_over_mamba_layers(tmp_path, monkeypatch):
    """The trainer's rule (no context parallelism for Nemotron-H's Mamba-2 layers) at config time, keys named."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    d = tmp_path / "nemotron"
    d.mkdir()
    hf = {"model_type": "nemotron_h", "num_attention_heads": 32, "num_key_value_heads": 2}
    (d / "config.json").write_text(json.dumps(hf | {"hybrid_override_pattern": "M*M-"}))
    base = ["--model.name", str(d), "--data.type", "fake", "--deployment.num-gpus", "2"]
    with pytest.raises(ConfigError, match=r"^model.cp=2: .*Mamba-2 .*use model.cp=1 \(from --model.cp on the command"):
        load_config(SFTConfig, [*base, "--model.cp", "2"])
    load_config(SFTConfig, base)

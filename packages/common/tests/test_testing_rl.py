"""The CPU `rl.toml` builder: a test's overrides merge into the base run, and the file is a valid RLConfig."""

import tomllib

from prime_rl.common.config.rl import RLConfig
from prime_rl.common.testing_rl import merged, rl_config, write_cpu_rl_config, write_rl_config


def test_overrides_merge_tables_and_replace_the_rest(tmp_path):
    path = write_cpu_rl_config(
        tmp_path / "rl.toml", tmp_path / "model", tmp_path, "probe", 8123,
        max_steps=7, ckpt={"interval": 2}, orchestrator={"sampling": {"seed": 3}}, inference={"max_restarts": 1},
    )  # fmt: skip
    cfg = tomllib.loads(path.read_text())
    assert cfg["max_steps"] == 7 and cfg["ckpt"] == {"interval": 2} and cfg["run"] == {"name": "probe"}
    assert cfg["orchestrator"]["sampling"] == {"max_tokens": 8, "seed": 3}  # merged, not replaced
    assert cfg["orchestrator"]["batch_size"] == 16 and cfg["inference"]["max_restarts"] == 1
    assert cfg["inference"]["server"] == {"port": 8123} and cfg["inference"]["vllm"]["dtype"] == "float32"


def test_lists_are_replaced_and_the_base_is_left_alone():
    base = {"a": {"b": [1, 2], "c": 1}}
    assert merged(base, {"a": {"b": [3]}}) == {"a": {"b": [3], "c": 1}}
    assert base == {"a": {"b": [1, 2], "c": 1}}


def test_the_base_run_is_a_valid_rl_config_apart_from_the_model(tmp_path):
    """Every key the builder writes exists in RLConfig (a renamed key fails here, not in a vLLM run)."""
    from prime_rl.common.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny")
    path = write_cpu_rl_config(tmp_path / "rl.toml", model, tmp_path / "out", "probe", 8123)
    RLConfig.model_validate(tomllib.loads(path.read_text()))


def test_rl_config_is_the_keys_every_run_names_with_the_overrides(tmp_path):
    """What a test that only loads, resolves or renders a run starts from (no CPU settings)."""
    cfg = rl_config("/m", tmp_path, "probe", orchestrator={"max_tokens": 8})
    assert cfg == {
        "output_dir": str(tmp_path), "run": {"name": "probe"}, "model": {"name": "/m"}, "orchestrator": {"max_tokens": 8}
    }  # fmt: skip
    assert tomllib.loads(write_rl_config(tmp_path / "rl.toml", cfg).read_text()) == cfg

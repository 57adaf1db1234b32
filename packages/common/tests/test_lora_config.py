"""The LoRA config keys: `[model.lora]` (sft and the RL trainer), `[inference.lora]`, and how `rl` wires LoRA RL
(rollouts name the adapter, inference serves it from step 0) or refuses it in one line before anything starts."""

import pytest
from pydantic import ValidationError

from prime_rl.common.config.inference import InferenceConfig
from prime_rl.common.config.rl import RLConfig
from prime_rl.common.config.rl_trainer import RLTrainerConfig
from prime_rl.common.config.trainer import LoRAConfig


def _error(excinfo: pytest.ExceptionInfo) -> str:
    return excinfo.value.errors()[0]["msg"]


def test_lora_config_defaults_and_regex():
    cfg = LoRAConfig()
    assert (cfg.rank, cfg.alpha, cfg.dropout, cfg.modules_to_save) == (16, 32.0, 0.0, [])
    assert LoRAConfig(target_modules=r"layers\.[0-3]\..*_proj").target_modules == r"layers\.[0-3]\..*_proj"
    with pytest.raises(ValidationError) as e:
        LoRAConfig(target_modules="(q_proj")
    assert "is not a valid regular expression" in _error(e)
    with pytest.raises(ValidationError):
        LoRAConfig(rank=0)


def test_rl_trainer_refuses_what_inference_cannot_serve():
    base = {"model": {"name": "m", "lora": {"rank": 8}}}
    with pytest.raises(ValidationError) as e:
        RLTrainerConfig.model_validate({**base, "weight_broadcast": {"type": "nccl"}})
    assert "adapters are published through the filesystem only" in _error(e)
    with pytest.raises(ValidationError) as e:
        RLTrainerConfig.model_validate({"model": {"name": "m", "lora": {"modules_to_save": ["lm_head"]}}})
    assert "vLLM serves LoRA adapters only" in _error(e)
    assert RLTrainerConfig.model_validate(base).model.lora.rank == 8


def test_inference_max_rank_is_one_vllm_allocates():
    assert InferenceConfig.model_validate({"lora": {"max_rank": 64}}).lora.max_rank == 64
    with pytest.raises(ValidationError) as e:
        InferenceConfig.model_validate({"lora": {"max_rank": 12}})
    assert "(e.g. 16)" in _error(e)


def test_rl_wires_lora_rl():
    cfg = RLConfig.model_validate(
        {"model": {"name": "m"}, "run": {"name": "exp"}, "trainer": {"model": {"lora": {"rank": 12}}}}
    )
    assert cfg.orchestrator.model.name == "exp"  # rollouts name the adapter (the run name by default)
    assert cfg.inference.model.name == cfg.trainer.model.name == "m"  # the base
    assert cfg.inference.lora.max_rank == 16 and cfg.inference.lora.placeholders == ["exp"]
    named = RLConfig.model_validate(
        {
            "model": {"name": "m"},
            "trainer": {"model": {"lora": {"name": "pol"}}},
            "orchestrator": {"model": {"name": "x"}},
        }
    )
    assert named.orchestrator.model.name == "x" and named.inference.lora.placeholders == ["pol"]
    plain = RLConfig.model_validate({"model": {"name": "m"}})
    assert plain.inference.lora is None and plain.orchestrator.model.name == "m"


def test_rl_refuses_a_rank_inference_would_refuse():
    with pytest.raises(ValidationError) as e:
        RLConfig.model_validate(
            {
                "model": {"name": "m"},
                "trainer": {"model": {"lora": {"rank": 32}}},
                "inference": {"lora": {"max_rank": 16}},
            }
        )
    assert "trainer.model.lora.rank=32 but inference serves LoRA adapters up to rank 16" in _error(e)

"""`rl` keeps one tool-call format per model: `[inference.vllm] tool_call_parser` (vLLM's chat API) and
`orchestrator.model.tool_call_parser` (multi-turn rollouts) agree or the config is refused before anything starts."""

import pytest
from pydantic import ValidationError

from prime_rl.common.config.rl import RLConfig


def _rl(vllm: dict, orchestrator_model: dict | None = None) -> RLConfig:
    data = {"model": {"name": "m"}, "inference": {"vllm": vllm}}
    if orchestrator_model is not None:
        data["orchestrator"] = {"model": orchestrator_model}
    return RLConfig.model_validate(data)


def test_the_orchestrator_adopts_the_served_parser():
    assert (
        _rl({"tool_call_parser": "glm45", "enable_auto_tool_choice": True}).orchestrator.model.tool_call_parser
        == "glm45"
    )
    assert _rl({}).orchestrator.model.tool_call_parser == "hermes"
    # a vLLM parser the orchestrator does not implement stays with the chat API; rollouts keep their own
    assert _rl({"tool_call_parser": "mistral"}).orchestrator.model.tool_call_parser == "hermes"
    agreed = _rl({"tool_call_parser": "glm45"}, {"tool_call_parser": "glm45"})
    assert agreed.orchestrator.model.tool_call_parser == "glm45"


def test_two_different_parsers_are_refused():
    with pytest.raises(ValidationError) as e:
        _rl({"tool_call_parser": "glm45"}, {"tool_call_parser": "hermes"})
    msg = e.value.errors()[0]["msg"]
    assert "inference.vllm.tool_call_parser='glm45' but orchestrator.model.tool_call_parser='hermes'" in msg

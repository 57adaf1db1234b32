"""`inference` before any engine starts: a bad model path, the CPU KV-cache default, a missing vllm-router
(one line, exit 2, nothing started, no temp dir left). None of this needs vLLM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from prime_rl.common.config import ConfigError, load_config
from prime_rl.common.config.inference import InferenceConfig
from prime_rl.inference import router
from prime_rl.inference.preflight import apply_cpu_defaults, check_inference, default_kv_cache_gib


def test_a_missing_local_model_path_is_a_config_error_naming_its_source(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "prime_rl.inference.entrypoint", "--model.name", str(tmp_path / "no" / "model")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "model.name=" in out.stderr and "(from --model.name on the command line)" in out.stderr
    for hub_id in ("Qwen/Qwen3-0.6B", "gpt2"):  # left to vLLM
        check_inference(load_config(InferenceConfig, ["--model.name", hub_id]))
    with pytest.raises(ConfigError):
        check_inference(load_config(InferenceConfig, ["--model.name", "./outputs/model"]))


def test_cpu_kv_cache_default_is_set_only_when_nobody_set_it(capsys):
    cfg = load_config(InferenceConfig, ["--model.name", "gpt2"])
    env: dict[str, str] = {}
    gib = apply_cpu_defaults(cfg, env, cpu=True)
    assert env == {"VLLM_CPU_KVCACHE_SPACE": str(gib)} and 1 <= gib <= 8
    assert "VLLM_CPU_KVCACHE_SPACE is unset on CPU" in capsys.readouterr().err
    assert apply_cpu_defaults(cfg, {"VLLM_CPU_KVCACHE_SPACE": "3"}, cpu=True) is None
    with_env_vars = load_config(
        InferenceConfig, ["--model.name", "gpt2", "--env-vars", '{"VLLM_CPU_KVCACHE_SPACE": "2"}']
    )
    assert apply_cpu_defaults(with_env_vars, {}, cpu=True) is None
    assert apply_cpu_defaults(cfg, {}, cpu=False) is None  # a CUDA build sizes by gpu_memory_utilization
    # a quarter of RAM over every engine, 1..8 GiB each
    two_by_two = load_config(InferenceConfig, ["--vllm.data-parallel-size", "2", "--router.replicas", "2"])
    assert default_kv_cache_gib(two_by_two, 24 * 2**30) == 1
    assert default_kv_cache_gib(cfg, 24 * 2**30) == 6 and default_kv_cache_gib(cfg, 512 * 2**30) == 8


def test_missing_vllm_router_fails_before_any_replica_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))  # no vllm-router beside it
    monkeypatch.setenv("PATH", str(tmp_path))
    started = []
    monkeypatch.setattr(router.subprocess, "Popen", lambda *a, **k: started.append(a))
    cfg = load_config(InferenceConfig, ["--model.name", "gpt2", "--router.replicas", "2"])
    assert router.run_replicas(cfg) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs vllm-router, which is not installed" in err
    assert started == []


def test_the_replica_config_dir_is_removed_when_a_replica_fails(tmp_path, monkeypatch, capsys):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "vllm-router").write_text("#!/bin/sh\nexit 0\n")
    (fake_bin / "vllm-router").chmod(0o755)
    python = fake_bin / "python"  # a "replica" that exits at once
    python.write_text("#!/bin/sh\nexit 3\n")
    python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(python))
    monkeypatch.setattr(router.tempfile, "tempdir", str(tmp_path))
    cfg = load_config(InferenceConfig, ["--model.name", "gpt2", "--router.replicas", "2"])
    assert router.run_replicas(cfg) == 1
    assert "exited with 3 during start-up" in capsys.readouterr().err
    assert [p.name for p in Path(tmp_path).iterdir() if p.name.startswith("prime-rl-inference-")] == []


def test_a_misspelled_vllm_key_is_one_config_error_before_the_engine():
    pytest.importorskip("vllm", reason="checked against vLLM's own serve options")
    cfg = load_config(InferenceConfig, ["--model.name", "gpt2", "--vllm.max-num-seq", "3"])
    with pytest.raises(ConfigError, match="'max_num_seq' is not a vLLM engine/server option") as e:
        check_inference(cfg)
    assert e.value.keys == ("vllm.max_num_seq",)

"""`resolve(cfg, host)`: pure, frozen, and the one resolution both launchers write (local `rl` and SLURM)."""

import dataclasses
from pathlib import Path

import pytest

from prime_rl.common.config import load_config
from prime_rl.common.config.base import ConfigError
from prime_rl.common.config.rl import RLConfig
from prime_rl.common.rundir import RunDir
from prime_rl.common.testing import make_tiny_model
from prime_rl.common.testing_rl import rl_config, write_rl_config
from prime_rl.launcher.host_facts import HostFacts, gather_slurm, read_served_dtype
from prime_rl.launcher.resolution import ResolvedRun, resolve
from prime_rl.launcher.rl import write_configs
from prime_rl.launcher.slurm import load_job, write_job
from prime_rl.launcher.slurm.job import job_class

HOST = HostFacts(served_dtype="float16", batch_port=40100, broadcast_port=40110, weights_port=40120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", dtype="float32")


def _cfg(model_dir: Path, *flags: str) -> RLConfig:
    return load_config(RLConfig, ["--model.name", str(model_dir), *flags])


def test_resolve_is_pure_and_its_result_frozen(model_dir):
    cfg = _cfg(model_dir, "--trainer.weight-broadcast.type", "nccl", "--ckpt.resume-step", "latest")
    before, fields_set = cfg.model_dump(), cfg.trainer.weight_broadcast.model_fields_set.copy()
    host = dataclasses.replace(HOST, resume_resolved=True, resume_step=4)
    first, second = resolve(cfg, host), resolve(cfg, host)
    assert first == second and first is not second
    assert cfg.model_dump() == before  # the input is left as it was, down to what counts as set
    assert cfg.trainer.weight_broadcast.model_fields_set == fields_set
    assert first.config.trainer.model is not cfg.trainer.model  # nothing mutable shared with the input
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.config = cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.resume_step = 5
    with pytest.raises(AttributeError):
        first.trainer = cfg.trainer
    # what the host says is what the processes get
    trainer, orchestrator = first.trainer, first.orchestrator
    assert trainer.data.port == orchestrator.trainer.port == 40100
    assert trainer.weight_broadcast.port == 40110 and orchestrator.trainer.weights_port == 40120
    assert trainer.weight_broadcast.announce == "tcp://127.0.0.1:40120"  # derived by RLConfig: it follows
    assert trainer.weight_broadcast.dtype == "float16"
    assert first.resume_step == trainer.ckpt.resume_step == orchestrator.ckpt.resume_step == 4
    assert set(first.process_configs()) == {"trainer", "orchestrator", "inference"}


def test_facts_left_out_keep_the_configs_values(model_dir):
    cfg = _cfg(model_dir, "--trainer.weight-broadcast.announce", "tcp://10.0.0.1:7000", "--ckpt.resume-step", "latest")
    resolved = resolve(cfg, HostFacts())
    assert resolved.config.model_dump() == cfg.model_dump()
    assert resolved.resume_step == "latest"  # not resolved on this host: each component resolves its own
    announce = resolve(cfg, HOST).trainer.weight_broadcast.announce
    assert announce == "tcp://10.0.0.1:7000"  # set by the user: a reserved weights port does not move it


def test_a_named_dtype_is_kept_locally_but_not_in_a_slurm_hand_off(model_dir, tmp_path):
    named = _cfg(model_dir, "--trainer.weight-broadcast.dtype", "float32")
    assert resolve(named, HOST).trainer.weight_broadcast.dtype == "float32"
    assert resolve(_cfg(model_dir), HOST).trainer.weight_broadcast.dtype == "float16"
    job = load_config(job_class(RLConfig), ["@", str(_slurm_toml(model_dir, tmp_path)), "--trainer.weight-broadcast.dtype", "float32"])  # fmt: skip
    assert resolve(job, HOST).trainer.weight_broadcast.dtype == "float16"  # every value of a hand-off reads as set


def test_served_dtype_comes_from_vllm_or_the_checkpoint(model_dir, tmp_path):
    assert read_served_dtype(_cfg(model_dir)) == "float32"  # "auto": config.json's torch_dtype
    assert read_served_dtype(_cfg(model_dir, "--inference.vllm.dtype", "half")) == "float16"
    job = load_config(job_class(RLConfig), ["@", str(_slurm_toml(tmp_path / "absent", tmp_path))])
    assert gather_slurm(job) == HostFacts()  # the model is not visible from this submit host


def _slurm_toml(model_dir: Path, tmp_path: Path) -> Path:
    config = rl_config(
        model_dir, tmp_path / "out", "r", orchestrator={"max_tokens": 8},
        deployment={"type": "multi_node", "num_train_nodes": 1, "num_infer_nodes": 1}, slurm={"job_name": "t"},
    )  # fmt: skip
    return write_rl_config(tmp_path / "rl.toml", config)


def test_local_launcher_and_slurm_job_write_the_same_configs(model_dir, tmp_path):
    """One RLConfig and one HostFacts: the local launcher's writer and the SLURM job's give equal files."""
    path = _slurm_toml(model_dir, tmp_path)
    job = load_job("rl", ["@", str(path)], HOST)
    slurm = write_job(job, python="/usr/bin/python3")
    local = write_configs(
        resolve(load_config(job_class(RLConfig), ["@", str(path)]), HOST), RunDir(tmp_path / "l", "r")
    )
    for name in ("trainer", "orchestrator", "inference"):
        assert local[name].read_text() == slurm.process_configs[name].read_text(), name
    assert local["rl"].read_text() == slurm.submitted_config.read_text()
    assert 'dtype = "float16"' in local["trainer"].read_text()  # the host's facts reached both
    assert "port = 40100" in local["trainer"].read_text()


def test_multi_node_dp_replicate_must_divide_the_trainer_ranks(model_dir, tmp_path):
    job = load_config(job_class(RLConfig), ["@", str(_slurm_toml(model_dir, tmp_path)), "--trainer.model.dp-replicate", "3"])  # fmt: skip
    with pytest.raises(ConfigError, match="dp_replicate=3 must divide the trainer's 1 nodes x 8 GPUs"):
        resolve(job, HostFacts())
    assert isinstance(resolve(_cfg(model_dir), HostFacts()), ResolvedRun)


def test_multi_node_orchestrator_sends_per_data_parallel_group(model_dir, tmp_path):
    """The orchestrator's `num_train_ranks` is derived for a multi-node trainer as for a single-node one: its
    ranks (2 nodes x 8 GPUs) over cp. The SLURM job passes this value on the orchestrator's command line too."""
    path = _slurm_toml(model_dir, tmp_path)
    job = load_config(job_class(RLConfig), ["@", str(path), "--deployment.num-train-nodes", "2"])
    assert resolve(job, HostFacts()).orchestrator.num_train_ranks == 16
    cp4 = load_config(job_class(RLConfig), ["@", str(path), "--deployment.num-train-nodes", "2", "--trainer.model.cp", "4"])  # fmt: skip
    assert resolve(cp4, HostFacts()).orchestrator.num_train_ranks == 4

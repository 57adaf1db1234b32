"""`[deployment] type = "colocated"`: what `rl` sets for each process, and the one-line refusals of bad input."""

import pytest

from prime_rl.common.config import ConfigError, load_config
from prime_rl.common.config import rl as rl_config
from prime_rl.common.config.deployment import COLOCATED_TRANSPORTS, ColocatedDeployment
from prime_rl.common.config.rl import RLConfig
from prime_rl.common.testing import make_tiny_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models") / "qwen3", kind="qwen3", dtype="float32")


def test_colocated_sets_each_side_to_take_turns(model, monkeypatch):
    monkeypatch.setattr(rl_config, "installed_vllm_is_cpu", lambda: False)
    cfg = load_config(
        RLConfig, ["--model.name", str(model), "--deployment.type", "colocated", "--deployment.num-gpus", "4",
                   "--deployment.sleep-level", "2", "--inference.vllm.tensor-parallel-size", "2"],
    )  # fmt: skip
    assert isinstance(cfg.deployment, ColocatedDeployment)
    assert cfg.orchestrator.inference.sleep_level == 2
    assert cfg.orchestrator.max_off_policy_steps == 0
    assert cfg.orchestrator.num_train_ranks == 4  # FSDP over the 4 GPUs inference spans too
    assert cfg.trainer.offload_between_steps and cfg.trainer.model.offload == "optimizer"
    assert (cfg.inference.vllm.tensor_parallel_size, cfg.inference.vllm.data_parallel_size) == (2, 2)
    assert cfg.inference.vllm.engine_args()["enable_sleep_mode"] is True


def test_vllm_cpu_is_not_asked_for_sleep_mode(model, monkeypatch):
    monkeypatch.setattr(rl_config, "installed_vllm_is_cpu", lambda: True)  # it refuses the flag on CPU
    cfg = load_config(RLConfig, ["--model.name", str(model), "--deployment.type", "colocated"])
    assert "enable_sleep_mode" not in cfg.inference.vllm.engine_args()
    assert cfg.orchestrator.inference.sleep_level == 2  # the control flow still runs (a logged no-op there)


def test_colocated_sleeps_at_level_2_unless_lora_needs_the_base_kept(model, monkeypatch):
    monkeypatch.setattr(rl_config, "installed_vllm_is_cpu", lambda: False)
    plain = load_config(RLConfig, ["--model.name", str(model), "--deployment.type", "colocated"])
    assert plain.deployment.sleep_level == plain.orchestrator.inference.sleep_level == 2  # every update is whole
    lora = ["--model.name", str(model), "--deployment.type", "colocated", "--trainer.model.lora.rank", "8"]
    cfg = load_config(RLConfig, lora)
    assert cfg.deployment.sleep_level == cfg.orchestrator.inference.sleep_level == 1  # the base survives the sleep
    assert cfg.trainer.weight_broadcast.type == "filesystem"  # adapters are loaded from a path
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, [*lora, "--deployment.sleep-level", "2"])
    assert "set deployment.sleep_level=1" in str(e.value) and "\n" not in str(e.value).strip()
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, [*lora, "--weight-broadcast.type", "ipc"])
    assert 'set weight_broadcast.type = "filesystem"' in str(e.value)


def test_split_runs_neither_sleep_nor_offload(model):
    cfg = load_config(RLConfig, ["--model.name", str(model)])
    assert cfg.orchestrator.inference.sleep_level == 0 and not cfg.trainer.offload_between_steps
    with pytest.raises(ConfigError, match='set deployment.type = "colocated"'):
        load_config(RLConfig, ["--model.name", str(model), "--orchestrator.inference.sleep-level", "1"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--inference.env-vars", '{"CUDA_VISIBLE_DEVICES": "0"}', "--trainer.env-vars", '{"CUDA_VISIBLE_DEVICES": "1"}'],
         "inference.env_vars.CUDA_VISIBLE_DEVICES='0' and trainer.env_vars.CUDA_VISIBLE_DEVICES='1' name different GPUs"),
        (["--inference.env-vars", '{"CUDA_VISIBLE_DEVICES": "0,1"}'], "name different GPUs; remove both"),
        (["--weight-broadcast.type", "nccl"], "weight_broadcast.type='nccl' with deployment.type='colocated'"),
        (["--orchestrator.max-off-policy-steps", "1"], "no rollout can overlap training"),
        (["--deployment.num-gpus", "2", "--inference.vllm.tensor-parallel-size", "2",
          "--inference.vllm.data-parallel-size", "2"], "must equal deployment.num_gpus=2"),
        (["--trainer.offload-between-steps", "false"], "keep its free memory from vLLM"),
        (["--deployment.num-nodes", "2"], "deployment.num_nodes=2 with deployment.type='colocated' runs one server "
                                           "and its trainer ranks per node through SLURM; add a [slurm] table"),
        (["--deployment.gpus-per-node", "8"], "deployment.gpus_per_node gives inference and trainer GPUs or nodes "
                                             "of their own, but deployment.type='colocated' puts both on the same "
                                             "ones; set deployment.num_gpus (GPUs per node)"),
        (["--deployment.num-nodes", "2", "--slurm.job-name", "x", "--deployment.num-gpus", "2",
          "--inference.vllm.tensor-parallel-size", "2", "--trainer.model.dp-replicate", "3"],
         "deployment.num_gpus=2 x num_nodes=2 must be divisible by trainer.model.dp_replicate=3"),
        (["--inference.max-restarts", "1"], "set inference.max_restarts=0"),
        (["--deployment.num-nodes", "3", "--slurm.job-name", "x", "--weight-broadcast.type", "ipc",
          "--weight-broadcast.port", "65534"],
         "node i's bucket channel listens on port + i, up to 65536, above 65535; set weight_broadcast.port to at "
         "most 65533"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_naming_the_fix(model, monkeypatch, flags, message):
    monkeypatch.setattr(rl_config, "installed_vllm_is_cpu", lambda: False)
    with pytest.raises(ConfigError, match=None) as e:
        load_config(RLConfig, ["--model.name", str(model), "--deployment.type", "colocated", *flags])
    assert message in str(e.value) and "\n" not in str(e.value).strip()


@pytest.mark.parametrize("cpu, memory", [(False, "device"), (True, "host")])
def test_colocated_runs_push_through_ipc_unless_told_otherwise(model, monkeypatch, cpu, memory):
    monkeypatch.setattr(rl_config, "installed_vllm_is_cpu", lambda: cpu)
    cfg = load_config(RLConfig, ["--model.name", str(model), "--deployment.type", "colocated"])
    assert COLOCATED_TRANSPORTS[0] == "ipc"
    wb = cfg.trainer.weight_broadcast
    assert (wb.type, wb.memory) == ("ipc", memory)  # the trainer's GPU on GPUs, /dev/shm on CPU
    controls = [f"tcp://127.0.0.1:{p}" for p in cfg.inference.instance_control_ports]
    assert wb.inference_addresses == controls  # the trainer pushes and wakes the weights
    assert cfg.orchestrator.inference.addresses == controls  # the orchestrator sleeps and wakes the KV cache
    explicit = load_config(RLConfig, ["--model.name", str(model), "--deployment.type", "colocated",
                                      "--weight-broadcast.type", "ipc", "--weight-broadcast.memory", "device"])  # fmt: skip
    assert explicit.trainer.weight_broadcast.memory == "device"  # a value the user set is kept


def test_the_filesystem_transport_still_serves_colocated_runs(model, monkeypatch):
    monkeypatch.setattr(rl_config, "installed_vllm_is_cpu", lambda: False)
    cfg = load_config(
        RLConfig,
        ["--model.name", str(model), "--deployment.type", "colocated", "--weight-broadcast.type", "filesystem"],
    )
    assert cfg.trainer.weight_broadcast.type == "filesystem" and cfg.orchestrator.inference.addresses


def test_colocated_under_slurm_runs_every_node_in_turns_pushing_through_ipc_per_node(model, monkeypatch):
    """Per node under SLURM: FSDP over every node's GPUs, one server per node over its GPUs, and ipc by default on
    any number of nodes (each node's trainer leader fills its own node's server: no disk); the filesystem
    transport when asked for, or with LoRA (adapters load from a path)."""
    monkeypatch.setattr(rl_config, "installed_vllm_is_cpu", lambda: False)
    base = ["--model.name", str(model), "--deployment.type", "colocated", "--deployment.num-gpus", "4",
            "--inference.vllm.tensor-parallel-size", "2", "--slurm.job-name", "x"]  # fmt: skip
    cfg = load_config(RLConfig, [*base, "--deployment.num-nodes", "3"])
    assert cfg.orchestrator.num_train_ranks == 12  # every node's 4 GPUs
    assert (cfg.inference.vllm.tensor_parallel_size, cfg.inference.vllm.data_parallel_size) == (2, 2)  # per node
    wb = cfg.trainer.weight_broadcast
    assert (wb.type, wb.memory) == ("ipc", "device")  # each node's buckets on its leader's GPU, which vLLM shares
    assert cfg.orchestrator.inference.sleep_level == 2 and cfg.trainer.offload_between_steps
    assert load_config(RLConfig, base).trainer.weight_broadcast.type == "ipc"  # one node: one host
    chosen = load_config(RLConfig, [*base, "--deployment.num-nodes", "3", "--weight-broadcast.type", "filesystem"])
    assert chosen.trainer.weight_broadcast.type == "filesystem"
    lora = load_config(RLConfig, [*base, "--deployment.num-nodes", "3", "--trainer.model.lora.rank", "8"])
    assert lora.trainer.weight_broadcast.type == "filesystem"


def test_ipc_in_a_split_slurm_job_is_still_refused(model, monkeypatch):
    """Without colocation a SLURM job puts the trainer and inference on different nodes: no shared memory."""
    monkeypatch.setattr(rl_config, "installed_vllm_is_cpu", lambda: False)
    with pytest.raises(ConfigError) as e:
        load_config(RLConfig, ["--model.name", str(model), "--slurm.job-name", "x", "--weight-broadcast.type", "ipc",
                               "--weight-broadcast.memory", "host"])  # fmt: skip
    assert "a SLURM job puts the trainer and inference on different nodes; use weight_broadcast.type='nccl'" in str(
        e.value
    )
    assert "\n" not in str(e.value).strip()

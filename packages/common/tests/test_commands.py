"""Every command line the project builds, word for word as the launchers built them before they moved here."""

from pathlib import Path

from prime_rl.common import commands

PY = "/venv/bin/python"
CFG = Path("/run/configs")


class ShellWord(str):
    """Like the SLURM renderer's: a word the job's shell expands."""


def test_torchrun_loopback_for_rl_and_sft() -> None:
    assert commands.torchrun_loopback_command(PY, 4, commands.RL_TRAINER, CFG / "trainer.toml") == [
        PY, "-m", "prime_rl.trainer.torchrun_loopback", "--nproc-per-node", "4", "--local-ranks-filter", "0",
        "-m", "prime_rl.trainer.rl.train", "@", "/run/configs/trainer.toml",
    ]  # fmt: skip
    assert commands.torchrun_loopback_command(PY, 2, commands.SFT_TRAINER, "t.toml")[-3:] == [
        "prime_rl.trainer.sft.train", "@", "t.toml"
    ]  # fmt: skip


def test_torchrun_static_keeps_shell_words() -> None:
    rank, endpoint, job_id = ShellWord('"$i"'), ShellWord('"$TRAIN_HEAD:29500"'), ShellWord('"$SLURM_JOB_ID"')
    argv = commands.torchrun_static_command(
        PY, 2, rank, 8, endpoint, job_id, commands.RL_TRAINER, CFG / "trainer.toml",
        commands.rl_trainer_node_args("t1"),
    )  # fmt: skip
    assert argv == [
        PY, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", '"$i"', "--nproc-per-node", "8",
        "--rdzv-backend", "static", "--rdzv-endpoint", '"$TRAIN_HEAD:29500"', "--rdzv-id", '"$SLURM_JOB_ID"',
        "--local-ranks-filter", "0", "-m", "prime_rl.trainer.rl.train", "@", "/run/configs/trainer.toml",
        "--data.host", "t1",
    ]  # fmt: skip
    assert all(type(a) is str or a in (rank, endpoint, job_id) for a in argv)
    assert isinstance(argv[6], ShellWord) and isinstance(argv[14], ShellWord)


def test_rl_trainer_node_args_push_weights_only_with_addresses() -> None:
    assert commands.rl_trainer_node_args("h") == ["--data.host", "h"]
    assert commands.rl_trainer_node_args("h", ["tcp://a:1", "tcp://b:2"]) == [
        "--data.host", "h", "--weight-broadcast.host", "h", "--weight-broadcast.inference-addresses",
        "tcp://a:1", "tcp://b:2",
    ]  # fmt: skip


def test_inference_commands() -> None:
    base = [PY, "-m", "prime_rl.inference.entrypoint", "@", "/run/configs/inference.toml"]
    assert commands.inference_command(PY, CFG / "inference.toml") == base
    assert commands.inference_replica_command(PY, CFG / "inference.toml", 8001, 8101) == [
        *base, "--server.port", "8001", "--server.control-port", "8101"
    ]  # fmt: skip
    assert commands.inference_replica_command(PY, CFG / "inference.toml", 8001, 8101, "decode")[-2:] == [
        "--deployment.role", "decode"
    ]  # fmt: skip
    assert commands.inference_node_command(PY, CFG / "inference.toml", "$p", "$c", "prefill") == [
        *base, "--deployment.role", "prefill", "--server.host", "0.0.0.0", "--server.port", "$p",
        "--server.control-host", "0.0.0.0", "--server.control-port", "$c",
    ]  # fmt: skip
    assert "--deployment.role" not in commands.inference_node_command(PY, "i.toml", 1, 2)


def test_orchestrator_commands() -> None:
    base = [PY, "-m", "prime_rl.orchestrator.entrypoint", "@", "/run/configs/orchestrator.toml"]
    assert commands.orchestrator_command(PY, CFG / "orchestrator.toml") == base
    node = commands.orchestrator_node_command(PY, CFG / "orchestrator.toml", "U", "K", ["m1", "m2"], 4)
    assert node == [
        *base, "--model.client.base-url", "U", "--model.client.api-key", "K", "--trainer.address", "0.0.0.0",
        "--model.client.metrics-urls", "m1", "m2", "--num-train-ranks", "4",
    ]  # fmt: skip
    with_loads = commands.orchestrator_node_command(PY, "o.toml", "U", "K", ["m"], 2, ["tcp://a:1"])
    assert with_loads[-2:] == ["--inference.addresses", "tcp://a:1"]


def test_router_commands() -> None:
    """The replica supervisor's router (every flag it passes) and a SLURM job's (shell words, key, P/D)."""
    assert commands.router_command("/venv/bin/vllm-router", ["http://127.0.0.1:8001", "http://127.0.0.1:8002"],
                                   "0.0.0.0", 8000, "127.0.0.1", 8102, policy="consistent_hash") == [
        "/venv/bin/vllm-router", "--worker-urls", "http://127.0.0.1:8001", "http://127.0.0.1:8002",
        "--host", "0.0.0.0", "--port", "8000",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", "8102", "--policy", "consistent_hash",
    ]  # fmt: skip
    workers = commands.router_pd_workers(["prefill", "decode"], ["http://a:1", "http://b:2"])
    assert workers == ["--prefill", "http://a:1", "--decode", "http://b:2"]
    assert commands.router_command("vllm-router", workers, "h", 1, "127.0.0.1", 2, disaggregated=True)[:6] == [
        "vllm-router", "--vllm-pd-disaggregation", "--prefill", "http://a:1", "--decode", "http://b:2"
    ]  # fmt: skip
    arrays = [ShellWord('"${PREFILL_URLS[@]}"'), ShellWord('"${DECODE_URLS[@]}"')]
    key = ShellWord('"$VLLM_API_KEY"')
    assert commands.router_command("vllm-router", arrays, "0.0.0.0", 9000, "127.0.0.1", 9001, disaggregated=True,
                                   kv_connector="nixl", api_key=key) == [
        "vllm-router", "--vllm-pd-disaggregation", '"${PREFILL_URLS[@]}"', '"${DECODE_URLS[@]}"',
        "--kv-connector", "nixl", "--host", "0.0.0.0", "--port", "9000", "--api-key", '"$VLLM_API_KEY"',
        "--prometheus-host", "127.0.0.1", "--prometheus-port", "9001",
    ]  # fmt: skip


def test_slurm_command() -> None:
    assert commands.slurm_command(PY, "rl", ["@", CFG / "rl.toml", "--dry-run"]) == [
        PY, "-m", "prime_rl.launcher.slurm", "rl", "@", "/run/configs/rl.toml", "--dry-run"
    ]  # fmt: skip


def test_imports_nothing_beyond_the_standard_library() -> None:
    import ast

    tree = ast.parse(Path(commands.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "os", "collections"}, imported

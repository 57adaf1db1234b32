"""examples/advanced: each multi-node config renders its SLURM job for the node counts it promises (--dry-run)."""

import subprocess
import sys
import tomllib
from pathlib import Path

from pydantic import TypeAdapter

from prime_rl.common.config.orchestrator import EnvConfig
from prime_rl.orchestrator.envs.registry import build_environment

BIN = Path(sys.executable).parent
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "advanced"


def _dry_run(tmp_path: Path, *configs: Path) -> Path:
    args = [BIN / "rl"]
    for config in configs:
        args += ["@", config]
    out = subprocess.run(
        [*args, "--output-dir", tmp_path / "out", "--dry-run"], capture_output=True, text=True, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return tmp_path / "out" / "rl"


def _assert_builds_swe_env(orchestrator: dict) -> None:
    """The rendered env entry builds as a worker would build it: environments/swe_env is installed (setup.sh)."""
    (entry,) = orchestrator["env"]
    assert entry["entrypoint"] == "swe_env:SWEEnvironment" and entry["kwargs"]["tasks"] == "bundled"
    env = build_environment(TypeAdapter(EnvConfig).validate_python(entry))
    assert type(env).__name__ == "SWEEnvironment" and len(env.ids) == 8
    assert env.max_turns == entry["kwargs"]["max_turns"]


def test_glm_4_5_air_two_node_overlay(tmp_path):
    glm = EXAMPLES / "glm-4.5-air"
    run_dir = _dry_run(tmp_path, glm / "swe-budget.toml", glm / "swe-2-node.toml")
    sbatch = (run_dir / "launcher" / "rl.sbatch").read_text()
    assert "#SBATCH --nodes=2" in sbatch and "#SBATCH --gres=gpu:8" in sbatch
    trainer = tomllib.loads((run_dir / "configs" / "trainer.toml").read_text())
    assert trainer["optim"]["type"] == "sign_sgd" and trainer["model"]["offload"] == "full"
    assert trainer["model"]["name"] == "zai-org/GLM-4.5-Air"
    orchestrator = tomllib.loads((run_dir / "configs" / "orchestrator.toml").read_text())
    assert orchestrator["batch_size"] == 64  # the overlay's, over the base's 256
    _assert_builds_swe_env(orchestrator)
    assert orchestrator["model"]["tool_call_parser"] == "glm45"  # taken from [inference.vllm]
    inference = tomllib.loads((run_dir / "configs" / "inference.toml").read_text())
    assert inference["vllm"]["tensor_parallel_size"] == 8 and inference["vllm"]["data_parallel_size"] == 1


def test_nemotron_3_super_four_trainer_nodes_one_inference_node_nccl(tmp_path):
    run_dir = _dry_run(tmp_path, EXAMPLES / "nemotron-3-super" / "swe.toml")
    sbatch = (run_dir / "launcher" / "rl.sbatch").read_text()
    assert "#SBATCH --nodes=5" in sbatch
    # rank 0 of the trainer pushes to every inference server's control endpoint, resolved on the cluster
    assert '--weight-broadcast.host "$TRAIN_HEAD"' in sbatch and "--weight-broadcast.inference-addresses" in sbatch
    trainer = tomllib.loads((run_dir / "configs" / "trainer.toml").read_text())
    assert trainer["weight_broadcast"]["type"] == "nccl" and trainer["model"]["ep"] == 8
    _assert_builds_swe_env(tomllib.loads((run_dir / "configs" / "orchestrator.toml").read_text()))


def _inference_dry_run(tmp_path: Path, config: Path) -> str:
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = subprocess.run(
        [BIN / "inference", "@", config, "--output-dir", tmp_path / "out", "--dry-run"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return (tmp_path / "out" / "inference" / "launcher" / "inference.sbatch").read_text()


def test_glm_5_3_replicas_and_pd_disaggregated_inference(tmp_path):
    sbatch = _inference_dry_run(tmp_path / "replicas", EXAMPLES / "glm-5.3" / "inference.toml")
    assert "#SBATCH --nodes=4" in sbatch
    sbatch = _inference_dry_run(tmp_path / "pd", EXAMPLES / "glm-5.3" / "inference-pd.toml")
    assert "#SBATCH --nodes=4" in sbatch and "--vllm-pd-disaggregation" in sbatch
    assert 'if [ "$i" -lt 2 ]; then role=prefill' in sbatch  # the first two nodes prefill, the other two decode

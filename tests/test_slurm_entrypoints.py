"""`sft` and `inference` hand a config with [slurm] to the launcher: --dry-run writes the sbatch script."""

import subprocess
import sys
from pathlib import Path

from prime_rl.common.testing import make_tiny_model

BIN = Path(sys.executable).parent


def test_sft_and_inference_with_slurm_write_their_sbatch(tmp_path):
    model = make_tiny_model(tmp_path / "model", dtype="float32")
    cfg = tmp_path / "sft.toml"
    cfg.write_text(
        f'max_steps = 2\noutput_dir = "{tmp_path}/out"\n[model]\nname = "{model}"\n[data]\ntype = "fake"\n'
        '[deployment]\ntype = "multi_node"\nnum_train_nodes = 2\ngpus_per_node = 1\n[slurm]\njob_name = "t"\n'
    )
    out = subprocess.run([BIN / "sft", "@", cfg, "--dry-run"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    sbatch = (tmp_path / "out" / "sft" / "launcher" / "sft.sbatch").read_text()
    assert "#SBATCH --nodes=2" in sbatch and "torch.distributed.run" in sbatch
    out = subprocess.run(
        [BIN / "inference", "--model.name", model, "--deployment.type", "multi_node", "--deployment.num-infer-nodes",
         "2", "--slurm.job-name", "i", "--output-dir", tmp_path / "out", "--dry-run"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "out" / "inference" / "launcher" / "inference.sbatch").is_file()


ROOT = Path(__file__).resolve().parents[1]


def test_seed_slurm_overlay_switches_the_example_to_multi_node(tmp_path):
    """scaling.md's thin overlay on this repository's example: `[deployment] type = "multi_node"` replaces the
    example's single-node keys (num_train_gpus, ...) instead of merging into them."""
    overlay = tmp_path / "my_slurm.toml"
    overlay.write_text(
        f'output_dir = "{tmp_path}/shared/outputs/my-rl"\n\n[slurm]\njob_name = "my-rl-run"\n\n'
        '[deployment]\ntype = "multi_node"\nnum_train_nodes = 2\nnum_infer_nodes = 1\ngpus_per_node = 8\n'
    )
    out = subprocess.run(
        [BIN / "rl", "@", ROOT / "examples/arithmetic/rl.toml", "@", overlay, "--dry-run"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    run_dir = tmp_path / "shared" / "outputs" / "my-rl" / "rl"
    sbatch = (run_dir / "launcher" / "rl.sbatch").read_text()
    assert "#SBATCH --nodes=3" in sbatch and "#SBATCH --job-name=my-rl-run" in sbatch
    assert 'type = "multi_node"' in (run_dir / "launcher" / "rl.toml").read_text()

"""`rl`'s own command lines, word for word as the launcher spelled them before prime_rl.common.commands owned them."""

import sys

from prime_rl.common.config import load_config
from prime_rl.common.config.rl import RLConfig
from prime_rl.common.rundir import RunDir
from prime_rl.launcher import rl


def test_local_run_starts_inference_orchestrator_and_a_loopback_torchrun(tmp_path):
    cfg = load_config(RLConfig, ["--model.name", "/m", "--deployment.num-train-gpus", "2"])
    configs = {name: tmp_path / "configs" / f"{name}.toml" for name in ("rl", "trainer", "orchestrator", "inference")}
    run_dir = RunDir(tmp_path, "r")
    run_dir.start_attempt()
    components = rl.build_components(cfg, run_dir, configs, [], [], secret=None)
    py = sys.executable
    assert {c.name: c.cmd for c in components} == {
        "inference": [py, "-m", "prime_rl.inference.entrypoint", "@", str(configs["inference"])],
        "orchestrator": [py, "-m", "prime_rl.orchestrator.entrypoint", "@", str(configs["orchestrator"])],
        "trainer": [
            py, "-m", "prime_rl.trainer.torchrun_loopback", "--nproc-per-node", "2", "--local-ranks-filter", "0",
            "-m", "prime_rl.trainer.rl.train", "@", str(configs["trainer"]),
        ],
    }  # fmt: skip


def test_a_slurm_run_is_handed_to_the_slurm_launcher(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(rl.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    configs = {"rl": tmp_path / "rl.toml"}
    assert rl.submit_slurm(RunDir(tmp_path, "r"), configs, dry_run=True) == 0
    assert rl.submit_slurm(RunDir(tmp_path, "r"), configs, dry_run=False) == 0
    base = [sys.executable, "-m", "prime_rl.launcher.slurm", "rl", "@", str(tmp_path / "rl.toml")]
    assert calls == [[*base, "--dry-run"], base]

import subprocess
import sys
import textwrap

from prime_rl.common.config.orchestrator import OrchestratorConfig
from prime_rl.orchestrator.entrypoint import main


def test_config_from_toml_and_flags(tmp_path):
    toml = tmp_path / "orch.toml"
    toml.write_text(
        textwrap.dedent(
            """
            batch_size = 16
            group_size = 4
            [env]
            type = "arithmetic"
            num_terms = 3
            [model.client]
            base_url = "http://infer:9000/v1"
            """
        )
    )
    from prime_rl.common.config import load_config

    cfg = load_config(OrchestratorConfig, ["@", str(toml), "--max-off-policy-steps", "2", "--trainer.port", "31000"])
    assert cfg.env.type == "arithmetic" and cfg.env.num_terms == 3
    assert cfg.model.client.base_url == "http://infer:9000/v1" and cfg.groups_per_step == 4
    assert cfg.max_off_policy_steps == 2 and cfg.trainer.port == 31000


def test_bad_sizes_rejected_with_fix():
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="multiple of group_size"):
        OrchestratorConfig(batch_size=10, group_size=4)
    with pytest.raises(ValidationError, match="below seq_len"):
        OrchestratorConfig(max_tokens=512, seq_len=512)


def test_dry_run_writes_resolved_config(tmp_path, capsys):
    main(["--output-dir", str(tmp_path), "--run-name", "r", "--dry-run", "--batch-size", "32"])
    written = tmp_path / "r" / "configs" / "orchestrator.toml"
    assert written.is_file()
    from prime_rl.common.config import load_config

    assert load_config(OrchestratorConfig, ["@", str(written)]).batch_size == 32


def test_orchestrator_never_imports_torch():
    code = (
        "import sys, prime_rl.orchestrator.entrypoint, prime_rl.orchestrator.envs.reverse_text; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

import subprocess
import sys
import textwrap

import pytest

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
    # one [env] table is still accepted: a list of one environment
    assert len(cfg.env) == 1 and cfg.env[0].type == "arithmetic" and cfg.env[0].num_terms == 3
    assert cfg.model.client.base_url == "http://infer:9000/v1" and cfg.groups_per_step == 4
    assert cfg.max_off_policy_steps == 2 and cfg.trainer.port == 31000


def test_several_environments_with_weights(tmp_path):
    from pydantic import ValidationError

    from prime_rl.common.config import load_config

    toml = tmp_path / "orch.toml"
    toml.write_text(
        textwrap.dedent(
            """
            [[env]]
            type = "arithmetic"
            weight = 3
            [[env]]
            type = "tool_arithmetic"
            name = "tools"
            timeout = 5
            workers = 2
            """
        )
    )
    cfg = load_config(OrchestratorConfig, ["@", str(toml)])
    assert [(e.resolved_name, e.weight, e.workers) for e in cfg.env] == [("arithmetic", 3.0, 1), ("tools", 1.0, 2)]
    assert cfg.env[1].timeout == 5
    with pytest.raises(ValidationError, match="appear more than once"):
        OrchestratorConfig(env=[{"type": "arithmetic"}, {"type": "arithmetic"}])
    with pytest.raises(ValidationError, match="tool_arithmetic"):  # the discriminator names the valid types
        OrchestratorConfig(env=[{"type": "no_such_env"}])


def test_bad_sizes_rejected_with_fix():
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="multiple of group_size"):
        OrchestratorConfig(batch_size=10, group_size=4)
    with pytest.raises(ValidationError, match="below seq_len"):
        OrchestratorConfig(sampling={"max_tokens": 512}, seq_len=512)


def test_old_top_level_sampling_keys_move_into_sampling():
    import pytest
    from pydantic import ValidationError

    cfg = OrchestratorConfig(temperature=0.7, max_tokens=8, seq_len=64)
    assert (cfg.sampling.temperature, cfg.sampling.max_tokens) == (0.7, 8)
    assert "temperature" not in cfg.model_dump()  # the resolved config speaks only [sampling]
    with pytest.raises(ValidationError, match="keep only sampling.temperature"):
        OrchestratorConfig(temperature=0.7, sampling={"temperature": 1.0})


def test_sampling_the_trainer_cannot_model_needs_an_opt_in():
    import pytest
    from pydantic import ValidationError

    for key, value in [("top_p", 0.8), ("top_k", 20), ("min_p", 0.1), ("repetition_penalty", 1.1),
                       ("presence_penalty", 0.5), ("frequency_penalty", -0.5)]:  # fmt: skip
        with pytest.raises(ValidationError, match=f"{key}={value} reshapes the sampled distribution"):
            OrchestratorConfig(sampling={key: value})
        assert getattr(OrchestratorConfig(sampling={key: value, "allow_unmodeled": True}).sampling, key) == value
    for off in ({"top_k": 0}, {"top_k": -1}, {"top_p": 1}, {"temperature": 0.3}):
        OrchestratorConfig(sampling=off)


@pytest.mark.parametrize(
    "flags, key",
    [
        (["--group-size", "1", "--batch-size", "4"], "group_size"),
        (["--sampling.top-k", "20"], "sampling.top_k"),
        (["--sampling.top-p", "0.9"], "sampling.top_p"),
    ],
)
def test_bad_input_is_one_line_naming_the_key_and_exit_2(flags, key):
    out = subprocess.run(
        [sys.executable, "-m", "prime_rl.orchestrator.entrypoint", *flags], capture_output=True, text=True
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and out.stderr.startswith(f"orchestrator: error: {key}:")


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


@pytest.mark.parametrize("module", ["prime_rl.orchestrator.entrypoint", "prime_rl.orchestrator.eval_entrypoint"])
def test_help_imports_only_the_config(module):
    """`orchestrator --help` and `eval --help` print the schema: the runtime (httpx, numpy, ZeroMQ, asyncio)
    stays unimported."""
    code = (
        f"import sys; from {module} import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "heavy = [m for m in ('torch', 'numpy', 'zmq', 'httpx', 'asyncio', 'urllib.request') if m in sys.modules]\n"
        "assert not heavy, f'--help imported {heavy}'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "--model.name" in out.stdout

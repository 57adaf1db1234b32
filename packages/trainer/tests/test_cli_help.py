"""`sft --help` and `trainer --help` validate nothing and start nothing: they must not import torch
(seconds), vLLM, numpy or ZeroMQ; the help is the config schema's alone."""

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["prime_rl.trainer.sft.entrypoint", "prime_rl.trainer.rl.entrypoint"])
def test_help_imports_no_torch(module):
    code = (
        f"import sys; from {module} import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "heavy = [m for m in ('torch', 'vllm', 'numpy', 'zmq', 'transformers') if m in sys.modules]\n"
        "assert not heavy, f'--help imported {heavy}'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "--model.name" in out.stdout


def test_sft_console_script_names_the_config_sft_parses():
    from prime_rl.common.config.trainer import SFTConfig
    from prime_rl.trainer.sft import console

    assert console.SFT_CONFIG == f"{SFTConfig.__module__}.{SFTConfig.__qualname__}"


@pytest.mark.parametrize("argv", [["--help"], ["-h", "model"]])
def test_sft_cached_help_is_the_rendered_help(tmp_path, argv):
    """The `sft` console script prints the stored text without importing pydantic, byte for byte what the
    entrypoint renders (which stored it)."""
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path), "COLUMNS": "110"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    texts = []
    for call in (
        "from prime_rl.trainer.sft.entrypoint import main; main()",
        "from prime_rl.trainer.sft.console import sft; sft()",
    ):
        code = (
            "import atexit, sys; atexit.register(lambda: print('pydantic' in sys.modules, file=sys.stderr))\n"
            f"sys.argv = ['sft', *{argv!r}]; {call}"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
        assert out.returncode == 0, out.stderr
        texts.append((out.stdout, out.stderr.splitlines()[-1]))
    (rendered, _), (cached, cached_pydantic) = texts
    assert "--model.name" in rendered and cached == rendered
    assert cached_pydantic == "False"

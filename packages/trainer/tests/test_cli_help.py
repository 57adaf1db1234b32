"""`sft --help` and `trainer --help` validate nothing and start nothing: they must not import torch
(seconds), vLLM, numpy or ZeroMQ; the help is the config schema's alone."""

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

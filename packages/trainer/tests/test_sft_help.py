"""`sft --help` validates nothing and starts nothing: it must not import torch (seconds) or numpy."""

import subprocess
import sys


def test_sft_help_imports_no_torch():
    code = (
        "import sys; from prime_rl.trainer.sft.entrypoint import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "heavy = [m for m in ('torch', 'vllm', 'numpy', 'zmq', 'transformers') if m in sys.modules]\n"
        "assert not heavy, f'sft --help imported {heavy}'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "--model.name" in out.stdout

"""The `rl` console script's `--help`: the cached text (read without importing pydantic) is byte for byte
what `prime_rl.launcher.rl.main` renders, for the whole help and for one table."""

import os
import subprocess
import sys

import pytest

from prime_rl.common.config.rl import RLConfig
from prime_rl.launcher import console

PYDANTIC_AT_EXIT = "import atexit, sys; atexit.register(lambda: print('pydantic' in sys.modules, file=sys.stderr))\n"


def _run(call: str, argv: list[str], env: dict[str, str]) -> tuple[str, bool]:
    """stdout of ``call`` with ``argv`` in a fresh process, and whether that process imported pydantic."""
    code = f"{PYDANTIC_AT_EXIT}import sys; sys.argv = ['rl', *{argv!r}]; {call}"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout, out.stderr.splitlines()[-1] == "True"


def test_the_console_script_names_the_config_rl_parses():
    assert console.RL_CONFIG == f"{RLConfig.__module__}.{RLConfig.__qualname__}"


@pytest.mark.parametrize("argv", [["--help"], ["--help", "trainer.model"]])
def test_cached_help_is_the_rendered_help(tmp_path, argv):
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path), "COLUMNS": "100"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    rendered, _ = _run("from prime_rl.launcher.rl import main; main()", argv, env)
    first, first_pydantic = _run("from prime_rl.launcher.console import rl; rl()", argv, env)
    cached, cached_pydantic = _run("from prime_rl.launcher.console import rl; rl()", argv, env)
    assert "--trainer.model.name" in rendered
    assert first == rendered and cached == rendered
    assert not first_pydantic and not cached_pydantic  # the slow path above stored it: both are hits
    narrower, narrower_pydantic = _run("from prime_rl.launcher.console import rl; rl()", argv, {**env, "COLUMNS": "90"})
    assert narrower_pydantic and narrower != rendered  # another width: rendered again, not the cached text

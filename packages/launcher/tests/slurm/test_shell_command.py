"""The SLURM renderer writes each component's argv (from prime_rl.common.commands) into bash: the words bash
reads back are the argv, with the job's shell words expanded, however the line is continued."""

from __future__ import annotations

import subprocess

from prime_rl.common import commands
from prime_rl.launcher.slurm.render import ShellWord, shell_command


def words_bash_reads(script_line: str, setup: str = "") -> list[str]:
    script = f'{setup}\nset -- \\\n    {script_line}\nprintf "%s\\0" "$@"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, check=True)
    return out.stdout.decode().split("\0")[:-1]


def test_quoted_words_and_shell_words_read_back_as_the_argv() -> None:
    argv = [
        "/path with space/python", "-m", "torch.distributed.run", "--node-rank", ShellWord('"$i"'),
        "--rdzv-endpoint", ShellWord('"$HEAD:29500"'), "--note", "it's $HOME `x`",
        "--addresses", ShellWord('"${ADDRS[@]}"'), "--last", "x" * 150,
    ]  # fmt: skip
    line = shell_command(argv, width=40)
    assert line.count("\\\n") > 3 and all(len(row) <= 40 for row in line.splitlines() if "x" * 150 not in row)
    expanded = [{'"$i"': "3", '"$HEAD:29500"': "h:29500"}.get(w, w) for w in argv]
    at = expanded.index('"${ADDRS[@]}"')
    expanded[at : at + 1] = ["tcp://a:1", "tcp://b 2"]
    setup = 'i=3; HEAD=h; ADDRS=("tcp://a:1" "tcp://b 2")'
    assert words_bash_reads(line, setup) == expanded


def test_an_option_keeps_its_values_on_its_line() -> None:
    argv = commands.torchrun_static_command("/p", 2, "0", 8, "h:1", "7", commands.SFT_TRAINER, "/c.toml")
    rows = shell_command(argv, width=60).split(" \\\n    ")
    assert "--local-ranks-filter 0" in " ".join(rows) and not any(r.endswith("--local-ranks-filter") for r in rows)
    assert words_bash_reads(shell_command(argv, width=60)) == argv

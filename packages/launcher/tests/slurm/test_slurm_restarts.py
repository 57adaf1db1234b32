"""The SLURM job's restart decisions (prime_rl.launcher.slurm.restarts `died`): the budget is kept across the job
script's calls in the restart record and counted within the window, as the local launcher counts it."""

import json
from pathlib import Path

from prime_rl.common.net import free_port
from prime_rl.launcher.slurm.restarts import main


def died(state: Path, replica: int, code: int) -> int:
    return main([
        "died", "--state", str(state), "--name", f"inference-node{replica}", "--replica", str(replica),
        "--max-restarts", "1", "--window", "60", "--router", f"http://127.0.0.1:{free_port()}",
        "--code", str(code), "--node", f"n{replica}", "--worker-url", f"http://n{replica}:9100",
    ])  # fmt: skip


def test_the_budget_is_kept_across_calls_and_counted_within_the_window(tmp_path: Path, capsys) -> None:
    state = tmp_path / "job_1.restarts.json"
    assert died(state, 0, 137) == 0
    out = capsys.readouterr().out
    assert out.startswith("inference-node0 on n0 died (SIGKILL) at ") and "restart 1/1 within" in out, out
    assert "router remove_worker failed: " in out  # no router here: said, and the restart goes on

    record = json.loads(state.read_text())
    record["restarting"].clear()  # what `readmit` does once the replica is back
    state.write_text(json.dumps(record))
    assert died(state, 1, 1) == 1  # the budget (1 within 60 s) is spent
    out = capsys.readouterr().out
    assert out.startswith("inference-node1 on n1 died (exit 1) at ") and "no restart left (1/1 used" in out, out
    assert "earlier: inference-node0 on n0 died (SIGKILL)" in out

    record["deaths"][0][0] -= 61  # the first restart falls out of the window
    state.write_text(json.dumps(record))
    assert died(state, 1, 1) == 0 and "restart 1/1 within" in capsys.readouterr().out
    assert died(state, 1, 137) == 1  # dies again while restarting
    assert capsys.readouterr().out.strip().endswith("; restart 1/1 died during start-up (SIGKILL)")

"""`exit_rank`: a finished rank ends with its exit code and every log line and print flushed, even though torch
keeps its gloo process group (and threads) alive past `destroy_process_group` through a DeviceMesh."""

import os
import subprocess
import sys

SCRIPT = """
import logging, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from prime_rl.trainer.world import close_world, exit_rank, init_world

logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
world = init_world()
mesh = init_device_mesh("cpu", (1,))
t = torch.ones(4)
dist.all_reduce(t, group=mesh.get_group())
close_world()
print("stdout line", end="")  # no newline: only an explicit flush writes it
logging.getLogger("rank").info("log line")
exit_rank(3)
"""


def test_exit_rank_flushes_and_keeps_the_code(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert proc.stdout == "stdout line"
    assert "log line" in proc.stderr

"""A single-node run's torchrun listens on loopback only (probe: its store listened on every interface)."""

import textwrap

from prime_rl.trainer.testing import torchrun

# Rank 0 lists what the torchrun agent (its parent) and it listen on, from /proc (no `ss` needed).
RANK = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist

    def listening(pid):
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        found = []
        for table in ("tcp", "tcp6"):
            for line in open(f"/proc/net/{table}").read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    found.append(fields[1].rsplit(":", 1)[0])
        return found

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        print("MASTER_ADDR", os.environ["MASTER_ADDR"], "SUM", t.item())
        print("LISTEN", " ".join(listening(os.getppid()) + listening(os.getpid())))
    dist.barrier()
    dist.destroy_process_group()
    """
)
LOOPBACK_HEX = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
"""127.0.0.1 (and ::1, 127.0.0.1 mapped into IPv6) as /proc/net/tcp{,6} writes them."""


def test_the_rendezvous_store_listens_on_loopback_only(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    result = torchrun(script, nproc=2, timeout=120, cwd=tmp_path)  # under commands.TORCHRUN_LOOPBACK, as `rl` runs
    lines = dict(
        line.split(" ", 1) for line in result.stdout.splitlines() if line.startswith(("MASTER_ADDR", "LISTEN"))
    )
    assert lines["MASTER_ADDR"] == "127.0.0.1 SUM 2.0"
    listening = lines["LISTEN"].split()
    assert listening, "the agent's store should be among the listeners"
    assert set(listening) <= LOOPBACK_HEX, listening  # `--standalone` listened on 00000000 (every interface)

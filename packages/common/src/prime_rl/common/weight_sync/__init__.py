"""The weight-transfer protocol, both ends, in one torch-level home (``pip install 'prime-rl-common[torch]'``).

The trainer (sending end) and the inference workers (receiving end) may not import each other, so the
protocol they share lives here, below both:

- ``broadcast``: the broadcast group (NCCL on GPU, gloo on CPU) both ends build, the bucket layout,
  packing/unpacking, and ``WeightBroadcaster``, the trainer's driver of a broadcast round;
- ``nixl_source`` / ``nixl_receiver``: the two ends of the receiver-driven NIXL transport, with their
  shared agent/buffer set-up in ``nixl_agent`` (the torch-free arithmetic and notifications are
  ``prime_rl.common.nixl_layout``, the metadata service ``prime_rl.common.nixl_metadata``);
- torch-free, beside this package: ``prime_rl.common.weight_layout``, the alignment, the one packer of
  broadcast buckets and NIXL groups, and torch dtype names (inference's API process checks layouts with it);
- ``servers``: the trainer's control connection to every inference server;
- ``announce``: the trainer's ``WeightsPublished`` message to the orchestrator (the orchestrator, which
  never imports torch, receives it with plain ``prime_rl.common.transport``).

Importing this package imports torch; nothing in the rest of ``prime_rl.common`` imports it (checked by
tests/test_boundaries.py), so the orchestrator and launcher stay torch-free.
"""

try:
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "prime_rl.common.weight_sync is the torch-level weight-transfer protocol: pip install 'prime-rl-common[torch]'"
    ) from e

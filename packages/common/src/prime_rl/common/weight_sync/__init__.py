"""The weight-transfer protocol, in one torch-level home (``pip install 'prime-rl-common[torch]'``).

The trainer (sending end, ``prime_rl.trainer.weights``) and the inference workers (receiving end,
``prime_rl.inference.weights``) may not import each other, so what both ends must agree on byte for byte
lives here, below both; the ends themselves do not:

- ``broadcast``: the broadcast group (NCCL on GPU, gloo on CPU) both ends build, the tensor specs and the
  bucket layout (``plan_buckets``, ``pack_bucket`` / ``unpack_bucket``);
- ``pinned``: ``pinned_empty``, exact-size page-locked host buffers for the long-lived host copies on both
  sides (rollback copies; optimizer offload, staging), where torch's pinned allocator rounds up to a power of two;
- ``nixl_agent``: the agent, buffer and polling set-up both ends of the NIXL transport build (the
  torch-free arithmetic and notifications are ``prime_rl.common.nixl_layout``, the metadata service
  ``prime_rl.common.nixl_metadata``);
- torch-free, beside this package: ``prime_rl.common.weight_layout``, the alignment, the one packer of
  broadcast buckets and NIXL groups, and torch dtype names (inference's API process checks layouts with it);
  ``prime_rl.common.weight_transports``, the table of each transport's lifecycle (who serves, who announces,
  who loads, its control requests and version rule).

Importing this package imports torch; nothing in the rest of ``prime_rl.common`` imports it (checked by
tests/test_boundaries.py), so the orchestrator and launcher stay torch-free.
"""

try:
    import torch  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "prime_rl.common.weight_sync is the torch-level weight-transfer protocol: pip install 'prime-rl-common[torch]'"
    ) from e

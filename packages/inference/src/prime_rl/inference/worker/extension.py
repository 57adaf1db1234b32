"""Worker-side weight updates, mixed into every vLLM worker with ``--worker-extension-cls``.

The API process reaches these methods through ``collective_rpc``: they run inside each worker, next
to the model, so weights are replaced in place without restarting the engine. Every transport ends in
the same place, ``prime_rl.inference.worker.reload``: checkpoint-format (Hugging Face) tensors go straight
into the served parameters where loading needs no post-processing (an unquantized dense model on CUDA),
else through vLLM's layerwise reload, which redoes it (repacking on CPU, quantization).

Validation (names, shapes, dtypes) happens in the API process before any of this runs, so a bad
update never reaches the model. What can only be seen in the data while it streams in (a transfer that
breaks midway, NaN/Inf) is rolled back from a host copy of the last complete update (``worker/broadcast.py``,
``worker/nixl.py``). The receiving ends of the transports are ``prime_rl.inference.weights``
(``broadcast_receiver``, ``nixl_receiver``); the protocol they share with the trainer's senders (broadcast
group, bucket layout, NIXL agents) is ``prime_rl.common.weight_sync``.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable, Iterable, Iterator

import torch
from safetensors import safe_open

from prime_rl.common.weight_sync.broadcast import BucketLayout, WeightGroup, build_weight_group
from prime_rl.common.wire import InitIpcRequest, decode


def _iter_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _takes_layout_fields(receive: Callable[..., dict]) -> Callable[..., dict]:
    """The worker RPC entry point of a streamed transport (broadcast, ipc) from ``receive(self, layout, version,
    served)``, timed. vLLM calls it by name with the positional arguments of this signature: the API process
    validated the request and passes its layout on as columns (``prime_rl.inference.weights.push``).

    Layout (chosen by the sender): tensor ``i`` occupies bytes ``[offsets[i], offsets[i] + numel * itemsize)``
    of bucket ``buckets[i]``; buckets arrive in order 0, 1, ... as flat uint8 tensors; tensors are listed in
    bucket order. A failed or non-finite update is rolled back (see ``prime_rl.inference.worker.broadcast``).
    """

    def entry(
        self: PrimeWorkerExtension,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        buckets: list[int],
        offsets: list[int],
        bucket_sizes: list[int],
        version: int = 0,
        served: int = 0,
    ) -> dict:
        start = time.perf_counter()
        layout = BucketLayout.from_fields(names, dtypes, shapes, buckets, offsets, bucket_sizes)
        stats = receive(self, layout, version, served)
        return {**stats, "seconds": time.perf_counter() - start}

    entry.__name__, entry.__qualname__ = receive.__name__, receive.__qualname__
    entry.__doc__ = receive.__doc__
    return entry


class PrimeWorkerExtension:
    """Methods added to vLLM's worker class; ``self`` is the worker (``self.model_runner``, ``self.rank``)."""

    _prime_group: WeightGroup | None = None
    _prime_bcast_keep = True  # keep a host copy of the last complete broadcast (set by prime_init_broadcast)
    _prime_bcast_copy = None  # prime_rl.inference.worker.broadcast.RollbackCopy of the served broadcast
    _prime_bcast_spares: list = []  # host buffers the next rollback copy reuses (replaced, never mutated)
    _prime_nixl = None  # prime_rl.inference.weights.nixl_receiver.NixlReceiver, built by prime_init_nixl
    _prime_ipc = None  # prime_rl.inference.weights.ipc_receiver.IpcReceiver, built by prime_init_ipc

    # -- helpers -------------------------------------------------------------------------------

    def _prime_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def _prime_reload(self, batches: Iterable[Iterable[tuple[str, torch.Tensor]]]) -> int:
        """Load checkpoint-format tensors, batch by batch (``prime_rl.inference.worker.reload``: directly into the
        served parameters where that is exact, else through vLLM's layerwise reload)."""
        from prime_rl.inference.worker.reload import ModelReload

        reload = ModelReload(self, copy=False)
        try:
            for batch in batches:
                reload.load(batch)
        finally:
            reload.finish()  # a layerwise reload left open would keep the model on the meta device
        return reload.count

    def _prime_refresh_tied_lm_head(self, model: torch.nn.Module) -> None:
        # With tied embeddings the LM head shares the embedding's parameter, but on CPU its kernel keeps a
        # packed copy made at load time; the reload repacks only modules whose weights it loaded, so the
        # head would keep computing logits with the old weights.
        lm_head = getattr(model, "lm_head", None)
        hf_config = self.vllm_config.model_config.hf_config  # type: ignore[attr-defined]
        if lm_head is None or not getattr(hf_config, "tie_word_embeddings", False):
            return
        quant_method = getattr(lm_head, "quant_method", None)
        if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
            quant_method.process_weights_after_loading(lm_head)

    def _prime_global_rank(self) -> int:
        parallel = self.vllm_config.parallel_config  # type: ignore[attr-defined]
        return parallel.data_parallel_index * parallel.world_size + self.rank  # type: ignore[attr-defined]

    # -- filesystem ----------------------------------------------------------------------------

    def prime_load_checkpoint(self, path: str) -> dict:
        """Reload every tensor of the safetensors files in ``path`` (a validated ``broadcasts/step_<n>``)."""
        start = time.perf_counter()
        self._prime_nixl_invalidate()
        self._prime_bcast_copy = None  # no longer what is served
        count = self._prime_reload([_iter_safetensors(path)])
        return {"tensors": count, "seconds": time.perf_counter() - start}

    # -- broadcast -----------------------------------------------------------------------------

    def prime_init_broadcast(
        self,
        host: str,
        port: int,
        world_size: int,
        rank_offset: int,
        backend: str,
        timeout_s: float,
        keep_rollback_copy: bool = True,
    ) -> dict:
        """Join the trainer's weight-broadcast group as rank ``rank_offset + global worker index``."""
        if self._prime_group is not None:
            self._prime_group.close()
            self._prime_group = None
        self._prime_bcast_keep = keep_rollback_copy
        if not keep_rollback_copy:
            self._prime_bcast_copy = None
        rank = rank_offset + self._prime_global_rank()
        self._prime_group = build_weight_group(host, port, rank, world_size, backend, timeout_s)
        return {"rank": rank}

    def prime_close_broadcast(self) -> None:
        if self._prime_group is not None:
            self._prime_group.close()
            self._prime_group = None

    @_takes_layout_fields
    def prime_receive_broadcast(self, layout: BucketLayout, version: int, served: int) -> dict:
        """Receive the layout's byte buckets from the trainer's group and load the tensors they hold."""
        from prime_rl.inference.worker.broadcast import receive

        group = self._prime_group
        if group is None:
            raise RuntimeError("no weight-broadcast group: send InitBroadcastRequest before BroadcastWeightsRequest")
        self._prime_nixl_invalidate()
        return receive(self, group, layout, version, served, self._prime_bcast_keep)

    # -- nixl ----------------------------------------------------------------------------------

    def _prime_nixl_invalidate(self) -> None:
        if self._prime_nixl is not None:
            self._prime_nixl.invalidate_rollback()

    def prime_init_nixl(
        self, host: str, port: int, session: str, rank_offset: int, keep_rollback_copy: bool, timeout_s: float
    ) -> dict:
        """Build this worker's NIXL receiver for a trainer session (replaces an older one)."""
        from prime_rl.inference.worker.nixl import init_receiver

        self.prime_close_nixl()
        receiver = init_receiver(self, host, port, session, rank_offset, keep_rollback_copy, timeout_s)
        self._prime_nixl = receiver
        self._prime_bcast_copy = None  # NIXL updates replace what a broadcast copy holds
        return {"agent": receiver.name, "arenas": receiver.num_arenas, "groups": len(receiver.layout.group_sizes)}

    def prime_close_nixl(self) -> None:
        if self._prime_nixl is not None:
            self._prime_nixl.close()
            self._prime_nixl = None

    def prime_receive_nixl(self, version: int) -> dict:
        """Pull ``version`` from the trainer ranks and load it (see ``prime_rl.inference.worker.nixl``)."""
        from prime_rl.inference.worker.nixl import receive

        if self._prime_nixl is None:
            raise RuntimeError("no NIXL receiver: send InitNixlRequest before NixlWeightsRequest")
        self._prime_bcast_copy = None  # whatever happens next, a broadcast copy no longer holds what serves
        return receive(self, self._prime_nixl, version)

    # -- ipc -----------------------------------------------------------------------------------

    def prime_init_ipc(self, request: bytes) -> dict:
        """Open the trainer's shared bucket slots (``request``: an encoded ``InitIpcRequest``; see
        ``prime_rl.inference.worker.ipc``)."""
        from prime_rl.inference.worker.ipc import init_receiver

        message = decode(request)
        if not isinstance(message, InitIpcRequest):
            raise TypeError(f"prime_init_ipc takes an encoded InitIpcRequest, not {type(message).__name__}")
        return init_receiver(self, message)

    def prime_close_ipc(self) -> None:
        from prime_rl.inference.worker.ipc import close_receiver

        close_receiver(self)

    @_takes_layout_fields
    def prime_receive_ipc(self, layout: BucketLayout, version: int, served: int) -> dict:
        """Load ``version`` from the slots, bucket by bucket, as ``prime_receive_broadcast`` does from the group."""
        from prime_rl.inference.worker.ipc import receive

        self._prime_nixl_invalidate()
        return receive(self, layout, version, served)

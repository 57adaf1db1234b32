"""Every message that crosses a process boundary in prime-rl.

Design decisions:
- One module, msgspec Structs in the vLLM v1 style: ``array_like=True`` (positional, compact),
  ``omit_defaults=True``, ``gc=False`` (no cycles, cheaper to allocate) and ``tag=True`` (the class
  name travels first, so one decoder takes the ``Message`` union). New fields are appended LAST and
  get a default, so an older peer's positional encoding still decodes.
- The schema version is NOT a struct field: with ``omit_defaults`` a field equal to its default is
  dropped by the sender and refilled by the receiver, which would hide a mismatch. Instead every
  encoded message starts with ``SCHEMA_VERSION`` (see ``encode_header``);
  the receiver reads the version first, before it tries to decode a body it may not understand, and
  refuses another version with a ``SchemaVersionError`` that names both versions.
  (Envelope in full: ``[SCHEMA_VERSION, message, specs, placements]``, placements = where each array
  sits in the data frames.)
- Tensors never go inside the msgpack body. A message refers to them by ``TensorSpec`` (name, dtype,
  shape); the arrays travel as separate ZeroMQ frames after the header (see
  ``prime_rl.common.transport``). ``TensorSpec.name`` is the key under which the receiver finds the array.
- Bump ``SCHEMA_VERSION`` whenever a change is not append-only (a field removed, reordered or
  retyped, a message renamed).

Left out: compression (loopback / RDMA-class links are faster than any codec here) and pickle (never).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import msgspec
import numpy as np

SCHEMA_VERSION: int = 1
"""Version of every message in this module; peers with another version are refused."""


DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
"""Bytes per element of every dtype name a ``TensorSpec`` may carry (torch names; numpy has no bfloat16)."""


def tensor_bytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a dense tensor of dtype name ``dtype`` and ``shape``: the one size rule of every spec and transport.
    A name outside ``DTYPE_ITEMSIZE`` takes numpy's itemsize (TypeError where numpy has no such dtype); the
    transports that carry only the table's dtypes (NIXL, the inference server's checks) refuse others first."""
    itemsize = DTYPE_ITEMSIZE.get(dtype) or np.dtype(dtype).itemsize
    return math.prod(shape) * itemsize  # math.prod: 50x faster than np.prod here


class WireError(ValueError):
    """A message could not be decoded: malformed bytes, unknown tag, wrong frames."""


class SchemaVersionError(WireError):
    """The peer speaks another ``SCHEMA_VERSION``."""


class _Struct(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Base options for every wire struct (not itself a message)."""


class Message(_Struct, tag=True):
    """Base of every top-level message; the tag (class name) is what a union decoder dispatches on."""


# ---------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------

_dtype_names: dict[np.dtype, str] = {}


def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, cached: numpy computes it in Python (~7 us), too slow for thousands of frames."""
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = dtype.name
    return name


class TensorSpec(_Struct):
    """Describes one array that travels as its own zero-copy frame (or over a weight transport)."""

    name: str
    """Key of the array; unique within one message."""
    dtype: str
    """numpy dtype string, e.g. "int32", "float32", "bool"; "bfloat16" only for weight specs."""
    shape: list[int]
    """Array shape."""

    @classmethod
    def of(cls, name: str, array: np.ndarray) -> TensorSpec:
        return cls(name=name, dtype=dtype_name(array.dtype), shape=list(array.shape))

    @property
    def num_bytes(self) -> int:
        return tensor_bytes(self.dtype, self.shape)


# ---------------------------------------------------------------------------------------------
# Orchestrator -> trainer
# ---------------------------------------------------------------------------------------------

MICRO_BATCH_DTYPES: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int32),
    "position_ids": np.dtype(np.int32),
    "loss_mask": np.dtype(np.bool_),
    "advantages": np.dtype(np.float32),
    "inference_logprobs": np.dtype(np.float32),
}
"""Required dtype of each micro-batch array; all five share one shape, ``[seq_len]`` or ``[B, seq_len]``."""
ROUTED_EXPERTS_DTYPE = np.dtype(np.int16)
"""Expert ids of ``MicroBatch.routed_experts`` (vLLM reports uint8 / uint16; -1 marks a token with none)."""


class MicroBatch(_Struct):
    """Header of one packed micro-batch; the arrays are frames named by the specs."""

    input_ids: TensorSpec
    """int32 token ids, samples packed back to back."""
    position_ids: TensorSpec
    """int32 positions, reset to 0 at every sample start (document masking derives from this)."""
    loss_mask: TensorSpec
    """bool: True where the token is a completion token that contributes to the loss."""
    advantages: TensorSpec
    """float32 per-token advantage."""
    inference_logprobs: TensorSpec
    """float32 logprob of each token under the inference policy that sampled it (0 for prompt tokens)."""
    temperature: float
    """Sampling temperature the rollouts used; the trainer divides logits by it."""
    routed_experts: TensorSpec | None = None
    """int16 ``[*input_ids.shape, num_hidden_layers, top_k]``: the experts inference routed each token to at each
    layer (vLLM's routed experts), -1 where it reported none (padding, a sample's last token); None when the
    orchestrator did not ask for them (``orchestrator.routed_experts``)."""

    def specs(self) -> list[TensorSpec]:
        specs = [getattr(self, field) for field in MICRO_BATCH_DTYPES]
        return specs if self.routed_experts is None else [*specs, self.routed_experts]


class TrainingBatch(Message):
    """One optimizer step's worth of micro-batches for one trainer data-parallel rank."""

    step: int
    """Trainer step this batch is for."""
    policy_version: int
    """Newest policy version that produced any rollout in the batch."""
    micro_batches: list[MicroBatch]
    """Micro-batches to accumulate gradients over, in order."""
    metrics: dict[str, float] = {}
    """Orchestrator-side metrics for this step (reward/*, seq_len/*, ...), logged by the trainer."""


def build_micro_batch(
    prefix: str,
    *,
    input_ids: np.ndarray,
    position_ids: np.ndarray,
    loss_mask: np.ndarray,
    advantages: np.ndarray,
    inference_logprobs: np.ndarray,
    temperature: float,
    routed_experts: np.ndarray | None = None,
) -> tuple[MicroBatch, dict[str, np.ndarray]]:
    """Validate five arrays (and the optional routed experts) and return the header plus ``{frame name: array}``.

    ``prefix`` makes frame names unique inside a ``TrainingBatch`` (e.g. ``"mb3"`` -> ``"mb3/input_ids"``).
    Arrays are cast to the wire dtype only when they differ (a cast is a copy).
    """
    given = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "loss_mask": loss_mask,
        "advantages": advantages,
        "inference_logprobs": inference_logprobs,
    }
    shape = np.shape(input_ids)
    arrays: dict[str, np.ndarray] = {}
    specs: dict[str, TensorSpec] = {}
    for field, dtype in MICRO_BATCH_DTYPES.items():
        array = np.ascontiguousarray(given[field], dtype=dtype)
        if array.shape != shape:
            raise WireError(
                f"micro-batch {prefix!r}: {field} has shape {array.shape} but input_ids has {shape}; "
                "all five arrays must share one shape ([seq_len] or [B, seq_len])"
            )
        name = f"{prefix}/{field}"
        arrays[name] = array
        specs[field] = TensorSpec.of(name, array)
    if routed_experts is not None:
        array = np.ascontiguousarray(routed_experts, dtype=ROUTED_EXPERTS_DTYPE)
        if array.ndim != len(shape) + 2 or array.shape[: len(shape)] != shape:
            raise WireError(
                f"micro-batch {prefix!r}: routed_experts has shape {array.shape}; expected {shape} + (layers, top_k)"
            )
        arrays[f"{prefix}/routed_experts"] = array
        specs["routed_experts"] = TensorSpec.of(f"{prefix}/routed_experts", array)
    return MicroBatch(**specs, temperature=float(temperature)), arrays


def build_training_batch(
    step: int,
    policy_version: int,
    micro_batches: Sequence[Mapping[str, np.ndarray]],
    temperature: float,
    metrics: Mapping[str, float] | None = None,
) -> tuple[TrainingBatch, dict[str, np.ndarray]]:
    """A ``TrainingBatch`` plus its frames from micro-batches given as ``{field: array}`` dicts.

    Each dict holds the five ``MICRO_BATCH_DTYPES`` fields (and optionally ``routed_experts``); frame names are
    ``mb<i>/<field>``.
    """
    headers: list[MicroBatch] = []
    arrays: dict[str, np.ndarray] = {}
    for i, fields in enumerate(micro_batches):
        missing = set(MICRO_BATCH_DTYPES) - set(fields)
        if missing:
            raise WireError(f"micro-batch {i} lacks {sorted(missing)}; each needs {list(MICRO_BATCH_DTYPES)}")
        header, frames = build_micro_batch(
            f"mb{i}",
            **{field: fields[field] for field in MICRO_BATCH_DTYPES},
            temperature=temperature,
            routed_experts=fields.get("routed_experts"),
        )
        headers.append(header)
        arrays.update(frames)
    batch = TrainingBatch(
        step=step,
        policy_version=policy_version,
        micro_batches=headers,
        metrics={k: float(v) for k, v in (metrics or {}).items()},
    )
    return batch, arrays


def micro_batch_arrays(micro_batch: MicroBatch, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The five arrays of a received micro-batch (and its routed experts when sent), keyed by field name, checked
    against its specs."""
    out: dict[str, np.ndarray] = {}
    for field, dtype in MICRO_BATCH_DTYPES.items():
        spec: TensorSpec = getattr(micro_batch, field)
        if spec.name not in arrays:
            raise WireError(f"micro-batch field {field}: frame {spec.name!r} missing; got {sorted(arrays)[:8]}")
        array = arrays[spec.name]
        if array.dtype != dtype or list(array.shape) != spec.shape:
            raise WireError(
                f"micro-batch field {field}: frame {spec.name!r} is {array.dtype}{list(array.shape)}, "
                f"expected {dtype}{spec.shape}"
            )
        out[field] = array
    spec = micro_batch.routed_experts
    if spec is not None:
        array = arrays.get(spec.name)
        if array is None or array.dtype != ROUTED_EXPERTS_DTYPE or list(array.shape) != spec.shape:
            got = "missing" if array is None else f"{array.dtype}{list(array.shape)}"
            raise WireError(
                f"micro-batch field routed_experts: frame {spec.name!r} is {got}, expected int16{spec.shape}"
            )
        out["routed_experts"] = array
    return out


# ---------------------------------------------------------------------------------------------
# Inference control plane (orchestrator / trainer -> inference server)
# ---------------------------------------------------------------------------------------------


class PauseRequest(Message):
    """Stop scheduling new generation (e.g. before a weight update)."""

    mode: str = "wait"
    """What happens to in-flight requests: "abort", "wait" (let them finish) or "keep" (freeze them)."""
    by: str = ""
    """Who pauses (e.g. "orchestrator"), logged and reported with the peer address; the run secret, not
    this name, is what authenticates the request."""


class ResumeRequest(Message):
    """Resume generation after a pause."""


class LoadWeightsRequest(Message):
    """Load weights from a directory (filesystem transport: broadcasts/step_<n>/)."""

    path: str
    """Directory holding the safetensors files (and the atomic-completion marker)."""
    version: int
    """Policy version these weights are; reported back in ControlReply.weight_version."""


class InitBroadcastRequest(Message):
    """Join a collective group with the trainer for broadcast weight transfer (nccl / gloo)."""

    host: str
    """Rendezvous host (the trainer's rank 0)."""
    port: int
    """Rendezvous port."""
    world_size: int
    """Total group size: 1 trainer sender + all inference workers."""
    rank_offset: int
    """Rank of this server's first worker in the group (the worker adds its local rank)."""
    backend: str = "nccl"
    """torch.distributed backend: "nccl" on GPU, "gloo" on CPU."""
    keep_rollback_copy: bool = True
    """Each worker keeps a host copy of the last complete broadcast, to roll back a failed or non-finite one."""


class BroadcastWeightsRequest(Message):
    """Receive one weight update over the initialized broadcast group."""

    version: int
    """Policy version of the weights being broadcast."""
    specs: list[TensorSpec]
    """Every tensor, in broadcast order, with its HF parameter name, dtype and shape."""
    buckets: list[int] = []
    """Bucket index of each tensor (parallel to ``specs``); buckets are broadcast in order 0, 1, ... as
    flat uint8 tensors and tensors are listed in bucket order."""
    offsets: list[int] = []
    """Byte offset of each tensor inside its bucket (a multiple of 256 so every dtype view is aligned)."""
    bucket_sizes: list[int] = []
    """Size in bytes of each bucket."""


class AwaitWeightsRequest(Message):
    """Wait until the update started by a BroadcastWeightsRequest has been received and applied.

    BroadcastWeightsRequest is answered as soon as the server has validated the specs and its workers
    wait for the data, so the trainer knows it may start broadcasting; this request then returns
    ControlReply(ok, error, weight_version) once the workers have loaded the weights (or failed)."""

    version: int
    """Policy version of the broadcast being awaited."""


class HealthRequest(Message):
    """Is the server alive, and which weights does it serve?"""


class ControlReply(Message):
    """Answer to any control request."""

    ok: bool
    """True when the request was carried out."""
    error: str | None = None
    """What went wrong (value, rule, fix) when ok is False."""
    weight_version: int = 0
    """Policy version the server holds after handling the request."""
    boot_id: str = ""
    """Random per start of the server process ("" from a server that does not say): a reply with another id than
    the last one from the same address comes from a restarted server, whatever request it answers."""


class HealthReply(Message):
    """Answer to a HealthRequest."""

    ok: bool
    """True when the engine is up and can generate."""
    weight_version: int = 0
    """Policy version currently served."""
    paused: bool = False
    """True while generation is paused."""
    num_running: int = 0
    """Requests currently being generated."""
    num_waiting: int = 0
    """Requests queued."""
    model: str = ""
    """Served model name."""
    run_id: str = ""
    """Fingerprint of the run secret the server was started with ("" without one): a launcher calls a
    server ready only if this is its own run's id (``prime_rl.common.auth.RunSecret.run_id``)."""
    boot_id: str = ""
    """As in ``ControlReply``: random per start of the server process."""
    error: str = ""
    """Why ``ok`` is False: e.g. a failed weight update whose previous weights could not be restored."""
    sleeping: bool = False
    """True while the engine sleeps (colocated runs: the trainer has the GPUs); see ``SleepRequest``."""
    awake: list[str] = []
    """What of the engine is awake ("weights", "kv_cache"): both when not sleeping, none right after a sleep."""


# ---------------------------------------------------------------------------------------------
# NIXL weight transport (``[weight_broadcast] type = "nixl"``): metadata service + control requests
# ---------------------------------------------------------------------------------------------


class NixlPeer(_Struct):
    """One NIXL agent as published in the metadata service (a trainer rank or an inference worker)."""

    name: str
    """Agent name, unique per process and session."""
    metadata: bytes
    """``nixl_agent.get_agent_metadata()``: what a peer loads with ``add_remote_agent``."""
    rank: int = 0
    """Trainer rank (sources) or global worker rank (receivers)."""
    slot_addrs: list[int] = []
    """Sources: base address of each registered transfer slot (slot s holds this rank's slice of a group)."""
    slot_bytes: int = 0
    """Sources: size of each slot."""
    device_id: int = 0
    """Device id of the slots (0 for host memory)."""
    mem_type: str = "DRAM"
    """NIXL memory type of the slots: "DRAM" (host) or "VRAM" (GPU)."""


class NixlLayout(_Struct):
    """Where every tensor of an update sits in the transfer groups; fixed for a session."""

    specs: list[TensorSpec]
    """Every tensor in transfer order: HF name, torch dtype name ("bfloat16", ...), shape."""
    groups: list[int]
    """Transfer group of each tensor (non-decreasing)."""
    offsets: list[int]
    """Byte offset of each tensor inside its group (multiples of 256)."""
    group_sizes: list[int]
    """Bytes of each group; group g is split into ``num_sources`` aligned slices, one per trainer rank."""
    num_sources: int
    """Trainer ranks that each hold one slice of every group."""
    num_slots: int = 1
    """Transfer arenas on each side: 2 when transfer and replay overlap, else 1."""


class MetadataPutRequest(Message):
    """Store ``value`` under ``key`` in the NIXL metadata service (replaces an older value)."""

    key: str
    """e.g. "<session>/trainer/0"."""
    value: bytes
    """Opaque bytes (an encoded NixlPeer / NixlLayout)."""


class MetadataGetRequest(Message):
    """Read one key from the metadata service; MetadataReply.value is None when absent."""

    key: str
    """Key to read."""


class MetadataListRequest(Message):
    """List the keys that start with ``prefix``."""

    prefix: str
    """e.g. "<session>/infer/"."""


class MetadataReply(Message):
    """Answer of the metadata service."""

    ok: bool
    """True when the request was carried out."""
    error: str | None = None
    """What went wrong when ok is False."""
    value: bytes | None = None
    """MetadataGetRequest: the stored value, None if the key is absent."""
    keys: list[str] = []
    """MetadataListRequest: matching keys, sorted."""


class InitNixlRequest(Message):
    """Set up NIXL receivers in every worker for one trainer session (peer metadata exchanged once)."""

    host: str
    """Host of the metadata service."""
    port: int
    """Port of the metadata service."""
    session: str
    """Key prefix of the trainer session in the service (layout and trainer-rank peers live under it)."""
    rank_offset: int = 0
    """Added to each worker's global rank to pick the trainer rank its reads start at."""
    keep_rollback_copy: bool = True
    """Keep a host copy of the served weights so a failed transfer can be rolled back."""
    timeout_s: float = 600.0
    """Seconds to wait for a peer (metadata, readiness notification, read completion)."""


class NixlWeightsRequest(Message):
    """Pull weight version ``version`` from the trainer ranks of the initialized NIXL session.

    Answered once the workers are receiving; AwaitWeightsRequest(version) then waits for the result."""

    version: int
    """Policy version to pull; must be newer than the served one."""


# ---------------------------------------------------------------------------------------------
# IPC weight transport (``[weight_broadcast] type = "ipc"``): shared buffers on one host
# ---------------------------------------------------------------------------------------------


class IpcSlot(_Struct):
    """One shared bucket buffer of the trainer that inference workers open (``prime_rl.common.weight_sync.ipc``).

    Host memory: ``path`` names a file in /dev/shm both sides map. Device memory: the CUDA IPC handle of the
    trainer's buffer (the fields of ``torch.multiprocessing.reductions.reduce_tensor``), and the GPU's UUID so a
    worker whose ``CUDA_VISIBLE_DEVICES`` numbers the GPUs differently finds the same one."""

    size: int
    """Bytes of the buffer (at least the largest bucket of the session)."""
    path: str = ""
    """Host memory: the shared-memory file."""
    device_uuid: str = ""
    """Device memory: UUID of the GPU holding the buffer."""
    handle: bytes = b""
    """Device memory: CUDA IPC memory handle of the buffer's allocation."""
    storage_size_bytes: int = 0
    storage_offset_bytes: int = 0
    tensor_offset: int = 0
    ref_counter_handle: bytes = b""
    ref_counter_offset: int = 0
    event_handle: bytes = b""
    event_sync_required: bool = False


class InitIpcRequest(Message):
    """Open the trainer's shared bucket buffers in every worker and join its bucket channel (once per session)."""

    host: str
    """Host of the trainer's bucket channel (a TCP store on trainer rank 0: buckets ready, buckets consumed)."""
    port: int
    """Port of the bucket channel."""
    session: str
    """Key prefix of this session in the channel."""
    memory: str
    """"host" (shared-memory files) or "device" (CUDA IPC handles)."""
    slots: list[IpcSlot]
    """The ring of buffers; bucket b is written into slot b % len(slots)."""
    keep_rollback_copy: bool = True
    """Each worker keeps a host copy of the last complete update, to roll back a failed or non-finite one."""
    timeout_s: float = 600.0
    """Seconds a worker waits for the next bucket before giving up (and rolling back)."""


class IpcWeightsRequest(Message):
    """Load weight version ``version`` from the shared buffers; the layout is ``BroadcastWeightsRequest``'s.

    Answered once validated and the workers wait for buckets; AwaitWeightsRequest(version) then waits for the
    result."""

    version: int
    """Policy version of the weights."""
    specs: list[TensorSpec]
    """Every tensor, in bucket order, with its HF parameter name, dtype and shape."""
    buckets: list[int] = []
    """Bucket index of each tensor (parallel to ``specs``)."""
    offsets: list[int] = []
    """Byte offset of each tensor inside its bucket (a multiple of 256)."""
    bucket_sizes: list[int] = []
    """Size in bytes of each bucket (each at most the slots' size)."""


# ---------------------------------------------------------------------------------------------
# Trainer -> orchestrator
# ---------------------------------------------------------------------------------------------


class WeightsPublished(Message):
    """The trainer announces a new, complete policy version (``prime_rl.trainer.weights.announce``).

    Sent once per version, only when it is whole: with the filesystem transport after the directory
    was written and atomically renamed into place (``path`` names it; the orchestrator has inference
    load it), with nccl/nixl after every inference server serves it (``path`` is None)."""

    version: int
    """Policy version (= optimizer steps taken)."""
    path: str | None = None
    """Complete ``broadcasts/step_<version>`` directory to load; None when inference already serves it."""
    publish_s: float = 0.0
    """Seconds the training loop was blocked publishing this version."""
    write_s: float = 0.0
    """Seconds the background part took (write + rename, or waiting for the servers' reload)."""


class EnvRequest(Message):
    """Orchestrator -> environment worker process: call ``method`` of its environment."""

    id: int
    method: str
    args: bytes
    """msgpack of the call's keyword arguments."""


class EnvReply(Message):
    """Environment worker -> orchestrator: the result of request ``id``."""

    id: int
    ok: bool
    result: bytes = b""
    """msgpack of the result (ok)."""
    error: str = ""
    """One line: what failed (not ok)."""


# ---------------------------------------------------------------------------------------------
# Colocated runs (``[deployment] type = "colocated"``): inference sleeps while the trainer steps
# ---------------------------------------------------------------------------------------------


class SleepRequest(Message):
    """Orchestrator -> inference: abort what runs and sleep (vLLM sleep mode) so the trainer can use the GPUs.

    Level 1 moves the weights to host memory and frees the KV cache; level 2 discards both (the next weight
    load brings weights back). Answered once the memory is freed."""

    level: int = 1
    """vLLM sleep level, 1 or 2."""
    by: str = ""
    """Who asks (logged with the peer address)."""


class WakeUpRequest(Message):
    """Orchestrator -> inference: wake what ``tags`` names (``[]``: everything). A colocated step wakes
    "weights" first (so new weights can load into them), then "kv_cache" once they are loaded."""

    tags: list[str] = []
    """"weights", "kv_cache", or empty for both."""
    by: str = ""
    """Who asks (logged with the peer address)."""


COLOCATED_MESSAGE_TYPES: tuple[type[Message], ...] = (SleepRequest, WakeUpRequest)
"""Added to ``MESSAGE_TYPES`` below; kept in one block so other additions to the wire merge beside it."""


# Append new messages above this line and add them here; the union decoder needs the closed set.
MESSAGE_TYPES: tuple[type[Message], ...] = (
    TrainingBatch,
    PauseRequest,
    ResumeRequest,
    LoadWeightsRequest,
    InitBroadcastRequest,
    BroadcastWeightsRequest,
    HealthRequest,
    ControlReply,
    HealthReply,
    AwaitWeightsRequest,
    MetadataPutRequest,
    MetadataGetRequest,
    MetadataListRequest,
    MetadataReply,
    InitNixlRequest,
    NixlWeightsRequest,
    WeightsPublished,
    EnvRequest,
    EnvReply,
    InitIpcRequest,
    IpcWeightsRequest,
    *COLOCATED_MESSAGE_TYPES,
)


# ---------------------------------------------------------------------------------------------
# Envelope: [SCHEMA_VERSION, message, specs, placements]
# ---------------------------------------------------------------------------------------------


class Envelope(NamedTuple):
    """A decoded header frame."""

    message: Message
    specs: list[TensorSpec]
    """One per array carried after the header."""
    placements: list[tuple[int, int]]
    """(data frame index, byte offset) of each array: small arrays share a frame, large ones own one."""


_encoder = msgspec.msgpack.Encoder()
_raw_list_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])
_int_decoder = msgspec.msgpack.Decoder(int)
_specs_decoder = msgspec.msgpack.Decoder(list[TensorSpec])
_placements_decoder = msgspec.msgpack.Decoder(list[tuple[int, int]])
_message_decoders: dict[tuple[type[Message], ...], msgspec.msgpack.Decoder] = {}


def _message_decoder(types: tuple[type[Message], ...]) -> msgspec.msgpack.Decoder:
    decoder = _message_decoders.get(types)
    if decoder is None:
        union: Any = types[0]
        for t in types[1:]:
            union = union | t
        decoder = _message_decoders[types] = msgspec.msgpack.Decoder(union)
    return decoder


def encode_header(
    message: Message,
    specs: Sequence[TensorSpec] = (),
    placements: Sequence[tuple[int, int]] | None = None,
) -> bytes:
    """Encode the envelope frame. ``placements`` defaults to one data frame per spec, at offset 0."""
    if not isinstance(message, Message):
        raise TypeError(f"can only send prime_rl.common.wire.Message subclasses, got {type(message).__name__}")
    if placements is None:
        placements = [(i, 0) for i in range(len(specs))]
    if len(placements) != len(specs):
        raise ValueError(f"{len(placements)} placements for {len(specs)} specs; give one per spec")
    return _encoder.encode((SCHEMA_VERSION, message, list(specs), list(placements)))


def decode_header(data: bytes | memoryview, types: Sequence[type[Message]] = MESSAGE_TYPES) -> Envelope:
    """Decode an envelope; check the version before the body. Raises WireError / SchemaVersionError."""
    try:
        parts = _raw_list_decoder.decode(data)
    except msgspec.DecodeError as e:
        raise WireError(f"malformed header ({len(data)} bytes): {e}; expected a msgpack envelope") from e
    if not parts:
        raise WireError("malformed header: empty envelope; expected [version, message, specs, placements]")
    try:
        version = _int_decoder.decode(parts[0])
    except msgspec.DecodeError as e:
        raise WireError(f"malformed header: schema version is not an int ({e})") from e
    if version != SCHEMA_VERSION:
        raise SchemaVersionError(
            f"peer speaks wire schema version {version}, this process speaks {SCHEMA_VERSION}; "
            "run the same prime-rl-common version on both sides"
        )
    if len(parts) != 4:
        raise WireError(f"malformed header: {len(parts)} parts, expected 4 (version, message, specs, placements)")
    try:
        message = _message_decoder(tuple(types)).decode(parts[1])
        specs = _specs_decoder.decode(parts[2])
        placements = _placements_decoder.decode(parts[3])
    except msgspec.DecodeError as e:  # ValidationError is a DecodeError
        raise WireError(f"malformed message: {e}") from e
    if len(placements) != len(specs):
        raise WireError(f"malformed header: {len(placements)} placements for {len(specs)} specs")
    return Envelope(message, specs, placements)


def encode(message: Message) -> bytes:
    """Encode a message with no arrays (e.g. to write it to a file)."""
    return encode_header(message)


def decode(data: bytes | memoryview, types: Sequence[type[Message]] = MESSAGE_TYPES) -> Message:
    """Inverse of ``encode``; refuses arrays, since a lone buffer cannot carry their frames."""
    envelope = decode_header(data, types)
    if envelope.specs:
        raise WireError(
            f"message {type(envelope.message).__name__} carries {len(envelope.specs)} arrays; use the transport"
        )
    return envelope.message


# -- the inference server's samples route (HTTP, JSON) -----------------------------------------------------------

SAMPLES_PATH = "/prime/v1/samples"
"""Token ids in, token ids + sampled logprobs + text out (``prime_rl.inference.samples``). On the H200 vLLM's chat
API took 2.26x as long for the same 262k tokens when its response carried per-token logprobs and ids (a pydantic
entry and ~93 bytes of JSON per token) as without them (benchmarks/results/rollout_path.md)."""


SAMPLING_KNOBS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
)  # fmt: skip
"""The sampling parameters every rollout request carries as configured, under these names all the way
(``[orchestrator.sampling]`` -> the orchestrator's ``SamplingArgs`` -> the chat body or ``SamplesRequest`` ->
vLLM's ``SamplingParams``): one list, so no path leaves one to the model's generation_config.json."""


class SamplesRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Body of ``POST SAMPLES_PATH``: ``n`` samples of ``prompt_token_ids``. Every sampling parameter is sent:
    the route takes none from the model's generation_config.json (the chat API would)."""

    model: str
    """A served model name: the base model or a loaded LoRA adapter."""
    prompt_token_ids: list[int]
    n: int
    max_tokens: int
    """Capped at what the context leaves after the prompt, as the chat API caps it."""
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    stop: list[str] = []
    seed: int | None = None
    ignore_eos: bool = False
    """Generate ``max_tokens`` whatever is sampled (benchmarks)."""


class Sample(msgspec.Struct):
    token_ids: bytes
    """int32 little-endian, one per generated token (base64 in JSON)."""
    logprobs: bytes
    """float32 little-endian: the sampled token's logprob at each position (vLLM's processed logprobs)."""
    text: str
    finish_reason: str | None


class SamplesResponse(msgspec.Struct):
    prompt_token_ids: list[int]
    samples: list[Sample]
    """In the order vLLM indexes them (0 .. n-1)."""

import msgspec
import numpy as np
import pytest

from prime_rl.common import wire


def _micro_batch(n: int = 6) -> dict[str, np.ndarray]:
    return {
        "input_ids": np.arange(n),
        "position_ids": np.arange(n),
        "loss_mask": np.arange(n) % 2 == 0,
        "advantages": np.linspace(-1, 1, n),
        "inference_logprobs": -np.ones(n),
    }


@pytest.mark.parametrize(
    "message",
    [
        wire.PauseRequest(mode="abort"),
        wire.ResumeRequest(),
        wire.LoadWeightsRequest(path="/x/broadcasts/step_3", version=3),
        wire.InitBroadcastRequest(host="127.0.0.1", port=29500, world_size=3, rank_offset=1, backend="gloo"),
        wire.BroadcastWeightsRequest(version=2, specs=[wire.TensorSpec("w", "bfloat16", [4, 8])]),
        wire.HealthRequest(),
        wire.ControlReply(ok=False, error="boom", weight_version=7),
        wire.HealthReply(ok=True, weight_version=1, paused=True, num_running=2, num_waiting=3, model="m"),
    ],
)
def test_every_message_round_trips_through_the_union(message):
    assert wire.decode(wire.encode(message)) == message


def test_every_message_type_is_in_the_union():
    subclasses = {c for c in wire.Message.__subclasses__()}
    assert subclasses == set(wire.MESSAGE_TYPES)


def test_training_batch_casts_to_wire_dtypes_and_names_frames():
    batch, arrays = wire.build_training_batch(5, 4, [_micro_batch(), _micro_batch(3)], 0.8, {"reward/mean": 0.5})
    assert batch.step == 5 and batch.policy_version == 4 and batch.metrics == {"reward/mean": 0.5}
    assert len(arrays) == 10
    mb1 = batch.micro_batches[1]
    assert mb1.input_ids == wire.TensorSpec("mb1/input_ids", "int32", [3])
    assert mb1.loss_mask.dtype == "bool" and mb1.advantages.dtype == "float32"
    fields = wire.micro_batch_arrays(mb1, arrays)
    assert fields["inference_logprobs"].dtype == np.float32
    np.testing.assert_array_equal(fields["position_ids"], [0, 1, 2])


def test_micro_batch_shape_mismatch_names_the_field():
    fields = _micro_batch()
    fields["advantages"] = np.zeros(5)
    with pytest.raises(wire.WireError, match="advantages has shape"):
        wire.build_training_batch(0, 0, [fields], 1.0)


def test_micro_batch_arrays_refuses_wrong_frames():
    batch, arrays = wire.build_training_batch(0, 0, [_micro_batch()], 1.0)
    good = arrays["mb0/input_ids"]
    arrays["mb0/input_ids"] = good.astype(np.int64)
    with pytest.raises(wire.WireError, match="input_ids"):
        wire.micro_batch_arrays(batch.micro_batches[0], arrays)
    arrays["mb0/input_ids"] = good
    del arrays["mb0/loss_mask"]
    with pytest.raises(wire.WireError, match="missing"):
        wire.micro_batch_arrays(batch.micro_batches[0], arrays)


def test_other_schema_version_is_refused_before_the_body_is_decoded():
    # A future peer may change a message's layout; the version check must come first.
    data = msgspec.msgpack.encode((wire.SCHEMA_VERSION + 1, ["SomeFutureMessage", 1, 2, 3], []))
    with pytest.raises(
        wire.SchemaVersionError, match=f"version {wire.SCHEMA_VERSION + 1}.*speaks {wire.SCHEMA_VERSION}"
    ):
        wire.decode(data)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1garbage",
        msgspec.msgpack.encode([wire.SCHEMA_VERSION]),
        msgspec.msgpack.encode(["one", ["HealthRequest"], []]),
        msgspec.msgpack.encode([wire.SCHEMA_VERSION, ["NoSuchMessage"], [], []]),
        msgspec.msgpack.encode([wire.SCHEMA_VERSION, ["HealthRequest"], []]),
        msgspec.msgpack.encode([wire.SCHEMA_VERSION, ["HealthRequest"], [["x", "int32", [1]]], []]),
        msgspec.msgpack.encode([wire.SCHEMA_VERSION, ["LoadWeightsRequest", 3, "not-an-int"], [], []]),
    ],
)
def test_malformed_bytes_raise_wire_error(data):
    with pytest.raises(wire.WireError):
        wire.decode(data)


def test_appended_field_with_default_decodes_from_older_encoding():
    # Old peers omit fields appended later; the receiver fills the defaults.
    old = msgspec.msgpack.encode((wire.SCHEMA_VERSION, ["HealthReply", True], [], []))
    assert wire.decode(old) == wire.HealthReply(ok=True)


def test_decoder_can_be_narrowed_to_some_types():
    data = wire.encode(wire.HealthRequest())
    with pytest.raises(wire.WireError):
        wire.decode(data, types=(wire.ControlReply, wire.HealthReply))


def test_weight_spec_sizes_include_bfloat16():
    """Weight specs carry torch dtype names; numpy has no bfloat16, the size table does."""
    from prime_rl.common.wire import TensorSpec

    assert TensorSpec(name="w", dtype="bfloat16", shape=[3, 4]).num_bytes == 24
    assert TensorSpec(name="w", dtype="float8_e4m3fn", shape=[5]).num_bytes == 5
    assert TensorSpec(name="w", dtype="float32", shape=[3]).num_bytes == 12


def test_tensor_bytes_is_the_one_size_rule():
    """TensorSpec, the broadcast layout's Spec and the NIXL layout all size a tensor with wire.tensor_bytes."""
    from prime_rl.common.nixl_layout import num_bytes
    from prime_rl.common.weight_sync.broadcast import Spec
    from prime_rl.common.wire import TensorSpec, tensor_bytes

    assert tensor_bytes("bfloat16", (3, 4)) == 24
    assert tensor_bytes("int64", ()) == 8  # a scalar
    assert tensor_bytes("uint16", [5]) == 10  # outside the table: numpy's itemsize
    spec = TensorSpec(name="w", dtype="float16", shape=[2, 3])
    assert spec.num_bytes == num_bytes(spec) == Spec("w", "float16", (2, 3)).num_bytes == 12
    with pytest.raises(ValueError, match="supported"):  # NIXL carries only the table's dtypes
        num_bytes(TensorSpec(name="w", dtype="uint16", shape=[5]))


def test_routed_experts_travel_as_an_optional_int16_frame():
    experts = np.arange(4 * 2 * 3).reshape(4, 2, 3) % 7
    plain, routed = _micro_batch(4), {**_micro_batch(4), "routed_experts": experts}
    batch, arrays = wire.build_training_batch(0, 0, [plain, routed], 1.0)
    assert batch.micro_batches[0].routed_experts is None and "routed_experts" not in wire.micro_batch_arrays(
        batch.micro_batches[0], arrays
    )
    spec = batch.micro_batches[1].routed_experts
    assert spec == wire.TensorSpec("mb1/routed_experts", "int16", [4, 2, 3])
    assert spec in batch.micro_batches[1].specs()
    np.testing.assert_array_equal(wire.micro_batch_arrays(batch.micro_batches[1], arrays)["routed_experts"], experts)
    # the header decodes positionally (the field is appended last), and a peer without it reads None
    assert wire.decode(wire.encode(batch)) == batch
    with pytest.raises(wire.WireError, match="routed_experts has shape"):
        wire.build_training_batch(0, 0, [{**plain, "routed_experts": experts[:3]}], 1.0)

"""A weights directory is read in full before the engine sees it (issue #17: truncated data passed the
header check and left the model on the meta device; NaN weights were accepted)."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from prime_rl.common.weight_checksum import CHECKSUMS_FILE, compute_checksums, read_checksums, write_checksums
from prime_rl.inference.weights import verify
from prime_rl.inference.weights.manifest import WeightUpdateError
from prime_rl.inference.weights.verify import verify_weights_dir


def _weights(tmp_path: Path, checksums: bool = True) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    tensors = {
        "a.weight": rng.standard_normal((64, 32)).astype(np.float32),
        "b.weight": rng.standard_normal((16,)).astype(np.float16),
        "c.ids": np.arange(10, dtype=np.int64),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    if checksums:
        write_checksums(tmp_path)
    (tmp_path / "STABLE").touch()
    return tmp_path


def _poke(file: Path, tensor: str, value: bytes, at: int = 0) -> None:
    """Overwrite bytes of one tensor in place (header untouched)."""
    (header_len,) = struct.unpack("<Q", file.read_bytes()[:8])
    begin = json.loads(file.read_bytes()[8 : 8 + header_len])[tensor]["data_offsets"][0]
    with open(file, "r+b") as f:
        f.seek(8 + header_len + begin + at)
        f.write(value)


def test_a_sound_directory_passes_with_and_without_checksums(tmp_path):
    report = verify_weights_dir(_weights(tmp_path / "x"))
    assert (report.files, report.tensors, report.checksummed) == (1, 3, True)
    assert report.bytes == 64 * 32 * 4 + 16 * 2 + 10 * 8
    assert not verify_weights_dir(_weights(tmp_path / "y", checksums=False)).checksummed


def test_checksums_round_trip(tmp_path):
    path = _weights(tmp_path)
    assert read_checksums(path) == compute_checksums(path)
    assert set(read_checksums(path)) == {"a.weight", "b.weight", "c.ids"}


@pytest.mark.parametrize("cut", [1, 4096])
def test_truncated_data_with_an_intact_header_is_refused(tmp_path, cut):
    path = _weights(tmp_path)
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-cut])
    with pytest.raises(WeightUpdateError, match="truncated"):
        verify_weights_dir(path)


def test_padded_file_is_refused(tmp_path):
    path = _weights(tmp_path)
    with open(path / "model.safetensors", "ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(WeightUpdateError, match="padded"):
        verify_weights_dir(path)


@pytest.mark.parametrize(
    ("tensor", "value"),
    [
        ("a.weight", np.array([np.nan], np.float32).tobytes()),
        ("a.weight", np.array([-np.inf], np.float32).tobytes()),
        ("b.weight", np.array([np.inf], np.float16).tobytes()),
    ],
)
def test_non_finite_values_are_refused(tmp_path, tensor, value):
    path = _weights(tmp_path, checksums=False)
    _poke(path / "model.safetensors", tensor, value, at=8)
    with pytest.raises(WeightUpdateError, match="1 NaN/Inf"):
        verify_weights_dir(path)
    verify_weights_dir(path, check_finite=False)  # the only defect is the value


def test_bfloat16_nan_is_found_on_raw_bits(tmp_path):
    # numpy has no bfloat16: write the file by hand; 0x7FC0 is a bf16 NaN, 0x3F80 is 1.0.
    data = np.array([0x3F80, 0x3F80, 0x7FC0, 0x3F80], np.uint16).tobytes()
    header = json.dumps({"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, len(data)]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + data)
    with pytest.raises(WeightUpdateError, match="tensor w has 1 NaN/Inf"):
        verify_weights_dir(tmp_path)


def test_data_changed_after_checksum_is_refused(tmp_path):
    path = _weights(tmp_path)
    _poke(path / "model.safetensors", "c.ids", np.array([7], np.int64).tobytes())  # finite, right size
    with pytest.raises(WeightUpdateError, match="c.ids has crc32 .* but checksums.json says"):
        verify_weights_dir(path)


def test_checksum_list_must_match_the_tensors(tmp_path):
    path = _weights(tmp_path)
    sums = json.loads((path / CHECKSUMS_FILE).read_text())
    del sums["tensors"]["b.weight"]
    (path / CHECKSUMS_FILE).write_text(json.dumps(sums))
    with pytest.raises(WeightUpdateError, match="no checksum for tensor b.weight"):
        verify_weights_dir(path)


def test_many_tensors_scanned_at_once_report_the_first_bad_one_in_file_order(tmp_path):
    """Tensors are checked on several threads; the error is still the first bad tensor of the file."""
    rng = np.random.default_rng(0)
    tensors = {f"layer{i:02d}.weight": rng.standard_normal((64, 64)).astype(np.float32) for i in range(24)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    write_checksums(tmp_path)
    # the checksums summed on several threads are each tensor's own crc32, under its own name
    assert read_checksums(tmp_path) == {n: zlib.crc32(t.tobytes()) for n, t in tensors.items()}
    assert verify_weights_dir(tmp_path).tensors == 24
    for bad in ("layer17.weight", "layer05.weight"):
        _poke(tmp_path / "model.safetensors", bad, struct.pack("<f", float("nan")))
    with pytest.raises(WeightUpdateError, match="tensor layer05.weight has 1 NaN"):
        verify_weights_dir(tmp_path)


def test_tensors_read_in_several_pieces_pass_and_a_defect_in_a_late_piece_is_found(tmp_path, monkeypatch):
    """Large tensors are read in pieces on several threads (checksums merged with crc32_combine) and tested
    for NaN/Inf in blocks: a sound file passes, a bad value or a changed byte in a late piece is refused."""
    monkeypatch.setattr(verify, "PIECE_BYTES", 1024)  # a 64x32 float32 tensor: 8 pieces
    monkeypatch.setattr(verify, "_BLOCK", 64)  # several finite-test blocks per piece
    path = _weights(tmp_path)
    assert verify_weights_dir(path).tensors == 3
    _poke(path / "model.safetensors", "a.weight", struct.pack("<f", 0.5), at=7 * 1024 + 12)  # finite, 8th piece
    with pytest.raises(WeightUpdateError, match="a.weight has crc32"):
        verify_weights_dir(path)
    _poke(path / "model.safetensors", "a.weight", struct.pack("<f", float("inf")), at=5 * 1024 + 4)
    with pytest.raises(WeightUpdateError, match="a.weight has 1 NaN/Inf"):
        verify_weights_dir(path, check_finite=True)


def test_files_are_scanned_together_but_the_first_defect_in_file_order_is_reported(tmp_path):
    rng = np.random.default_rng(1)
    for shard in ("model-00001.safetensors", "model-00002.safetensors"):
        save_file({f"{shard[:11]}.w": rng.standard_normal((32, 32)).astype(np.float32)}, str(tmp_path / shard))
    write_checksums(tmp_path)
    assert verify_weights_dir(tmp_path).files == 2
    first, second = tmp_path / "model-00001.safetensors", tmp_path / "model-00002.safetensors"
    _poke(first, "model-00001.w", struct.pack("<f", 0.25))  # changed data in the first file
    second.write_bytes(second.read_bytes()[:-4])  # and a truncated second one
    with pytest.raises(WeightUpdateError, match="model-00001.w has crc32"):
        verify_weights_dir(tmp_path)
    first.write_bytes(first.read_bytes()[:-4])
    with pytest.raises(WeightUpdateError, match="model-00001.safetensors is .* truncated"):
        verify_weights_dir(tmp_path)

"""The filesystem transport's writer: safetensors byte-identical to the library's, shards written side by side,
and checksums summed from memory that equal what a reader computes from the files."""

import zlib

import torch
from safetensors.torch import load_file, save_file

from prime_rl.common.testing import make_tiny_model
from prime_rl.common.weight_checksum import compute_checksums, read_checksums
from prime_rl.trainer.models.config import load_arch_config
from prime_rl.trainer.weights import files


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(96, 64, generator=g).bfloat16() for i in range(6)}
    out["model.embed_tokens.weight"] = torch.randn(256, 64, generator=g).bfloat16()
    out["model.norm.weight"] = torch.ones(0).bfloat16()  # an empty tensor is written and summed too
    return out


def test_file_is_byte_identical_to_safetensors_and_crcs_match_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "_PIECE", 4096)  # many pieces per tensor, written by several threads
    monkeypatch.setattr(files, "_BLOCK", 1000)  # blocks that do not divide a piece: a short last block
    tensors = _tensors()
    crcs = files.write_safetensors(tmp_path / "ours.safetensors", tensors, {"format": "pt"}, workers=4)
    save_file(tensors, str(tmp_path / "lib.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "lib.safetensors").read_bytes()
    (tmp_path / "lib.safetensors").unlink()
    assert crcs == compute_checksums(tmp_path)
    # summed piece by piece and merged, yet zlib's CRC of each tensor's whole bytes
    assert crcs == {name: zlib.crc32(t.view(torch.uint8).numpy().tobytes()) for name, t in tensors.items()}


def test_hf_dir_is_sharded_per_writer_and_loads_back(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "_MIN_SHARD", 1)
    monkeypatch.setattr(files, "_WORKERS", 3)
    config = load_arch_config(make_tiny_model(tmp_path / "model"))
    tensors = _tensors()
    out = tmp_path / "step_1"
    files.write_hf_dir(tensors, out, config)
    shards = sorted(out.glob("*.safetensors"))
    assert 3 <= len(shards) <= 4 and (out / "model.safetensors.index.json").is_file()  # greedy: about one each
    assert read_checksums(out) == compute_checksums(out)
    loaded = {k: v for shard in shards for k, v in load_file(str(shard)).items()}
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)

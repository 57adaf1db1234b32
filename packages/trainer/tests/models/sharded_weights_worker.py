"""One rank of test_sharded_weights.py (run under torchrun): load/save through FSDP2 DTensor params."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from prime_rl.trainer.models import build_model, load_hf_weights, read_hf_state_dict, save_hf_weights
from prime_rl.trainer.world import exit_rank


def main(src: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    model = build_model(src, attn="sdpa", dtype=torch.float32, device="meta")
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.tie_weights()
    load_hf_weights(model, src)

    reference = build_model(src, attn="sdpa", dtype=torch.float32, device="cpu")
    load_hf_weights(reference, src)
    ref_sd = reference.state_dict()
    for name, param in model.state_dict().items():
        assert param.to_local().numel() < ref_sd[name].numel(), f"{name} is not sharded"
        assert torch.equal(param.full_tensor(), ref_sd[name]), name

    save_hf_weights(model.state_dict(), f"{out}/rank{rank}", model.config)  # full_tensor is collective
    a, b = read_hf_state_dict(src), read_hf_state_dict(f"{out}/rank{rank}")
    assert sorted(a) == sorted(b), "names differ"
    for k in a:
        assert torch.equal(a[k], b[k]), k
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_rank(0)  # a finished rank skips interpreter finalization (see exit_rank)

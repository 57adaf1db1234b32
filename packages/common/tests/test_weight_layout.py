"""The one packer of broadcast buckets and NIXL groups, and the alignment the receivers check."""

from prime_rl.common.nixl_layout import plan_layout
from prime_rl.common.weight_layout import ALIGNMENT, SAFETENSORS_DTYPES, align_up, dtype_name, pack_aligned
from prime_rl.common.wire import DTYPE_ITEMSIZE, TensorSpec


def test_pack_aligned_keeps_order_aligns_and_gives_a_big_tensor_its_own_bin():
    layout = pack_aligned([60, 100, 5000, 10, 3000], max_bytes=4096)
    assert layout.bins == [0, 0, 1, 2, 2]
    assert layout.offsets == [0, 256, 0, 0, 256]  # 60 bytes: the next tensor starts at the next 256
    assert layout.sizes == [356, 5000, 3256]  # bin 2: 10 bytes, then 3000 at byte 256 (3256 <= 4096)
    assert all(off % ALIGNMENT == 0 for off in layout.offsets)
    assert pack_aligned([], max_bytes=4096) == ([], [], [])


def test_nixl_groups_are_packed_like_broadcast_buckets():
    specs = [TensorSpec(name=f"t{i}", dtype="bfloat16", shape=[n]) for i, n in enumerate([30, 50, 2500, 5, 1500])]
    layout = plan_layout(specs, num_sources=2, group_bytes=4096)
    packed = pack_aligned([2 * n for n in (30, 50, 2500, 5, 1500)], max_bytes=4096)
    assert (layout.groups, layout.offsets, layout.group_sizes) == tuple(packed)


def test_align_up_and_torch_dtype_names():
    assert [align_up(n) for n in (0, 1, 256, 257)] == [0, 256, 256, 512]

    class FakeDtype:  # str(torch.bfloat16) == "torch.bfloat16"; no torch needed here
        def __str__(self) -> str:
            return "torch.bfloat16"

    assert dtype_name(FakeDtype()) == "bfloat16"


def test_every_safetensors_code_names_a_wire_dtype():
    # the trainer writes these codes and inference reads them: one table, every name a wire dtype
    assert sorted(SAFETENSORS_DTYPES.values()) == sorted(DTYPE_ITEMSIZE)

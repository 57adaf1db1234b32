"""A CPU test double of DeepEP's normal-mode (training) API: `deep_ep.Buffer`, `Config`, `EventOverlap`.

Tests install it as `sys.modules["deep_ep"]`; it runs on any process group with torch all-to-all
(gloo here). It keeps the signatures, return tuples and semantics of deep_ep/buffer.py (intranode
normal mode) that a caller can observe:
- `get_dispatch_layout(topk_idx, num_experts)` -> (num_tokens_per_rank int32 (R,), None (intranode),
  num_tokens_per_expert int32 (E,), is_token_in_rank bool (N, R), event); -1 in topk_idx selects nothing.
- `dispatch(x, num_tokens_per_rank=, num_tokens_per_rdma_rank=, is_token_in_rank=, num_tokens_per_expert=,
  topk_idx=, topk_weights=)` sends each token once to every rank owning one of its experts; received rows
  are grouped by source rank, in the source's token order. It returns (recv_x, recv_topk_idx,
  recv_topk_weights, num_recv_tokens_per_expert_list, handle, event): recv_topk_idx holds local expert
  ids, -1 for experts of other ranks (whose recv_topk_weights are 0), the list counts per local expert
  (aligned up to `expert_alignment`), and the handle is an opaque tuple.
- `dispatch(x, handle=handle)` (cached mode, topk_* must be None) -> (recv_x, None, None, None, None, event).
- `combine(x, handle, topk_weights=None)` -> (combined_x, combined_topk_weights or None, event): sums the
  rows of each token over the ranks it went to, with no weights, accumulating in float32.
- Inputs are checked like the kernels check them: bf16 contiguous tokens, int64 topk_idx, float32
  topk_weights, no empty token batch, an even `set_num_sms`, a known rank count for the configs.

Counters (`Buffer.stats`) let a test prove which calls ran. FP8 tokens, internode / low-latency modes
and async events are not modelled.
"""

from collections import Counter

import torch
import torch.distributed as dist

NUM_MAX_NVL_PEERS = 8


class EventOverlap:
    def __init__(self, event: object = None, extra_tensors: tuple | None = None):
        self.event = event

    def current_stream_wait(self) -> None:
        pass


class Config:
    def __init__(self, num_sms: int, nvl_send: int, nvl_recv: int, rdma_send: int, rdma_recv: int):
        self.num_sms = num_sms
        self.nvl_send, self.nvl_recv, self.rdma_send, self.rdma_recv = nvl_send, nvl_recv, rdma_send, rdma_recv

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        # channels (num_sms / 2) x ranks x receive slots x (token + metadata), 128-byte aligned like DeepEP
        raw = (self.num_sms // 2) * num_ranks * self.nvl_recv * (hidden_bytes + 64)
        return (raw + 127) // 128 * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0  # intranode: NVLink only
        raw = (self.num_sms // 2) * (num_ranks // NUM_MAX_NVL_PEERS) * self.rdma_recv * (hidden_bytes + 64) * 2
        return (raw + 127) // 128 * 128


_TUNED_RANKS = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)


class Buffer:
    num_sms: int = 20
    stats: Counter = Counter()
    instances: list["Buffer"] = []

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        comm: object = None,
    ) -> None:
        assert not low_latency_mode, "double: low-latency mode is not modelled"
        assert num_nvl_bytes > 0 and num_nvl_bytes % 128 == 0, num_nvl_bytes
        assert num_rdma_bytes % 128 == 0 and (num_rdma_bytes == 0 or group.size() > NUM_MAX_NVL_PEERS)
        self.group, self.rank, self.group_size = group, group.rank(), group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        ids: list = [None] * self.group_size  # DeepEP exchanges device ids / IPC handles: a collective
        dist.all_gather_object(ids, self.rank, group=group)
        Buffer.instances.append(self)

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        assert num_ranks in _TUNED_RANKS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, 24 if num_ranks == 2 else 6, 256, 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        assert num_ranks in _TUNED_RANKS, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, 10 if num_ranks == 2 else 4, 256, 6, 128)

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, None, torch.Tensor, torch.Tensor, EventOverlap]:
        assert topk_idx.dtype == torch.int64 and topk_idx.dim() == 2 and topk_idx.is_contiguous()
        assert topk_idx.shape[0] > 0, "topk_idx_ptr != 0"  # DeepEP asserts on an empty batch
        assert num_experts % self.group_size == 0
        Buffer.stats["layout"] += 1
        valid = topk_idx >= 0
        num_tokens_per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        rank_of = torch.where(valid, topk_idx // (num_experts // self.group_size), -1)  # (N, k)
        is_token_in_rank = (rank_of.unsqueeze(-1) == torch.arange(self.group_size)).any(1)  # (N, R)
        num_tokens_per_rank = is_token_in_rank.sum(0).to(torch.int32)
        return num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, EventOverlap()

    def _exchange(self, t: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        out = t.new_empty((sum(recv_counts), *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), recv_counts, send_counts, group=self.group)
        return out

    @staticmethod
    def _check_tokens(x: object) -> None:
        assert not isinstance(x, tuple), "double: FP8 tokens are not modelled"
        assert x.dtype == torch.bfloat16 and x.dim() == 2 and x.is_contiguous(), (x.dtype, x.shape)

    def dispatch(
        self,
        x: torch.Tensor,
        handle: tuple | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple:
        self._check_tokens(x)
        if handle is not None:  # cached mode: same layout as the dispatch that made the handle
            assert topk_idx is None and topk_weights is None
            send_token, send_counts, recv_counts, _, _, _ = handle
            Buffer.stats["cached_dispatch"] += 1
            recv_x = self._exchange(x[send_token], send_counts.tolist(), recv_counts.tolist())
            return recv_x, None, None, None, None, EventOverlap()
        assert num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None
        assert num_tokens_per_rdma_rank is None  # intranode
        assert topk_idx.dtype == torch.int64 and topk_weights.dtype == torch.float32
        assert x.shape[0] == topk_idx.shape[0] == is_token_in_rank.shape[0] > 0
        Buffer.stats["dispatch"] += 1
        num_local = num_tokens_per_expert.numel() // self.group_size
        dest, send_token = is_token_in_rank.t().nonzero(as_tuple=True)  # by destination rank, then token
        send_counts = num_tokens_per_rank.to(torch.int64)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        local = topk_idx[send_token] - (dest * num_local).unsqueeze(-1)  # (S, k) ids relative to the destination
        mine = (topk_idx[send_token] >= 0) & (local >= 0) & (local < num_local)
        recv_x = self._exchange(x[send_token], sc, rc)
        recv_topk_idx = self._exchange(torch.where(mine, local, -1), sc, rc)
        recv_topk_weights = self._exchange(torch.where(mine, topk_weights[send_token], 0.0), sc, rc)
        recv_src_idx = self._exchange(send_token.to(torch.int32), sc, rc)
        counts = torch.bincount(recv_topk_idx[recv_topk_idx >= 0], minlength=num_local).tolist()
        num_recv_tokens_per_expert_list = [-(-c // expert_alignment) * expert_alignment for c in counts]
        handle = (send_token, send_counts, recv_counts, recv_src_idx, is_token_in_rank, torch.tensor(x.shape[0]))
        return recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, EventOverlap()

    def combine(
        self,
        x: torch.Tensor,
        handle: tuple,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, EventOverlap]:
        self._check_tokens(x)
        assert bias is None, "double: combine bias is not modelled"
        send_token, send_counts, recv_counts, recv_src_idx, _, num_tokens = handle
        assert x.shape[0] == recv_src_idx.shape[0]
        Buffer.stats["combine_with_weights" if topk_weights is not None else "combine"] += 1
        sc, rc = send_counts.tolist(), recv_counts.tolist()

        def reduce(rows: torch.Tensor) -> torch.Tensor:  # back to the source ranks, summed per token in fp32
            back = self._exchange(rows, rc, sc)  # (S, ...) in dispatch's send order
            out = torch.zeros((int(num_tokens), *rows.shape[1:]), dtype=torch.float32)
            return out.index_add_(0, send_token, back.float())

        combined_x = reduce(x).to(x.dtype)
        combined_weights = None
        if topk_weights is not None:
            assert topk_weights.dtype == torch.float32
            combined_weights = reduce(topk_weights)
        return combined_x, combined_weights, EventOverlap()

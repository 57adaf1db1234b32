"""One rank of the token-budget exactness tests (run under torchrun by test_batching.py).

Builds orchestrator-like rows (samples packed first-fit, padded tails, a zero-loss balancing row, two
temperatures), then for each loss variant runs one `RLObjective.forward_backward` on a freshly loaded model
through `TokenBudgetSource` and saves, on rank 0, the step's statistics and the full gradients. Rank r of a
world of W takes rows r, r + W, ...; `budget` "None" is the row-by-row path.

Context parallelism ("cp=N"): the cp ranks of a data-parallel group get their rows through
`ContextParallelSource` (cp rank 0 holds them, the others receive its broadcast), data-parallel group d takes
rows d, d + dp, ...; the variant "sequence_no_cp_sum" drops the all-reduce of the per-sample sums (a control).

argv: policy_dir, reference_dir, out.pt, budget ("None" or tokens), then "broken" to break sample boundaries
and/or "cp=N".
"""

import sys

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from prime_rl.common.config.trainer import TrainerModelConfig
from prime_rl.trainer.loop import to_host
from prime_rl.trainer.model import build_training_model
from prime_rl.trainer.parallel import ParallelDims
from prime_rl.trainer.rl.batching import TokenBudgetSource, build_forwards
from prime_rl.trainer.rl.data import ContextParallelSource, from_arrays
from prime_rl.trainer.rl.loss import LossSettings
from prime_rl.trainer.rl.train import RLObjective
from prime_rl.trainer.world import close_world, exit_rank, init_world

SEQ_LEN, NUM_ROWS, VOCAB = 96, 8, 200
VARIANTS = {  # name -> (LossSettings, norm, max_len, with a KL reference)
    "token": (LossSettings("token"), "token", None, False),
    "sequence": (LossSettings("sequence", 0.5, 2.0), "sequence", None, False),
    "constant": (LossSettings("token"), "constant", 48, False),
    "token_kl": (LossSettings("token", kl_coef=0.1, kl_estimator="k3"), "token", None, True),
}


def make_rows(seed: int = 0) -> list:
    """Rows as the orchestrator packs them (see prime_rl.orchestrator.packing); row 5 trains on nothing."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(NUM_ROWS):
        ids = np.zeros(SEQ_LEN, np.int32)
        pos = np.arange(SEQ_LEN, dtype=np.int32)
        mask = np.zeros(SEQ_LEN, bool)
        adv = np.zeros(SEQ_LEN, np.float32)
        logq = np.zeros(SEQ_LEN, np.float32)
        start = 0
        while i != 5:
            prompt, completion = int(rng.integers(3, 9)), int(rng.integers(4, 30))
            if start + prompt + completion > SEQ_LEN - int(rng.integers(0, 20)):
                break
            end = start + prompt + completion
            ids[start:end] = rng.integers(1, VOCAB, end - start)
            pos[start:end] = np.arange(end - start)
            mask[start + prompt : end] = True
            adv[start + prompt : end] = rng.normal()
            logq[start + prompt : end] = rng.normal(-6.0, 0.3, completion)
            start = end
        pos[start:] = np.arange(SEQ_LEN - start)  # the padding tail: its own run of positions
        arrays = dict(input_ids=ids, position_ids=pos, loss_mask=mask, advantages=adv, inference_logprobs=logq)
        rows.append(from_arrays(arrays, temperature=1.0 if i < 6 else 0.7))
    return rows


class ListSource:
    def __init__(self, rows: list):
        self.rows = rows

    def get(self, step: int) -> list:
        return self.rows

    def close(self) -> None:
        pass


def straddling(forwards: list, cp: int) -> int:
    """Slice boundaries that fall inside a sample with loss tokens on both sides."""
    count = 0
    for mb in forwards:
        ids, size = mb.sample_ids(), mb.input_ids.shape[-1] // cp
        for b in range(size, mb.input_ids.shape[-1], size):
            same = ids == ids[b]
            if ids[b - 1] == ids[b] and mb.loss_mask[:b][same[:b]].any() and mb.loss_mask[b:][same[b:]].any():
                count += 1
    return count


def main(policy_dir: str, reference_dir: str, out: str, budget: str, broken: bool, cp: int = 1) -> None:
    world = init_world()
    dims = ParallelDims(dp_replicate=1, dp_shard=world.world_size, world_size=world.world_size, cp=cp)
    mesh = dims.build_mesh("cpu")
    dp_rank, cp_rank = dims.dp_rank(world.rank), dims.cp_rank(world.rank)
    rows = make_rows()[dp_rank :: dims.dp]
    inner = ListSource(rows)
    if dims.cp_enabled:  # only cp rank 0 holds the rows, as only it has the orchestrator's socket
        inner = ContextParallelSource(lambda: ListSource(rows), cp_rank, cp, timeout_s=60)
    source = TokenBudgetSource(inner, None if budget == "None" else int(budget), cp)
    forwards = source.get(0)
    local = len(build_forwards(rows, source.budget, source.multiple)) if source.budget else len(rows)
    if broken:  # control: one position run per forward, so attention crosses samples and rows
        for mb in forwards:
            mb.position_ids = torch.arange(mb.position_ids.shape[-1])[None]
    plain = dict(
        ac=None,
        ac_offloading=None,
        offload="none",
        reshard_after_forward=True,
        fused_lm_head_token_chunk_size=16,
        attn="sdpa",
    )
    results = {
        "num_forwards": len(forwards),
        "local_forwards": local,
        "lengths": [mb.input_ids.shape[-1] for mb in forwards],
        "straddling": straddling(forwards, cp),
    }
    variants = dict(VARIANTS)
    if dims.cp_enabled:
        variants["sequence_no_cp_sum"] = VARIANTS["sequence"]
    for name, (settings, norm, max_len, kl) in variants.items():
        torch.manual_seed(0)
        policy = build_training_model(TrainerModelConfig(name=policy_dir, **plain), dims, mesh, world.device)
        ref = None
        if kl:  # another random model of the same shape: KL to it is far from 0
            ref = build_training_model(TrainerModelConfig(name=reference_dir, **plain), dims, mesh, world.device)
            ref.requires_grad_(False)
        cp_group = mesh["cp"].get_group() if dims.cp_enabled else None  # as rl.train.build_objective
        objective = RLObjective(dims, world, settings, norm, max_len, ref, cp_group=cp_group)
        if name == "sequence_no_cp_sum":
            objective.cp_group = None
        stats = to_host(objective.forward_backward(policy, forwards))
        grads = {
            n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in policy.named_parameters()
        }
        results[name] = {"stats": stats, "grads": grads}
    torch.save(results if world.rank == 0 else {k: results[k] for k in ("num_forwards", "local_forwards", "straddling")},
               out if world.rank == 0 else f"{out}.{world.rank}")  # fmt: skip
    close_world()


if __name__ == "__main__":
    flags = sys.argv[5:]
    cp = next((int(f.split("=")[1]) for f in flags if f.startswith("cp=")), 1)
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], "broken" in flags, cp)
    exit_rank(0)  # a finished rank skips interpreter finalization (see exit_rank)

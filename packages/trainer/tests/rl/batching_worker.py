"""One rank of the token-budget exactness tests (run under torchrun by test_batching.py).

Builds orchestrator-like rows (samples packed first-fit, padded tails, a zero-loss balancing row, two
temperatures), then for each loss variant runs one `RLObjective.forward_backward` on a freshly loaded model
through `TokenBudgetSource` and saves, on rank 0, the step's statistics and the full gradients. Rank r of a
world of W takes rows r, r + W, ...; `budget` "None" is the row-by-row path.

argv: policy_dir, reference_dir, out.pt, budget ("None" or tokens), "broken" to break sample boundaries.
"""

import sys

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from prime_rl.common.config.trainer import ModelConfig
from prime_rl.trainer.loop import to_host
from prime_rl.trainer.model import build_training_model
from prime_rl.trainer.parallel import ParallelDims
from prime_rl.trainer.rl.batching import TokenBudgetSource, build_forwards
from prime_rl.trainer.rl.data import from_arrays
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


def main(policy_dir: str, reference_dir: str, out: str, budget: str, broken: bool) -> None:
    world = init_world()
    dims = ParallelDims.from_world(world.world_size, 1)
    mesh = dims.build_mesh("cpu")
    rows = make_rows()[world.rank :: world.world_size]
    source = TokenBudgetSource(ListSource(rows), None if budget == "None" else int(budget))
    forwards = source.get(0)
    local = len(build_forwards(rows, source.budget, source.multiple)) if source.budget else len(rows)
    if broken:  # control: one position run per forward, so attention crosses samples and rows
        for mb in forwards:
            mb.position_ids = torch.arange(mb.position_ids.shape[-1])[None]
    plain = dict(ac=None, ac_offloading=None, offload="none", fused_lm_head_token_chunk_size=16, attn="sdpa")
    results = {
        "num_forwards": len(forwards),
        "local_forwards": local,
        "lengths": [mb.input_ids.shape[-1] for mb in forwards],
    }
    for name, (settings, norm, max_len, kl) in VARIANTS.items():
        torch.manual_seed(0)
        policy = build_training_model(ModelConfig(name=policy_dir, **plain), dims, mesh, world.device)
        ref = None
        if kl:  # another random model of the same shape: KL to it is far from 0
            ref = build_training_model(ModelConfig(name=reference_dir, **plain), dims, mesh, world.device)
            ref.requires_grad_(False)
        objective = RLObjective(dims, world, settings, norm, max_len, ref)
        stats = to_host(objective.forward_backward(policy, forwards))
        grads = {
            n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for n, p in policy.named_parameters()
        }
        results[name] = {"stats": stats, "grads": grads}
    torch.save(results if world.rank == 0 else {k: results[k] for k in ("num_forwards", "local_forwards")},
               out if world.rank == 0 else f"{out}.{world.rank}")  # fmt: skip
    close_world()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], len(sys.argv) > 5 and sys.argv[5] == "broken")
    exit_rank(0)  # a finished rank skips interpreter finalization (see exit_rank)

"""The SFT loop, one process per rank (launched by `sft` or by hand with torchrun):

    torchrun --nproc-per-node 8 --local-ranks-filter 0 -m prime_rl.trainer.sft.train @ sft.toml

The loop is `prime_rl.trainer.loop.train_loop`, shared with the RL trainer; what is SFT's own is the
batch source (a pure function of the step: packed chat samples or fake rows) and the objective.

Loss: mean over all assistant (loss) tokens of the step, across micro-batches and ranks, so N ranks
compute the same gradient as one process on the same rows. FSDP averages gradients over the dp
ranks, so each rank's loss is scaled by dp / global_loss_tokens.

Cheap checks (model dir, tokenizer vs vocab, data, batch divisibility, parallel layout) all run
before the model is built; on a bad input every rank exits with code 2 and rank 0 prints one line.
"""

import logging
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from prime_rl.common.config import parse_config
from prime_rl.common.config.trainer import SFTConfig, SFTDataConfig
from prime_rl.trainer.ckpt import export_hf
from prime_rl.trainer.data import DataLoader, SFTMicroBatch, build_data_loader
from prime_rl.trainer.loop import to_host, train_loop
from prime_rl.trainer.lora import export_lora
from prime_rl.trainer.model import CausalLM
from prime_rl.trainer.models import PackedSeqs
from prime_rl.trainer.parallel import ParallelDims
from prime_rl.trainer.parallel.context import shard_micro_batch
from prime_rl.trainer.parallel.fsdp import reshard_after_backward
from prime_rl.trainer.run import bad_input_exits, build_trainer, inspect_model, start_rank
from prime_rl.trainer.world import World, close_world, exit_rank


def load_tokenizer(model_dir: Path, vocab_size: int):  # noqa: ANN201 - a transformers tokenizer
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"the tokenizer in {model_dir} has {len(tokenizer)} tokens > the model's vocab_size={vocab_size}: "
            "tokenizer and model do not match; use the tokenizer that ships with the model"
        )
    return tokenizer


def setup(cfg: SFTConfig, world: World) -> tuple[ParallelDims, DataLoader, object]:
    """Every check that needs no model weights; raises ValueError/FileNotFoundError on bad input."""
    model_dir, model_config, dims = inspect_model(cfg.model, world)
    tokenizer = load_tokenizer(model_dir, model_config.vocab_size) if isinstance(cfg.data, SFTDataConfig) else None
    rank_in_dp = dims.dp_rank(world.rank)  # the cp ranks of one sequence read the same rows
    loader = build_data_loader(cfg.data, tokenizer, model_config.vocab_size, rank_in_dp, dims.dp)
    return dims, loader, model_config


class SFTSource:
    """The loader's micro-batches; the next step's are built on the CPU while the GPU runs this one."""

    def __init__(self, loader: DataLoader):
        self.loader = loader
        self.next: tuple[int, list[SFTMicroBatch]] | None = None

    def get(self, step: int) -> list[SFTMicroBatch]:
        if self.next is not None and self.next[0] == step:
            return self.next[1]
        return self.loader.micro_batches(step)

    def prefetch(self, step: int) -> None:
        self.next = (step, self.loader.micro_batches(step))

    def close(self) -> None:
        self.next = None


class SFTObjective:
    """Cross-entropy: the mean negative log-likelihood over every loss token of the step."""

    def __init__(self, dims: ParallelDims, world: World):
        self.dims, self.world = dims, world

    def forward_backward(
        self, model: CausalLM, micro_batches: list[SFTMicroBatch], before_last: Callable[[], None]
    ) -> dict:
        return forward_backward(model, micro_batches, self.dims, self.world, before_last)

    def metrics(self, stats: dict[str, float]) -> dict[str, float]:
        return {"loss/mean": stats["loss"], "loss/tokens": stats["loss_tokens"]}

    def summary(self, metrics: dict[str, float]) -> str:
        return f"Loss {metrics['loss/mean']:.4f}"


def train(cfg: SFTConfig) -> None:
    run_dir, world, logger = start_rank(cfg.output_dir, cfg.run_name, cfg.log_level)
    with bad_input_exits(world, logger):
        dims, loader, model_config = setup(cfg, world)
    logger.info(
        f"world {world.world_size} ({dims}), device {world.device}, {loader.num_micro_batches} "
        f"micro-batches/step of {cfg.data.micro_batch_size} x {cfg.data.seq_len} tokens"
    )
    tokens = cfg.data.micro_batch_size * cfg.data.seq_len
    cfg, _mesh, model, trainer = build_trainer(cfg, dims, world, run_dir, logger, tokens, cfg.data.seq_len)
    source = SFTSource(loader)
    train_loop(
        trainer,
        source,
        SFTObjective(dims, world),
        max_steps=cfg.max_steps,
        max_norm=cfg.optim.max_norm,
        ckpt_interval=cfg.ckpt.interval,
        resume_step=cfg.ckpt.resume_step,
    )
    source.close()
    if cfg.ckpt.export_hf:
        out = run_dir.root / "weights" / f"step_{cfg.max_steps}"
        if cfg.model.lora is not None:  # the adapter in peft format (+ merged HF weights in out/merged)
            export_lora(model, out, world.is_main, merged=cfg.model.lora.export_merged)
        else:
            export_hf(model, model.model, out, world.is_main)
        logger.info(f"exported Hugging Face weights to {out}")
    close_world()


def train_step(model: CausalLM, loader: DataLoader, step: int, dims: ParallelDims, world: World) -> dict:
    """Forward + backward over this rank's micro-batches; returns the step's global loss statistics."""
    return to_host(forward_backward(model, loader.micro_batches(step), dims, world))


def forward_backward(
    model: CausalLM,
    micro_batches: list[SFTMicroBatch],
    dims: ParallelDims,
    world: World,
    before_last: Callable[[], None] | None = None,
) -> dict:
    """`train_step` without a host sync: "loss" and "loss_tokens" stay device tensors (see `to_host`)."""
    if dims.cp_enabled:  # each CP rank takes its contiguous slice of every micro-batch
        micro_batches = [shard_micro_batch(mb, dims.cp_rank(world.rank), dims.cp) for mb in micro_batches]
    counts = torch.tensor([sum(mb.num_loss_tokens for mb in micro_batches)], dtype=torch.float64, device=world.device)
    dist.all_reduce(counts)
    loss_tokens = counts[0].clamp(min=1.0)
    # FSDP averages gradients over all ranks (CP ranks included; EP divides expert grads the same way):
    # world / global tokens makes the result the global token mean
    scale = (world.world_size / loss_tokens).float()
    nll_sum = torch.zeros((), dtype=torch.float64, device=world.device)
    tokens = 0
    for i, mb in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        if before_last is not None and last:
            before_last()
        reshard_after_backward(model, last)  # reshard_after_forward = false: gathered once a step
        seqs = PackedSeqs.from_position_ids(mb.position_ids).to(world.device)  # on the host: no device sync
        mb = mb.to(world.device)
        # -sum of the target logprobs (ignored targets count 0), cross-entropy-only LM head
        nll = model(mb.input_ids, mb.position_ids, mb.targets, seqs=seqs, nll_sum=True)
        (nll * scale).backward()
        nll_sum += nll.detach()
        tokens += mb.input_ids.numel()
    dist.all_reduce(nll_sum)
    return {"loss": nll_sum / loss_tokens, "loss_tokens": counts[0], "tokens": tokens * world.world_size}


def main(argv: list[str] | None = None) -> None:
    logging.captureWarnings(True)
    train(parse_config(SFTConfig, argv, prog="sft"))


if __name__ == "__main__":
    main()
    exit_rank(0)  # not interpreter finalization: see exit_rank

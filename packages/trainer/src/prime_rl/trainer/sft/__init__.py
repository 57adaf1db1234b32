"""Supervised fine-tuning: `sft` (entrypoint: config + torchrun launch) and the per-rank loop (train)."""

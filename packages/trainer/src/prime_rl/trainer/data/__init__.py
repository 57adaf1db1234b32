"""Training data: SFT chat files and fake tokens, packed into fixed-length rows of micro-batches."""

from prime_rl.trainer.data.loader import DataLoader, SFTMicroBatch, build_data_loader
from prime_rl.trainer.data.packing import Sample

__all__ = ["DataLoader", "SFTMicroBatch", "Sample", "build_data_loader"]

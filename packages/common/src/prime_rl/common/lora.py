"""The LoRA adapter directory the trainer writes and inference reads: peft's layout plus the served name.

Trainer and inference may not import each other, so the file names both ends agree on live here once.
A published version (`broadcasts/step_<n>/`) holds all three files and the `STABLE` marker; an exported
adapter (`weights/step_<n>/`) only peft's two.
"""

ADAPTER_CONFIG = "adapter_config.json"
"""peft's adapter config (r, lora_alpha, target_modules, ...)."""
ADAPTER_WEIGHTS = "adapter_model.safetensors"
"""peft's adapter tensors, keys `base_model.model.<HF module>.lora_A.weight` / `.lora_B.weight`."""
ADAPTER_META = "prime_rl_adapter.json"
"""{"name": ..., "version": ...}: the name inference serves a published adapter under (not part of peft's format)."""

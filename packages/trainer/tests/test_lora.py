"""LoRA on one process: gradients match peft on the same tiny model, bad input fails with one clear line,
the peft-format export loads in peft (same logits) and the merged export loads in transformers (same logits)."""

import json

import pytest
import torch
import torch.nn.functional as F

from prime_rl.common.config.trainer import LoRAConfig
from prime_rl.common.lora import ADAPTER_CONFIG
from prime_rl.common.testing import make_tiny_model
from prime_rl.trainer.lora import (
    adapter_config,
    apply_lora,
    check_lora,
    init_lora_weights,
    is_lora_param,
    lora_modules,
    merge_lora,
    num_trainable_params,
    peft_state_dict,
    training_flops_per_token,
    write_adapter_dir,
)
from prime_rl.trainer.models import (
    build_model,
    load_arch_config,
    load_hf_weights,
    model_flops_per_token,
    num_active_params,
    save_hf_weights,
)

peft = pytest.importorskip("peft", reason="peft is the reference implementation (test extra of prime-rl-trainer)")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def fp32_model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("lora") / "tiny-fp32", dtype="float32", seed=3)


def _ours(model_dir, cfg: LoRAConfig) -> torch.nn.Module:
    model = build_model(str(model_dir), attn="sdpa", dtype=torch.float32, device="cpu")
    load_hf_weights(model, model_dir)
    apply_lora(model, cfg)
    init_lora_weights(model, seed=0)
    with torch.no_grad():  # B != 0, or the gradient of every A is zero and the test proves little
        gen = torch.Generator().manual_seed(1)
        for module in lora_modules(model).values():
            module.lora_B.copy_(torch.randn(module.lora_B.shape, generator=gen) * 0.05)
    return model


def _peft(model_dir, cfg: LoRAConfig, ours: torch.nn.Module) -> torch.nn.Module:
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    peft_cfg = peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=0.0,
        target_modules=cfg.target_modules,
        modules_to_save=cfg.modules_to_save or None,
    )
    model = peft.get_peft_model(hf, peft_cfg)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, module in lora_modules(ours).items():
            for leaf in ("lora_A", "lora_B"):
                params[f"base_model.model.model.{name}.{leaf}.default.weight"].copy_(getattr(module, leaf))
    return model


def _loss_ours(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    logits = model.lm_head(model(ids, positions))[0]  # (T, V)
    return F.cross_entropy(logits[:-1], ids[0, 1:])


def _loss_peft(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits[0]
    return F.cross_entropy(logits[:-1], ids[0, 1:])


@pytest.mark.parametrize("modules_to_save", [[], ["lm_head"]], ids=["adapters", "with_lm_head"])
def test_gradients_match_peft(fp32_model_dir, modules_to_save):
    cfg = LoRAConfig(
        rank=4, alpha=8.0, target_modules=["q_proj", "v_proj", "down_proj"], modules_to_save=modules_to_save
    )
    ours = _ours(fp32_model_dir, cfg)
    reference = _peft(fp32_model_dir, cfg, ours)
    ids = torch.randint(3, 400, (1, 48), generator=torch.Generator().manual_seed(0))
    loss, ref_loss = _loss_ours(ours, ids), _loss_peft(reference, ids)
    loss.backward()
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-5)

    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    checked = 0
    for name, param in ours.named_parameters():
        if not param.requires_grad:
            assert param.grad is None, f"{name} is frozen yet has a gradient"
            continue
        module, _, leaf = name.rpartition(".")
        if leaf in ("lora_A", "lora_B"):
            ref = ref_grads[f"base_model.model.model.{module}.{leaf}.default.weight"]
        else:
            ref = ref_grads[f"base_model.model.{name}".replace(".weight", ".modules_to_save.default.weight")]
        assert param.grad.abs().max() > 0, name
        torch.testing.assert_close(param.grad, ref, rtol=1e-4, atol=1e-6, msg=name)
        checked += 1
    # 2 layers x 3 targets x (A, B), plus the LM head when trained in full
    assert checked == 12 + len(modules_to_save)
    assert len(ref_grads) == checked
    trainable, total = num_trainable_params(ours)
    assert trainable == sum(p.numel() for p in ref_grads.values()) and trainable < total


def test_bad_input_is_one_clear_line(fp32_model_dir):
    config = load_arch_config(str(fp32_model_dir))
    cases = {
        "entry 'qkv_proj' matches no linear layer": LoRAConfig(target_modules=["q_proj", "qkv_proj"]),
        "entry 'router' matches no linear layer": LoRAConfig(target_modules=["router"]),
        r"entry '.*\\.nope' matches no linear layer": LoRAConfig(target_modules=r".*\.nope"),
        "must be <= min(in, out) = 128": LoRAConfig(rank=200, target_modules=["q_proj"]),
        "cannot be adapted": LoRAConfig(target_modules=r".*(q_proj|lm_head)"),
        "matches no module": LoRAConfig(modules_to_save=["score"]),
    }
    for expected, cfg in cases.items():
        with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")) as info:
            check_lora(cfg, config)
        assert "\n" not in str(info.value)
    assert check_lora(LoRAConfig(target_modules=r"layers\.1\.self_attn\.o_proj"), config) == [
        "layers.1.self_attn.o_proj"
    ]


def test_peft_export_and_merged_export_load(fp32_model_dir, tmp_path):
    cfg = LoRAConfig(rank=4, alpha=16.0, target_modules=["q_proj", "k_proj", "up_proj"], modules_to_save=["lm_head"])
    ours = _ours(fp32_model_dir, cfg)
    with torch.no_grad():
        ours.lm_head.weight.mul_(1.5)  # a trained-in-full module must reach the export too
    ids = torch.randint(3, 400, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ours.lm_head(ours(ids, torch.arange(32).unsqueeze(0)))[0]
    config = load_arch_config(str(fp32_model_dir))

    trainable = {n: p.detach() for n, p in ours.named_parameters() if p.requires_grad}
    adapter_dir = tmp_path / "adapter"
    write_adapter_dir(adapter_dir, peft_state_dict(trainable, config), adapter_config(ours, str(fp32_model_dir)))
    written = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    assert written["target_modules"] == ["k_proj", "q_proj", "up_proj"] and written["modules_to_save"] == ["lm_head"]
    base = transformers.AutoModelForCausalLM.from_pretrained(fp32_model_dir, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, adapter_dir)
    with torch.no_grad():
        got = loaded(input_ids=ids).logits[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)

    merged = merge_lora(ours.state_dict(), cfg.alpha / cfg.rank)
    assert not any(is_lora_param(k) for k in merged)
    save_hf_weights(merged, tmp_path / "merged", config)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        got = plain(input_ids=ids).logits[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_partial_targets_export_as_regex(fp32_model_dir):
    model = build_model(str(fp32_model_dir), device="meta")
    apply_lora(model, LoRAConfig(rank=2, target_modules=r"layers\.0\.mlp\.(up|down)_proj"))
    target = adapter_config(model, "base")["target_modules"]
    assert target == r"^(model\.layers\.0\.mlp\.up_proj|model\.layers\.0\.mlp\.down_proj)$"


def test_flops_count_no_weight_gradient_for_the_frozen_base(fp32_model_dir):
    config = load_arch_config(str(fp32_model_dir))
    seq = 256
    plain = build_model(str(fp32_model_dir), device="meta")
    full = model_flops_per_token(config, seq)
    assert training_flops_per_token(plain, seq) == full
    attention = full - 6 * num_active_params(config)
    lora = build_model(str(fp32_model_dir), device="meta")
    apply_lora(lora, LoRAConfig(rank=4, target_modules=["q_proj", "down_proj"]))
    adapters = sum(p.numel() for n, p in lora.named_parameters() if is_lora_param(n))
    assert training_flops_per_token(lora, seq) == 4 * num_active_params(config) + 6 * adapters + attention
    head = build_model(str(fp32_model_dir), device="meta")
    apply_lora(head, LoRAConfig(rank=4, target_modules=["q_proj", "down_proj"], modules_to_save=["lm_head"]))
    vocab_hidden = config.vocab_size * config.hidden_size  # the LM head's weight gradient is computed again
    assert training_flops_per_token(head, seq) == training_flops_per_token(lora, seq) + 2 * vocab_hidden


@pytest.mark.parametrize("saved", ["embed_tokens", "lm_head"])
@pytest.mark.parametrize("tied", [False, True])
def test_flops_count_an_embedding_trained_in_full_only_where_the_lm_head_multiplies_it(tmp_path, tied, saved):
    """Untied, the embedding is a lookup (no FLOPs) and the LM head a matmul; tied, the one matrix is both, so
    training either name in full costs the LM head's weight gradient, counted once."""
    model_dir = make_tiny_model(tmp_path / "tiny", dtype="float32", tie_word_embeddings=tied)
    config, seq = load_arch_config(str(model_dir)), 256
    lora = build_model(str(model_dir), device="meta")
    apply_lora(lora, LoRAConfig(rank=4, target_modules=["q_proj"]))
    saving = build_model(str(model_dir), device="meta")
    apply_lora(saving, LoRAConfig(rank=4, target_modules=["q_proj"], modules_to_save=[saved]))
    multiplies = tied or saved == "lm_head"
    extra = 2 * config.vocab_size * config.hidden_size if multiplies else 0
    assert training_flops_per_token(saving, seq) == training_flops_per_token(lora, seq) + extra

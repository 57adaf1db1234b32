"""Nemotron-H / Nemotron-3 (`nemotron_h`): logits and gradients against transformers' NemotronHForCausalLM
on tiny random configs (every mixer type: Mamba-2, attention, relu^2 MLP, MoE), packed rows against
their documents one by one (Mamba state and conv1d reset at every document start), the checkpoint
round trip, and the published Nemotron-3 Nano shape on the meta device."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from prime_rl.trainer.models import PackedSeqs, build_model, load_hf_weights, read_hf_state_dict, save_hf_weights
from prime_rl.trainer.models.config import load_arch_config
from prime_rl.trainer.models.flops import model_flops_per_token, num_active_params
from prime_rl.trainer.models.mamba import causal_conv1d_packed, ssd_chunk_scan

TINY_NH = dict(
    vocab_size=128, hidden_size=64, hybrid_override_pattern="M*-ME", num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
    chunk_size=8, conv_kernel=4, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=24,
    moe_shared_expert_intermediate_size=32, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    layer_norm_epsilon=1e-5, max_position_embeddings=256,
    # dt clamped below at 1e-3 by every transformers version: up to 5.24 at time_step_min, from 5.25 at
    # time_step_limit (which we follow, as vLLM does); the default limit (0, inf) clamps nothing
    time_step_min=1e-3, time_step_limit=(1e-3, float("inf")),
)  # fmt: skip
CASES = {
    "hybrid_moe": {},  # Nemotron-3's mix: Mamba-2, attention, MLP, MoE with grouped sigmoid routing
    "dense_hybrid_one_group": {"hybrid_override_pattern": "M-M*-", "n_groups": 1},  # Nemotron-H (no MoE)
    "latent_moe_bias": {"hybrid_override_pattern": "ME*E", "moe_latent_size": 32, "use_bias": True, "n_group": 1,
                        "topk_group": 1, "norm_topk_prob": False},  # Nemotron-3 Super's latent MoE
}  # fmt: skip


def _hf_model(path, seed=0, **overrides):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    config = NemotronHConfig(**{**TINY_NH, **overrides})
    config._attn_implementation = "eager"
    model = NemotronHForCausalLM(config).float().eval()
    with torch.no_grad():  # randomize what HF initializes to constants, so a mix-up cannot hide
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight") or name.endswith(".D"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias") and not name.endswith("dt_bias"):
                p.normal_(0, 0.1)
            elif name.endswith("A_log"):
                p.uniform_(-1.0, 1.5)
            elif name.endswith("dt_bias"):  # softplus from ~1e-4 to ~0.7: some dt hit the time_step_min clamp
                p.uniform_(-9.0, 0.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.3)  # large enough to change which experts are chosen
    model.save_pretrained(path)
    return model


def _ours(path):
    model = build_model(path, attn="sdpa", dtype=torch.float32, device="cpu")
    load_hf_weights(model, path)
    return model


def _hf_grad(hf_params, name):
    hf_name = {"embed_tokens.weight": "model.embeddings.weight", "norm.weight": "model.norm_f.weight"}.get(name)
    if name == "lm_head.weight":
        hf_name = name
    return hf_params[hf_name or "model." + name].grad


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_gradients_match_transformers(tmp_path, case):
    hf = _hf_model(tmp_path, **CASES[case])
    ours = _ours(tmp_path)
    ids = torch.randint(0, TINY_NH["vocab_size"], (1, 37), generator=torch.Generator().manual_seed(2))  # 4 chunks + 5
    logits = ours.lm_head(ours(ids, torch.arange(37)[None]))
    ref = hf(input_ids=ids).logits
    torch.testing.assert_close(logits, ref, atol=2e-5, rtol=1e-5)

    logits.square().mean().backward()
    ref.square().mean().backward()
    hf_params = dict(hf.named_parameters())
    assert len(hf_params) == len(dict(ours.named_parameters()))
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, _hf_grad(hf_params, name), atol=1e-5, rtol=1e-4, msg=name)


# Document starts at 5 (inside chunk 0), 16 (exactly a chunk start), 17 (after a 1-token document), 33.
LENGTHS = [5, 11, 1, 16, 9]


def _naive_scan(x, dt, A, B, C, doc_ids):
    """The recurrence itself, token by token: the reference the chunked scan must equal."""
    heads, groups = x.shape[1], B.shape[1]
    B, C = B.repeat_interleave(heads // groups, 1), C.repeat_interleave(heads // groups, 1)
    state = torch.zeros(heads, x.shape[2], B.shape[2])  # (h, p, n)
    ys = []
    for t in range(x.shape[0]):
        if t == 0 or doc_ids[t] != doc_ids[t - 1]:
            state = torch.zeros_like(state)
        decay = torch.exp(dt[t] * A)[:, None, None]
        state = decay * state + (dt[t, :, None, None] * x[t, :, :, None]) * B[t, :, None, :]
        ys.append(torch.einsum("hpn,hn->hp", state, C[t]))
    return torch.stack(ys)


@pytest.mark.parametrize("chunk_size", [1, 4, 8, 64])
def test_chunked_scan_equals_the_recurrence_with_resets(chunk_size):
    g = torch.Generator().manual_seed(0)
    T, h, p, groups, n = sum(LENGTHS), 4, 3, 2, 5
    x, B, C = (
        torch.randn(T, h, p, generator=g),
        torch.randn(T, groups, n, generator=g),
        torch.randn(T, groups, n, generator=g),
    )
    dt = torch.rand(T, h, generator=g) * 0.5 + 0.01
    A = -torch.rand(h, generator=g) * 2 - 0.1
    doc_ids = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    y = ssd_chunk_scan(x, dt, A, B, C, doc_ids, chunk_size)
    torch.testing.assert_close(y, _naive_scan(x, dt, A, B, C, doc_ids), atol=1e-5, rtol=1e-5)
    # guard: without the resets the recurrence gives another answer, so the comparison above can fail
    assert not torch.allclose(y, _naive_scan(x, dt, A, B, C, torch.zeros_like(doc_ids)), atol=1e-3)


def test_packed_conv_never_reads_the_previous_document():
    g = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(12, 6, generator=g), torch.randn(6, 1, 4, generator=g), torch.randn(6, generator=g)
    doc_ids = torch.tensor([0] * 5 + [1] * 2 + [2] * 5)
    out = causal_conv1d_packed(x, weight, bias, doc_ids)
    for start, end in ((0, 5), (5, 7), (7, 12)):
        ref = F.conv1d(x[start:end].T[None], weight, bias, padding=3, groups=6)[0, :, : end - start].T
        torch.testing.assert_close(out[start:end], ref)


def _doc_loss(model, input_ids, position_ids):
    logits = model.lm_head(model(input_ids, position_ids)).flatten(0, 1)  # (T, V)
    targets = input_ids.flatten().roll(-1)
    doc_ids = PackedSeqs.from_position_ids(position_ids).doc_ids  # rows start documents too
    next_is_same_doc = torch.cat([doc_ids[1:] == doc_ids[:-1], torch.tensor([False])])
    return F.cross_entropy(logits[next_is_same_doc], targets[next_is_same_doc], reduction="sum")


@pytest.mark.parametrize("rows", [1, 2])
def test_packed_row_equals_documents_one_by_one(tmp_path, rows):
    hf = _hf_model(tmp_path)
    model = _ours(tmp_path)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, TINY_NH["vocab_size"], (1, sum(LENGTHS)), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    if rows == 2:  # a second row starting mid-document (positions 11.. of a truncated sample) is its own document
        ids, pos = ids.view(2, -1), torch.cat([pos[:, :21], torch.cat([torch.arange(11, 23), torch.arange(9)])[None]])
        lengths = [5, 11, 1, 4, 12, 9]
    else:
        lengths = LENGTHS

    packed_out = model(ids, pos)  # (rows, T, H)
    packed_loss = _doc_loss(model, ids, pos)
    packed_loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    single_loss, outs = torch.zeros(()), []
    for doc_ids in ids.flatten().split(lengths):
        doc_pos = torch.arange(doc_ids.numel())[None]
        outs.append(model(doc_ids[None], doc_pos)[0])
        single_loss = single_loss + _doc_loss(model, doc_ids[None], doc_pos)
        with torch.no_grad():  # and transformers agrees document by document
            ref = hf(input_ids=doc_ids[None]).logits[0]
            torch.testing.assert_close(model.lm_head(outs[-1]), ref, atol=2e-5, rtol=1e-5)
    single_loss.backward()

    torch.testing.assert_close(packed_out.flatten(0, 1), torch.cat(outs), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_loss, single_loss, atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_checkpoint_round_trips_bit_for_bit_without_mtp_layers(tmp_path):
    _hf_model(tmp_path / "hf")
    saved = read_hf_state_dict(tmp_path / "hf")
    assert "backbone.layers.4.mixer.experts.7.up_proj.weight" in saved  # the on-disk layout HF writes
    # Nemotron-3 Super checkpoints carry multi-token-prediction weights under mtp.*
    from safetensors.torch import save_file

    save_file({"mtp.layers.0.norm.weight": torch.ones(64)}, str(tmp_path / "hf" / "mtp.safetensors"))
    model = _ours(tmp_path / "hf")  # the MTP tensors are skipped, not "unexpected"
    save_hf_weights(model, tmp_path / "out")
    again = read_hf_state_dict(tmp_path / "out")
    assert sorted(again) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(again[name], tensor), name
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "nemotron_h"
    from transformers import NemotronHForCausalLM  # and transformers loads what we wrote

    reloaded = NemotronHForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(reloaded.model.layers[4].mixer.experts.up_proj, model.layers[4].mixer.experts.up_proj)
    assert torch.equal(reloaded.model.embeddings.weight, model.embed_tokens.weight)


def test_config_reads_pattern_or_block_types_and_counts_active_params(tmp_path):
    hf = _hf_model(tmp_path)
    c = load_arch_config(tmp_path)  # transformers 5 writes layers_block_type
    assert c.layer_types == ["mamba", "attention", "mlp", "mamba", "moe"]
    old_style = {**TINY_NH, "model_type": "nemotron_h", "mamba_n_groups": 2, "mamba_d_conv": 3}
    old_style.pop("n_groups"), old_style.pop("conv_kernel")
    legacy = load_arch_config(old_style)  # released checkpoints: hybrid_override_pattern and mamba_* keys
    assert legacy.layer_types == c.layer_types and (legacy.mamba_n_groups, legacy.conv_kernel) == (2, 3)
    assert c.time_step_limit == (1e-3, float("inf"))  # as written by transformers (JSON Infinity)
    bare = {k: v for k, v in TINY_NH.items() if not k.startswith("time_step")}
    assert load_arch_config({**bare, "model_type": "nemotron_h"}).time_step_limit == (0.0, float("inf"))
    assert [c.is_moe_layer(i) for i in range(5)] == [False, False, False, False, True]
    assert (c.num_experts, c.n_group, c.topk_group, c.routed_scaling_factor) == (8, 4, 2, 2.5)
    # active params per token: everything but the input embedding, with 3 of 8 routed experts per token
    all_params = sum(p.numel() for p in hf.parameters()) - hf.model.embeddings.weight.numel()
    assert num_active_params(c) == all_params - (8 - 3) * 2 * 64 * 24
    # MFU: the attention term counts the one attention layer, not all five
    assert model_flops_per_token(c, 100) == 6 * num_active_params(c) + 12 * 1 * 4 * 16 * 100


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"hybrid_override_pattern": "M*X"}, r"hybrid_override_pattern='M\*X' has \['X'\]"),
        ({"mlp_hidden_act": "silu"}, "mlp_hidden_act='silu' is not supported; only 'relu2'"),
        ({"n_groups": 3}, "n_groups=3 must divide mamba_num_heads=8"),
        ({"n_group": 3}, "n_group=3 must divide"),
        ({"time_step_limit": [0.1, 0.01]}, r"time_step_limit=\[0.1, 0.01\] must be \[low, high\]"),
    ],
)
def test_bad_configs_are_refused_with_the_fix(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_arch_config({**TINY_NH, **overrides, "model_type": "nemotron_h"})


def test_nemotron_3_nano_shape_builds_on_meta_at_its_published_size():
    """nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16's config.json: 31.6B parameters, 3.2B active (without
    the input embedding; 3.6B with it). 52 layers: 23 Mamba-2, 23 MoE (128 experts, top 6 + 1 shared), 6 attention."""
    nano = dict(
        model_type="nemotron_h", vocab_size=131072, hidden_size=2688, intermediate_size=1856,
        hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME", num_hidden_layers=52,
        num_attention_heads=32, num_key_value_heads=2, head_dim=128, mamba_num_heads=64, mamba_head_dim=64,
        ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128, use_conv_bias=True, mamba_proj_bias=False,
        use_bias=False, n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712, n_shared_experts=1, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, mlp_hidden_act="relu2", layer_norm_epsilon=1e-5, tie_word_embeddings=False,
        max_position_embeddings=262144,
    )  # fmt: skip
    model = build_model(nano, device="meta")
    types = model.config.layer_types
    assert (types.count("mamba"), types.count("moe"), types.count("attention")) == (23, 23, 6)
    total = sum(p.numel() for p in model.parameters())
    assert total == 31_577_937_344  # transformers' NemotronHForCausalLM on meta counts the same
    assert 3.2e9 < num_active_params(load_arch_config(nano)) < 3.25e9
    assert 3.55e9 < num_active_params(load_arch_config(nano)) + 131072 * 2688 < 3.6e9


def test_every_block_compiles_as_full_graphs_and_matches_eager(tmp_path, monkeypatch):
    """apply_compile's fullgraph choice per block (Mamba-2, attention, MLP whole; the MoE around its experts,
    whose per-expert loop reads host counts on CPU) traces without a graph break; aot_eager keeps it fast."""
    from torch import nn

    from prime_rl.trainer.parallel.compile import apply_compile

    _hf_model(tmp_path)
    eager, compiled = _ours(tmp_path), _ours(tmp_path)
    compile_module = nn.Module.compile
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: compile_module(self, backend="aot_eager", **kw))
    torch._dynamo.reset()
    apply_compile(compiled.layers, fullgraph=True, moe_is_one_graph=False)
    ids, pos = torch.randint(0, 128, (1, 21), generator=torch.Generator().manual_seed(5)), torch.arange(21)[None]
    pos[0, 9:] -= 9  # two documents
    for model in (eager, compiled):
        model.lm_head(model(ids, pos)).square().mean().backward()
    # one graph per block type (Mamba-2, attention, MLP) plus the MoE's gate, shared expert and norm
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 6
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_bf16_logits_follow_transformers(tmp_path):
    """In bf16 the casts matter (fp32 norm scaling, dt in the activation dtype before the fp32 scan)."""
    hf = _hf_model(tmp_path, **CASES["dense_hybrid_one_group"]).to(torch.bfloat16)
    ours = build_model(tmp_path, attn="sdpa", dtype=torch.bfloat16, device="cpu")
    load_hf_weights(ours, tmp_path)
    ids = torch.randint(0, TINY_NH["vocab_size"], (1, 37), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, ref = ours.lm_head(ours(ids, torch.arange(37)[None])).float(), hf(input_ids=ids).logits.float()
    err = (got - ref).abs().max().item()
    assert err < 0.01 * ref.abs().max().item(), err  # measured: 0.0039 of 0.63 (one bf16 ulp)


def test_nemotron_3_super_shape_builds_on_meta_at_its_published_size():
    """Nemotron-3 Super 120B-A12B (the issue's RL example): 88 layers, 40 Mamba-2 / 40 latent MoE (512 experts,
    top 22, latent 1024) / 8 attention; 120.6B parameters, 12.7B active with the embedding. The layer order
    here is illustrative (the count does not depend on it); the MTP layer is not built (see weights.py)."""
    super_ = dict(
        model_type="nemotron_h", vocab_size=131072, hidden_size=4096, intermediate_size=21504,
        hybrid_override_pattern="MEMEMEMEME*" * 8, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
        mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128,
        n_routed_experts=512, num_experts_per_tok=22, moe_intermediate_size=2688, moe_latent_size=1024,
        moe_shared_expert_intermediate_size=5376, n_shared_experts=1, n_group=1, topk_group=1,
        routed_scaling_factor=5.0, norm_topk_prob=True, tie_word_embeddings=False,
    )  # fmt: skip
    model = build_model(super_, device="meta")
    assert model.layers[1].mixer.fc1_latent_proj.weight.shape == (1024, 4096)
    assert model.layers[1].mixer.experts.up_proj.shape == (512, 2688, 1024)
    assert sum(p.numel() for p in model.parameters()) == 120_668_687_360  # transformers on meta: the same
    active_with_embedding = num_active_params(load_arch_config(super_)) + 131072 * 4096
    assert 12.7e9 < active_with_embedding < 12.8e9


def test_init_weights_fills_every_tensor_like_transformers_and_router_stats_report_moe_layers():
    config = {**TINY_NH, "model_type": "nemotron_h", "moe_latent_size": 32}
    torch.manual_seed(0)
    model = build_model(config, dtype=torch.float32, device="cpu")  # from meta: to_empty() + init_weights()
    for name, t in model.state_dict().items():
        assert torch.isfinite(t).all() and t.abs().max() < 1e3, name  # nothing left as to_empty() garbage
    mixer = model.layers[0].mixer
    assert torch.equal(mixer.A_log, torch.log(torch.arange(1, 9, dtype=torch.float32))) and (mixer.D == 1).all()
    dt = F.softplus(mixer.dt_bias)
    assert (dt >= 1e-4).all() and (dt <= 0.1 + 1e-6).all()
    model(torch.randint(0, 128, (1, 10)), torch.arange(10)[None])
    assert list(model.router_stats()) == [4] and model.router_stats()[4].sum() == 10 * 3  # 10 tokens, top 3

"""Packed sequences: attention stays inside each document, so packing changes nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prime_rl.trainer.models import PackedSeqs, build_model, load_hf_weights

LENGTHS = [7, 30, 1, 22]


def test_packed_seqs_boundaries():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 0, 1, 2, 3]])  # row 2 starts mid-document
    seqs = PackedSeqs.from_position_ids(position_ids)
    assert seqs.cu_seqlens.tolist() == [0, 3, 5, 6, 8, 12]
    assert seqs.cu_seqlens.dtype == torch.int32
    assert seqs.doc_ids.tolist() == [0, 0, 0, 1, 1, 2, 3, 3, 4, 4, 4, 4]
    assert seqs.max_seqlen == 4 and seqs.num_docs == 5


def test_packed_seqs_to_keeps_boundaries_and_drops_cache():
    seqs = PackedSeqs.from_position_ids(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    seqs.cache["sdpa_mask"] = torch.ones(1)
    moved = seqs.to("meta")  # the training loop builds on the host, then moves to the accelerator
    assert moved.cu_seqlens.device.type == moved.doc_ids.device.type == moved.position_ids.device.type == "meta"
    assert (moved.max_seqlen, moved.num_docs, moved.num_tokens) == (3, 3, 6)
    assert moved.cache == {}  # masks are per device: rebuilt there


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("attn", ["sdpa", "flex"])
def test_host_built_seqs_give_the_same_forward(hf_model_factory, packed, attn):
    """The trainer passes boundaries built on the host (no device sync); the model must not care."""
    model = _model(hf_model_factory, "qwen3", attn)
    input_ids, position_ids = packed(LENGTHS, model.config.vocab_size)
    with torch.no_grad():  # FlexAttention has no backward on CPU
        given = model(input_ids, position_ids, seqs=PackedSeqs.from_position_ids(position_ids.clone()))
        torch.testing.assert_close(given, model(input_ids, position_ids), atol=0, rtol=0)


def _loss(model, input_ids, position_ids):
    """Sum of next-token cross entropy within each document (the last token of a doc predicts nothing)."""
    logits = model.lm_head(model(input_ids, position_ids))[0].float()  # (T, V)
    targets = input_ids[0].roll(-1)
    next_is_same_doc = torch.cat([position_ids[0, 1:] != 0, torch.tensor([False])])
    return F.cross_entropy(logits[next_is_same_doc], targets[next_is_same_doc], reduction="sum")


def _model(hf_model_factory, kind, attn):
    _, path = hf_model_factory(kind)
    model = build_model(path, attn=attn, dtype=torch.float32, device="cpu")
    load_hf_weights(model, path)
    return model


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_sdpa_packed_loss_and_grads_equal_one_by_one(hf_model_factory, packed, kind):
    model = _model(hf_model_factory, kind, "sdpa")
    input_ids, position_ids = packed(LENGTHS, model.config.vocab_size)

    packed_loss = _loss(model, input_ids, position_ids)
    packed_loss.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    single_loss = torch.zeros(())
    for ids, pos in zip(input_ids.split(LENGTHS, dim=1), position_ids.split(LENGTHS, dim=1)):
        single_loss = single_loss + _loss(model, ids, pos)
    single_loss.backward()

    torch.testing.assert_close(packed_loss, single_loss, atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_packing_changes_hidden_states_without_document_mask(hf_model_factory, packed):
    """Guard for the test above: attending across documents would give different outputs."""
    model = _model(hf_model_factory, "qwen3", "sdpa")
    input_ids, position_ids = packed(LENGTHS, model.config.vocab_size)
    with torch.no_grad():
        masked = model(input_ids, position_ids)
        one_doc = model(input_ids, torch.arange(input_ids.shape[1])[None])
    tail = slice(LENGTHS[0], None)
    assert not torch.allclose(masked[:, tail], one_doc[:, tail], atol=1e-3)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_flex_packed_matches_sdpa(hf_model_factory, packed, kind):
    # FlexAttention has no backward on CPU (torch 2.13): forward here, backward in the GPU test.
    _, path = hf_model_factory(kind)
    models = {}
    for attn in ("sdpa", "flex"):
        models[attn] = build_model(path, attn=attn, dtype=torch.float32, device="cpu")
        load_hf_weights(models[attn], path)
    input_ids, position_ids = packed(LENGTHS, models["sdpa"].config.vocab_size)
    with torch.no_grad():
        ref = models["sdpa"](input_ids, position_ids)
        out = models["flex"](input_ids, position_ids)
        singles = torch.cat(
            [models["flex"](i, p) for i, p in zip(input_ids.split(LENGTHS, 1), position_ids.split(LENGTHS, 1))], dim=1
        )
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, singles, atol=1e-5, rtol=1e-5)


def test_batch_rows_are_separate_documents(hf_model_factory, packed):
    model = _model(hf_model_factory, "qwen3", "sdpa")
    input_ids, position_ids = packed([16, 16], model.config.vocab_size)
    with torch.no_grad():
        as_rows = model(input_ids.view(2, 16), position_ids.view(2, 16))
        as_packed = model(input_ids, position_ids)
    assert as_rows.shape == (2, 16, model.config.hidden_size)
    torch.testing.assert_close(as_rows.reshape(1, 32, -1), as_packed)

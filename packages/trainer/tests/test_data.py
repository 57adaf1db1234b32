"""Packing, assistant-only loss masks, fake data and the step-indexed loader."""

import json

import pytest
import torch
from transformers import AutoTokenizer

from prime_rl.common.config import load_config
from prime_rl.common.config.trainer import FakeDataConfig, SFTDataConfig
from prime_rl.trainer.data import build_data_loader
from prime_rl.trainer.data.packing import IGNORE_INDEX, Sample, pack_samples
from prime_rl.trainer.data.sft import load_sft_samples, tokenize_conversation

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "add 2 3"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "add 1 1"},
    {"role": "assistant", "content": "2"},
]


def test_pack_samples_positions_targets_and_padding():
    a = Sample([1, 2, 3], [False, True, True])
    b = Sample([4, 5], [False, True])
    c = Sample([6, 7, 8, 9], [False, False, True, True])
    rows = pack_samples([a, b, c], seq_len=6, pad_id=0)
    assert len(rows) == 2
    assert rows[0].input_ids.tolist() == [1, 2, 3, 4, 5, 0]
    assert rows[0].position_ids.tolist() == [0, 1, 2, 0, 1, 0]  # padding is its own document
    # targets: next token within a sample, only where the next token carries loss
    assert rows[0].targets.tolist() == [2, 3, IGNORE_INDEX, 5, IGNORE_INDEX, IGNORE_INDEX]
    assert rows[1].input_ids.tolist() == [6, 7, 8, 9, 0, 0]
    assert rows[1].targets.tolist() == [IGNORE_INDEX, 8, 9, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]


def test_pack_rejects_sample_longer_than_seq_len():
    with pytest.raises(ValueError, match="longer than data.seq_len=4"):
        pack_samples([Sample([1] * 5, [True] * 5)], seq_len=4)


def test_assistant_mask_covers_exactly_the_assistant_turns(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    sample = tokenize_conversation(tok, CHAT)
    full = tok.apply_chat_template(CHAT, tokenize=False)
    assert tok.decode(sample.input_ids) == full
    trained = tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])
    # the assistant contents and their end-of-turn markers, nothing from system/user or role headers
    assert "5" in trained and "2" in trained
    assert "add" not in trained and "brief" not in trained and "assistant" not in trained
    assert "<|im_end|>" in trained


def _write_jsonl(path, conversations):
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return path


def test_sft_file_errors(tiny_model_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    path = _write_jsonl(tmp_path / "d.jsonl", [CHAT])
    with pytest.raises(ValueError, match=r"> data.seq_len=8"):
        load_sft_samples(path, tok, seq_len=8, vocab_size=len(tok))
    with pytest.raises(ValueError, match="does not match the model"):
        load_sft_samples(path, tok, seq_len=512, vocab_size=10)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_sft_samples(tmp_path / "missing.jsonl", tok, seq_len=512, vocab_size=len(tok))


def test_parquet_and_jsonl_give_the_same_samples(tiny_model_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    pq.write_table(pa.table({"messages": [CHAT, CHAT[:3]]}), tmp_path / "d.parquet")
    a = load_sft_samples(tmp_path / "d.parquet", tok, 512, len(tok))
    b = load_sft_samples(_write_jsonl(tmp_path / "d.jsonl", [CHAT, CHAT[:3]]), tok, 512, len(tok))
    assert [s.input_ids for s in a] == [s.input_ids for s in b]


def _cat(mbs):
    return torch.cat([mb.input_ids for mb in mbs], dim=1)


@pytest.mark.parametrize("kind", ["fake", "sft"])
def test_ranks_split_the_single_process_batch(tiny_model_dir, tmp_path, kind):
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    if kind == "fake":
        cfg = FakeDataConfig(seq_len=32, batch_size=4, min_sample_len=5, max_sample_len=20)
    else:
        path = _write_jsonl(tmp_path / "d.jsonl", [CHAT, CHAT[:3], CHAT[1:3]] * 5)
        cfg = SFTDataConfig(path=path, seq_len=64, batch_size=4)
    one = build_data_loader(cfg, tok, len(tok), 0, 1)
    two = [build_data_loader(cfg, tok, len(tok), r, 2) for r in range(2)]
    for step in (0, 1, 7):  # step 7 wraps into later epochs for the small SFT file
        both = torch.cat([_cat(two[r].micro_batches(step)) for r in range(2)], dim=1)
        assert torch.equal(_cat(one.micro_batches(step)), both)
    assert not torch.equal(_cat(one.micro_batches(0)), _cat(one.micro_batches(1)))


def test_micro_batch_concatenates_rows_and_batch_must_divide():
    cfg = FakeDataConfig(seq_len=16, batch_size=4, micro_batch_size=2)
    mbs = build_data_loader(cfg, None, 100, 0, 1).micro_batches(0)
    assert len(mbs) == 2 and mbs[0].input_ids.shape == (1, 32)
    assert mbs[0].position_ids[0, 16] == 0  # second row starts a new document
    with pytest.raises(ValueError, match="must be a multiple of"):
        build_data_loader(cfg, None, 100, 0, 3)


def test_fake_sample_lengths_validated():
    with pytest.raises(Exception, match="max_sample_len"):
        load_config(FakeDataConfig, ["--seq-len", "16", "--max-sample-len", "32"])

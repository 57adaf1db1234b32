"""SFT samples from a local chat file: `{"messages": [{"role": ..., "content": ...}, ...]}` per row.

The tokenizer's chat template renders each conversation. Loss goes on assistant tokens only: the
tokens that message i adds are found by rendering messages[:i] and messages[:i+1] and checking the
shorter one is a prefix of the longer (true for ordinary chat templates; an error names the sample
otherwise). For an assistant turn the prefix includes the generation prompt, so the role header is
not trained on — the model learns what follows "<|im_start|>assistant\n", as at inference.

Everything is tokenized up front: bad samples (too long, ids outside the model's vocabulary) fail
before the model is built.
"""

import json
from pathlib import Path
from typing import Any

from prime_rl.trainer.data.packing import Sample


def read_conversations(path: Path) -> list[list[dict[str, Any]]]:
    """Read the `messages` column of a .jsonl or .parquet file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data.path={str(path)!r} does not exist; point it at a .jsonl or .parquet chat file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        if "messages" not in table.column_names:
            raise ValueError(f"{path} has columns {table.column_names}; SFT needs a 'messages' column")
        rows = table.column("messages").to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        rows = []
        with path.open() as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if "messages" not in record:
                    raise ValueError(f"{path}:{lineno} has keys {sorted(record)}; SFT needs a 'messages' key")
                rows.append(record["messages"])
    else:
        raise ValueError(f"data.path={str(path)!r}: unsupported suffix {path.suffix!r}; use .jsonl or .parquet")
    if not rows:
        raise ValueError(f"{path} holds no samples")
    return rows


def tokenize_conversation(tokenizer: Any, messages: list[dict[str, Any]]) -> Sample:
    """Render one conversation with the chat template; mask in the assistant turns' tokens."""
    ids: list[int] = []
    mask: list[bool] = []
    for i, message in enumerate(messages):
        is_assistant = message["role"] == "assistant"
        prefix = _render(tokenizer, messages[:i], add_generation_prompt=is_assistant) if i else []
        full = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if full[: len(prefix)] != prefix or full[: len(ids)] != ids:
            raise ValueError(
                f"the chat template is not prefix-stable at message {i} (role {message['role']!r}): rendering "
                "fewer messages does not give a prefix of rendering more; use a template without history rewriting"
            )
        # tokens between ids and prefix: the generation prompt (no loss); after prefix: the message
        mask.extend([False] * (len(prefix) - len(ids)))
        mask.extend([is_assistant] * (len(full) - len(prefix)))
        ids = full
    return Sample(input_ids=ids, loss_mask=mask)


def _render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(out, dict) or hasattr(out, "input_ids"):  # BatchEncoding in newer transformers
        out = out["input_ids"]
    return list(out)


def load_sft_samples(path: Path, tokenizer: Any, seq_len: int, vocab_size: int) -> list[Sample]:
    """Tokenize every conversation; fail on the first sample the model cannot train on."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer of {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; add one to "
            "tokenizer_config.json (chat_template) to train on chat messages"
        )
    samples = []
    for index, messages in enumerate(read_conversations(path)):
        sample = tokenize_conversation(tokenizer, messages)
        if len(sample.input_ids) > seq_len:
            raise ValueError(
                f"sample {index} of {path} has {len(sample.input_ids)} tokens > data.seq_len={seq_len}; raise "
                "data.seq_len or drop/shorten that sample"
            )
        if not any(sample.loss_mask[1:]):
            raise ValueError(f"sample {index} of {path} has no assistant tokens to train on")
        top = max(sample.input_ids)
        if top >= vocab_size:
            raise ValueError(
                f"sample {index} has token id {top} >= the model's vocab_size={vocab_size}: the tokenizer does not "
                "match the model; use the tokenizer that ships with the model"
            )
        samples.append(sample)
    return samples

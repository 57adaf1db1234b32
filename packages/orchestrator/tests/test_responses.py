"""The typed decoding of vLLM's answers (responses.py) reads exactly what the dict-walking parser read."""

import json

import numpy as np
import pytest

from prime_rl.orchestrator.client import InferenceError, parse_chat_response, parse_completion_response


def vllm_chat_body(n: int = 3, tokens: int = 200, seed: int = 0) -> dict:
    """A chat completion as vLLM 0.26-0.32 writes it with logprobs, return_token_ids, return_tokens_as_token_ids:
    every field it sends, the ones the orchestrator ignores included."""
    rng = np.random.default_rng(seed)
    choices = []
    for i in range(n):
        ids = [int(t) for t in rng.integers(0, 151_936, size=tokens)]
        # float32 logprobs written as Python floats, with vLLM's -9999.0 floor and an exact zero among them
        logprobs = [float(x) for x in rng.normal(-8, 4, size=tokens).astype(np.float32)]
        logprobs[:2] = [-9999.0, 0.0]
        content = [
            {"token": f"token_id:{t}", "logprob": lp, "bytes": [104, 105], "top_logprobs": []}
            for t, lp in zip(ids, logprobs)
        ]
        message = {"role": "assistant", "content": f"text {i} \u00e9\u4e2d", "refusal": None, "tool_calls": [],
                   "reasoning_content": None}  # fmt: skip
        choices.append({"index": i, "message": message, "logprobs": {"content": content}, "stop_reason": None,
                        "finish_reason": "length" if i else "stop", "token_ids": ids})  # fmt: skip
    choices.reverse()  # the parser orders choices by index
    return {"id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "m", "choices": choices,
            "usage": {"prompt_tokens": 4}, "prompt_logprobs": None, "prompt_token_ids": [1, 2, 3, 151_935],
            "kv_transfer_params": None}  # fmt: skip


def test_chat_body_decodes_to_the_exact_ids_logprobs_and_text_of_json_loads():
    body = vllm_chat_body()
    raw = json.dumps(body).encode()
    expected = json.loads(raw)  # what the old parser read: stdlib floats and ints
    result = parse_chat_response(raw, 3)
    assert result.prompt_ids == [1, 2, 3, 151_935]
    for i, completion in enumerate(result.completions):
        choice = next(c for c in expected["choices"] if c["index"] == i)
        assert completion.token_ids == choice["token_ids"]
        assert completion.logprobs == [e["logprob"] for e in choice["logprobs"]["content"]]  # bit-exact floats
        assert all(type(x) is float for x in completion.logprobs) and all(type(t) is int for t in completion.token_ids)
        assert completion.text == choice["message"]["content"]
        assert completion.finish_reason == choice["finish_reason"]
        assert completion.routed_experts is None
    decoded = parse_chat_response(expected, 3)  # an already decoded body reads the same
    assert [c.__dict__ for c in decoded.completions] == [c.__dict__ for c in result.completions]


def test_token_ids_fall_back_to_token_id_spellings_and_other_spellings_are_refused():
    body = vllm_chat_body(n=2, tokens=5)
    with_ids = parse_chat_response(body, 2)
    for choice in body["choices"]:
        del choice["token_ids"]
    spelled = parse_chat_response(json.dumps(body).encode(), 2)
    assert [c.token_ids for c in spelled.completions] == [c.token_ids for c in with_ids.completions]
    body["choices"][0]["logprobs"]["content"][0]["token"] = "hello"
    with pytest.raises(InferenceError, match="tokens are not 'token_id:<n>'"):
        parse_chat_response(body, 2)


def test_missing_or_malformed_fields_are_inference_errors():
    body = vllm_chat_body(n=1, tokens=3)
    with pytest.raises(InferenceError, match="asked for n=2 completions, got 1"):
        parse_chat_response(body, 2)
    with pytest.raises(InferenceError, match="no prompt_token_ids"):
        parse_chat_response({**body, "prompt_token_ids": None}, 1)
    body["choices"][0]["logprobs"]["content"][0]["logprob"] = "high"
    with pytest.raises(InferenceError, match=r"unreadable chat completion response: .*logprob"):
        parse_chat_response(json.dumps(body).encode(), 1)
    with pytest.raises(InferenceError, match="unreadable chat completion response"):
        parse_chat_response(b"<html>bad gateway</html>", 1)


def test_completion_body_decodes_like_before():
    """/v1/completions (multi-turn): token_logprobs as a flat list; both id lists required."""
    choice = {"index": 1, "text": "ab", "token_ids": [5, 6], "prompt_token_ids": [1, 2], "finish_reason": "stop",
              "logprobs": {"tokens": ["token_id:5", "token_id:6"], "token_logprobs": [-0.5, -1.25],
                           "top_logprobs": [{"token_id:5": -0.5}, {"token_id:6": -1.25}], "text_offset": [0, 1]}}  # fmt: skip
    other = {**choice, "index": 0, "text": None}
    raw = json.dumps({"choices": [choice, other]}).encode()
    first, second = parse_completion_response(raw, 2)
    assert (first.completion.text, second.completion.text) == ("", "ab")
    assert second.prompt_ids == [1, 2] and second.completion.token_ids == [5, 6]
    assert second.completion.logprobs == [-0.5, -1.25] and second.completion.finish_reason == "stop"
    with pytest.raises(InferenceError, match="no token_ids / prompt_token_ids"):
        parse_completion_response({"choices": [{**choice, "token_ids": None}]}, 1)

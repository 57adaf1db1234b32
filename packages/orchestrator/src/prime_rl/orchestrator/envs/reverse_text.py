"""reverse_text: reverse a short random string of letters (or the order of a few words).

Reward is 1 - normalized Levenshtein distance between the stripped completion and the answer, so
a half-right answer earns partial credit: the signal is dense enough for a tiny model to climb.
"""

from __future__ import annotations

import numpy as np

from prime_rl.orchestrator.envs.base import Environment, Messages, Task

LETTERS = "abcdefghijklmnopqrstuvwxyz"
WORDS = (
    "apple river stone cloud green music table light paper horse quiet smile bread ocean tiger "
    "glass storm plant sugar honey train money chair watch dream"
).split()


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insert, delete, substitute each cost 1); O(len(a) * len(b))."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def similarity(prediction: str, answer: str) -> float:
    """1 - edit_distance / max length, in [0, 1]; 1.0 for two empty strings."""
    longest = max(len(prediction), len(answer))
    if longest == 0:
        return 1.0
    return 1.0 - edit_distance(prediction, answer) / longest


class ReverseTextEnv(Environment):
    name = "reverse_text"

    def __init__(self, unit: str = "chars", min_len: int = 3, max_len: int = 8):
        if unit not in ("chars", "words"):
            raise ValueError(f"reverse_text unit={unit!r} must be 'chars' or 'words'")
        if not 1 <= min_len <= max_len:
            raise ValueError(f"reverse_text needs 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
        self.unit, self.min_len, self.max_len = unit, min_len, max_len

    def sample_tasks(self, n: int, rng: np.random.Generator) -> list[Task]:
        tasks = []
        for length in rng.integers(self.min_len, self.max_len + 1, size=n):
            if self.unit == "chars":
                text = "".join(LETTERS[i] for i in rng.integers(0, len(LETTERS), size=int(length)))
                answer = text[::-1]
            else:
                words = [WORDS[i] for i in rng.integers(0, len(WORDS), size=int(length))]
                text, answer = " ".join(words), " ".join(reversed(words))
            tasks.append({"text": text, "answer": answer})
        return tasks

    def build_prompt(self, task: Task) -> Messages:
        what = "the characters of this text" if self.unit == "chars" else "the order of these words"
        return [{"role": "user", "content": f"Reverse {what}. Reply with the result only.\n{task['text']}"}]

    def score(self, task: Task, completion_text: str) -> float:
        return similarity(completion_text.strip(), task["answer"])

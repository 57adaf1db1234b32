"""The bundled tasks, written as readable Python; this script writes them to src/swe_env/data/tasks.jsonl.

    python environments/swe_env/make_tasks.py          # rewrite the JSONL after editing a task here
    python -m swe_env.check                            # then check every task through the environment

Eight small repositories, each with one bug of a different kind (off-by-one, operator precedence in a
boolean rule, a missing even-length case, a mutable default argument, incomplete normalization, an unsorted
input assumption, aliasing of a module-level dict, a bug one module away from its symptom). Each has visible
tests that show the bug, hidden tests that check the described behaviour more widely, and a reference patch
(`replace_in_file` edits). The tests in environments/swe_env/tests check the JSONL is this script's output.
"""

from __future__ import annotations

import json
from pathlib import Path
from textwrap import dedent

OUT = Path(__file__).parent / "src" / "swe_env" / "data" / "tasks.jsonl"


def _d(text: str) -> str:
    return dedent(text).lstrip("\n")


PAGER = {
    "id": "pager-off-by-one",
    "problem_statement": _d("""
        `paginate(items, page, per_page)` in pager.py skips the first page: `paginate([1, 2, 3, 4, 5], 1, 2)`
        returns `[3, 4]` instead of `[1, 2]`. Pages are numbered from 1; a page past the last one is empty.
    """),
    "files": {
        "pager.py": _d('''
            """Split a list of items into numbered pages."""


            def num_pages(items: list, per_page: int) -> int:
                """How many pages `items` fill (the last one may be partial)."""
                if per_page < 1:
                    raise ValueError(f"per_page={per_page} must be >= 1")
                return (len(items) + per_page - 1) // per_page


            def paginate(items: list, page: int, per_page: int) -> list:
                """The items on page `page` (pages are numbered from 1); an empty list past the last page."""
                if page < 1:
                    raise ValueError(f"page={page} must be >= 1 (pages are numbered from 1)")
                start = page * per_page
                return items[start : start + per_page]
        '''),
    },
    "visible_tests": {
        "tests/test_pager.py": _d("""
            from pager import num_pages, paginate


            def test_num_pages():
                assert num_pages([1, 2, 3, 4, 5], 2) == 3


            def test_first_page():
                assert paginate([1, 2, 3, 4, 5], 1, 2) == [1, 2]
        """),
    },
    "hidden_tests": {
        "tests/test_pager_hidden.py": _d("""
            import pytest

            from pager import num_pages, paginate

            ITEMS = list(range(1, 8))


            def test_every_page():
                assert [paginate(ITEMS, p, 3) for p in (1, 2, 3)] == [[1, 2, 3], [4, 5, 6], [7]]


            def test_pages_cover_the_items_once():
                pages = [paginate(ITEMS, p, 2) for p in range(1, num_pages(ITEMS, 2) + 1)]
                assert sum(pages, []) == ITEMS


            def test_past_the_last_page_is_empty():
                assert paginate(ITEMS, 4, 3) == []


            def test_page_zero_is_refused():
                with pytest.raises(ValueError):
                    paginate(ITEMS, 0, 3)
        """),
    },
    "reference_patch": [
        {"path": "pager.py", "old": "start = page * per_page", "new": "start = (page - 1) * per_page"},
    ],
}

LEAP = {
    "id": "leap-year-boolean",
    "problem_statement": _d("""
        `days_in_month(2024, 2)` in calendar_utils.py returns 28, but 2024 is a leap year, so February has 29
        days. Leap years follow the Gregorian rule: every year divisible by 4, except years divisible by 100
        that are not divisible by 400 (1900 is not a leap year, 2000 is).
    """),
    "files": {
        "calendar_utils.py": _d('''
            """Gregorian calendar helpers."""

            DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]


            def is_leap(year: int) -> bool:
                """Every 4th year, except centuries, except every 4th century."""
                return year % 4 == 0 and year % 100 != 0 and year % 400 == 0


            def days_in_month(year: int, month: int) -> int:
                if not 1 <= month <= 12:
                    raise ValueError(f"month={month} must be in 1..12")
                if month == 2 and is_leap(year):
                    return 29
                return DAYS[month - 1]
        '''),
    },
    "visible_tests": {
        "tests/test_calendar.py": _d("""
            from calendar_utils import days_in_month


            def test_february_of_a_leap_year():
                assert days_in_month(2024, 2) == 29


            def test_other_months():
                assert days_in_month(2023, 2) == 28
                assert days_in_month(2023, 4) == 30
        """),
    },
    "hidden_tests": {
        "tests/test_calendar_hidden.py": _d("""
            import pytest

            from calendar_utils import days_in_month, is_leap


            @pytest.mark.parametrize(
                "year, leap",
                [(1900, False), (2000, True), (2023, False), (2024, True), (2100, False), (2400, True), (1996, True)],
            )
            def test_is_leap(year, leap):
                assert is_leap(year) is leap


            def test_year_lengths():
                assert sum(days_in_month(2024, m) for m in range(1, 13)) == 366
                assert sum(days_in_month(1900, m) for m in range(1, 13)) == 365
                assert days_in_month(2000, 2) == 29
        """),
    },
    "reference_patch": [
        {
            "path": "calendar_utils.py",
            "old": "year % 4 == 0 and year % 100 != 0 and year % 400 == 0",
            "new": "year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)",
        },
    ],
}

MEDIAN = {
    "id": "median-even-count",
    "problem_statement": _d("""
        `median([1, 2, 3, 4])` in stats.py returns 3. For an even number of values the median is the mean of
        the two middle values of the sorted list (here 2.5). It must not reorder the caller's list.
    """),
    "files": {
        "stats.py": _d('''
            """Small descriptive statistics."""


            def mean(values: list[float]) -> float:
                if not values:
                    raise ValueError("mean of an empty list is undefined")
                return sum(values) / len(values)


            def median(values: list[float]) -> float:
                """The middle value of the sorted values (the mean of the two middle ones for an even count)."""
                if not values:
                    raise ValueError("median of an empty list is undefined")
                ordered = sorted(values)
                return ordered[len(ordered) // 2]
        '''),
    },
    "visible_tests": {
        "tests/test_stats.py": _d("""
            from stats import mean, median


            def test_mean():
                assert mean([1, 2, 3]) == 2


            def test_median():
                assert median([3, 1, 2]) == 2
                assert median([1, 2, 3, 4]) == 2.5
        """),
    },
    "hidden_tests": {
        "tests/test_stats_hidden.py": _d("""
            import pytest

            from stats import median


            @pytest.mark.parametrize(
                "values, expected",
                [([5], 5), ([4, 1, 3, 2], 2.5), ([1, 1, 2, 10], 1.5), ([-1, 1], 0), ([7, 3, 5], 5), ([2, 2], 2)],
            )
            def test_median(values, expected):
                assert median(values) == expected


            def test_input_is_not_reordered():
                values = [4, 1, 3, 2]
                median(values)
                assert values == [4, 1, 3, 2]


            def test_empty():
                with pytest.raises(ValueError):
                    median([])
        """),
    },
    "reference_patch": [
        {
            "path": "stats.py",
            "old": "    return ordered[len(ordered) // 2]\n",
            "new": "    mid = len(ordered) // 2\n"
            "    if len(ordered) % 2 == 0:\n"
            "        return (ordered[mid - 1] + ordered[mid]) / 2\n"
            "    return ordered[mid]\n",
        },
    ],
}

TODO = {
    "id": "todo-mutable-default",
    "problem_statement": _d("""
        New `TodoList()` objects in todo.py share their items: after `a = TodoList(); a.add("milk")`, a fresh
        `TodoList()` already contains "milk" (and adding "milk" to it raises). Every list created without
        arguments must start empty and stay independent of the others.
    """),
    "files": {
        "todo.py": _d('''
            """A minimal to-do list."""


            class TodoList:
                def __init__(self, items: list[str] = []):
                    self.items = items

                def add(self, item: str) -> None:
                    if item in self.items:
                        raise ValueError(f"{item!r} is already on the list")
                    self.items.append(item)

                def done(self, item: str) -> None:
                    self.items.remove(item)

                def __len__(self) -> int:
                    return len(self.items)
        '''),
    },
    "visible_tests": {
        "tests/test_todo.py": _d("""
            from todo import TodoList


            def test_new_lists_are_independent():
                a = TodoList()
                a.add("milk")
                assert len(TodoList()) == 0
        """),
    },
    "hidden_tests": {
        "tests/test_todo_hidden.py": _d("""
            import pytest

            from todo import TodoList


            def test_many_lists():
                lists = [TodoList() for _ in range(3)]
                for i, todo in enumerate(lists):
                    todo.add(f"task {i}")
                assert [t.items for t in lists] == [["task 0"], ["task 1"], ["task 2"]]


            def test_same_item_on_two_lists():
                a, b = TodoList(), TodoList()
                a.add("milk")
                b.add("milk")
                assert len(a) == len(b) == 1


            def test_duplicates_and_done():
                todo = TodoList(["bread"])
                with pytest.raises(ValueError):
                    todo.add("bread")
                todo.done("bread")
                assert len(todo) == 0
                assert len(TodoList()) == 0
        """),
    },
    "reference_patch": [
        {
            "path": "todo.py",
            "old": "    def __init__(self, items: list[str] = []):\n        self.items = items\n",
            "new": "    def __init__(self, items: list[str] | None = None):\n"
            "        self.items = list(items) if items is not None else []\n",
        },
    ],
}

SLUG = {
    "id": "slugify-normalization",
    "problem_statement": _d("""
        `slugify("Hello, World!")` in slug.py returns "hello,-world!". A slug may contain only lowercase ASCII
        letters, digits and single hyphens between words: any run of other characters (spaces, punctuation)
        becomes one hyphen, and a slug never starts or ends with a hyphen. "Hello, World!" -> "hello-world".
    """),
    "files": {
        "slug.py": _d('''
            """URL slugs from titles."""


            def slugify(title: str) -> str:
                """Lowercase letters and digits, words joined by single hyphens."""
                return title.lower().replace(" ", "-")
        '''),
        "README.md": '# slug\n\n`slugify(title)` makes URL slugs: `slugify("Hello, World!") == "hello-world"`.\n',
    },
    "visible_tests": {
        "tests/test_slug.py": _d("""
            from slug import slugify


            def test_simple():
                assert slugify("Hello World") == "hello-world"


            def test_punctuation():
                assert slugify("Hello, World!") == "hello-world"
        """),
    },
    "hidden_tests": {
        "tests/test_slug_hidden.py": _d("""
            import pytest

            from slug import slugify


            @pytest.mark.parametrize(
                "title, slug",
                [
                    ("  Leading and trailing  ", "leading-and-trailing"),
                    ("Many   spaces\\tand\\ttabs", "many-spaces-and-tabs"),
                    ("C'est la vie -- 2024 edition", "c-est-la-vie-2024-edition"),
                    ("already-a-slug", "already-a-slug"),
                    ("Version 2.0 (beta)!", "version-2-0-beta"),
                    ("!!!", ""),
                ],
            )
            def test_slugify(title, slug):
                assert slugify(title) == slug
        """),
    },
    "reference_patch": [
        {
            "path": "slug.py",
            "old": '"""URL slugs from titles."""\n',
            "new": '"""URL slugs from titles."""\n\nimport re\n',
        },
        {
            "path": "slug.py",
            "old": 'return title.lower().replace(" ", "-")',
            "new": 'return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")',
        },
    ],
}

INTERVALS = {
    "id": "merge-intervals-unsorted",
    "problem_statement": _d("""
        `merge([(5, 8), (1, 3), (2, 6)])` in intervals.py returns `[(5, 8), (1, 6)]`; it should be `[(1, 8)]`.
        The input intervals can come in any order; the result is sorted by start and merges every pair of
        intervals that share at least one point.
    """),
    "files": {
        "intervals.py": _d('''
            """Merging closed integer intervals."""


            def merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
                """Merge intervals that share at least one point; the result is sorted by start."""
                merged: list[tuple[int, int]] = []
                for start, end in intervals:
                    if merged and start <= merged[-1][1]:
                        merged[-1] = (merged[-1][0], max(merged[-1][1], end))
                    else:
                        merged.append((start, end))
                return merged
        '''),
    },
    "visible_tests": {
        "tests/test_intervals.py": _d("""
            from intervals import merge


            def test_sorted_input():
                assert merge([(1, 3), (2, 6), (8, 9)]) == [(1, 6), (8, 9)]


            def test_unsorted_input():
                assert merge([(5, 8), (1, 3), (2, 6)]) == [(1, 8)]
        """),
    },
    "hidden_tests": {
        "tests/test_intervals_hidden.py": _d("""
            import pytest

            from intervals import merge


            @pytest.mark.parametrize(
                "intervals, expected",
                [
                    ([], []),
                    ([(7, 8), (1, 2)], [(1, 2), (7, 8)]),
                    ([(2, 3), (1, 10)], [(1, 10)]),
                    ([(3, 4), (1, 2), (2, 3)], [(1, 4)]),
                    ([(10, 12), (4, 5), (1, 2), (11, 15)], [(1, 2), (4, 5), (10, 15)]),
                ],
            )
            def test_merge(intervals, expected):
                assert merge(intervals) == expected


            def test_input_is_not_modified():
                intervals = [(5, 8), (1, 3)]
                merge(intervals)
                assert intervals == [(5, 8), (1, 3)]
        """),
    },
    "reference_patch": [
        {"path": "intervals.py", "old": "for start, end in intervals:", "new": "for start, end in sorted(intervals):"},
    ],
}

SETTINGS = {
    "id": "settings-shared-defaults",
    "problem_statement": _d("""
        Overrides leak between calls of `load_settings` (app/settings.py): after `load_settings({"debug": True})`,
        a later `load_settings()` also has `debug` set to True. Each call must return the defaults with only
        its own overrides applied, and must not change `DEFAULTS`.
    """),
    "files": {
        "app/__init__.py": "",
        "app/settings.py": _d('''
            """Application settings: defaults overlaid with the caller's overrides."""

            DEFAULTS = {"host": "localhost", "port": 8080, "debug": False}


            def load_settings(overrides: dict | None = None) -> dict:
                """The defaults with `overrides` applied; neither `overrides` nor DEFAULTS is modified."""
                settings = DEFAULTS
                if overrides:
                    unknown = set(overrides) - set(DEFAULTS)
                    if unknown:
                        raise KeyError(f"unknown settings {sorted(unknown)}; known: {sorted(DEFAULTS)}")
                    settings.update(overrides)
                return settings
        '''),
        "app/server.py": _d('''
            """The address the app listens on."""

            from app.settings import load_settings


            def address(overrides: dict | None = None) -> str:
                settings = load_settings(overrides)
                return f"{settings['host']}:{settings['port']}"
        '''),
    },
    "visible_tests": {
        "tests/test_settings.py": _d("""
            from app.settings import load_settings


            def test_overrides_do_not_leak():
                assert load_settings({"debug": True})["debug"] is True
                assert load_settings()["debug"] is False
        """),
    },
    "hidden_tests": {
        "tests/test_settings_hidden.py": _d("""
            import pytest

            from app.server import address
            from app.settings import DEFAULTS, load_settings


            def test_defaults_unchanged():
                load_settings({"port": 9000, "debug": True})
                assert DEFAULTS == {"host": "localhost", "port": 8080, "debug": False}


            def test_calls_are_independent():
                assert address({"port": 9000}) == "localhost:9000"
                assert address() == "localhost:8080"


            def test_changing_a_result_changes_nothing_else():
                settings = load_settings()
                settings["host"] = "example.org"
                assert load_settings()["host"] == "localhost"


            def test_unknown_setting():
                with pytest.raises(KeyError):
                    load_settings({"colour": "blue"})
        """),
    },
    "reference_patch": [
        {"path": "app/settings.py", "old": "settings = DEFAULTS\n", "new": "settings = dict(DEFAULTS)\n"},
    ],
}

WORDFREQ = {
    "id": "wordfreq-whitespace",
    "problem_statement": _d("""
        `top_words` (wordfreq package) miscounts text whose words are separated by newlines, tabs or several
        spaces: `top_words("the cat\\nthe  dog", 2)` returns `[("", 1), ("cat\\nthe", 1)]` instead of
        `[("the", 2), ("cat", 1)]`. Words are separated by any run of whitespace and compared lowercased.
    """),
    "files": {
        "wordfreq/__init__.py": '"""Word frequencies of a text."""\n\nfrom wordfreq.count import top_words\n\n__all__ = ["top_words"]\n',
        "wordfreq/tokenize.py": _d('''
            """Split text into words."""


            def tokenize(text: str) -> list[str]:
                """The lowercased words of `text`."""
                return text.lower().split(" ")
        '''),
        "wordfreq/count.py": _d('''
            """Word counts."""

            from collections import Counter

            from wordfreq.tokenize import tokenize


            def top_words(text: str, n: int) -> list[tuple[str, int]]:
                """The `n` most frequent words with their counts, most frequent first, ties alphabetically."""
                counts = Counter(tokenize(text))
                return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
        '''),
    },
    "visible_tests": {
        "tests/test_count.py": _d("""
            from wordfreq import top_words


            def test_single_spaces():
                assert top_words("b a b", 2) == [("b", 2), ("a", 1)]


            def test_newlines_and_runs_of_spaces():
                assert top_words("the cat\\nthe  dog", 2) == [("the", 2), ("cat", 1)]
        """),
    },
    "hidden_tests": {
        "tests/test_wordfreq_hidden.py": _d("""
            from wordfreq import top_words
            from wordfreq.tokenize import tokenize


            def test_tokenize_any_whitespace():
                assert tokenize("  One\\ttwo\\n\\nthree   four ") == ["one", "two", "three", "four"]


            def test_empty_text():
                assert tokenize("") == []
                assert top_words("   ", 3) == []


            def test_case_and_ties():
                text = "Dog cat\\nDOG\\tbird   cat dog"
                assert top_words(text, 3) == [("dog", 3), ("cat", 2), ("bird", 1)]
        """),
    },
    "reference_patch": [
        {"path": "wordfreq/tokenize.py", "old": 'return text.lower().split(" ")', "new": "return text.lower().split()"},
    ],
}

TASKS = [PAGER, LEAP, MEDIAN, TODO, SLUG, INTERVALS, SETTINGS, WORDFREQ]


def render() -> str:
    """The JSONL text: one task per line, keys in a fixed order."""
    return "".join(json.dumps(task, ensure_ascii=False) + "\n" for task in TASKS)


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(render(), encoding="utf-8")
    print(f"wrote {len(TASKS)} tasks to {OUT}")


if __name__ == "__main__":
    main()

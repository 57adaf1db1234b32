"""New config objects with some nested fields replaced, instead of assignments into validated ones.

A derived setting (the orchestrator's inference URL, a reserved port) used to be assigned into the nested model
that validation had returned, so every holder of that model saw it change. Here the changed branch is rebuilt
with ``model_copy(update=...)`` from the changed leaves up: the original and its children are left as they are,
and each replaced field counts as set, as an assignment made it. Untouched branches are shared with the
original (deep-copy it first where the result must share nothing).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


def updated_fields(model: BaseModel, changes: dict[str, Any]) -> dict[str, Any]:
    """The new values of ``model``'s own fields that ``changes`` (dotted paths -> values) touches, each built
    without assigning to ``model`` or its children: ``{"data.port": 5}`` gives ``{"data": <a new data>}``."""
    here: dict[str, Any] = {}
    below: dict[str, dict[str, Any]] = defaultdict(dict)
    for path, value in changes.items():
        head, _, rest = path.partition(".")
        if rest:
            below[head][rest] = value
        else:
            here[head] = value
    for head, sub in below.items():
        here[head] = updated(getattr(model, head), sub)
    return here


def updated(model: M, changes: dict[str, Any]) -> M:
    """A copy of ``model`` with the dotted fields of ``changes`` replaced (``{"trainer.data.port": 5}``)."""
    return model.model_copy(update=updated_fields(model, changes))

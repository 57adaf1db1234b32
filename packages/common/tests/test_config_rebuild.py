"""`updated`: a config with nested fields replaced, the original left as it was."""

from prime_rl.common.config import BaseConfig
from prime_rl.common.config.rebuild import updated, updated_fields


class Leaf(BaseConfig):
    port: int = 1
    host: str = "a"


class Branch(BaseConfig):
    leaf: Leaf = Leaf()
    other: Leaf = Leaf()


class Root(BaseConfig):
    branch: Branch = Branch()
    steps: int = 0


def test_updated_replaces_leaves_without_touching_the_original():
    root = Root()
    new = updated(root, {"branch.leaf.port": 5, "branch.leaf.host": "b", "steps": 3})
    assert (new.branch.leaf.port, new.branch.leaf.host, new.steps) == (5, "b", 3)
    assert root == Root() and root.branch.leaf.model_fields_set == set()  # nothing assigned into the original
    assert new.branch.leaf.model_fields_set == {"port", "host"}  # replaced fields count as set, as assigned ones did
    assert new.branch.other is root.branch.other  # untouched branches are shared


def test_updated_fields_names_only_the_top_level_fields_touched():
    root = Root()
    fields = updated_fields(root, {"branch.other.port": 9})
    assert set(fields) == {"branch"} and fields["branch"].other.port == 9 and root.branch.other.port == 1
    assert updated(root, {}) == root

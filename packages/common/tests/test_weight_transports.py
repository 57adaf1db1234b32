"""The lifecycle table of the weight transports agrees with the config and the wire: one row per
``[weight_broadcast] type``, control requests that exist, and the invariants the prose of DESIGN.md states."""

import typing

from prime_rl.common.config.rl_trainer import WeightBroadcastConfig
from prime_rl.common.weight_transports import ANNOUNCER, TRANSPORTS, refuse_version
from prime_rl.common.wire import AwaitWeightsRequest, LoadWeightsRequest, Message, NixlWeightsRequest


def _config_types() -> set[str]:
    union = typing.get_args(WeightBroadcastConfig)[0]  # Annotated[A | B | C, Field(...)]
    return {cls.model_fields["type"].default for cls in typing.get_args(union)}


def test_one_row_per_configurable_transport():
    assert set(TRANSPORTS) == _config_types() == {"filesystem", "nccl", "nixl", "ipc"}
    assert all(name == t.name for name, t in TRANSPORTS.items())


def test_rows_name_wire_requests_and_agree_on_who_loads():
    for t in TRANSPORTS.values():
        assert all(issubclass(r, Message) for r in t.setup + t.update), t.name
        # A path to load is announced exactly when the orchestrator makes inference load it; otherwise the
        # trainer drives the load and learns it is served from AwaitWeightsRequest before announcing.
        assert t.announces_path == (t.loads == "orchestrator"), t.name
        if t.loads == "trainer":
            assert t.setup and t.update[-1] is AwaitWeightsRequest, t.name
        else:
            assert t.update == (LoadWeightsRequest,) and not t.setup, t.name
    assert TRANSPORTS["nixl"].sending_ranks == "every rank" and TRANSPORTS["nccl"].sending_ranks == "rank 0"
    assert ANNOUNCER == "trainer global rank 0"


def test_version_rule():
    assert refuse_version("nixl", 3, 3) == (
        "refused NIXL update to version 3: version 3 is served and versions must increase"
    )
    assert refuse_version("nixl", 4, 3) is None
    assert refuse_version("nccl", 2, 3) is None and refuse_version("filesystem", 1, 3) is None


def test_both_loading_sides_build_a_versions_requests_from_the_row():
    # the orchestrator's filesystem load and the trainer's pushes send exactly the row's `update`, in order
    assert TRANSPORTS["filesystem"].begin_request(3, path="/run/broadcasts/step_3") == LoadWeightsRequest(
        path="/run/broadcasts/step_3", version=3
    )
    assert TRANSPORTS["filesystem"].finish_requests(3) == ()
    assert TRANSPORTS["nixl"].begin_request(4) == NixlWeightsRequest(version=4)
    for t in TRANSPORTS.values():
        fields = {"specs": []} if t.name in ("nccl", "ipc") else {"path": "/p"} if t.name == "filesystem" else {}
        sent = (t.begin_request(5, **fields), *t.finish_requests(5))
        assert tuple(type(r) for r in sent) == t.update, t.name
        assert all(r.version == 5 for r in sent), t.name

"""docs/DESIGN.md's map stays true: every owner it names exists, and its picture is what the code gives."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def design_map():
    spec = importlib.util.spec_from_file_location("design_map", ROOT / "scripts" / "design_map.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_owner_in_the_concept_map_exists(design_map):
    assert design_map.check_concepts(design_map.DESIGN.read_text()) == []


def test_a_renamed_owner_is_named(design_map):
    text = design_map.DESIGN.read_text().replace("rundir.RunDir`", "rundir.RunDirectory`")
    assert design_map.check_concepts(text) == [
        "concept map names common.rundir.RunDirectory: "
        "packages/common/src/prime_rl/common/rundir.py defines no RunDirectory"
    ]


def test_a_moved_module_and_an_unreadable_owner_are_named(design_map):
    text = design_map.DESIGN.read_text().replace("`trainer.ckpt.CheckpointManager`", "`trainer.checkpoint.Manager`")
    text = text.replace("`orchestrator.teacher.Distiller`", "`orchestrator/teacher.py`")
    assert design_map.check_concepts(text) == [
        "concept map owner cell '`orchestrator/teacher.py`': write each owner `<package>.<module>.<Symbol>`",
        "concept map names trainer.checkpoint.Manager: no module trainer.checkpoint under packages/",
    ]


def test_the_concept_map_fits_a_page(design_map):
    table = design_map._between(design_map.DESIGN.read_text(), design_map.CONCEPTS_BEGIN, design_map.CONCEPTS_END)
    assert len(table.splitlines()) <= 60 and len(table) <= 6500, "merge rows of one concept; keep owners terse"


def test_the_picture_is_generated_from_the_code(design_map):
    text = design_map.DESIGN.read_text()
    current = design_map._between(text, design_map.PICTURE_BEGIN, design_map.PICTURE_END)
    assert current == design_map.generate(), "stale: run `python scripts/design_map.py --write`"


def test_processes_that_name_one_port_are_joined_by_an_edge(design_map):
    configs = {
        "inference": {"server": {"host": "127.0.0.1", "port": 8000, "control_port": "None"}},
        "orchestrator": {
            "model": {"client": {"base_url": "http://127.0.0.1:8000/v1"}},
            "inference": {"addresses": ["tcp://127.0.0.1:8100"]},
            "trainer": {"port": 5555},
        },
        "trainer": {"data": {"port": 5555}, "other_port": 6000},
    }
    assert design_map.channels(configs) == [
        ("inference", "orchestrator", "inference.server.control_port = orchestrator.inference.addresses"),
        ("inference", "orchestrator", "inference.server.port = orchestrator.model.client.base_url"),
        ("orchestrator", "trainer", "orchestrator.trainer.port = trainer.data.port"),
    ]


def test_control_arrows_follow_the_transports_table(design_map):
    """The push transports' trainer -> inference arrow comes from ``TRANSPORTS``: a row that changes who loads
    (or which requests it sends) changes the picture."""
    from prime_rl.common.weight_transports import TRANSPORTS

    colocated = {"orchestrator": ["SleepRequest", "WakeUpRequest"], "trainer": ["WakeUpRequest"], "inference": []}
    edges = design_map.control_edges(TRANSPORTS, colocated)
    assert edges[:2] == [
        ("orchestrator", "inference", "filesystem weights: LoadWeightsRequest"),
        (
            "trainer",
            "inference",
            "nccl, nixl, ipc weights: InitBroadcastRequest, BroadcastWeightsRequest, AwaitWeightsRequest, "
            "InitNixlRequest, NixlWeightsRequest, InitIpcRequest, IpcWeightsRequest",
        ),
    ]
    assert edges[2:] == [
        ("orchestrator", "inference", "colocated: SleepRequest, WakeUpRequest"),
        ("trainer", "inference", "colocated: WakeUpRequest"),
    ]
    moved = {**TRANSPORTS, "nccl": dataclasses.replace(TRANSPORTS["nccl"], loads="orchestrator")}
    assert design_map.control_edges(moved, {})[0] == (
        "orchestrator",
        "inference",
        "filesystem, nccl weights: LoadWeightsRequest, InitBroadcastRequest, BroadcastWeightsRequest, "
        "AwaitWeightsRequest",
    )


def test_the_colocated_requests_are_read_from_the_code(design_map):
    assert design_map.constructed_names("trainer", {"WakeUpRequest", "SleepRequest"}) == {"WakeUpRequest"}
    assert design_map.constructed_names("orchestrator", {"WakeUpRequest", "SleepRequest"}) == {
        "WakeUpRequest",
        "SleepRequest",
    }

"""A colocated ipc publish frees the trainer's memory twice: before inference's weights wake (room for them) and
after the push, before the announcement (the announcement makes the orchestrator wake the KV cache into the room
the trainer leaves; on the H200 the cached full copies of the 1.7B shape, 3.4 GiB, made that wake run out of
memory)."""

from types import SimpleNamespace

import torch

from prime_rl.trainer.rl import publish_ipc
from prime_rl.trainer.rl.publish_base import BackgroundJob
from prime_rl.trainer.rl.publish_ipc import IpcPublisher


class _Sender:
    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.servers = SimpleNamespace(clients=[object()])

    def wake_weights(self) -> None:
        self.events.append("wake weights")

    def stage(self, version: int, named: list) -> SimpleNamespace:
        self.events.append(f"stage {version} ({len(named)} tensors)")
        return SimpleNamespace(bucket_sizes=[1, 1])

    def finish(self, version: int) -> None:
        self.events.append(f"served {version}")


def test_colocated_publish_frees_memory_before_the_weights_wake_and_before_the_announcement(monkeypatch):
    events: list[str] = []
    monkeypatch.setattr(publish_ipc, "model_state_dict_to_hf", lambda tensors, config: tensors)
    publisher = object.__new__(IpcPublisher)  # no model, world or servers: only publish's order runs
    publisher.state = {"a": torch.ones(2), "b": torch.zeros(3)}
    publisher.dtype = torch.bfloat16
    publisher.model = SimpleNamespace(config=None)
    publisher.world = SimpleNamespace(world_size=1)
    publisher.per_node = False  # one node: rank 0 pushes, the background job waits and announces
    publisher.job = BackgroundJob("ipc weight update")
    publisher.last_write_time = publisher.last_wait_time = 0.0
    publisher.sender = _Sender(events)
    publisher.make_room = lambda: events.append("make room")
    publisher.announcer = SimpleNamespace(announce=lambda version, **kw: events.append(f"announce {version}"))

    blocked = publisher.publish(1)
    publisher.flush()

    assert events == [
        "make room",  # the step's memory, before vLLM's weights wake beside the trainer's
        "wake weights",
        "stage 1 (2 tensors)",
        "make room",  # the push's full copies, before the announcement wakes the KV cache
        "served 1",
        "announce 1",
    ]
    # the step's metrics get each part of the blocked time, in the order the parts ran
    assert list(publisher.last_phases) == ["flush", "gather", "make_room", "wake_weights", "push", "free"]
    assert 0 <= sum(publisher.last_phases.values()) <= blocked

"""The real orchestrator loop end to end: a local OpenAI-compatible HTTP server for inference, ZeroMQ
receivers standing in for trainer ranks (publishing broadcasts/step_<n+1> after each batch and
announcing it with a WeightsPublished message, like the trainer does), and a recording fake for the
inference control plane."""

import asyncio
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from prime_rl.common.config.orchestrator import OrchestratorConfig
from prime_rl.common.monitor import FileMonitor, read_metrics
from prime_rl.common.net import free_port
from prime_rl.common.rundir import BROADCAST_MARKER, RunDir
from prime_rl.common.seeding import sample_seed
from prime_rl.common.transport import Receiver, Sender
from prime_rl.common.wire import TrainingBatch, WeightsPublished, micro_batch_arrays
from prime_rl.orchestrator.batch import BatchSender
from prime_rl.orchestrator.client import InferenceClient
from prime_rl.orchestrator.envs.reverse_text import ReverseTextEnv
from prime_rl.orchestrator.orchestrator import Orchestrator
from prime_rl.orchestrator.state import load_state


class BoomEnv(ReverseTextEnv):
    """reverse_text whose grader crashes on the completion "BOOM"."""

    def score(self, task, completion_text):
        if completion_text == "BOOM":
            raise ValueError("grader crashed on BOOM")
        return super().score(task, completion_text)


class RecordingControl:
    def __init__(self):
        self.calls = []

    async def pause(self, mode):
        self.calls.append(("pause", mode))

    async def load_weights(self, path, version):
        self.calls.append(("load", Path(path).name, version))

    async def resume(self):
        self.calls.append(("resume",))

    def close(self):
        pass


class FakeTrainer:
    """One thread per rank pulls TrainingBatches; after each step rank 0 publishes the next weights."""

    def __init__(
        self,
        run_dir: RunDir,
        port: int,
        num_ranks: int,
        num_steps: int,
        weights_port: int,
        publish_delay: float = 0.0,
        push: Callable[[int], None] | None = None,
    ):
        self.run_dir, self.publish_delay, self.weights_port = run_dir, publish_delay, weights_port
        self.push = push
        """A push transport (ipc): called with each version instead of writing it, which is announced without a path."""
        self.received: list[list[tuple[TrainingBatch, dict]]] = [[] for _ in range(num_ranks)]
        self.arrival_times: list[list[float]] = [[] for _ in range(num_ranks)]  # time.monotonic() of each batch
        self.errors: list[BaseException] = []
        self.threads = [
            threading.Thread(target=self._run, args=(rank, port, num_steps), daemon=True) for rank in range(num_ranks)
        ]
        for t in self.threads:
            t.start()

    def _run(self, rank: int, port: int, num_steps: int) -> None:
        try:
            # queues like the trainer's VersionAnnouncer: the orchestrator may have taken its last step and gone
            # before an announcement it did not need (CI: a blocking send timed out after the run had passed)
            announcer = (
                Sender(f"tcp://127.0.0.1:{self.weights_port}", timeout_s=30, queue_without_peer=True)
                if rank == 0
                else None
            )
            with Receiver(f"tcp://127.0.0.1:{port + rank}", bind=False, timeout_s=30) as receiver:
                for i in range(num_steps):
                    message, arrays = receiver.recv()
                    self.arrival_times[rank].append(time.monotonic())
                    self.received[rank].append((message, {k: np.array(v) for k, v in arrays.items()}))
                    if rank == 0:
                        time.sleep(self.publish_delay)
                        # the last version is one no step samples from: the orchestrator may have exited,
                        # and a send to nobody would block until its timeout
                        if self.push is not None:
                            if i < num_steps - 1:
                                self.push(message.step + 1)
                                announcer.send(WeightsPublished(version=message.step + 1, path=None))
                            continue
                        d = self.run_dir.broadcast_dir(message.step + 1)
                        d.mkdir(parents=True)
                        (d / BROADCAST_MARKER).touch()
                        if i < num_steps - 1:
                            announcer.send(WeightsPublished(version=message.step + 1, path=str(d)))
            if announcer is not None:
                announcer.close()
        except BaseException as e:
            self.errors.append(e)

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=30)
        assert not self.errors, self.errors


def make_config(tmp_path: Path, base_url: str, port: int, **overrides) -> OrchestratorConfig:
    fields = dict(
        output_dir=tmp_path,
        run_name="run",
        model={"name": "tiny", "client": {"base_url": base_url, "max_retries": 1, "retry_backoff": 0.01}},
        env={"type": "reverse_text", "min_len": 3, "max_len": 6},
        batch_size=8,
        group_size=4,
        seq_len=256,
        sampling={"max_tokens": 16, "temperature": 0.7},
        max_steps=3,
        num_train_ranks=2,
        trainer={"port": port, "send_timeout": 30, "weights_port": free_port()},
        ckpt={"interval": 1},
        weights_poll_interval=0.01,
        weights_timeout=30,
    )
    fields.update(overrides)
    return OrchestratorConfig.model_validate(fields)


def run_orchestrator(config: OrchestratorConfig, env, control) -> Orchestrator:
    async def go() -> Orchestrator:
        client = InferenceClient(config.model.client.base_url, config.model.name, max_retries=1, retry_backoff=0.01)
        sender = BatchSender("127.0.0.1", config.trainer.port, config.num_train_ranks, timeout=30)
        monitor = FileMonitor(RunDir(config.output_dir, config.run_name))
        orchestrator = Orchestrator(config, env, client, control, sender.send, monitor)
        try:
            await asyncio.wait_for(orchestrator.run(), timeout=60)
        finally:
            await client.aclose()
            sender.close()
            monitor.close()
        return orchestrator

    return asyncio.run(go())


def test_rollouts_to_trainer_batches_end_to_end(tmp_path, make_server, ports):
    server = make_server(boom_last=True)
    port = ports.free_range(2)
    config = make_config(tmp_path, server.base_url, port)
    run_dir = RunDir(tmp_path, "run")
    trainer = FakeTrainer(run_dir, port, num_ranks=2, num_steps=3, weights_port=config.trainer.weights_port)
    control = RecordingControl()
    orchestrator = run_orchestrator(config, BoomEnv(min_len=3, max_len=6), control)
    trainer.join()

    # every rank got one TrainingBatch per step, with equally many micro-batches
    for step in range(3):
        batches = [trainer.received[rank][step] for rank in range(2)]
        assert [b.step for b, _ in batches] == [step, step]
        assert len(batches[0][0].micro_batches) == len(batches[1][0].micro_batches) >= 1
        loss_tokens = 0
        for batch, arrays in batches:
            assert batch.policy_version <= step
            for mb in batch.micro_batches:
                a = micro_batch_arrays(mb, arrays)
                assert a["input_ids"].shape == (256,) and mb.temperature == 0.7
                assert a["position_ids"][0] == 0
                assert not a["advantages"][~a["loss_mask"]].any()
                assert (a["inference_logprobs"][a["loss_mask"]] < 0).all()
                loss_tokens += int(a["loss_mask"].sum())
        assert loss_tokens > 0

    # the trainer's published weights were loaded: pause -> load -> resume, newest version each time
    # (with max_off_policy_steps=1 the poller may see step_1 and step_2 at once and load only step_2)
    loads = [c for c in control.calls if c[0] == "load"]
    assert loads and [v for _, _, v in loads] == sorted({v for _, _, v in loads}) and loads[-1][2] >= 1
    for i, call in enumerate(control.calls):
        if call[0] == "load":
            assert control.calls[i - 1] == ("pause", "keep") and control.calls[i + 1] == ("resume",)
            assert call[1] == f"step_{call[2]}"

    # a batch's row is the trainer's: optimizer steps done once it is trained (= policy version published)
    metrics = read_metrics(run_dir.metrics_path)
    assert [m["step"] for m in metrics] == [b.step + 1 for b, _ in trainer.received[0]] == [1, 2, 3]
    for m in metrics:
        # one BOOM completion per group, two groups per step: counted, scored 0, the run went on
        assert m["env/failed"] == 2
        assert 0.0 < m["reward/mean"] < 1.0 and m["reward/std"] > 0
        assert (
            m["off_policy/dropped"] == 0
            and m["batch/dropped_overlong"] == 0
            and m["seq_len/mean"] > 0
            and m["perf/rollout_throughput"] > 0
        )
    # requests were tagged: after step 1 was published, batch 2 used version >= 1
    assert metrics[2]["policy/batch_version"] >= 1
    assert all(body["return_token_ids"] for body in server.requests)
    # the whole [sampling] table goes out with every request, so generation_config.json never applies
    for body in server.requests:
        assert body["temperature"] == 0.7 and body["max_tokens"] == 16 and body["seed"] is None
        assert (body["top_p"], body["top_k"], body["min_p"]) == (1.0, -1, 0.0)
        assert (body["repetition_penalty"], body["presence_penalty"], body["frequency_penalty"]) == (1.0, 0.0, 0.0)

    # orchestrator state checkpointed each step, and a resumed orchestrator continues from it
    saved = load_state(run_dir.orchestrator_checkpoint_dir(3))
    assert saved.step == 3 and saved.tasks_drawn >= 6
    resumed_config = make_config(tmp_path, server.base_url, port, ckpt={"interval": 1, "resume_step": "latest"})
    resumed = Orchestrator(resumed_config, BoomEnv(), None, RecordingControl(), lambda batches: None)
    assert resumed.step == 3 and resumed.scheduler.start_step == 3
    assert resumed.scheduler.tasks_drawn == saved.tasks_drawn
    assert resumed.scheduler.rng.bit_generator.state == saved.rng_state
    assert orchestrator.step == 3


class FlatOnShortTasksEnv(ReverseTextEnv):
    """reverse_text, except that tasks of 3 letters score 1 whatever the completion: zero-advantage groups."""

    def score(self, task, completion_text):
        return 1.0 if len(task["answer"]) == 3 else super().score(task, completion_text)


def _trained_samples(received: list[tuple[TrainingBatch, dict]]) -> list[int]:
    """Loss tokens per step in one rank's batches."""
    return [
        sum(int(micro_batch_arrays(mb, arrays)["loss_mask"].sum()) for mb in batch.micro_batches)
        for batch, arrays in received
    ]


def test_zero_advantage_groups_are_left_out_and_counted(tmp_path, make_server, ports):
    server = make_server()
    port = ports.free_range(1)
    steps = 4
    config = make_config(tmp_path, server.base_url, port, num_train_ranks=1, max_steps=steps, batch_size=16,
                         env={"type": "reverse_text", "min_len": 3, "max_len": 4}, ckpt={})  # fmt: skip
    trainer = FakeTrainer(RunDir(tmp_path, "run"), port, 1, steps, config.trainer.weights_port)
    orchestrator = run_orchestrator(config, FlatOnShortTasksEnv(min_len=3, max_len=4), RecordingControl())
    trainer.join()
    metrics = read_metrics(RunDir(tmp_path, "run").metrics_path)
    # the fake server answers the same completions to the same task: a task's loss tokens are fixed
    flat = [m["batch/zero_advantage_groups"] for m in metrics]
    assert 0 < sum(flat) < steps * 4, flat  # both kinds of task were drawn
    for m, tokens in zip(metrics, _trained_samples(trainer.received[0])):
        assert m["batch/loss_tokens"] == tokens
        assert m["batch/trained_groups"] == 4 - m["batch/zero_advantage_groups"]
        assert m["batch/zero_advantage_fraction"] == m["batch/zero_advantage_groups"] / 4
        assert (tokens == 0) == (m["batch/trained_groups"] == 0)
        assert m["reward/mean"] > 0  # metrics still cover every group sampled
    assert orchestrator.step == steps

    # switched off, every group trains; a server of its own: the first run's last requests (in flight when it
    # stopped, no seed) may still reach the first server after its run ended
    server = make_server()
    run = tmp_path / "unfiltered"
    config = make_config(run, server.base_url, port, num_train_ranks=1, max_steps=steps, batch_size=16,
                         env={"type": "reverse_text", "min_len": 3, "max_len": 4}, ckpt={},
                         advantage={"filter_zero_advantage": False}, sampling={"max_tokens": 16, "seed": 100})  # fmt: skip
    trainer = FakeTrainer(RunDir(run, "run"), port, 1, steps, config.trainer.weights_port)
    run_orchestrator(config, FlatOnShortTasksEnv(min_len=3, max_len=4), RecordingControl())
    trainer.join()
    assert all(m["batch/trained_groups"] == 4 for m in read_metrics(RunDir(run, "run").metrics_path))
    # a sampling seed makes every request reproducible: sample_seed(run seed, step, task index), the same
    # after a resume; no two groups share seeds (vLLM uses seed + i for the group's i-th sample)
    seeds = sorted(body["seed"] for body in server.requests)
    expected = {sample_seed(100, t // 4, t, 0) for t in range(len(server.requests) + 16)}  # 4 groups per step
    assert set(seeds) <= expected and len(set(seeds)) == len(seeds)
    assert all(b - a >= 4 for a, b in zip(seeds, seeds[1:]))


def test_stale_rollouts_are_dropped_and_counted(tmp_path, make_server, ports):
    # Request 0 (sampled with version 0) takes 1 s; meanwhile the trainer publishes a version every
    # 0.3 s, so by the time it arrives its step is > max_off_policy_steps = 1 ahead: it must be dropped.
    server = make_server(slow_requests={0: 1.0})
    port = ports.free_range(1)
    config = make_config(tmp_path, server.base_url, port, num_train_ranks=1, max_steps=6, max_off_policy_steps=1)
    trainer = FakeTrainer(RunDir(tmp_path, "run"), port, 1, 6, config.trainer.weights_port, publish_delay=0.3)
    run_orchestrator(config, ReverseTextEnv(min_len=3, max_len=6), RecordingControl())
    trainer.join()
    metrics = read_metrics(RunDir(tmp_path, "run").metrics_path)
    assert len(metrics) == 6
    assert sum(m["off_policy/dropped"] for m in metrics) == 1
    assert all(m["off_policy/staleness_max"] <= 1 for m in metrics)


def test_unreachable_inference_stops_the_run_with_a_clear_error(tmp_path, ports):
    url = f"http://127.0.0.1:{ports.closed()}/v1"
    config = make_config(tmp_path, url, ports.free_range(1), num_train_ranks=1)
    try:
        run_orchestrator(config, ReverseTextEnv(), RecordingControl())
    except Exception as e:
        assert url in str(e) and "unreachable" in str(e)
    else:
        raise AssertionError("the run should have failed")

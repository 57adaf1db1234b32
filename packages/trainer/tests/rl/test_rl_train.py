"""The RL trainer end to end on CPU: fake data, and batches from an orchestrator-like ZeroMQ sender."""

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from safetensors.numpy import load_file

from prime_rl.common.testing import make_tiny_model
from prime_rl.common.transport import Sender
from prime_rl.common.wire import build_training_batch
from prime_rl.trainer.testing import torchrun


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny"
    make_tiny_model(path, kind="qwen3", dtype="float32")
    return path


def _run_trainer(args, timeout=240):
    """One trainer process, one intra-op thread like the ranks `torchrun` starts: on a busy 2-core machine torch's
    default (a thread per core) made the tiny MoE's steps 8x slower."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "prime_rl.trainer.rl.train", *args], capture_output=True, text=True, timeout=timeout,
        env=env,
    )  # fmt: skip


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "monitors/file/metrics.jsonl").read_text().splitlines()]


def test_fake_data_runs_and_publishes_weights(tiny_model, tmp_path):
    out = _run_trainer(
        [
            "--model.name", str(tiny_model), "--output-dir", str(tmp_path), "--run-name", "fake",
            "--data.fake", "--data.fake.generate-samples", "--data.fake.doc-len", "40", "--data.seq-len", "128",
            "--data.fake.batch-size", "2", "--max-steps", "2", "--weight-broadcast.dtype", "float32",
        ]
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rows = _metrics(tmp_path / "fake")
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("loss/mean", "entropy/mean", "mismatch_kl", "perf/throughput", "perf/mfu", "perf/peak_memory"):
        assert key in rows[0]
    assert rows[0]["mismatch_kl"] == 0.0  # fake data is on-policy
    published = tmp_path / "fake" / "broadcasts" / "step_2"
    assert (published / "STABLE").exists()
    weights = load_file(str(published / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].dtype == np.float32


def test_trains_on_orchestrator_batches(tiny_model, tmp_path):
    """A sender in the orchestrator's role ships two steps; the trainer learns from them and logs mismatch."""
    seq_len, port = 64, 29611
    rng = np.random.default_rng(0)
    done = threading.Event()

    def orchestrator():
        with Sender(f"tcp://127.0.0.1:{port}", bind=True, timeout_s=120) as sender:
            for step in range(2):
                ids = rng.integers(0, 200, seq_len)
                pos = np.concatenate([np.arange(30), np.arange(34)])
                mask = np.zeros(seq_len, bool)
                mask[10:30] = True
                mask[45:] = True
                batch, arrays = build_training_batch(
                    step, step, [dict(input_ids=ids, position_ids=pos, loss_mask=mask,
                                      advantages=rng.normal(size=seq_len), inference_logprobs=np.full(seq_len, -5.0))],
                    temperature=1.0, metrics={"reward/mean": 0.5},
                )  # fmt: skip
                sender.send(batch, arrays)
        done.set()

    thread = threading.Thread(target=orchestrator, daemon=True)
    thread.start()
    out = _run_trainer(
        ["--model.name", str(tiny_model), "--output-dir", str(tmp_path), "--run-name", "orch",
         "--data.port", str(port), "--max-steps", "2", "--weight-broadcast.dtype", "float32"]
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    thread.join(timeout=10)
    assert done.is_set()
    rows = _metrics(tmp_path / "orch")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["loss/tokens"] == 39  # 20 + 19 completion tokens
    assert rows[0]["mismatch_kl"] > 0  # inference logprobs of -5 differ from the trainer's
    assert (tmp_path / "orch" / "broadcasts" / "step_2" / "STABLE").exists()


@pytest.mark.parametrize(
    ("cp", "world", "message"),
    [
        ("3", None, "model.cp=3 must divide the model's num_attention_heads=4; use 1, 2 or 4"),
        ("2", "3", "model.cp=2 must divide the 3 ranks of an FSDP island (WORLD_SIZE=3 // model.dp_replicate=1)"),
    ],
)
def test_dry_run_refuses_a_layout_the_ranks_would_refuse(tiny_model, tmp_path, monkeypatch, capsys, cp, world, message):
    """`trainer --dry-run` checks cp against the model's heads (4 here) and $WORLD_SIZE as `rl --dry-run` does:
    one line naming the key and where it was set; nothing written."""
    from prime_rl.trainer.rl.train import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    if world is not None:
        monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit) as exit_:
        main(["--model.name", str(tiny_model), "--output-dir", str(tmp_path), "--model.cp", cp, "--dry-run"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"trainer: error: {message}") and err.endswith("from --model.cp on the command line)\n")
    assert not (tmp_path / "rl").exists()


def test_arrays_are_aligned_to_positions_for_the_lm_head():
    """Token t's mask/advantage/logprob move to position t-1, where the head predicts token t."""
    import torch

    from prime_rl.trainer.rl.data import IGNORE_INDEX, from_arrays

    ids = np.array([5, 6, 7, 8, 9, 10], np.int32)
    pos = np.array([0, 1, 2, 0, 1, 2], np.int32)  # two samples of 3 tokens
    mask = np.array([False, True, True, False, True, True])
    arrays = dict(input_ids=ids, position_ids=pos, loss_mask=mask,
                  advantages=np.arange(6, dtype=np.float32), inference_logprobs=-np.arange(6, dtype=np.float32))  # fmt: skip
    mb = from_arrays(arrays, 1.0)
    assert mb.targets.tolist() == [6, 7, IGNORE_INDEX, 9, 10, IGNORE_INDEX]
    assert mb.loss_mask.tolist() == [True, True, False, True, True, False]
    assert mb.advantages.tolist() == [1, 2, 0, 4, 5, 0]
    assert mb.inference_logprobs.tolist() == [-1, -2, 0, -4, -5, 0]
    left, right = mb.shard(0, 2), mb.shard(1, 2)
    assert torch.equal(torch.cat([left.targets, right.targets]), mb.targets)


LORA = ["--model.lora.rank", "4", "--model.lora.target-modules", '["q_proj", "v_proj", "down_proj"]',
        "--optim.lr", "1e-2"]  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.parametrize(("extra", "steps"), [([], 1), (LORA, 2)], ids=["full", "lora"])
def test_context_parallel_matches_one_process(tiny_model, tmp_path, extra, steps):
    """cp=2 over 2 gloo ranks trains on the same fake rows as one process: same loss and grad norm, with full
    fine-tuning and with LoRA adapters (whose second step runs on the adapters the first one moved)."""
    common = ["--model.name", str(tiny_model), "--output-dir", str(tmp_path), "--data.fake", "--data.seq-len", "128",
              "--data.fake.batch-size", "1", "--max-steps", str(steps), "--weight-broadcast.dtype", "float32",
              "--model.reduce-dtype", "float32", *extra]  # fmt: skip
    one = _run_trainer([*common, "--run-name", "cp1"])
    assert one.returncode == 0, one.stdout + one.stderr
    torchrun("-m", "prime_rl.trainer.rl.train", *common, "--run-name", "cp2", "--model.cp", "2", nproc=2)
    ref, got = _metrics(tmp_path / "cp1"), _metrics(tmp_path / "cp2")
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    for a, b in zip(ref, got):
        assert b["loss/tokens"] == a["loss/tokens"]
        assert abs(b["entropy/mean"] - a["entropy/mean"]) < 2e-2 * abs(a["entropy/mean"])
        assert a["optim/grad_norm"] > 0
        assert abs(b["optim/grad_norm"] - a["optim/grad_norm"]) < 5e-2 * a["optim/grad_norm"]
        assert b["loss/mean"] == pytest.approx(a["loss/mean"], rel=5e-2, abs=1e-4)


def test_trainer_env_vars_expand_and_apply(monkeypatch):
    """scaling.md's [trainer.env_vars] block: PATH = "/usr/local/cuda-13.0/bin:${PATH}"."""
    from prime_rl.common.config import load_config
    from prime_rl.common.config.rl import RLConfig
    from prime_rl.trainer.rl.train import apply_env_vars

    monkeypatch.setenv("PATH", "/usr/bin")
    cfg = load_config(
        RLConfig,
        [
            "--model.name",
            "/m",
            "--trainer.env-vars",
            '{"CUDA_HOME": "/usr/local/cuda-13.0", "PATH": "/usr/local/cuda-13.0/bin:${PATH}"}',
        ],
    )
    apply_env_vars(cfg.trainer.env_vars)
    assert os.environ["CUDA_HOME"] == "/usr/local/cuda-13.0"
    assert os.environ["PATH"] == "/usr/local/cuda-13.0/bin:/usr/bin"


def test_gspo_with_kl_to_the_initial_weights(tiny_model, tmp_path):
    """The sequence-level loss with a KL term: the frozen reference equals the policy at step 1 (KL exactly
    0), and the KL grows as the policy moves away from it."""
    out = _run_trainer(
        [
            "--model.name", str(tiny_model), "--output-dir", str(tmp_path), "--run-name", "gspo",
            "--data.fake", "--data.fake.generate-samples", "--data.fake.doc-len", "40", "--data.seq-len", "128",
            "--data.fake.batch-size", "2", "--max-steps", "3", "--optim.lr", "1e-2",
            "--loss.type", "sequence", "--loss.kl.coef", "0.05", "--loss.kl.estimator", "k3",
        ]
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = _metrics(tmp_path / "gspo")
    assert rows[0]["kl_ref"] == 0.0
    assert rows[-1]["kl_ref"] > 0.0
    assert rows[0]["loss/samples"] == 8  # 2 rows of 128 tokens in samples of 40: 4 samples per row


def _orchestrator_batches(
    seq_len: int = 128, steps: int = 2, layouts: tuple[list[int], ...] = ([40, 50, 38],), groups: int = 1
) -> list[list]:
    """Per data-parallel group, its TrainingBatch of each step: every step packs one row per sample-length layout
    (the default's second sample straddles the cp=2 slice boundary at position 64 with loss tokens on both
    sides), and group g gets rows g, g + groups, ... of it (the same rows whatever ``groups`` is)."""
    rng = np.random.default_rng(1)
    out = [[] for _ in range(groups)]
    for step in range(steps):
        rows = []
        for lengths in layouts:
            padding = [seq_len - sum(lengths)] if sum(lengths) < seq_len else []  # its own run of positions
            pos = np.concatenate([np.arange(n) for n in [*lengths, *padding]])
            mask = np.zeros(seq_len, bool)
            for start, n in zip(np.cumsum([0, *lengths[:-1]]), lengths):
                mask[start + 8 : start + n] = True  # an 8-token prompt, then the completion
            adv = np.repeat(rng.normal(size=len(lengths)), lengths).astype(np.float32)
            adv = np.pad(adv, (0, seq_len - adv.size))
            rows.append(dict(input_ids=rng.integers(0, 200, seq_len), position_ids=pos, loss_mask=mask,
                             advantages=adv, inference_logprobs=rng.normal(-5.5, 0.2, seq_len)))  # fmt: skip
        for g in range(groups):
            out[g].append(build_training_batch(step, step, rows[g::groups], temperature=1.0, metrics={}))
    return out


def _serve(port: int, per_group: list[list]) -> list[threading.Thread]:
    """One orchestrator socket per data-parallel group, on ``port + group`` as `OrchestratorSource` expects."""

    def send(port: int, batches: list) -> None:
        with Sender(f"tcp://127.0.0.1:{port}", bind=True, timeout_s=180) as sender:
            for batch, arrays in batches:
                sender.send(batch, arrays)

    threads = [threading.Thread(target=send, args=(port + g, b), daemon=True) for g, b in enumerate(per_group)]
    for thread in threads:
        thread.start()
    return threads


def _join(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive(), "the trainer did not take every batch"


@pytest.mark.multiprocess
def test_context_parallel_on_orchestrator_batches(tiny_model, tmp_path):
    """cp=2 on 2 ranks fed by one orchestrator socket (cp rank 0 receives, broadcasts) trains GSPO with
    norm = "sequence" on samples cut by the slice boundary like one process on the same batches: per-step
    loss, sample count and gradient norm (the second step after an optimizer step on both)."""
    common = ["--model.name", str(tiny_model), "--output-dir", str(tmp_path), "--max-steps", "2",
              "--weight-broadcast.dtype", "float32", "--model.reduce-dtype", "float32", "--data.seq-len", "128",
              "--loss.type", "sequence", "--loss.sequence-mask-low", "0.01", "--loss.sequence-mask-high", "100",
              "--optim.lr", "1e-3"]  # fmt: skip
    port = 29631
    threads = _serve(port, _orchestrator_batches())
    one = _run_trainer([*common, "--run-name", "cp1", "--data.port", str(port)])
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    _join(threads)
    threads = _serve(port + 1, _orchestrator_batches())
    torchrun(
        "-m", "prime_rl.trainer.rl.train", *common, "--run-name", "cp2", "--model.cp", "2",
        "--data.port", str(port + 1), nproc=2,
    )  # fmt: skip
    _join(threads)
    _assert_same_steps(_metrics(tmp_path / "cp1"), _metrics(tmp_path / "cp2"), samples=3)


def _assert_same_steps(ref: list[dict], got: list[dict], samples: int, steps: int = 2) -> None:
    """Per step: the same loss tokens and samples (each counted once), loss, mismatch KL and gradient norm; step 1
    (same weights on both) tighter: without the all-reduce of GSPO's per-sample sums over the cp group, dp=2 x
    cp=2 x ep=2 was off by 9e-4 (loss) and 1.3e-3 (grad norm) there, against <= 1e-4 observed with it."""
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert all(r["loss/mean"] != 0 and r["optim/grad_norm"] > 0 for r in ref)  # no sample masked out
    assert got[0]["loss/mean"] == pytest.approx(ref[0]["loss/mean"], rel=1e-4)
    assert got[0]["optim/grad_norm"] == pytest.approx(ref[0]["optim/grad_norm"], rel=5e-4)
    for a, b in zip(ref, got):
        assert b["loss/samples"] == a["loss/samples"] == samples and b["loss/tokens"] == a["loss/tokens"]
        # after step 1, Adam turns the tiny bf16 gradient differences into updates of up to lr: a GSPO loss near 0
        # (0.0106 at step 2 of dp=2 x cp=2 x ep=2) then moved 7e-5
        assert b["loss/mean"] == pytest.approx(a["loss/mean"], rel=2e-2, abs=2e-4)
        assert b["mismatch_kl"] == pytest.approx(a["mismatch_kl"], rel=1e-2)
        assert b["optim/grad_norm"] == pytest.approx(a["optim/grad_norm"], rel=2e-2)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("moe") / "tiny-moe", kind="qwen3_moe", dtype="float32")


@pytest.mark.multiprocess
def test_dp2_by_cp2_with_ep_and_hsdp_on_orchestrator_batches(tiny_moe, tmp_path):
    """4 gloo ranks as dp=2 x cp=2 with ep=2 over the same rank pairs (a tiny MoE), once with FSDP over all 4 and
    once as HSDP (dp_replicate=2), each data-parallel group fed by its own orchestrator socket, train GSPO with
    norm = "sequence" and a KL term like one process fed both rows of every step on one socket: per-step loss,
    KL, entropy, gradient norm, and loss tokens, samples and padding counted once (samples of both rows cross
    the cp slice boundary)."""
    common = ["--model.name", str(tiny_moe), "--output-dir", str(tmp_path), "--max-steps", "2",
              "--weight-broadcast.dtype", "float32", "--model.reduce-dtype", "float32", "--data.seq-len", "128",
              "--loss.type", "sequence", "--loss.sequence-mask-low", "0.01", "--loss.sequence-mask-high", "100",
              "--loss.kl.coef", "0.05", "--loss.kl.estimator", "k3", "--optim.lr", "1e-3"]  # fmt: skip
    # each row's second sample straddles position 64 with loss tokens on both sides; the second row ends in 8 tokens
    # of padding, so perf/padding_fraction (real / computed tokens, summed over ranks) is not trivially 0
    layouts = ([40, 50, 38], [30, 50, 40])
    port = 29641
    threads = _serve(port, _orchestrator_batches(layouts=layouts))
    one = _run_trainer([*common, "--run-name", "ref", "--data.port", str(port)])
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    _join(threads)
    ref = _metrics(tmp_path / "ref")
    assert ref[0]["kl_ref"] == 0.0 and ref[1]["kl_ref"] > 0.0
    for name, extra in [("fsdp", []), ("hsdp", ["--model.dp-replicate", "2"])]:
        port += 2
        threads = _serve(port, _orchestrator_batches(layouts=layouts, groups=2))
        torchrun(
            "-m", "prime_rl.trainer.rl.train", *common, "--run-name", name, "--model.cp", "2", "--model.ep", "2",
            "--data.port", str(port), *extra, nproc=4,
        )  # fmt: skip
        _join(threads)
        got = _metrics(tmp_path / name)
        _assert_same_steps(ref, got, samples=6)
        for a, b in zip(ref, got):
            assert b["perf/padding_fraction"] == a["perf/padding_fraction"] == 8 / 256
            assert b["entropy/mean"] == pytest.approx(a["entropy/mean"], rel=1e-2)
            assert b["kl_ref"] == pytest.approx(a["kl_ref"], rel=2e-2, abs=1e-6)


def test_keeping_parameters_gathered_between_forwards_changes_no_number(tiny_model, tmp_path):
    """`model.reshard_after_forward = false` keeps the gathered weights from a step's first forward to its last
    backward (`parallel.fsdp.reshard_after_backward`): the same losses and gradient norms as the default, over
    steps of 4 forwards each (one 64-token row per forward)."""
    rows = {}
    for reshard in ("true", "false"):
        out = _run_trainer(
            ["--model.name", str(tiny_model), "--output-dir", str(tmp_path), "--run-name", reshard,
             "--data.fake", "--data.fake.batch-size", "4", "--data.seq-len", "64", "--data.micro-batch-tokens", "64",
             "--max-steps", "2", "--weight-broadcast.dtype", "float32", "--model.reshard-after-forward", reshard]
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        rows[reshard] = _metrics(tmp_path / reshard)
    for default, kept in zip(rows["true"], rows["false"], strict=True):
        for key in ("loss/mean", "entropy/mean", "optim/grad_norm"):
            assert kept[key] == default[key], (key, default["step"])

"""`offload` / `ac` = "auto": the plan as a pure function (roomy GPU, tight GPU, CPU, explicit choices, the H200
calibration), and its resolution into a TrainerModelConfig on CPU."""

import logging

import pytest
import torch

from prime_rl.common.config.trainer import ACConfig, TrainerModelConfig
from prime_rl.trainer.memory_plan import (
    Footprint,
    GiB,
    check_host_memory,
    host_bytes,
    peak_bytes,
    plan_memory,
    plannable_bytes,
    require_resolved,
    resolve_memory,
)


def _qwen3(layers: int, hidden: int, heads: int, kv: int, intermediate: int, vocab: int = 151936) -> Footprint:
    per_layer = 2 * hidden * heads * 128 + 2 * hidden * kv * 128 + 3 * hidden * intermediate + 2 * hidden + 256
    n = layers * per_layer + vocab * hidden + hidden
    return Footprint(n, n, layers, hidden, intermediate, vocab, tied=True)


QWEN3_1_7B = _qwen3(28, 2048, 16, 8, 6144)
QWEN3_4B = _qwen3(36, 2560, 32, 8, 9728)
_TIED_8B = _qwen3(36, 4096, 32, 8, 12288)
QWEN3_8B = Footprint(*[_TIED_8B.num_params + 151936 * 4096] * 2, 36, 4096, 12288, 151936, tied=False)  # untied head


def _levers(plan) -> tuple:
    return plan.offload, plan.ac, plan.ac_offloading


def test_estimate_matches_the_h200_measurements():
    """Measured on an H200: Qwen3-1.7B, no AC, no offload, RL trainer: 43.75 GiB at 8k tokens per forward and
    91.98 GiB at 32k (64k ran out of 139.8 GiB); `sft` at 8k 38.8 GiB; Qwen3-4B, full AC: 64.7 GiB (torchtitan);
    RL, full AC, 128k tokens: 48.0 GiB. The estimate tracks the RL points and never falls below a measurement."""
    assert QWEN3_1_7B.num_params == pytest.approx(1.72e9, rel=1e-2)
    assert peak_bytes(QWEN3_1_7B, 8192, "none", False, False) / GiB == pytest.approx(43.75, rel=0.03)
    assert peak_bytes(QWEN3_1_7B, 32768, "none", False, False) / GiB == pytest.approx(91.98, rel=0.03)
    assert peak_bytes(QWEN3_1_7B, 65536, "none", False, False) / GiB > 139.8
    assert peak_bytes(QWEN3_1_7B, 8192, "none", False, False) / GiB >= 38.8  # sft: conservative
    assert peak_bytes(QWEN3_4B, 8192, "none", True, False) / GiB == pytest.approx(64.7, rel=0.03)
    assert 48.0 <= peak_bytes(QWEN3_1_7B, 131072, "none", True, False) / GiB <= 48.0 * 1.1


def test_roomy_gpu_gets_no_ac_and_no_offload():
    plan = plan_memory(QWEN3_1_7B, 8192, 98 * GiB)
    assert _levers(plan) == ("none", False, False) and plan.fits


def test_levers_engage_in_order_as_memory_gets_tight():
    order = [_levers(plan_memory(QWEN3_1_7B, 8192, free * GiB)) for free in (60, 40, 30, 12)]
    assert order == [("none", False, False), ("none", True, False), ("optimizer", True, False), ("full", True, True)]
    assert plan_memory(QWEN3_4B, 8192, 80 * GiB).ac  # 4B without AC needs ~83 GiB
    assert not plan_memory(QWEN3_4B, 8192, 139 * GiB).ac


def test_nothing_fits_takes_the_last_lever_and_says_so():
    plan = plan_memory(QWEN3_4B, 65536, 4 * GiB)
    assert _levers(plan) == ("full", True, True) and not plan.fits


def test_colocated_trainer_plans_for_the_gpu_inference_leaves_asleep():
    """H200, 2026-12-04: the colocated trainer started beside an awake vLLM at 0.9 and saw 10.3 GiB free; planning
    on that turned full AC and AC offloading on (3.9k tok/s). It plans for the GPU of a sleeping vLLM instead."""
    total, awake_free = 139.8 * GiB, 10.3 * GiB
    assert plannable_bytes(awake_free, total, 0, shares_gpu=False) == awake_free  # split runs: what is free now
    asleep = plannable_bytes(awake_free, total, 0, shares_gpu=True)
    assert asleep == pytest.approx(135.8 * GiB)  # both contexts (2 GiB each) held back
    assert plannable_bytes(awake_free, total, 1 * GiB, shares_gpu=True) == asleep - GiB  # already reserved
    assert _levers(plan_memory(QWEN3_1_7B, 8192, awake_free, offload="optimizer"))[1]  # the old plan: AC on
    assert _levers(plan_memory(QWEN3_1_7B, 8192, asleep, offload="optimizer")) == ("optimizer", False, False)


def test_cpu_takes_the_fastest_plan():
    assert _levers(plan_memory(QWEN3_4B, 65536, None)) == ("none", False, False)


def test_explicit_choices_are_kept():
    plan = plan_memory(QWEN3_1_7B, 8192, 30 * GiB, offload="none")  # only AC (and its offloading) may move
    assert _levers(plan) == ("none", True, True) and not plan.fits
    plan = plan_memory(QWEN3_1_7B, 8192, 30 * GiB, ac=False)  # no AC: offload what it must
    assert plan.offload in ("optimizer", "full") and not plan.ac
    assert plan_memory(QWEN3_1_7B, 8192, 12 * GiB, ac_offloading=False).ac_offloading is False


def test_sharding_and_tokens_move_the_plan():
    assert plan_memory(QWEN3_1_7B, 8192, 30 * GiB, shard=8).offload == "none"  # state / 8
    assert plan_memory(QWEN3_1_7B, 32768, 60 * GiB).ac  # 4x the activations


def test_resolve_on_cpu_turns_auto_into_none(tiny_model_dir, caplog):
    cfg = TrainerModelConfig(name=str(tiny_model_dir))
    assert (cfg.offload, cfg.ac, cfg.ac_offloading) == ("auto", "auto", "auto")
    with pytest.raises(ValueError, match='"auto" must be resolved first'):
        require_resolved(cfg, "build_training_model")
    with caplog.at_level(logging.INFO):
        out = resolve_memory(cfg, 2048, torch.device("cpu"), logger=logging.getLogger("plan"))
    assert (out.offload, out.ac, out.ac_offloading, out.reshard_after_forward) == ("none", None, None, False)
    assert "memory plan:" in caplog.text and "CPU -> offload none, ac none" in caplog.text
    assert "reshard_after_forward false" in caplog.text
    explicit = TrainerModelConfig(name=str(tiny_model_dir), offload="optimizer", ac=ACConfig(mode="selective"))
    out = resolve_memory(explicit, 2048, torch.device("cpu"))
    assert out.offload == "optimizer" and out.ac.mode == "selective" and out.ac_offloading is None
    assert out.reshard_after_forward is False  # CPU: the fastest plan
    kept = TrainerModelConfig(name=str(tiny_model_dir), reshard_after_forward=True, offload="none", ac=None)
    out = resolve_memory(kept, 2048, torch.device("cpu"))
    assert out.reshard_after_forward is True and out.ac_offloading is None  # the user's choice stays


def test_weights_stay_gathered_where_their_two_bytes_a_parameter_fit():
    """H100, 2026-12-05, RL trainer on 256 real-shaped rollouts, 8k tokens a forward: kept gathered 37.0k tok/s
    at 46.1 GiB, resharded 34.0k at 43.6 GiB. "auto" keeps them when the plan fits, reshards before it turns AC
    on, and reshards under full offload (the weights live on the host)."""

    def plan(free_gib, **kw):
        p = plan_memory(QWEN3_1_7B, 8192, free_gib * GiB, reshard_after_forward="auto", **kw)
        return (*_levers(p), p.reshard_after_forward)

    kept = peak_bytes(QWEN3_1_7B, 8192, "none", False, False, reshard_after_forward=False)
    resharded = peak_bytes(QWEN3_1_7B, 8192, "none", False, False)
    assert (kept - resharded) / GiB == pytest.approx(2 * QWEN3_1_7B.num_params / GiB - 2.0, abs=1.5)
    assert kept / GiB == pytest.approx(46.09, rel=0.05)  # the measured peak, kept gathered
    assert plan(78) == ("none", False, False, False)  # the H100: 78 GiB free
    between = (kept + resharded) / 2 / 0.9 / GiB  # resharding fits, keeping does not
    assert plan(between) == ("none", False, False, True)
    assert plan(40) == ("none", True, False, False)  # AC's saved memory leaves room to keep them again
    assert plan(35) == ("none", True, False, True)
    assert plan(30) == ("optimizer", True, False, False)  # the optimizer step (25.6 GiB) is the peak there
    assert plan(78, offload="optimizer")[3] is False  # a colocated trainer: the optimizer offloaded, room to keep
    assert plan(78, offload="full")[3] is True  # the weights live on the host: resharded
    assert plan_memory(QWEN3_1_7B, 8192, None, reshard_after_forward="auto").reshard_after_forward is False  # CPU
    assert plan_memory(QWEN3_1_7B, 8192, 78 * GiB).reshard_after_forward is True  # explicit true is kept


def test_host_memory_an_offload_plan_pins_is_its_state_per_rank():
    n = QWEN3_8B.num_trainable
    assert host_bytes(QWEN3_8B, "none", False, 8192) == 0
    assert host_bytes(QWEN3_8B, "optimizer", False, 8192) == 8 * n  # AdamW's two fp32 moments
    assert host_bytes(QWEN3_8B, "optimizer", False, 8192, shard=4) == 2 * n
    assert host_bytes(QWEN3_8B, "optimizer", False, 8192, optimizer_bytes=0) == 0  # SignSGD: no state
    assert host_bytes(QWEN3_8B, "full", False, 8192) == 16 * n  # + fp32 masters and gradient accumulators
    assert host_bytes(QWEN3_8B, "full", True, 8192) == 16 * n + 2 * 8192 * 36 * 4096  # + bf16 block inputs


def test_a_plan_the_host_cannot_pin_is_refused_before_the_run_starts():
    """H200 machine, 128 GiB of RAM, 2026-12-05: the colocated Qwen3-8B trainer planned optimizer offload
    (61 GiB of state) and was SIGKILLed by the OOM killer in its first step. With too little host memory the
    plan now fails at start-up, naming what to change; with enough it passes."""
    check_host_memory(QWEN3_8B, "optimizer", False, 8192, available=100 * GiB)
    check_host_memory(QWEN3_8B, "optimizer", False, 8192, available=None)  # unknown (not Linux): no check
    check_host_memory(QWEN3_8B, "none", False, 8192, available=1 * GiB)  # nothing offloaded
    with pytest.raises(ValueError) as e:
        check_host_memory(QWEN3_8B, "optimizer", False, 8192, available=50 * GiB)
    msg = str(e.value)
    assert "model.offload='optimizer' needs 61.0 GiB of pinned host memory" in msg
    assert "50.0 GiB the host has available" in msg and "add GPUs" in msg
    # eight ranks of one node share the host: each pins its shard
    check_host_memory(QWEN3_8B, "optimizer", False, 8192, available=100 * GiB, shard=8, local_ranks=8)
    with pytest.raises(ValueError, match="8 rank"):
        check_host_memory(QWEN3_8B, "full", False, 8192, available=100 * GiB, shard=8, local_ranks=8)


def test_a_colocated_inference_s_rollback_copies_count_against_the_host():
    """Colocated on one GPU, the vLLM worker later pins two bf16 copies of the pushed weights (4 bytes a param):
    the trainer's plan counts them, and the message says which setting drops them."""
    from prime_rl.common.config.rl_trainer import IpcBroadcastConfig, NCCLBroadcastConfig, RLTrainerConfig
    from prime_rl.trainer.rl.train import colocated_rollback_bytes_per_param

    def cfg(**kw) -> RLTrainerConfig:
        return RLTrainerConfig(model=TrainerModelConfig(name="unused"), **kw)

    assert (
        colocated_rollback_bytes_per_param(cfg(offload_between_steps=True, weight_broadcast=IpcBroadcastConfig())) == 4
    )
    assert colocated_rollback_bytes_per_param(cfg(weight_broadcast=NCCLBroadcastConfig())) == 0  # split: other hosts
    no_copy = IpcBroadcastConfig(keep_rollback_copy=False)
    assert colocated_rollback_bytes_per_param(cfg(offload_between_steps=True, weight_broadcast=no_copy)) == 0
    assert colocated_rollback_bytes_per_param(cfg(offload_between_steps=True)) == 0  # filesystem: no copies

    rollback = 4 * QWEN3_8B.num_params  # 30.5 GiB beside the trainer's 61.0
    check_host_memory(QWEN3_8B, "optimizer", False, 8192, available=110 * GiB, reserved=rollback)
    with pytest.raises(ValueError) as e:
        check_host_memory(QWEN3_8B, "optimizer", False, 8192, available=90 * GiB, reserved=rollback)
    assert "plus 30.5 GiB for the colocated inference's rollback copies" in str(e.value)
    assert "weight_broadcast.keep_rollback_copy = false" in str(e.value)

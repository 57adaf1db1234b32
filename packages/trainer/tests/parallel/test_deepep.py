"""DeepEP dispatch (`[model.moe.dispatch] type = "deepep"`) on CPU, through a test double of DeepEP.

DeepEP needs CUDA and NVSHMEM, so it cannot be installed here: deep_ep_double.py re-implements the
normal-mode `deep_ep.Buffer` API on gloo all-to-all (same call signatures, return tuples, -1 entries in
recv_topk_idx, opaque handle for combine and cached dispatch, unweighted combine), and deepep_worker.py
installs it as `deep_ep` in the torchrun workers. What is checked: an EP=2 model with DeepEP dispatch
matches the one-process reference and EP=2 with torch dispatch (step-0 loss, every gradient, step-1
loss), also with token chunks and with selective AC, and the backward really ran through combine /
cached dispatch; plus the start-up errors. The real DeepEP CUDA kernels were not run.
"""

import sys
from pathlib import Path

import pytest

from packages.trainer.tests.parallel import deep_ep_double
from packages.trainer.tests.parallel.test_scaling import PLAIN, _assert_close, _run
from prime_rl.common.config.trainer import DeepEPDispatchConfig, MoEConfig
from prime_rl.common.testing import make_tiny_model
from prime_rl.trainer.parallel.deepep import check_deepep_runtime
from prime_rl.trainer.parallel.expert import check_dispatch

WORKER = Path(__file__).with_name("deepep_worker.py")
EP2 = [*PLAIN, "--model.ep", "2"]
DEEPEP = ["--model.moe.dispatch.type", "deepep", "--model.moe.dispatch.num-sms", "16"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepep")
    moe = str(make_tiny_model(root / "moe", kind="qwen3_moe", seed=0))  # 8 experts, top-2
    single = _run(root / "single.pt", 1, [{"name": "moe", "model_dir": moe, "flags": PLAIN}], worker=WORKER)
    pair = _run(root / "pair.pt", 2, [
        {"name": "torch", "model_dir": moe, "flags": EP2},
        {"name": "deepep", "model_dir": moe, "flags": [*EP2, *DEEPEP]},
        # 64 tokens per rank in chunks of <= 24: three dispatch / combine rounds per layer
        {"name": "deepep_chunked", "model_dir": moe, "flags": [*EP2, *DEEPEP, "--model.moe.dispatch.token-chunk-size", "24"]},
        {"name": "deepep_selective_ac", "model_dir": moe,
         "flags": ["--model.ac-offloading", "None", "--model.offload", "none", "--model.ep", "2", *DEEPEP,
                   "--model.ac.mode", "selective"]},
    ], worker=WORKER)  # fmt: skip
    return single, pair


def test_deepep_matches_single_process_and_torch_dispatch(runs):
    single, pair = runs
    assert pair["deepep"]["dims"] == (2, 1, 2)  # (dp, cp, ep)
    _assert_close(single["moe"], pair["deepep"])  # gradients seen: 2.4e-3 relative, the same as torch dispatch
    # same math as the torch path up to bf16 summation order (seen: bit-identical)
    assert pair["deepep"]["loss0"] == pytest.approx(pair["torch"]["loss0"], abs=1e-6)
    assert pair["deepep"]["loss1"] == pytest.approx(pair["torch"]["loss1"], abs=1e-4)
    _assert_close(pair["torch"], pair["deepep"], grad_rel=1e-3)


def test_deepep_ran_dispatch_and_combine_both_ways(runs):
    _, pair = runs
    calls, torch_calls = pair["deepep"]["deep_ep"], pair["torch"]["deep_ep"]
    assert torch_calls.get("dispatch", 0) == 0 and torch_calls["buffers"] == 0  # torch dispatch never touches DeepEP
    assert calls["buffers"] == 1 and calls["num_sms"] == 16  # one buffer for all layers; num_sms honoured
    # per MoE layer and micro-batch: forward dispatch + combine, backward combine (of token and routing-weight
    # gradients) + cached dispatch
    assert calls["dispatch"] > 0
    assert calls["dispatch"] == calls["combine"] == calls["combine_with_weights"] == calls["cached_dispatch"]
    assert calls["layout"] == calls["dispatch"]


def test_deepep_token_chunks(runs):
    single, pair = runs
    _assert_close(single["moe"], pair["deepep_chunked"])
    assert pair["deepep_chunked"]["deep_ep"]["dispatch"] == 3 * pair["deepep"]["deep_ep"]["dispatch"]


def test_deepep_with_selective_ac(runs):
    single, pair = runs
    _assert_close(single["moe"], pair["deepep_selective_ac"])
    # DeepEP calls are not aten ops, so selective AC recomputes them: dispatch twice per layer and step
    assert pair["deepep_selective_ac"]["deep_ep"]["dispatch"] == 2 * pair["deepep"]["deep_ep"]["dispatch"]


def test_deepep_start_up_errors(monkeypatch):
    with pytest.raises(ValueError, match=r'"deepep" needs model.ep > 1, got ep=1'):
        check_dispatch(MoEConfig(dispatch=DeepEPDispatchConfig()), ep=1)
    with pytest.raises(ValueError, match="num_sms=23 must be even"):
        check_dispatch(MoEConfig(dispatch=DeepEPDispatchConfig(num_sms=23)), ep=2)
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # import deep_ep -> ImportError
    with pytest.raises(ImportError, match="needs the `deep_ep` package"):
        check_dispatch(MoEConfig(dispatch=DeepEPDispatchConfig()), ep=2)
    monkeypatch.setitem(sys.modules, "deep_ep", deep_ep_double)
    check_dispatch(MoEConfig(dispatch=DeepEPDispatchConfig()), ep=2)  # importable: accepted


def test_deepep_needs_cuda_and_nccl():
    with pytest.raises(ValueError, match=r"needs CUDA devices and an NCCL process group, got device_type='cpu'"):
        check_deepep_runtime("cpu", "gloo")
    with pytest.raises(ValueError, match="backend 'gloo'"):
        check_deepep_runtime("cuda", "gloo")
    check_deepep_runtime("cuda", "nccl")

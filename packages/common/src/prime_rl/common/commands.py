"""Every command line prime-rl builds for a process of its own: trainer (torchrun), inference, orchestrator,
the vllm-router in front of several inference servers, and the hand-over of a ``[slurm]`` run to
``python -m prime_rl.launcher.slurm``.

Pure functions: an interpreter, config paths and numbers in, ``list[str]`` out; nothing is started or read.
Callers: the local launcher (``launcher/rl.py``), the SLURM renderer (``launcher/slurm/render.py``, which
writes these lists into the sbatch templates), multi-GPU ``sft`` (``trainer/sft/entrypoint.py``), the local
replica supervisor (``inference/router.py``), the tests' inference server (``inference/testing.py``) and the
``[slurm]`` route of every entrypoint (``config/slurm_route.py``).

Design decisions:
- It lives in common, not the launcher: ``sft`` (trainer package) and the replica supervisor (inference) build
  commands too, and may import only common. It imports nothing but the standard library (no torch, no pydantic),
  so ``rl --help`` / ``--dry-run`` stay light.
- Values given as ``str`` pass through unchanged (``Path`` and ``int`` are converted with ``str``). The SLURM
  renderer passes shell words such as ``"$i"`` or ``"${CONTROL_ADDRS[@]}"`` (a ``str`` subclass it leaves
  unquoted); they are known only inside the job, on each node.
- Single-node trainers run ``prime_rl.trainer.torchrun_loopback`` (the rendezvous store on 127.0.0.1, see
  docs/DESIGN.md); multi-node ones ``torch.distributed.run`` with a static rendezvous on the head trainer node.
  Both print rank 0 only on the console (``--local-ranks-filter 0``); every rank writes its own log file.
- The ``vllm-router`` command line is here too (another program's, but started by both the replica supervisor and
  the SLURM job): one word order and one set of flags for both.
- Left out: environment variables (``prime_rl.common.env``) and the helper calls inside the sbatch scripts
  (attempt, status, watchdog).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

Arg = str | int | os.PathLike[str]

TORCHRUN_LOOPBACK = "prime_rl.trainer.torchrun_loopback"
TORCHRUN_STATIC = "torch.distributed.run"
RL_TRAINER = "prime_rl.trainer.rl.train"
SFT_TRAINER = "prime_rl.trainer.sft.train"
INFERENCE = "prime_rl.inference.entrypoint"
ORCHESTRATOR = "prime_rl.orchestrator.entrypoint"
SLURM = "prime_rl.launcher.slurm"


def _arg(value: Arg) -> str:
    """``value`` as one argv word; a ``str`` (or a subclass: a shell word) is kept as it is."""
    return value if isinstance(value, str) else str(value)


def _args(values: Sequence[Arg]) -> list[str]:
    return [_arg(v) for v in values]


def torchrun_loopback_command(python: Arg, nproc: Arg, module: str, config: Arg) -> list[str]:
    """``nproc`` local ranks of ``module @ config`` on one node, the rendezvous store on loopback (`rl`, `sft`)."""
    return [
        _arg(python), "-m", TORCHRUN_LOOPBACK,  # torchrun, store on 127.0.0.1
        "--nproc-per-node", _arg(nproc),
        "--local-ranks-filter", "0",  # console: rank 0 only (each rank also writes its own file)
        "-m", module, "@", _arg(config),
    ]  # fmt: skip


def torchrun_static_command(
    python: Arg,
    num_nodes: Arg,
    node_rank: Arg,
    nproc: Arg,
    rdzv_endpoint: Arg,
    rdzv_id: Arg,
    module: str,
    config: Arg,
    args: Sequence[Arg] = (),
) -> list[str]:
    """One node's torchrun of a multi-node trainer (SLURM): static rendezvous at ``rdzv_endpoint`` (host:port)."""
    return [
        _arg(python), "-m", TORCHRUN_STATIC,
        "--nnodes", _arg(num_nodes), "--node-rank", _arg(node_rank), "--nproc-per-node", _arg(nproc),
        "--rdzv-backend", "static", "--rdzv-endpoint", _arg(rdzv_endpoint), "--rdzv-id", _arg(rdzv_id),
        "--local-ranks-filter", "0",
        "-m", module, "@", _arg(config), *_args(args),
    ]  # fmt: skip


def rl_trainer_node_args(head: Arg, inference_addresses: Sequence[Arg] | None = None) -> list[str]:
    """The RL trainer's flags on a SLURM node: batches from ``head`` (where the orchestrator runs); with
    ``inference_addresses`` (nccl / nixl) the trainer pushes weights itself, its group rooted at ``head``."""
    args = ["--data.host", _arg(head)]
    if inference_addresses is not None:
        args += ["--weight-broadcast.host", _arg(head), "--weight-broadcast.inference-addresses"]
        args += _args(inference_addresses)
    return args


def inference_command(python: Arg, config: Arg) -> list[str]:
    """One inference server (or the replica supervisor, with ``router.replicas > 1``) of ``config``."""
    return [_arg(python), "-m", INFERENCE, "@", _arg(config)]


def inference_replica_command(
    python: Arg, config: Arg, port: Arg, control_port: Arg, role: Arg | None = None
) -> list[str]:
    """One replica (or P/D instance in ``role``) behind the local router, on its own ports."""
    cmd = [*inference_command(python, config), "--server.port", _arg(port), "--server.control-port", _arg(control_port)]
    return cmd + (["--deployment.role", _arg(role)] if role is not None else [])


def inference_node_command(
    python: Arg, config: Arg, port: Arg, control_port: Arg, role: Arg | None = None
) -> list[str]:
    """One SLURM node's inference server (a P/D instance in ``role``): HTTP and control on every address
    (other nodes reach it; control authenticates with the run secret)."""
    cmd = inference_command(python, config)
    if role is not None:
        cmd += ["--deployment.role", _arg(role)]
    return cmd + [
        "--server.host", "0.0.0.0", "--server.port", _arg(port),
        "--server.control-host", "0.0.0.0", "--server.control-port", _arg(control_port),
    ]  # fmt: skip


def orchestrator_command(python: Arg, config: Arg) -> list[str]:
    return [_arg(python), "-m", ORCHESTRATOR, "@", _arg(config)]


def orchestrator_node_command(
    python: Arg,
    config: Arg,
    base_url: Arg,
    api_key: Arg,
    metrics_urls: Sequence[Arg],
    num_train_ranks: Arg,
    inference_addresses: Sequence[Arg] | None = None,
) -> list[str]:
    """The orchestrator of a SLURM job: rollouts through the router at ``base_url``, batches to
    ``num_train_ranks`` data-parallel groups (bound beyond loopback); ``inference_addresses`` (filesystem
    transport) are the control endpoints it asks to load each published step."""
    cmd = [
        *orchestrator_command(python, config),
        "--model.client.base-url", _arg(base_url), "--model.client.api-key", _arg(api_key),
        "--trainer.address", "0.0.0.0",
        "--model.client.metrics-urls", *_args(metrics_urls),
        "--num-train-ranks", _arg(num_train_ranks),
    ]  # fmt: skip
    return cmd + (["--inference.addresses", *_args(inference_addresses)] if inference_addresses is not None else [])


def router_pd_workers(roles: Sequence[str], urls: Sequence[Arg]) -> list[str]:
    """vllm-router's P/D workers: ``--prefill URL`` or ``--decode URL`` for each instance, in order."""
    return [word for role, url in zip(roles, urls, strict=True) for word in (f"--{role}", _arg(url))]


def router_command(
    exe: Arg,
    workers: Sequence[Arg],
    host: Arg,
    port: Arg,
    metrics_host: Arg,
    metrics_port: Arg,
    *,
    disaggregated: bool = False,
    kv_connector: Arg | None = None,
    api_key: Arg | None = None,
    policy: Arg | None = None,
) -> list[str]:
    """vllm-router (``exe``) on ``host:port`` in front of ``workers``: their URLs, or ``disaggregated`` (P/D) the
    words of ``router_pd_workers`` (or shell words that expand to them). Its metrics listen on ``metrics_host:
    metrics_port``: vllm-router's fixed default port would make two routers on one node collide."""
    cmd = [_arg(exe)]
    cmd += ["--vllm-pd-disaggregation" if disaggregated else "--worker-urls", *_args(workers)]
    if kv_connector is not None:  # P/D: how the decode instance fetches the prompt's KV
        cmd += ["--kv-connector", _arg(kv_connector)]
    cmd += ["--host", _arg(host), "--port", _arg(port)]
    if api_key is not None:
        cmd += ["--api-key", _arg(api_key)]
    cmd += ["--prometheus-host", _arg(metrics_host), "--prometheus-port", _arg(metrics_port)]
    return cmd + (["--policy", _arg(policy)] if policy is not None else [])


def slurm_command(python: Arg, kind: str, argv: Sequence[Arg]) -> list[str]:
    """Hand ``kind`` (``sft``, ``inference``, ``rl``) with its own ``argv`` to the SLURM launcher."""
    return [_arg(python), "-m", SLURM, kind, *_args(argv)]

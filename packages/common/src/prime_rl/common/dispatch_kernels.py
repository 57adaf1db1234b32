"""Whether the kernels a `[model.moe.dispatch]` backend or a `[model.moe.compute]` precision needs are importable
(and wired in): one line, or None.

Cheap and torch-free at import, and in common so that every command that starts the trainer asks it before
torchrun starts (and in `--dry-run`): `sft`, `trainer` and `rl` (single node and colocated; a SLURM job's trainer
asks on its own node, where the kernels are). A missing Mega MoE build or DeepEP then ends the command with one
line and exit 2, not a traceback from every rank. `check_dispatch` (trainer/parallel/expert.py) raises the same
line inside the ranks, where the rules that need the model (ep > 1) are checked too; `check_moe_compute`
(trainer/models/moe_compute.py) likewise, naming the GPU it found for "mxfp8".
"""

import importlib
import sys


def missing_attrs(module: str, attrs: tuple[str, ...]) -> list[str]:
    """`module.attr` for each attr that cannot be reached (all of them when the import fails)."""
    try:
        mod = importlib.import_module(module)
    except Exception:  # a broken CUDA extension raises more than ImportError
        return [f"{module}.{a}" for a in attrs]
    return [f"{module}.{a}" for a in attrs if not hasattr(mod, a)]


def dispatch_kernels_error(dispatch_type: str, table: str = "model.moe.dispatch") -> str | None:
    """The one-line refusal for a dispatch type whose kernels are missing (or not wired in), else None; ``table``
    is where the command's config sets it (``rl``: ``trainer.model.moe.dispatch``)."""
    if dispatch_type == "mega_moe":
        missing = missing_attrs("deep_gemm", ("mega_moe_dispatch", "mega_moe_combine"))
        if missing:
            return (
                f'[{table}] type = "mega_moe" needs the prime-mega-moe kernels {missing} (a deep_gemm '
                'build from prime-mega-moe, installed with `uv pip install --no-deps <wheel>`); use type = "torch"'
            )
        return f'[{table}] type = "mega_moe" is not wired into this trainer yet; use type = "torch"'
    if dispatch_type == "deepep" and missing_attrs("deep_ep", ("Buffer",)):
        return (
            f'[{table}] type = "deepep" needs the `deep_ep` package (DeepEP), which is not importable; '
            'install DeepEP or use type = "torch"'
        )
    return None


def compute_kernels_error(compute_type: str, table: str = "model.moe.compute") -> str | None:
    """The one-line refusal for a routed-expert precision this trainer cannot run, else None ("bf16" runs). No
    device query here (the submit host may have none): the ranks' `check_moe_compute` adds the GPU it found."""
    if compute_type == "deepgemm_fp8":
        missing = missing_attrs("deep_gemm", ("m_grouped_fp8_gemm_nt_contiguous",))
        if missing:
            return (
                f'[{table}] type = "deepgemm_fp8" needs the `deep_gemm` package (DeepGEMM: {", ".join(missing)} is '
                'not importable); install DeepGEMM, or use type = "bf16"'
            )
        return f'[{table}] type = "deepgemm_fp8" is not wired into this trainer yet; use type = "bf16"'
    if compute_type == "mxfp8":
        return f'[{table}] type = "mxfp8" (SM100 GPUs) is not wired into this trainer yet; use type = "bf16"'
    return None


def exit_if_moe_kernels_missing(dispatch_type: str, compute_type: str, prog: str, prefix: str = "model.moe") -> None:
    """Before torchrun (and in --dry-run): `<prog>: error: <line>` on stderr and exit 2 when the MoE dispatch's
    kernels are missing or the routed-expert precision cannot run; ``prefix`` is where the command's config keeps
    the MoE tables (``rl``: ``trainer.model.moe``). The "torch" dispatch and "bf16" compute import nothing."""
    error = dispatch_kernels_error(dispatch_type, f"{prefix}.dispatch") or compute_kernels_error(
        compute_type, f"{prefix}.compute"
    )
    if error:
        sys.stderr.write(f"{prog}: error: {error}\n")
        raise SystemExit(2)

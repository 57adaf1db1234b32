"""Whether the kernels a `[model.moe.dispatch]` backend needs are importable: one line, or None.

Cheap and torch-free at import, and in common so that every command that starts the trainer asks it before
torchrun starts (and in `--dry-run`): `sft`, `trainer` and `rl` (single node and colocated; a SLURM job's trainer
asks on its own node, where the kernels are). A missing Mega MoE build or DeepEP then ends the command with one
line and exit 2, not a traceback from every rank. `check_dispatch` (trainer/parallel/expert.py) raises the same
line inside the ranks, where the rules that need the model (ep > 1) are checked too.
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


def exit_if_dispatch_kernels_missing(dispatch_type: str, prog: str, table: str = "model.moe.dispatch") -> None:
    """Before torchrun (and in --dry-run): `<prog>: error: <line>` on stderr and exit 2 when the kernels are
    missing. The "torch" dispatch imports nothing."""
    error = dispatch_kernels_error(dispatch_type, table) if dispatch_type != "torch" else None
    if error:
        sys.stderr.write(f"{prog}: error: {error}\n")
        raise SystemExit(2)

"""`model.compile = "auto"` compiles on CUDA only; explicit choices pass through unchanged."""

from prime_rl.common.config.trainer import CompileConfig
from prime_rl.trainer.parallel.compile import resolve_compile


def test_auto_compiles_on_cuda_only():
    assert resolve_compile("auto", "cuda") == CompileConfig()
    assert resolve_compile("auto", "cpu") is None


def test_explicit_choices_are_kept():
    explicit = CompileConfig(fullgraph=False)
    assert resolve_compile(explicit, "cpu") is explicit
    assert resolve_compile(None, "cuda") is None

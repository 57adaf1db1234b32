"""A `[model.moe.dispatch]` backend without its kernels, or a `[model.moe.compute]` precision this trainer cannot
run, ends `sft` and `trainer` with one line and exit 2 before torchrun starts, in `--dry-run` too (issue 32's bad
input), instead of a traceback from every rank."""

import subprocess
import sys

import pytest

from prime_rl.common.dispatch_kernels import compute_kernels_error, dispatch_kernels_error
from prime_rl.trainer.rl.train import main as trainer_main
from prime_rl.trainer.sft.entrypoint import main as sft_main


@pytest.fixture
def no_kernels(monkeypatch):
    for module in ("deep_ep", "deep_gemm"):  # import -> ImportError, installed or not
        monkeypatch.setitem(sys.modules, module, None)


@pytest.mark.parametrize(
    "table,value,needs,fix",
    [
        ("dispatch", "mega_moe", "deep_gemm.mega_moe_dispatch", 'use type = "torch"'),
        ("dispatch", "deepep", "`deep_ep`", 'use type = "torch"'),
        ("compute", "deepgemm_fp8", "deep_gemm.m_grouped_fp8_gemm_nt_contiguous", 'use type = "bf16"'),
        ("compute", "mxfp8", "SM100", 'use type = "bf16"'),
    ],
)
@pytest.mark.parametrize("prog", ["sft", "trainer"])
def test_a_moe_setting_that_cannot_run_exits_2_in_one_line_before_torchrun(
    no_kernels, tmp_path, capsys, prog, table, value, needs, fix
):
    main = sft_main if prog == "sft" else trainer_main
    args = ["--model.name", "m", "--output-dir", str(tmp_path), f"--model.moe.{table}.type", value, "--dry-run"]
    with pytest.raises(SystemExit) as e:
        main(args + (["--data.type", "fake"] if prog == "sft" else []))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"{prog}: error: [model.moe.{table}] ") and err.count("\n") == 1, err
    assert needs in err and fix in err
    assert not any(tmp_path.iterdir())  # nothing written, nothing launched


def test_torch_dispatch_and_bf16_compute_import_nothing(no_kernels):
    assert dispatch_kernels_error("torch") is None and compute_kernels_error("bf16") is None


def test_the_check_keeps_sft_start_up_free_of_torch():
    """`sft --help` / `--dry-run` stay fast: the check's module imports no torch (parallel/ would)."""
    code = "import sys, prime_rl.trainer.sft.entrypoint; assert 'torch' not in sys.modules, 'torch imported'"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]

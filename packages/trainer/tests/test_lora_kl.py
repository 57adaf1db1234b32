"""LoRA RL's KL reference is the policy with its adapters off (no second copy of the weights): the same KL
and the same gradients as against a frozen copy of the initial weights, in one process and under FSDP2."""

from pathlib import Path

import pytest
import torch

from prime_rl.trainer.testing import torchrun

pytestmark = pytest.mark.multiprocess  # several processes: the dev-venv suite runs them

WORKER = Path(__file__).with_name("lora_kl_worker.py")


@pytest.mark.parametrize("nproc", [1, 2])
def test_base_view_is_the_initial_policy(tiny_model_dir, tmp_path, nproc):
    out = tmp_path / "kl.pt"
    torchrun(str(WORKER), str(tiny_model_dir), str(out), nproc=nproc)
    got = torch.load(out)
    copy, view = got["copy"], got["view"]
    assert copy["stats"]["kl_ref"] > 1e-4  # the adapters moved the policy away from its base
    assert view["stats"]["kl_ref"] == pytest.approx(copy["stats"]["kl_ref"], rel=1e-6, abs=1e-9)
    assert view["stats"]["loss/mean"] == pytest.approx(copy["stats"]["loss/mean"], rel=1e-6, abs=1e-9)
    assert view["grads"].keys() == copy["grads"].keys() and len(view["grads"]) == 2 * 2 * 2
    for name, g in copy["grads"].items():
        torch.testing.assert_close(view["grads"][name], g, rtol=1e-5, atol=1e-7, msg=name)
    assert view["scaling"] == copy["scaling"] == 32 / 4  # the adapters are back on after the reference forward

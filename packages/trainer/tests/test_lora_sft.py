"""`sft` with `[model.lora]`: bad input exits 2 with one line before any weight is read. The end-to-end LoRA
example (its data comes from the orchestrator's arithmetic environment) lives in tests/test_lora_sft_example.py."""

import pytest

from prime_rl.trainer.sft.entrypoint import main


def test_bad_lora_input_exits_2_with_one_line(tiny_model_dir, tmp_path, capsys):
    common = ["--model.name", str(tiny_model_dir), "--data.type", "fake", "--output-dir", str(tmp_path)]
    for flags, expected in (
        (["--model.lora.target-modules", '["qkv_proj"]'], "matches no linear layer of the model"),
        (["--model.lora.rank", "4096"], "model.lora.rank=4096 exceeds"),
    ):
        with pytest.raises(SystemExit) as e:
            main([*common, *flags])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert expected in err and len(err.strip().splitlines()) == 1, err

"""The config contract: defaults < TOML files (left to right) < flags; one-line errors, exit 2."""

import subprocess
import sys
from pathlib import Path
from typing import Annotated, Literal

import pytest
from pydantic import Field

from prime_rl.common.config import BaseConfig, ConfigError, load_config, parse_config, write_toml


class AdamW(BaseConfig):
    type: Literal["adamw"] = "adamw"
    lr: float = 1e-4
    """learning rate"""
    betas: list[float] = [0.9, 0.999]


class SignSGD(BaseConfig):
    type: Literal["sign_sgd"] = "sign_sgd"
    lr: float = 1e-5


class AC(BaseConfig):
    mode: Literal["full", "selective"] = "full"
    freq: int = 1


class Model(BaseConfig):
    seq_len: int = 2048
    """tokens per micro-batch"""
    reshard_after_forward: bool = True
    ac: AC | None = AC()
    fused_lm_head_token_chunk_size: int | Literal["disabled"] = 8192


class Run(BaseConfig):
    name: str = "default"


class Config(BaseConfig):
    """A test config."""

    output_dir: Path = Path("outputs")
    run: Run = Run()
    model: Model = Model()
    optim: Annotated[AdamW | SignSGD, Field(discriminator="type")] = AdamW()
    max_steps: int | None = None
    dry_run: bool = False


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_then_files_left_to_right_then_flags(tmp_path):
    a = write(tmp_path, "a.toml", "max_steps = 5\n[model]\nseq_len = 512\nreshard_after_forward = false\n")
    b = write(tmp_path, "b.toml", "[model]\nseq_len = 1024\n")
    cfg = load_config(Config, ["@", a, "@", b, "--model.seq-len", "4096", "--run.name", "exp1"])
    assert cfg.model.seq_len == 4096  # flag wins
    assert cfg.model.reshard_after_forward is False  # a.toml kept where b.toml is silent
    assert cfg.max_steps == 5 and cfg.run.name == "exp1"
    assert cfg.optim.lr == 1e-4  # default


def test_bool_flags_and_none(tmp_path):
    cfg = load_config(Config, ["--no-model.reshard-after-forward", "--dry-run"])
    assert cfg.model.reshard_after_forward is False and cfg.dry_run is True
    cfg = load_config(Config, ["--model.reshard-after-forward", "false"])
    assert cfg.model.reshard_after_forward is False
    cfg = load_config(Config, ["--max-steps", "None", "--model.ac", "None"])
    assert cfg.max_steps is None and cfg.model.ac is None
    assert load_config(Config, ["--no-model.ac"]).model.ac is None
    toml = write(tmp_path, "x.toml", '[model]\nac = "None"\n')
    assert load_config(Config, ["@", toml]).model.ac is None
    assert load_config(Config, ["@", toml, "--model.ac.mode", "selective"]).model.ac.mode == "selective"


def test_discriminated_union_switch(tmp_path):
    cfg = load_config(Config, ["--optim.type", "sign_sgd", "--optim.lr", "3e-6"])
    assert isinstance(cfg.optim, SignSGD) and cfg.optim.lr == 3e-6
    # a later file switching the variant replaces, not merges, the earlier table
    a = write(tmp_path, "a.toml", '[optim]\ntype = "adamw"\nbetas = [0.8, 0.9]\n')
    b = write(tmp_path, "b.toml", '[optim]\ntype = "sign_sgd"\n')
    assert isinstance(load_config(Config, ["@", a, "@", b]).optim, SignSGD)
    assert load_config(Config, ["@", a]).optim.betas == [0.8, 0.9]
    assert load_config(Config, ["--optim.betas", "0.5", "0.6"]).optim.betas == [0.5, 0.6]


class Single(BaseConfig):
    type: Literal["single"] = "single"
    num_gpus: int = 1


class Multi(BaseConfig):
    type: Literal["multi"] = "multi"
    num_nodes: int = 1
    gpus_per_node: int = 8


class Placement(BaseConfig):
    deployment: Annotated[Single | Multi, Field(discriminator="type")] = Single()
    optim: Annotated[AdamW | SignSGD, Field(discriminator="type")] = SignSGD()


class Run2(BaseConfig):
    placement: Placement = Placement()
    optim: Annotated[AdamW | SignSGD, Field(discriminator="type")] = AdamW()


def test_overlay_switching_type_replaces_a_table_that_left_type_at_its_default(tmp_path):
    """scaling.md's thin overlay: the base sets keys of the default variant without naming it."""
    base = write(tmp_path, "base.toml", "[placement.deployment]\nnum_gpus = 2\n[optim]\nlr = 3e-4\n")
    overlay = write(tmp_path, "slurm.toml", '[placement.deployment]\ntype = "multi"\nnum_nodes = 2\n')
    cfg = load_config(Run2, ["@", base, "@", overlay])
    assert cfg.placement.deployment == Multi(num_nodes=2)
    # the same through a flag, and a flag naming the variant already in effect keeps its keys
    cfg = load_config(Run2, ["@", base, "--placement.deployment.type", "multi"])
    assert cfg.placement.deployment == Multi()
    assert load_config(Run2, ["@", base, "--placement.deployment.type", "single"]).placement.deployment.num_gpus == 2
    # the default variant is the enclosing field's: placement.optim defaults to sign_sgd, optim to adamw
    a = write(tmp_path, "a.toml", "[placement.optim]\nlr = 0.5\n")
    assert load_config(Run2, ["@", a, "--placement.optim.type", "sign_sgd"]).placement.optim.lr == 0.5
    assert load_config(Run2, ["@", base, "--optim.type", "sign_sgd"]).optim == SignSGD()
    assert load_config(Run2, ["@", base, "--optim.type", "adamw"]).optim.lr == 3e-4


def test_keys_of_a_replaced_variant_are_not_blamed_on_its_file(tmp_path):
    base = write(tmp_path, "base.toml", "[placement.deployment]\nnum_gpus = 2\n")
    overlay = write(tmp_path, "overlay.toml", '[placement.deployment]\ntype = "multi"\nnum_nodes = "x"\n')
    with pytest.raises(ConfigError, match="overlay.toml"):
        load_config(Run2, ["@", base, "@", overlay])


def test_union_of_int_and_literal():
    assert (
        load_config(Config, ["--model.fused-lm-head-token-chunk-size", "disabled"]).model.fused_lm_head_token_chunk_size
        == "disabled"
    )
    assert (
        load_config(Config, ["--model.fused-lm-head-token-chunk-size=1024"]).model.fused_lm_head_token_chunk_size
        == 1024
    )


@pytest.mark.parametrize(
    "argv_fn, expected",
    [
        (
            lambda d: ["--model.seq-lenn", "3"],
            "unknown option --model.seq-lenn (command line); did you mean --model.seq-len?",
        ),
        (lambda d: ["--model.seq-len", "abc"], "model.seq_len: Input should be a valid integer"),
        (lambda d: ["@", str(d / "missing.toml")], "config file not found"),
        (lambda d: ["@", write(d, "bad.toml", "[model\nseq_len=1")], "bad TOML in"),
        (lambda d: ["@", write(d, "typo.toml", "[model]\nseqlen = 3\n")], "unknown key 'model.seqlen' (in "),
        (lambda d: ["@", write(d, "wrong.toml", "[model]\nseq_len = 'x'\n")], "wrong.toml)"),
    ],
)
def test_bad_input_names_key_and_source(tmp_path, argv_fn, expected):
    with pytest.raises(ConfigError) as e:
        load_config(Config, argv_fn(tmp_path))
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


def test_parse_config_exits_2_with_one_line(tmp_path, capsys):
    bad = write(tmp_path, "typo.toml", "[model]\nseqlen = 3\n")
    with pytest.raises(SystemExit) as e:
        parse_config(Config, ["@", bad], prog="sft")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "typo.toml" in err and "seqlen" in err and "Traceback" not in err


def test_help_lists_options_with_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(Config, ["--help"], prog="sft")
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--model.seq-len  (default: 2048)" in out and "tokens per micro-batch" in out
    assert "--optim.lr" in out and "[type=sign_sgd]" in out


def test_write_toml_round_trips(tmp_path):
    cfg = load_config(Config, ["--optim.type", "sign_sgd", "--model.ac", "None", "--max-steps", "7"])
    path = write_toml(cfg, tmp_path / "configs" / "trainer.toml")
    assert load_config(Config, ["@", str(path)]) == cfg


def test_config_loading_does_not_import_torch():
    code = "import sys; import prime_rl.common.config as c; assert 'torch' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"

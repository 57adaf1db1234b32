"""`[trainer.loss]`: the variants a user picks by `type`, and the combinations refused at config time."""

import pytest

from prime_rl.common.config import parse_config
from prime_rl.common.config.rl_trainer import RLTrainerConfig, SequenceLossConfig, TokenLossConfig


def _parse(*flags: str) -> RLTrainerConfig:
    return parse_config(RLTrainerConfig, ["--model.name", "m", *flags], prog="trainer")


def test_default_is_todays_token_loss():
    loss = _parse().loss
    assert isinstance(loss, TokenLossConfig)
    assert (loss.token_mask_low, loss.token_mask_high, loss.norm, loss.kl) == (0.125, 8.0, "token", None)


def test_gspo_dr_grpo_and_kl_from_flags():
    loss = _parse("--loss.type", "sequence", "--loss.kl.coef", "0.01", "--loss.kl.estimator", "k1").loss
    assert isinstance(loss, SequenceLossConfig) and loss.norm == "sequence"
    assert loss.kl is not None and (loss.kl.coef, loss.kl.estimator) == (0.01, "k1")
    loss = _parse("--loss.norm", "constant", "--loss.max-len", "512").loss
    assert (loss.norm, loss.max_len) == ("constant", 512)


@pytest.mark.parametrize(
    "flags, key",
    [
        (["--loss.type", "sequence", "--loss.sequence-mask-low", "1.5"], "sequence_mask_low"),  # masks every sample
        (["--loss.type", "sequence", "--loss.sequence-mask-high", "0.9"], "sequence_mask_high"),
        (["--loss.norm", "constant"], "max_len"),  # Dr. GRPO needs its fixed length
        (["--loss.max-len", "64"], "max_len"),  # a length that no normalization uses
        (["--loss.type", "sequence", "--loss.token-mask-low", "0.2"], "token_mask_low"),  # the token loss's key
        (["--loss.kl.coef", "0.1", "--loss.kl.estimator", "k2"], "estimator"),
        (["--loss.kl.estimator", "k3"], "coef"),  # a KL term needs its weight
    ],
)
def test_combinations_that_cannot_work_exit_2_naming_the_key(flags, key, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(*flags)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert key in err and len(err.strip().splitlines()) == 1, err

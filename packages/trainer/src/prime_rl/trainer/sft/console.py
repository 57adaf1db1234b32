"""The `sft` console script. A bare `sft --help [SECTION]` is answered from the text the last one printed
(`prime_rl.common.help_cache`): importing the entrypoint costs pydantic and the config modules, most of a
help that only changes with the code. Anything else, and a help whose cache is missing or stale, runs
`prime_rl.trainer.sft.entrypoint.main`, whose `parse_config` renders the help and stores it."""

import sys

from prime_rl.common.help_cache import exit_with_cached_help

SFT_CONFIG = "prime_rl.common.config.trainer.SFTConfig"
"""the config class `sft` parses (module.qualname), named without importing it"""


def sft() -> None:
    exit_with_cached_help("sft", SFT_CONFIG, sys.argv[1:])
    from prime_rl.trainer.sft.entrypoint import main

    main()

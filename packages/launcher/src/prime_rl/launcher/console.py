"""The `rl` console script. A bare `rl --help [SECTION]` is answered from the text the last one printed
(`prime_rl.common.help_cache`): importing `prime_rl.launcher.rl` costs pydantic and every config module,
~0.2 s of a help that only changes with the code. Anything else, and a help whose cache is missing or stale,
runs `prime_rl.launcher.rl.main`, whose `parse_config` renders the help and stores it."""

import sys

from prime_rl.common.help_cache import exit_with_cached_help

RL_CONFIG = "prime_rl.common.config.rl.RLConfig"
"""the config class `rl` parses (module.qualname), named without importing it"""


def rl() -> None:
    exit_with_cached_help("rl", RL_CONFIG, sys.argv[1:])
    from prime_rl.launcher.rl import main

    main()

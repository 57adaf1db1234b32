"""A verifiers taskset package whose own dependency is not installed."""

import no_such_dependency_for_prime_rl_tests  # noqa: F401

"""prime_rl.kernels: fused / chunked kernels (Triton on GPU, plain-torch reference everywhere).

The public names are the LM head's, listed once in `prime_rl.kernels.lm_head.__all__` and re-exported here.
"""

from prime_rl.kernels.lm_head import *  # noqa: F403
from prime_rl.kernels.lm_head import __all__ as __all__

"""prime_rl.kernels"""

"""prime_rl.trainer"""

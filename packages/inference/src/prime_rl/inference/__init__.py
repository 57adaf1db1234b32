"""prime_rl.inference"""

"""prime_rl.launcher"""

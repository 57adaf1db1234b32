"""prime_rl.common"""

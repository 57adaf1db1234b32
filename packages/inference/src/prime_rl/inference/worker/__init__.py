"""prime_rl.inference.worker"""

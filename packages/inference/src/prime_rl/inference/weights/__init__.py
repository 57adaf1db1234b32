"""prime_rl.inference.weights"""

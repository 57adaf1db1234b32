"""prime_rl.orchestrator"""

"""Weight updates in inference.

In the API process (torch-free): what an update must contain and its checks (``manifest``, ``verify``,
``nixl_control``), the filesystem load (``load``), the push transports' control requests (``push``) and the
engine sequence every update runs (``apply``). In the vLLM workers (torch, no vLLM): the receiving ends of the
transports (``broadcast_receiver``, ``nixl_receiver``), called by ``prime_rl.inference.worker``.
"""

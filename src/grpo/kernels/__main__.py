"""`python -m grpo.kernels`: build grpo's CPU ops for this machine now (make setup does), rather than in the
first rollout; says where they are, or why they are not available (not an error: decoding then runs on
PyTorch's ops)."""

import logging

from grpo import kernels

logging.basicConfig(level=logging.INFO, format="%(message)s")
if kernels.cpu_ops() is not None:
    print(f"grpo's CPU ops: {kernels.library_path()}")
else:
    print(f"grpo's CPU ops are not available ({kernels.why_unavailable()}); decoding uses PyTorch's ops")

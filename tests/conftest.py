import os

import torch

# The Triton kernels run on CPU only in the interpreter, and triton reads this when it is
# first imported (any test module may import it indirectly), so set it before anything.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("CACHESEEK_HYPOTHESIS_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci")

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


# The longest files start first, so that the workers of scripts/test.sh (one file each at
# a time) finish together instead of one of them starting a four-minute file last. xdist
# hands each worker two files at the start, in this order, alternately: the third goes to
# the worker running the first (the longest by far), so it is the shortest of the four.
LONGEST_FIRST = ("test_vllm_connector.py", "test_crash.py", "test_transformers_integration.py", "test_transformers4.py")


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file's own order is kept

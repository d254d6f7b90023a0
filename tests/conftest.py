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


# The longest files start first (longest-processing-time order), so that the workers of
# scripts/test.sh (one file each at a time, the next handed to whichever runs low) finish
# together instead of one of them starting a two-minute file last. Seconds a file took in a
# full run on the 2-core CI machine, for the order only; scripts/test.sh passes
# --no-loadscope-reorder, without which xdist orders files by their number of tests instead
# (and ran the one-test transformers 4 file last).
LONGEST_FIRST = ("test_vllm_connector.py", "test_crash.py", "test_server_edges.py", "test_operations.py",
                 "test_redis_server.py", "test_trace.py", "test_transformers4.py", "test_paged_kernels.py",
                 "test_kernels.py", "test_server.py", "test_typing.py", "test_write_behind.py", "test_redis_tier.py",
                 "test_remote.py", "test_protocol.py", "test_stress.py", "test_layerwise.py",
                 "test_transformers_integration.py", "test_disk_faults.py", "test_cpu_benchmarks.py",
                 "test_server_ingest.py", "test_slow_readers.py", "test_server_drain.py", "test_disk_owner.py")


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file's own order is kept

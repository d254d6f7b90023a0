"""The transformers integration under transformers 4 (the suite runs on 5; both are supported).

``scripts/test.sh`` builds a venv over the test Python's own packages with transformers 4
on top (``CACHESEEK_TRANSFORMERS4_PYTHON``), and this runs the tests that touch
transformers there: ``prefill_with_reuse`` on a tiny Llama and on SmolLM2 (bit-identical
reuse, the layer-wise path, the demo through the server), the suffix attention (whose mask
function transformers 4 calls with the queries' ``cache_position``), and the model
benchmarks. transformers 4 keeps the cache in ``past_key_values`` and returns it there.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

PYTHON = os.environ.get("CACHESEEK_TRANSFORMERS4_PYTHON")
ROOT = Path(__file__).resolve().parents[1]
TESTS = [
    "tests/test_transformers_integration.py",
    "tests/test_suffix_attention.py",
    "tests/test_model_benchmarks.py",
    "tests/test_store.py::test_ingest_takes_an_hf_dynamic_cache",
    "tests/test_store.py::test_ingest_takes_the_self_attention_part_of_an_encoder_decoder_cache",
    "tests/test_layerwise.py::test_layerwise_prefill_equals_the_normal_one_and_stores_the_same_blocks",
    "tests/test_layerwise.py::test_layerwise_prefill_with_a_background_issuer_equals_the_normal_one",
    "tests/test_layerwise.py::test_each_layer_waits_inside_the_forward_in_order",
    "tests/test_layerwise.py::test_a_failed_layerwise_load_is_recomputed",
    "tests/test_layerwise.py::test_a_layerwise_load_that_differs_from_its_lookup_runs_the_right_suffix",
    "tests/test_layerwise.py::test_smollm2_layerwise_reuse_equals_the_normal_path",
    "tests/test_layerwise.py::test_layerwise_prefill_through_a_server_equals_the_normal_one",
]
# The int8 codec's greedy agreement over 3 prompts of SmolLM2 (the slowest test of the file):
# the codec's quality, not transformers'; the returned cache continuing a generation under
# transformers 4 is test_returned_cache_continues_with_generate's, which runs.
DESELECT = ["tests/test_transformers_integration.py::test_int8_reuse_keeps_greedy_continuations"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PYTHON is None, reason="CACHESEEK_TRANSFORMERS4_PYTHON names no Python with transformers 4 "
                                              "(scripts/test.sh builds one and sets it)"),
]


def test_the_transformers_tests_pass_under_transformers_4():
    version = subprocess.run([PYTHON, "-c", "import transformers; print(transformers.__version__)"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert version.returncode == 0, version.stderr[-2000:]
    assert version.stdout.strip().startswith("4."), version.stdout
    done = subprocess.run([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-ra", *TESTS,
                           *(arg for test in DESELECT for arg in ("--deselect", test))],
                          capture_output=True, text=True, timeout=1200, cwd=ROOT)
    tail = done.stdout[-6000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert " passed" in done.stdout and " failed" not in done.stdout and " error" not in done.stdout, tail

"""kill -9 during ingest, many times: acknowledged blocks survive exactly, nothing torn is served."""

import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import cacheseek as cs
from store_helpers import assert_prefix_equal, make_kv, tokens_for

LAYOUT = cs.KVLayout(num_layers=8, num_kv_heads=4, head_dim=128, dtype="float16")  # 1 MiB Raw blocks
BLOCK = 64
HERE = Path(__file__).resolve().parent

CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {here!r})
    import cacheseek as cs
    from store_helpers import make_kv, tokens_for
    layout = cs.KVLayout(num_layers=8, num_kv_heads=4, head_dim=128, dtype="float16")
    cache = cs.PrefixCache(model_id="crash", layout=layout, codec=cs.Raw(), block_tokens={block},
                           tiers=cs.TierConfig(cpu_bytes="8MiB", disk_path={disk!r}))
    seed = {first_seed}
    while True:
        toks, kv = tokens_for(seed, 6 * {block}), make_kv(6 * {block}, seed, layout)
        print("BEGIN", seed, flush=True)
        res = cache.ingest(toks, kv)
        assert res.failed == 0 and not res.errors, res
        print("ACK", seed, flush=True)
        seed += 1
""")


def _cache(disk: Path) -> cs.PrefixCache:
    return cs.PrefixCache(model_id="crash", layout=LAYOUT, codec=cs.Raw(), block_tokens=BLOCK,
                          tiers=cs.TierConfig(cpu_bytes=0, disk_path=disk))


@pytest.mark.slow
def test_sigkill_at_random_moments_never_loses_an_ack_or_serves_a_torn_block(tmp_path):
    disk = tmp_path / "disk"
    rng = random.Random(1234)
    acked: set[int] = set()
    begun: set[int] = set()
    seed = 0
    for round_ in range(12):
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD.format(here=str(HERE), block=BLOCK, disk=str(disk), first_seed=seed)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        # Wait until it is writing, then kill it at a random moment.
        first = child.stdout.readline()
        assert first.startswith("BEGIN"), child.stderr.read()
        begun.add(int(first.split()[1]))
        time.sleep(rng.uniform(0.0, 0.6))
        child.send_signal(signal.SIGKILL)
        out, _ = child.communicate()
        for line in out.splitlines():
            word, s = line.split()
            (acked if word == "ACK" else begun).add(int(s))
        seed = max(begun) + 1

        cache = _cache(disk)
        assert not list(disk.glob("*/.tmp-*")), "temp files survived the restart scan"
        assert cache.store.tier("disk").check() == {"ok": cache.stats()["tiers"][0]["blocks"], "corrupt": 0}
        for s in sorted(begun):
            toks, kv = tokens_for(s, 6 * BLOCK), make_kv(6 * BLOCK, s, LAYOUT)
            got = cache.materialize(toks)
            if s in acked:
                assert_prefix_equal(got, kv, 6 * BLOCK)
            else:  # in flight when killed: any prefix it serves must be exact
                assert_prefix_equal(got, kv, got.num_tokens)
        cache.close()
    assert len(acked) >= 3, f"the child acknowledged too little to test anything ({len(acked)})"

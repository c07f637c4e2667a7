"""A short soak (perf/soak.py): a decode loop that wraps, rolls back and re-prefills, verified
against the numpy reference on a host mirror, with resident memory flat; then create/close churn.

Stated tolerances: VmRSS may grow at most RSS_TOL_MIB between the end of the warm-up and the end
of the decode loop, and at most RSS_TOL_MIB over the create/close cycles; the number of plans and
of live device objects (buffers, programs, recorded sequences) must not change across either.
"""
import gc
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:          # `pytest` (not `python -m pytest`) leaves the repo root off
    sys.path.insert(0, str(ROOT))

from perf.soak import SoakConfig, live_device_objects, run_create_close, run_decode_soak  # noqa: E402

RSS_TOL_MIB = 4


def test_decode_soak_short(device):
    # capacity 96 with a speculative step every 10 steps: about 5 wraps (reset + prefill) in 400 steps
    cfg = SoakConfig(steps=400, verify_every=20, warmup=100, heads=4, kv_heads=2, head_dim=32, capacity=96,
                     prefill=16, spec=4, spec_every=10, rss_pct=0, rss_mib=RSS_TOL_MIB, cycles=0)
    rep = run_decode_soak(cfg, device)
    report = "\n".join(rep.lines())
    assert rep.steps == 400, report
    assert not rep.failures, report
    assert rep.verifications >= 400 // 20 and rep.verified_ok == rep.verifications, report
    # the loop really exercised reset/prefill, speculative rollback and plain decode
    assert rep.resets >= 3 and rep.spec_steps >= 30 and rep.tokens_rolled_back >= rep.spec_steps, report
    assert rep.decode_steps > 300, report
    assert rep.objects_stable, report
    assert rep.rss_growth_mib <= RSS_TOL_MIB, report
    assert rep.ok, report


def test_create_close_cycles(device):
    gc.collect()     # objects an earlier test of this process left unreachable are not this test's
    before = live_device_objects()
    rep = run_create_close(cycles=200, capacity=4096, dtype="float32", limit_mib=RSS_TOL_MIB, device=device)
    report = "\n".join(rep.lines())
    assert not rep.failures, report
    assert rep.after.objects == rep.before.objects, report
    assert live_device_objects() == before, report
    assert rep.rss_growth_mib <= RSS_TOL_MIB, report
    assert rep.ok, report

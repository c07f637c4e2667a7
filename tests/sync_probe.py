"""Deliberately racy Kompute sequence: two dependent dispatches with no barrier between them.

Run by scripts/validation.sh before the suite, under the same validation-layer settings, to prove
the layer is loaded and synchronization validation is on (it must report SYNC-HAZARD here). It
talks to kp directly on purpose: vkattn's own recordings refuse this pattern.

``sync_probe.py war``: a write after another dispatch's read of the same buffer, no barrier between
(must give SYNC-HAZARD-WRITE-AFTER-READ); ``war-download``: the same with a download of a third
buffer between them, which vkattn/_kp.py takes as ordering the pair (must give no message).
``pytest -n 1 tests/sync_probe.py``: the racy sequence in an xdist worker (scripts/validation.sh's
check that a worker's messages are counted, before it runs `make test` under the layer).
"""
import sys

import numpy as np

import kp

from vkattn import compiler


def main() -> None:
    mgr = kp.Manager()
    spirv = compiler.compile_shader("gather_slots")    # dst[i] = src[params[1 + i]], uvec4 words
    src = mgr.tensor_t(np.arange(64, dtype=np.uint32))
    mid = mgr.tensor_t(np.zeros(64, np.uint32))
    out = mgr.tensor_t(np.zeros(64, np.uint32))
    params = mgr.tensor_t(np.array([16] + list(range(16)), np.uint32))
    unused = [mgr.tensor_t(np.zeros(1, np.float32)) for _ in range(4)]
    spec, push = np.array([64, 1, 1], np.uint32), np.zeros(0, np.uint32)
    first = mgr.algorithm([src, src, mid, mid, params] + unused, spirv, [1, 1, 1], spec, push)
    second = mgr.algorithm([mid, mid, out, out, params] + unused, spirv, [1, 1, 1], spec, push)
    seq = mgr.sequence()
    seq.record(kp.OpTensorSyncDevice([src, params])).record(kp.OpAlgoDispatch(first))
    seq.record(kp.OpAlgoDispatch(second)).record(kp.OpTensorSyncLocal([out])).eval()


def write_after_read(download: bool) -> None:
    mgr = kp.Manager()
    spirv = compiler.compile_shader("gather_slots")
    src = mgr.tensor_t(np.arange(64, dtype=np.uint32))
    mid = mgr.tensor_t(np.zeros(64, np.uint32))
    out = mgr.tensor_t(np.zeros(64, np.uint32))
    params = mgr.tensor_t(np.array([16] + list(range(16)), np.uint32))
    unused = [mgr.tensor_t(np.zeros(1, np.float32)) for _ in range(8)]
    spec, push = np.array([64, 1, 1], np.uint32), np.zeros(0, np.uint32)
    reader = mgr.algorithm([src, src, mid, mid, params] + unused[:4], spirv, [1, 1, 1], spec, push)   # src -> mid
    writer = mgr.algorithm([out, out, src, src, params] + unused[4:], spirv, [1, 1, 1], spec, push)   # out -> src
    seq = mgr.sequence()
    seq.record(kp.OpTensorSyncDevice([src, out, params])).record(kp.OpAlgoDispatch(reader))
    if download:
        seq.record(kp.OpTensorSyncLocal([mid]))
    seq.record(kp.OpAlgoDispatch(writer)).record(kp.OpTensorSyncLocal([src])).eval()


def test_racy_sequence_in_a_worker():
    """Not part of the suite (the file is not named test_*): scripts/validation.sh runs it in an
    xdist worker before `-- make test`, to show that a worker's layer messages reach its count."""
    main()


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode not in ("", "war", "war-download"):
        sys.exit(f"sync_probe.py: unknown mode {mode!r} (war, war-download or none)")
    if mode:
        write_after_read(mode == "war-download")
    else:
        main()

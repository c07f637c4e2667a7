"""Deliberately racy Kompute sequence: two dependent dispatches with no barrier between them.

Run by scripts/validation.sh before the suite, under the same validation-layer settings, to prove
the layer is loaded and synchronization validation is on (it must report SYNC-HAZARD here). It
talks to kp directly on purpose: vkattn's own recordings refuse this pattern.
"""
import numpy as np

import kp

from vkattn import compiler


def main() -> None:
    mgr = kp.Manager()
    spirv = compiler.compile_shader("reduce")          # out[i] = part[i] for one split, l = 1 (+ lse)
    part = mgr.tensor_t(np.ones(64, np.float32))
    ml = mgr.tensor_t(np.array([0.0, 1.0], np.float32))
    mid = mgr.tensor_t(np.zeros(64, np.float32))
    out = mgr.tensor_t(np.zeros(64, np.float32))
    lse1, lse2 = mgr.tensor_t(np.zeros(1, np.float32)), mgr.tensor_t(np.zeros(1, np.float32))
    spec, push = np.array([64, 1, 1, 64, 64], np.uint32), np.zeros(0, np.uint32)
    first = mgr.algorithm([part, ml, mid, lse1], spirv, [1, 1, 1], spec, push)
    second = mgr.algorithm([mid, ml, out, lse2], spirv, [1, 1, 1], spec, push)
    seq = mgr.sequence()
    seq.record(kp.OpTensorSyncDevice([part, ml])).record(kp.OpAlgoDispatch(first))
    seq.record(kp.OpAlgoDispatch(second)).record(kp.OpTensorSyncLocal([out])).eval()


if __name__ == "__main__":
    main()

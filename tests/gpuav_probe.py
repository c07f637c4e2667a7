"""A deliberately out-of-bounds Kompute dispatch: one gather_slots.comp dispatch told to read a
source row past the end of its source buffer.

Run by scripts/validation.sh before the GPU-assisted-validation pass, under the same layer
settings, to prove the layer is loaded with GPU-assisted validation and buffer bounds checks on:
it must report the read (VUID-vkCmdDispatch-None-02706, "access out of bounds"). It talks to kp
directly on purpose: vkattn never passes the kernels an index the host has not bounded.
"""
import numpy as np

import kp

from vkattn import compiler

ROWS = 16        # uvec4 words in the source buffer
BAD_ROW = 40     # the row the probe asks for: words 640 .. 655 of a 256-byte buffer


def main() -> None:
    mgr = kp.Manager()
    spirv = compiler.compile_shader("gather_slots")    # rk[i] = kc[params[1 + i]] (DK4 = DV4 = 1)
    src = mgr.tensor_t(np.arange(4 * ROWS, dtype=np.uint32))
    out = mgr.tensor_t(np.zeros(4, np.uint32))
    params = mgr.tensor_t(np.array([1, BAD_ROW], np.uint32))
    unused = [mgr.tensor_t(np.zeros(1, np.float32)) for _ in range(4)]
    spec, push = np.array([1, 1, 1], np.uint32), np.zeros(0, np.uint32)
    algo = mgr.algorithm([src, src, out, out, params] + unused, spirv, [1, 1, 1], spec, push)
    seq = mgr.sequence()
    seq.record(kp.OpTensorSyncDevice([src, out, params])).record(kp.OpAlgoDispatch(algo))
    seq.record(kp.OpTensorSyncLocal([out])).eval()
    # one more submission: Debian 13's layer (1.4.309) reports a submission's finding when the queue
    # next submits; left for the process's exit it sometimes went unreported (1 run of 8, session 23)
    mgr.sequence().record(kp.OpTensorSyncDevice([out])).eval()
    print("gpuav probe: dispatched a read of row", BAD_ROW, "of a", ROWS, "row buffer")


if __name__ == "__main__":
    main()

"""Every per-device tuning choice, in one place.

Lavapipe (llvmpipe) runs each workgroup on one CPU thread as 8-wide SIMD (its subgroup), so it
wants few, fat workgroups: enough splits to keep every core busy and no more. GPUs want many
workgroups in flight, so decode splits the cache further. Sizes that depend on the shape are
derived here from the device's limits (shared memory, workgroup size), never assumed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

WORKGROUP = 64          # threads per attention workgroup; also the key tile (one key per thread)
ACC_FLOATS = 64         # accumulator floats per thread in the V phase (register budget)
PREFILL_NQ = 32         # query vectors (heads x rows) per prefill workgroup, before shrinking


@dataclass(frozen=True)
class AttnConfig:
    kernel: str    # "tile" (attn.comp) or "lane" (attn_lane.comp, decode on CPU-like devices)
    wg: int
    bq: int        # query rows per workgroup
    splits: int    # key splits (split-K); 1 = no reduce pass
    tq: int        # query groups in the V phase
    kg: int        # key groups in the V phase
    shared_bytes: int

    def qtiles(self, s: int) -> int:
        return -(-s // self.bq)


def decode_kernel(device) -> str:
    """attn_lane.comp where memory ops are dear and private memory cheap (CPU drivers), else attn.comp."""
    env = os.environ.get("VKATTN_DECODE_KERNEL", "")
    if env:
        if env not in ("tile", "lane"):
            raise ValueError(f"VKATTN_DECODE_KERNEL={env!r}: expected 'tile' or 'lane'")
        return env
    return "lane" if device.is_software else "tile"


def lane_config(device, num_kv_heads: int, capacity: int) -> AttnConfig:
    """attn_lane.comp: one subgroup per workgroup; enough key splits to give every core a few."""
    wg = max(1, min(device.subgroup_size or 8, device.max_workgroup_size))
    env = os.environ.get("VKATTN_DECODE_SPLITS")
    splits = int(env) if env else -(-4 * (os.cpu_count() or 1) // num_kv_heads)
    splits = max(1, min(splits, -(-capacity // 16)))
    return AttnConfig(kernel="lane", wg=wg, bq=1, splits=splits, tq=1, kg=1, shared_bytes=4 * wg * 64)


def decode_splits(device, capacity: int) -> int:
    env = os.environ.get("VKATTN_DECODE_SPLITS")
    if env:
        return max(1, int(env))
    cores = os.cpu_count() or 1
    want = 2 * cores if device.is_software else 32
    return max(1, min(want, -(-capacity // WORKGROUP)))


def shared_bytes(wg, nq, pk, ch, qpt, kg) -> int:
    red = wg * qpt * ch if kg > 1 else 1
    return 16 * nq * pk + 4 * nq * wg + 12 * nq + 16 * red


def attention_config(device, group: int, s: int, dk4: int, dv4: int, ch: int, capacity: int,
                     num_kv_heads: int) -> AttnConfig:
    """Kernel and tile sizes; raises DeviceLimitError if even the smallest tile does not fit."""
    from .errors import DeviceLimitError

    if s == 1 and decode_kernel(device) == "lane":
        return lane_config(device, num_kv_heads, capacity)

    wg = WORKGROUP
    while wg < dv4:
        wg *= 2
    if wg > device.max_workgroup_size:
        raise DeviceLimitError(
            f"head dims need a workgroup of {wg} threads; the device allows {device.max_workgroup_size}")
    pk = dk4 * ch
    limit = device.max_shared_memory
    bq = 1 if s == 1 else max(1, min(s, PREFILL_NQ // group))
    while True:
        nq = group * bq
        # fewest query groups whose accumulators fit the register budget
        tq = 1
        while -(-nq // tq) * ch * 4 > ACC_FLOATS and (tq + 1) * dv4 <= wg:
            tq += 1
        qpt = -(-nq // tq)
        kg = max(1, wg // (dv4 * tq)) if s == 1 else 1
        need = shared_bytes(wg, nq, pk, ch, qpt, kg)
        if need <= limit:
            break
        if bq == 1:
            raise DeviceLimitError(
                f"attention tile needs {need} bytes of shared memory; the device has {limit}")
        bq = max(1, bq // 2)
    splits = decode_splits(device, capacity) if s == 1 else 1
    return AttnConfig(kernel="tile", wg=wg, bq=bq, splits=splits, tq=tq, kg=kg, shared_bytes=need)

"""Every per-device tuning choice, in one place.

Lavapipe (llvmpipe) runs each workgroup on one CPU thread as 8-wide SIMD (its subgroup). Measured
there (Mesa 22.3, 2 vCPU Zen 4; perf/RESULTS.md): every buffer or shared-memory load is a scalar
loop over the lanes, inside loops even when the address is uniform, about 0.5 ns per 32-bit word
streamed (`python -m perf loads`), which bounds decode; every write of a loop-carried value inside
a loop is blended with the exec mask (so the kernels touch carried state once per key block); a
barrier is a coroutine switch; constant xor shuffles are nearly free; a loop runs as a do-while
under the exec mask, so its body runs once more with every lane off when it ends (and once when it
runs no iteration), and an `if` whose lanes are all off is not skipped either (a decode step at
L=1 runs about 14 us of shader code per workgroup, session 6); a loop stops after 65535 iterations
per invocation. So software devices get attn_lane.comp (one subgroup per workgroup, no shared
memory, no barrier), few fat workgroups (enough splits for every core and no more: each one pays
that fixed cost) and a bound on keys per invocation. GPUs get attn.comp with many workgroups in
flight. Sizes that depend on the shape are derived from the device's limits (shared memory,
workgroup size, probed subgroup), never assumed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

WORKGROUP = 64          # threads of the grid-stride kernels (append, gather, copy); attn.comp's target
                        # workgroup size (a decode tile with fewer threads takes key columns)
TILE_MAX_WG = 256       # attn.comp threads per workgroup at most
TILE_CLUSTER = 32       # attn.comp threads per key row at most (a float16 head_dim-128 row is 16
                        # units of 16 bytes: one 256-byte run per load instruction and cluster)
TILE_ROW_FLOATS = 80    # attn.comp prefill: register floats per thread for its rows' query and
                        # accumulator slices (+ max, sum); sets the rows per thread, at most
TILE_MAX_RPT = 4        # .. this many (RADV navi21 / gfx1100 / vega10, perf gpu: float16 head_dim
                        # 128 prefill 108-112 VGPRs at 4 rows and one key per step)
TILE_KB_DECODE = 2      # attn.comp keys per column and step, loaded before use: decode 2 (two keys
TILE_KB_PREFILL = 1     # of loads in flight at 56-60 VGPRs), prefill 1 (its rows need the registers)
TILE_TARGET_WGS = 256   # attn.comp with s > 1: split the keys until about this many workgroups run
TILE_SPLIT_KEYS = 512   # .. but give each split this many keys of the capacity at least
PREFILL_NQ = 32         # query vectors (heads x rows) per prefill workgroup, before shrinking
LANE_NQ = 32            # query vectors per attn_lane.comp workgroup: every K/V load serves this many
                        # (prefill S=512, d 128 on lavapipe: 16 -> 121 ms, 32 -> 95 ms, 64 -> 104 ms)
LANE_STATE_VEC4 = 128   # private vec4 (queries + accumulators) per lane in attn_lane.comp
FUSED_APPEND_MAX_ROWS = 32   # KVCache.forward with more new rows (PagedKVCache.forward: a sequence
                        # with more) appends them in a submission of its own, then attends from the
                        # cache: in the fused kernel every workgroup of a sequence stores all of its
                        # new rows (attn_lane.comp: no barrier needed), so the stores grow with
                        # rows x query tiles, which soon costs more than one more round trip
                        # (before that design, prefill S=512 from empty on lavapipe: KVCache 98 ->
                        # 67.5 ms per call, PagedKVCache 94-95 -> 58-60 ms)
TILE_MAX_KEYS = 8192    # keys per attn.comp workgroup on a software device (~200 loop iterations per
                        # 64-key tile; measured wrong from ~20000 keys on lavapipe, which ends a loop
                        # after 65535 iterations per invocation). GPUs have no such cap.
LANE_MAX_KEYS = 32768   # keys one attn_lane.comp invocation may walk (lavapipe stops loops at 65535)


@dataclass(frozen=True)
class AttnConfig:
    kernel: str    # "tile" (attn.comp, GPUs) or "lane" (attn_lane.comp, CPU-like devices)
    wg: int
    bq: int        # query rows per workgroup
    splits: int    # key splits (split-K); 1 = no merge
    ds: int = 1    # attn.comp: threads per key row (cluster)
    rpt: int = 1   # attn.comp: query vectors per thread
    cols: int = 1  # attn.comp: key columns per workgroup
    kb: int = 1    # attn.comp: keys per column and step

    def qtiles(self, s: int) -> int:
        return -(-s // self.bq)

    def spec(self, group: int, dk4: int, dv4: int, dv: int, flags: int, rope_dim: int) -> list:
        """The kernel's specialisation constants, in constant_id order."""
        # SPLIT, not the split count: the kernels take the count from the grid, so one pipeline
        # serves every capacity (the count follows the capacity)
        head = [self.wg, group, self.bq, dk4, dv4, dv, int(self.splits > 1), flags, max(rope_dim, 8)]
        return head + ([self.ds, self.rpt, self.cols, self.kb] if self.kernel == "tile" else [])

    def shared_bytes(self, group: int, dv4: int, ch: int) -> int:
        """attn.comp's shared memory: the column merge (COLS > 1) and a flag."""
        merge = self.cols * group * self.bq if self.cols > 1 else 1
        return 8 * merge + 16 * (merge * dv4 * ch if self.cols > 1 else 1) + 4


SUBGROUP_SHUFFLE = 0x10       # VkSubgroupFeatureFlagBits: SHUFFLE
SUBGROUP_VOTE = 0x02          # VkSubgroupFeatureFlagBits: VOTE (attn.comp's subgroupAny)
COMPUTE_STAGE = 0x20          # VkShaderStageFlagBits: COMPUTE


def kernel_for(device) -> str:
    """attn_lane.comp where memory ops are dear, private memory cheap and subgroup shuffles are
    available in compute (CPU drivers: lavapipe), else attn.comp. VKATTN_KERNEL overrides."""
    env = os.environ.get("VKATTN_KERNEL", "")
    if env not in ("", "tile", "lane"):
        raise ValueError(f"VKATTN_KERNEL={env!r}: expected 'tile' or 'lane'")
    if env == "tile":
        return "tile"
    if env == "lane" or device.is_software:
        if device.lane_subgroup():
            return "lane"
        if env == "lane":
            raise ValueError("VKATTN_KERNEL=lane: this device has no usable subgroup for attn_lane.comp")
    return "tile"


def lane_config(device, group: int, s: int, dk4: int, dv4: int, ch: int, num_kv_heads: int,
                capacity: int) -> AttnConfig:
    """attn_lane.comp: one subgroup per workgroup owning up to LANE_NQ query vectors (heads x
    rows), fewer when the head dims are large: a lane keeps (KPL + VPL) * CH vec4 of query and
    accumulator per query vector, bounded by LANE_STATE_VEC4: the key block is straight-line code
    over all of them, and llvmpipe's compile time grows faster than that code (float16 head_dim
    128 prefill, shader cache off, this 2-core machine: 6.4 s to compile at 32 query vectors, 2.4 s
    at 16, 1.3 s at 8; the call then takes 72 / 74 / 91 ms from an empty cache, and on a 1536-token
    past 363-376 ms at 32 against 415-419 ms at 16). The budget of 128 keeps 16 at head_dim 128:
    13% on a prefill over a long past, for a cold test suite of about 5 min instead of more than
    7 (perf/RESULTS.md, session 9). Rows per workgroup are the fewest covering s in halvings, so odd short prefills share
    pipelines."""
    wg = device.lane_subgroup()          # probed: one subgroup, shuffles work
    per_qv = (-(-dk4 // wg) + -(-dv4 // wg)) * ch
    nq = max(1, min(LANE_NQ, LANE_STATE_VEC4 // per_qv))
    bq = max(1, nq // group)
    while bq // 2 >= s:             # fewest rows covering s, in powers of two (fewer pipelines)
        bq //= 2
    splits = decode_splits(device, "lane", num_kv_heads, capacity) if s == 1 else 1
    # one loop iteration per key and invocation: stay far below lavapipe's per-invocation cap
    splits = max(splits, -(-capacity // LANE_MAX_KEYS))
    splits = max(1, min(splits, -(-capacity // 16)))
    return AttnConfig(kernel="lane", wg=wg, bq=bq, splits=splits)


def decode_splits(device, kernel: str, num_kv_heads: int, capacity: int) -> int:
    """Key splits for decode (VKATTN_DECODE_SPLITS overrides). The lane kernel wants a few
    workgroups per CPU core in all (they are fat); attn.comp on a GPU wants many in flight."""
    env = os.environ.get("VKATTN_DECODE_SPLITS")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"VKATTN_DECODE_SPLITS={env!r}: expected a positive integer")
        return int(env)
    cores = os.cpu_count() or 1
    if kernel == "lane":
        return -(-4 * cores // num_kv_heads)
    want = 2 * cores if device.is_software else 32
    return max(1, min(want, -(-capacity // WORKGROUP)))


def tile_config(device, group: int, s: int, dk4: int, dv4: int, ch: int, capacity: int,
                num_kv_heads: int) -> AttnConfig:
    """attn.comp: a cluster of DS threads per key row (the smallest power of two covering the row's
    16-byte words, at most TILE_CLUSTER and the device's shuffle cluster), RPT query vectors per
    thread (decode: 1, the fewest registers; prefill: as many as TILE_ROW_FLOATS allows, so each
    K/V load serves several rows), key columns to fill a WORKGROUP-thread workgroup."""
    from .errors import DeviceLimitError

    uv = 2 if ch == 4 else ch            # float vec4 per load unit: int8 rows are read by 8 bytes
    dku, dvu = dk4 * ch // uv, dv4 * ch // uv
    ds = 1
    while ds < min(max(dku, dvu), TILE_CLUSTER, device.tile_cluster()):
        ds *= 2
    row_floats = (-(-dku // ds) + -(-dvu // ds)) * uv * 4 + 2
    max_wg = min(TILE_MAX_WG, device.max_workgroup_size)
    if s == 1:
        bq, rpt, kb = 1, 1, TILE_KB_DECODE
        while ds * -(-group // rpt) > max_wg:
            rpt *= 2
    else:
        rpt, kb = 1, TILE_KB_PREFILL
        while 2 * rpt * row_floats <= TILE_ROW_FLOATS and 2 * rpt <= TILE_MAX_RPT:
            rpt *= 2
        bq = 1                      # a power of two: whole subgroups even when s is odd
        while bq < s and 2 * bq * group <= PREFILL_NQ:
            bq *= 2
        while bq > 1 and ds * -(-group * bq // rpt) > max_wg:
            bq //= 2
        while ds * -(-group * bq // rpt) > max_wg:
            rpt *= 2
    nq = group * bq
    rpt = min(rpt, nq)
    threads = ds * -(-nq // rpt)
    if threads > device.max_workgroup_size:
        raise DeviceLimitError(f"attention tile needs {threads} threads; the device allows {device.max_workgroup_size}")
    cols = max(1, min(WORKGROUP, max_wg) // threads)
    if s == 1:
        splits = decode_splits(device, "tile", num_kv_heads, capacity)
    else:       # a few query tiles over a long past (a chunk, speculative verify): split the keys too
        want = 2 * (os.cpu_count() or 1) if device.is_software else TILE_TARGET_WGS
        tiles = num_kv_heads * -(-s // bq)
        splits = max(1, min(32, -(-want // tiles), -(-capacity // TILE_SPLIT_KEYS)))
    if device.is_software:
        splits = max(splits, -(-capacity // TILE_MAX_KEYS))
    cfg = AttnConfig(kernel="tile", wg=threads * cols, bq=bq, splits=splits, ds=ds, rpt=rpt, cols=cols, kb=kb)
    need = cfg.shared_bytes(group, dv4, ch)
    if need > device.max_shared_memory:
        raise DeviceLimitError(f"attention tile needs {need} bytes of shared memory; the device has "
                               f"{device.max_shared_memory}")
    return cfg


def attention_config(device, group: int, s: int, dk4: int, dv4: int, ch: int, capacity: int,
                     num_kv_heads: int) -> AttnConfig:
    """Kernel and tile sizes; raises DeviceLimitError if even the smallest tile does not fit."""
    if kernel_for(device) == "lane":
        return lane_config(device, group, s, dk4, dv4, ch, num_kv_heads, capacity)
    return tile_config(device, group, s, dk4, dv4, ch, capacity, num_kv_heads)

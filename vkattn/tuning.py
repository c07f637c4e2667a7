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

import contextlib
import os
from dataclasses import dataclass

from .checks import env_flag
from .errors import DeviceLimitError

WORKGROUP = 64          # threads of the grid-stride kernels (append, gather, copy); attn.comp's target
                        # workgroup size (a decode tile with fewer threads takes key columns)
TILE_MAX_WG = 256       # attn.comp threads per workgroup at most
TILE_CLUSTER = 32       # attn.comp threads per key row at most (a float16 head_dim-128 row is 16
                        # units of 16 bytes: one 256-byte run per load instruction and cluster)
TILE_SHARED_CLUSTER = 16   # .. where the row's partial dot products are summed through shared memory
                        # instead (no usable shuffle cluster wide enough): every thread of a cluster
                        # reads the cluster's DS partials, so fewer threads read less; at 16 a thread
                        # holds at most 4 units of a head_dim-256 row
TILE_MAX_UNITS = 8      # float vec4 per thread and K (or V) row at most with shuffles: a narrower
                        # shuffle cluster (subgroup 4, a forced VKATTN_TILE_CLUSTER) sums through
                        # shared memory instead, so a thread's registers stay bounded at any head dim
                        # (head_dim 256 float32 at a cluster of 8: 8; at 4 it would be 16)
TILE_SHARED_BUDGET = 16384   # attn.comp shared memory per workgroup at most (the column merge gives up
                        # columns to stay below it): 16 KiB is Vulkan's guaranteed minimum
TILE_ROW_FLOATS = 80    # attn.comp prefill: register floats per thread for its rows' query and
                        # accumulator slices (+ max, sum); sets the rows per thread, at most
TILE_MAX_RPT = 4        # .. this many (RADV navi21 / gfx1100 / vega10, perf gpu: float16 head_dim
                        # 128 prefill 108-112 VGPRs at 4 rows and one key per step)
TILE_KB_DECODE = 2      # attn.comp keys per column and step, loaded before use: decode 2 (two keys
TILE_KB_PREFILL = 1     # of loads in flight at 56-60 VGPRs), prefill 1 (its rows need the registers)
TILE_DECODE_NVIDIA = (2, 4)   # attn.comp decode on NVIDIA (vendor 0x10de): 2 query vectors per thread
                        # (each K/V load serves two of the group's heads) and 4 keys per step. H200,
                        # float16 32/8 heads d128, L=16384, device ms, three alternated runs: 1,2
                        # (the default) 0.174-0.175, 2,2 0.121-0.122, 2,4 0.119, 1,4 0.144
                        # (perf/RESULTS.md session 18; VKATTN_TILE_DECODE, perf/gpu_session.sh sweep).
                        # int8 and other GPUs keep 1 and TILE_KB_DECODE, the fewest registers (RADV)
NVIDIA_VENDOR = 0x10de
TILE_TARGET_WGS = 256   # attn.comp with s > 1: split the keys until about this many workgroups run
TILE_SPLIT_KEYS = 512   # .. but give each split this many keys of the capacity at least
DECODE_SPLIT_KEYS = 128  # attn.comp decode on a GPU: about this many keys per split workgroup, from 32
DECODE_MAX_SPLITS = 256  # .. to 256 splits per kv head (NVIDIA H100, device time, perf/RESULTS.md
                         # session 10: 32 splits L=65536 4.08 ms, 256 splits 0.98; L=16384 best at 128)
MIN_CHUNK = 64          # keys per split at least: short sequences of a batch use fewer splits
DECODE_BOUND_MIN = 4096  # decode plans are sized for the live length rounded up to a power of two from
                         # here (at most the capacity), so the split count follows the context
PREFILL_NQ = 32         # query vectors (heads x rows) per prefill workgroup, before shrinking
LANE_NQ = 32            # query vectors per attn_lane.comp workgroup: every K/V load serves this many
                        # (prefill S=512, d 128 on lavapipe: 16 -> 121 ms, 32 -> 95 ms, 64 -> 104 ms)
LANE_STATE_VEC4 = 128   # private vec4 (queries + accumulators) per lane in attn_lane.comp
LANE_LONG_ROWS = 128    # .. a call of at least this many query rows (a long prefill) may use
LANE_STATE_VEC4_LONG = 256   # this many: twice the query vectors per K/V load at head_dim 128
                        # (S=512 over 1536 cached, float16 32/8 heads, lavapipe 22.3, one run,
                        # fastest of 10: 320 -> 272 ms, from empty 53 -> 47 ms), paid with a longer
                        # first compile (6.4 s against 2.4 s) only by calls that long
FUSED_APPEND_MAX_ROWS = 32   # KVCache.forward with more new rows (PagedKVCache.forward: a sequence
                        # with more) appends them in a dispatch of its own, then attends from the
                        # cache (one submission, a barrier between): in the fused kernel every
                        # workgroup of a sequence stores all of its new rows (attn_lane.comp: no
                        # barrier needed), so the stores grow with rows x query tiles, which soon
                        # costs more than one more round trip
                        # (before that design, prefill S=512 from empty on lavapipe: KVCache 98 ->
                        # 67.5 ms per call, PagedKVCache 94-95 -> 58-60 ms)
CASCADE_MIN_PREFIX = 256   # PagedKVCache.forward on a software device attends a prefix of full blocks
                        # that two or more sequences of a batch share once for all of them
                        # (vkattn.cascade) from this many shared tokens (VKATTN_CASCADE=1: from one
                        # block, on any device). Lavapipe, 16 sequences, 32/8 heads d128, 64..256 own
                        # tokens each: 128 shared tokens already 0.92x today's step time, 512 0.70x.
                        # Re-timed under decode_splits' lane rule of session 28 (fewer splits; perf
                        # cascade, 2-vCPU Zen 4): 128 shared 1.07x (twice), 192 0.95x, 256 0.90-0.93x,
                        # 512 0.75x -- the crossover moved above 128, 256 stays
TILE_MAX_KEYS = 8192    # keys per attn.comp workgroup on a software device (~200 loop iterations per
                        # 64-key tile; measured wrong from ~20000 keys on lavapipe, which ends a loop
                        # after 65535 iterations per invocation). GPUs have no such cap.
LANE_MAX_KEYS = 32768   # keys one attn_lane.comp invocation may walk (lavapipe stops loops at 65535)
COOPMAT_SUBGROUP = 32   # attn_coopmat.comp: the subgroup size its pipelines are pinned to where the device
                        # allows it (Device.coopmat_subgroup), else the reported one (lavapipe: 8)
COOPMAT_SUBGROUPS = 4   # .. subgroups per workgroup, one matrix row tile (M query vectors) each
COOPMAT_KEY_TILES = 2   # .. keys per block: this many matrix sides (max(N, K))
COOPMAT_MAX_DIM = 128   # .. padded head dims it takes at most: a subgroup holds its Q rows' hi part
                        # and all of its O columns in registers (d 128, 16x16 matrices, subgroup 32:
                        # 64 + 64 VGPRs a lane on RDNA3); wider heads go to the device's other kernel
COOPMAT_SHARED_BUDGET = 32768   # .. shared memory per workgroup wanted (GPUs: two workgroups in 64 KiB);
                        # a tile over it gives up keys per block, and where even the fewest keys pass
                        # it (head_dim 128: Q's lo rows alone are 17 KiB) the device's limit decides
                        # (coopmat_config; 45 KiB at d128: one workgroup per 64 KiB)


@dataclass(frozen=True)
class AttnConfig:
    kernel: str    # "tile" (attn.comp, GPUs), "lane" (attn_lane.comp, CPU-like devices) or "coopmat"
                   # (attn_coopmat.comp: prefill and chunks on cooperative matrices)
    wg: int
    bq: int        # query rows per workgroup
    splits: int    # key splits (split-K); 1 = no merge
    ds: int = 1    # attn.comp: threads per key row (cluster)
    rpt: int = 1   # attn.comp: query vectors per thread
    cols: int = 1  # attn.comp: key columns per workgroup
    kb: int = 1    # attn.comp: keys per column and step
    shuffle: bool = True   # attn.comp: a key row's cluster sums with subgroup shuffles (else shared memory)
    sg: int = 0    # attn_coopmat.comp: the pinned subgroup size
    mnk: tuple = ()   # .. the matrix shape (M, N, K)
    bc: int = 0    # .. keys per block
    br: int = 0    # .. matrix rows per workgroup (a row tile of M per subgroup, >= group * bq)
    tpr: int = 0   # .. softmax lanes per row (max(1, sg / M))
    unroll: bool = True   # .. its loops over a subgroup's accumulators unrolled (GPUs: they stay in
                          # registers); not on CPU drivers, where llvmpipe compiles the unrolled
                          # pipeline in twice the time (13.5 s against 7.6 s, lavapipe 26, d64)

    def qtiles(self, s: int) -> int:
        return -(-s // self.bq)

    def spec(self, group: int, dk4: int, dv4: int, dv: int, flags: int, rope_dim: int) -> list:
        """The kernel's specialisation constants, in constant_id order."""
        # SPLIT, not the split count: the kernels take the count from the grid, so one pipeline
        # serves every capacity (the count follows the capacity)
        head = [self.wg, group, self.bq, dk4, dv4, dv, int(self.splits > 1), flags, max(rope_dim, 8)]
        if self.kernel == "coopmat":
            return head + [self.sg, *self.mnk, self.bc, self.br, self.tpr]
        return head + ([self.ds, self.rpt, self.cols, self.kb] if self.kernel == "tile" else [])

    def shared_bytes(self, group: int, dv4: int, ch: int) -> int:
        """attn.comp's shared memory: the column merge (COLS > 1), a flag and, without shuffles,
        the cluster sums' exchange (attn.comp s_red)."""
        merge = self.cols * group * self.bq if self.cols > 1 else 1
        red = self.wg * max(self.rpt * self.kb, 2) if self.ds > 1 and not self.shuffle else 1
        return 8 * merge + 16 * (merge * dv4 * ch if self.cols > 1 else 1) + 4 + 4 * red


SUBGROUP_VOTE = 0x2           # VkSubgroupFeatureFlagBits: VOTE (attn.comp's subgroupAny)
SUBGROUP_SHUFFLE = 0x10       # VkSubgroupFeatureFlagBits: SHUFFLE
COMPUTE_STAGE = 0x20          # VkShaderStageFlagBits: COMPUTE


def forced_kernel() -> str:
    """VKATTN_KERNEL ("" when unset); ValueError naming it for anything but tile, lane, coopmat."""
    env = os.environ.get("VKATTN_KERNEL", "")
    if env not in ("", "tile", "lane", "coopmat"):
        raise ValueError(f"VKATTN_KERNEL={env!r}: expected 'tile', 'lane' or 'coopmat'")
    return env


def coopmat_fixed_trips() -> bool:
    """attn_coopmat.comp's COOPMAT_FIXED_TRIPS: its loops over O's tiles walk each tile's words in
    a fixed number of steps per lane, so that a compiler unrolls them and keeps the O accumulators
    in registers (NVK's NAK, GA100: 96 -> 224 GPRs, 20 -> 8 warps per SM, its 256 bytes a thread of
    local memory gone; RADV: the same VGPRs, more instructions; perf/gpu_report_nvk.md). Where the
    words were walked from the lane index (before session 24) NAK kept o[] in local memory, read and
    written at every key block. VKATTN_COOPMAT_FIXED_TRIPS=0 builds the earlier loops (to time both
    on a GPU: perf/gpu_session.sh)."""
    return env_flag("VKATTN_COOPMAT_FIXED_TRIPS", True)


def coopmat_stage_batch() -> bool:
    """attn_coopmat.comp's COOPMAT_STAGE_BATCH: a key block's K/V words are all loaded before any
    is stored to shared memory, so their memory latencies overlap (NVK's NAK kept each load beside
    its store and waited for it, 8 words a thread at float16 d128). VKATTN_COOPMAT_STAGE_BATCH=0
    builds the word-at-a-time loop (perf/gpu_session.sh times both)."""
    return env_flag("VKATTN_COOPMAT_STAGE_BATCH", True)


def tile_merge_batch() -> int | None:
    """attn.comp's TILE_MERGE_BATCH from VKATTN_TILE_MERGE_BATCH (0 to 8), or None: the shader's
    own default, 2. The split-K merge reads this many of a thread's splits at once, so their
    latencies overlap (0: the one-at-a-time loops before session 24; perf/gpu_session.sh times
    them). Only where a thread holds a decode's 1 or 2 rows of a 16- or 32-bit format (chunks and
    int8 read one split at a time): there 2 costs no wave on RADV (Mesa 22.3 and 26, every family)
    nor on NVK's GA100 (float16 120 GPRs); 4 costs occupancy (navi21 24 -> 18 waves, navi31
    32 -> 24, GA100 float16 16 -> 12 warps): perf/RESULTS.md session 24."""
    env = os.environ.get("VKATTN_TILE_MERGE_BATCH", "")
    if not env:
        return None
    if not env.isdigit() or int(env) > 8:
        raise ValueError(f"VKATTN_TILE_MERGE_BATCH={env!r}: expected 0 to 8")
    return int(env)


def coopmat_tile() -> tuple:
    """(subgroups per workgroup, matrix sides of keys per block) of attn_coopmat.comp:
    VKATTN_COOPMAT_TILE="NSG,KT" (NSG 1, 2, 4 or 8; KT 1, 2 or 4) for a GPU's sweep
    (perf/gpu_session.sh's coopsweep step), else (COOPMAT_SUBGROUPS, COOPMAT_KEY_TILES). A tile
    over the device's shared memory gives up keys per block as the default's does (coopmat_config)."""
    env = os.environ.get("VKATTN_COOPMAT_TILE", "")
    if not env:
        return COOPMAT_SUBGROUPS, COOPMAT_KEY_TILES
    parts = env.split(",")
    if len(parts) != 2 or parts[0] not in ("1", "2", "4", "8") or parts[1] not in ("1", "2", "4"):
        raise ValueError(f"VKATTN_COOPMAT_TILE={env!r}: expected NSG,KT with NSG 1, 2, 4 or 8 and KT 1, 2 or 4")
    return int(parts[0]), int(parts[1])


def tile_v_early() -> bool:
    """attn.comp's TILE_V_EARLY from VKATTN_TILE_V_EARLY (0 or 1; unset: 0, the shader's default):
    the decode loads a step's V words with its K words, before the scores, not after them. Off
    until a GPU times it (perf/gpu_session.sh's vearly step): RADV builds the same code either way
    (ACO hoists those loads already), NVK's float16 decode 128 GPRs instead of 120 at the same 16
    warps per SM (perf/gpu_report_nvk.md)."""
    return env_flag("VKATTN_TILE_V_EARLY", False)


@contextlib.contextmanager
def env_set(**values):
    """The VKATTN_* variables given set (None: unset) for the plans built inside -- the planner
    reads them when a plan is built --, each restored after."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = str(v)
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def kernel_forced(kernel: str):
    """VKATTN_KERNEL=kernel for the plans built inside, the previous value restored after."""
    return env_set(VKATTN_KERNEL=kernel)


def kernel_for(device) -> str:
    """The kernel of decode and of what attn_coopmat.comp does not take: attn_lane.comp where
    memory ops are dear, private memory cheap and subgroup shuffles are available in compute (CPU
    drivers: lavapipe), else attn.comp. VKATTN_KERNEL=tile/lane overrides (coopmat: this choice
    for decode and the fallbacks, see coopmat_wanted)."""
    env = forced_kernel()
    if env == "tile":
        return "tile"
    if env == "lane" or device.is_software:
        if device.lane_subgroup():
            return "lane"
        if env == "lane":
            raise ValueError("VKATTN_KERNEL=lane: this device has no usable subgroup for attn_lane.comp")
    return "tile"


TEXEL_APPEND_MIN_WORDS = 1 << 20   # a decode with new rows appends them first (a dispatch and a
                        # barrier more) where its attention then reads at least this many K/V words
                        # from texel views instead of storage (texel_kv): the 0.29 ns a word saved
                        # must pay them. Lavapipe, 2-vCPU Zen 4, 32/8 heads d128, ms a decode step
                        # fused / appended first (scratch, alternated, medians). Two submissions
                        # (session 30): float16 512 keys (0.5 M words) 0.51 / 0.52, 1024 keys 0.87 /
                        # 0.75, 4096 keys 3.0 / 2.1; q4 (0.38 K words a key) 1024 keys 0.58 / 0.72.
                        # One submission (session 31): float16 256 keys 0.34 / 0.49, 512 0.51 /
                        # 0.50, 1024 0.88 / 0.72; q4 1024 0.58 / 0.66, 2048 (0.79 M words) 1.03 /
                        # 1.03: the break-even moved to 0.5-0.8 M words, where both tie


def texel_kv(device, kernel: str, nn: int, store) -> bool:
    """Whether an attention dispatch reads K and V from uniform texel buffers (attn_lane.comp
    KV_TEXEL): the lane kernel, no fused append (``nn`` 0: a texel view is read-only and need not
    see stores of its own dispatch), a device that binds texel buffers (the patched kp, no known
    driver fault) and the cache ``store``'s K/V buffers within its maxTexelBufferElements (four
    words a texel, every format).
    Lavapipe gathers a texel fetch with vector instructions and runs a storage load as a per-lane
    loop (0.125 against 0.416 ns a word, python -m perf loads). VKATTN_TEXEL_KV=0 turns it off
    (the storage path, as with a plain kp)."""
    if nn:
        return False
    k = getattr(store, "_k", None)      # None: a format planned without buffers (perf's traffic models)
    return _texel_views(device, kernel, None if k is None else k.nbytes // 16)


def _texel_views(device, kernel: str, texels: int | None) -> bool:
    """The lane kernel, texel views not turned off (VKATTN_TEXEL_KV=0), a device that binds them
    (a planning device: never) and a view of ``texels`` (four words each; None: not known yet)
    within its maxTexelBufferElements."""
    if kernel != "lane" or not env_flag("VKATTN_TEXEL_KV", True):
        return False
    if not getattr(device, "texel_buffers", False):
        return False
    return texels is None or texels <= device.info.max_texel_buffer_elements


def texel_aux(device, kernel: str, lane_words: bool, aux_words: int) -> bool:
    """Whether attn_lane.comp also reads its aux buffer through a uniform texel view (AUX_TEXEL):
    where its key loop reads aux words at each lane's own address -- a mask's values, a paged
    block table (``lane_words``) -- which llvmpipe loads lane by lane from a storage buffer and
    gathers from a texel view (perf lpjit, session 38: 15% of a masked decode's samples, 4% of a
    paged one's). A device that binds texel buffers and an aux of ``aux_words`` (its split
    counters included) within its maxTexelBufferElements, four words a texel; VKATTN_TEXEL_KV=0
    turns it off with the K/V views."""
    return lane_words and _texel_views(device, kernel, -(-aux_words // 4))


def coopmat_wanted(device) -> bool:
    """Whether prefill and chunks (more than one query row) go to attn_coopmat.comp.

    VKATTN_KERNEL=coopmat: always (a ValueError naming the reason where the device or the compiler
    cannot: Device.coopmat_problem); tile or lane: never. By default (COOPMAT_DEFAULT) on a GPU
    that can run it -- the device offers the matrices and features, glslang builds them, and the
    kernel passed its self-test there (coopmat_problem) -- and whose speed probe timed it at most
    COOPMAT_MARGIN of the other kernel's time (Device.coopmat_pays). Not on CPU drivers: their
    matrices are emulated (Mesa 26's lavapipe: 11-14x slower than attn_lane.comp, perf/RESULTS.md
    sessions 14 and 15), and a planning device (PlanningDevice, ``perf gpu``) times nothing, so it plans
    the other kernel."""
    env = forced_kernel()
    if env == "coopmat":
        problem = device.coopmat_problem()
        if problem:
            raise ValueError(f"VKATTN_KERNEL=coopmat: {problem}")
        return True
    return (COOPMAT_DEFAULT and env == "" and not device.is_software and not device.coopmat_problem()
            and device.coopmat_pays())


def coopmat_choice(device) -> str:
    """One line on the kernel of prefill and chunks on ``device`` and why (``python -m vkattn
    check``, ``make gpu-bench``); runs the self-test and, where the default would, the speed probe."""
    try:
        if coopmat_wanted(device):
            if forced_kernel() == "coopmat":
                return "attn_coopmat.comp for prefill and chunks (forced: VKATTN_KERNEL=coopmat)"
            return f"attn_coopmat.comp for prefill and chunks{_probe_words(device)}"
    except ValueError as exc:
        return str(exc)
    problem = device.coopmat_problem()
    other = kernel_for(device)
    if problem:
        return f"{KERNEL_FILES[other]} (attn_coopmat.comp cannot run: {problem})"
    if forced_kernel():
        return f"{KERNEL_FILES[other]} (VKATTN_KERNEL={forced_kernel()})"
    if device.is_software:
        return f"{KERNEL_FILES[other]} (a CPU driver: its matrices are emulated; VKATTN_KERNEL=coopmat runs them)"
    if not COOPMAT_DEFAULT:
        return f"{KERNEL_FILES[other]} (tuning.COOPMAT_DEFAULT is off)"
    return f"{KERNEL_FILES[other]}{_probe_words(device)}"


KERNEL_FILES = {"tile": "attn.comp", "lane": "attn_lane.comp", "coopmat": "attn_coopmat.comp"}


def _probe_words(device) -> str:
    """The speed probe's figures, where it ran."""
    speed = getattr(device, "_coopmat_speed", None)
    if not speed:
        return ""
    if "error" in speed:
        return f" (its speed probe could not run: {speed['error']})"
    other = speed["other"]
    return (f" (speed probe, {speed['clock']} time: attn_coopmat.comp {speed['coopmat']:.3f} ms, "
            f"{KERNEL_FILES[other]} {speed[other]:.3f} ms)")


# attn_coopmat.comp by default on GPUs that offer cooperative matrices, pass its self-test and time
# it faster (coopmat_wanted)
COOPMAT_DEFAULT = True
COOPMAT_PROBE = (8, 4, 128, 512)   # the speed probe's call: a float16 prefill from empty of this many
                        # (kv heads, query heads per kv head, head_dim, rows) -- an LLM's prompt, big
                        # enough that the GPU's work, not the submission, is what is timed
COOPMAT_PROBE_ROUNDS = 3   # .. alternated rounds timed on each kernel (after one warm-up each): the median
COOPMAT_MARGIN = 0.9    # .. attn_coopmat.comp is picked where it takes at most this fraction of the
                        # other kernel's time: a near tie keeps the kernel every device runs


def coopmat_shared_bytes(br: int, bc: int, dk4: int, dv4: int, ch: int, mnk: tuple, nsg: int) -> int:
    """attn_coopmat.comp's shared memory (its declarations, for these constants): one uvec4 array
    -- the block's K and V rows and a scratch tile per subgroup, or (before the key loop) the
    staging of the workgroup's Q hi rows; then Q's lo rows -- and the per-row and per-key scalars."""
    mm, mn, mk = mnk
    dks = -(-dk4 * 4 * ch // mk) * mk
    dvs = -(-dv4 * 4 * ch // mn) * mn
    krow, vrow = dks // 8 + 1, dvs // 8 + 1
    scratch = max(mm * (bc // 4 + 1), 2 * mm * (bc // 8 + 1), mm * (mn // 4 + 1))
    words = max(bc * (krow + vrow) + nsg * scratch, br * krow) + br * krow   # + Q's lo rows
    i8 = ch == 4        # int8's per-key scales; fp8 (also 16 a word) declares none: at most 8 * BC bytes over
    return 16 * words + 2 * br * 4 + (2 * bc * 4 if i8 else 8) + nsg * 4 + 4


def coopmat_config(device, group: int, s: int, dk4: int, dv4: int, ch: int, capacity: int,
                   num_kv_heads: int):
    """attn_coopmat.comp for a call of ``s`` > 1 query rows, or None where it does not take the
    call -- the stated fallbacks to the device's other kernel (kernel_for): float32 storage (its
    float16 matrices would round the stored values), head dims over COOPMAT_MAX_DIM, more query
    heads per kv head than the workgroup has matrix rows, and tiles over the device's shared
    memory even with the fewest keys per block.

    The workgroup: COOPMAT_SUBGROUPS subgroups of Device.coopmat_subgroup(), one row tile of M
    query vectors each (BR = COOPMAT_SUBGROUPS * M); query rows bq (a power of two, G * bq <= BR)
    folded with the G heads into those rows; BC = COOPMAT_KEY_TILES * max(N, K) keys per block
    (both from VKATTN_COOPMAT_TILE where set: coopmat_tile),
    halved while over COOPMAT_SHARED_BUDGET (then the device's limit) down to one matrix side and
    8 * TPR; the softmax by TPR = max(1, SG / M) lanes per row, each taking runs of 8 adjacent
    columns (whole words of P). Split-K as attn.comp's prefill (tile_config)."""
    if ch == 1:
        return None
    mnk = device.coopmat_shape()
    mm, mn, mk = mnk
    sg = device.coopmat_subgroup()
    nsg, key_tiles = coopmat_tile()
    wg = nsg * sg
    br = nsg * mm
    if wg > device.max_workgroup_size or group > br:
        return None
    if -(-dk4 * 4 * ch // mk) * mk > COOPMAT_MAX_DIM or -(-dv4 * 4 * ch // mn) * mn > COOPMAT_MAX_DIM:
        return None
    bq = 1
    while bq < s and 2 * bq * group <= br:
        bq *= 2
    tpr = max(1, sg // mm)
    least = max(mn, mk, 8 * tpr)

    def fit(budget):
        bc = max(key_tiles * max(mn, mk), least)
        while coopmat_shared_bytes(br, bc, dk4, dv4, ch, mnk, nsg) > budget:
            if bc // 2 < least:
                return None
            bc //= 2
        return bc

    # within COOPMAT_SHARED_BUDGET; where even the smallest tile passes it, within the device's limit
    bc = fit(min(COOPMAT_SHARED_BUDGET, device.max_shared_memory)) or fit(device.max_shared_memory)
    if bc is None:
        return None
    want = 2 * (os.cpu_count() or 1) if device.is_software else TILE_TARGET_WGS
    tiles = num_kv_heads * -(-s // bq)
    splits = max(1, min(32, -(-want // tiles), -(-capacity // TILE_SPLIT_KEYS)))
    if device.is_software:
        splits = max(splits, -(-capacity // TILE_MAX_KEYS))
    return AttnConfig(kernel="coopmat", wg=wg, bq=bq, splits=splits, sg=sg, mnk=tuple(mnk), bc=bc, br=br,
                      tpr=tpr, unroll=not device.is_software)


def coopmat_takes(device, rows: int, ch: int, matrices: bool = True) -> bool:
    """Whether a call of ``rows`` query rows may go to attn_coopmat.comp, which reads every key from
    the cache (no fused append): such a forward appends its new rows first. ``matrices``: the
    storage format's (vkattn.formats: False for float32 and bfloat16, which the kernel's float16
    matrices cannot hold exactly)."""
    return rows > 1 and ch != 1 and matrices and coopmat_wanted(device)


def lane_config(device, group: int, s: int, dk4: int, dv4: int, ch: int, num_kv_heads: int,
                capacity: int, splits: int | None = None, nseq: int = 1) -> AttnConfig:
    """attn_lane.comp: one subgroup per workgroup owning up to LANE_NQ query vectors (heads x
    rows), fewer when the head dims are large: a lane keeps (KPL + VPL) * CH vec4 of query and
    accumulator per query vector, bounded by LANE_STATE_VEC4: the key block is straight-line code
    over all of them, and llvmpipe's compile time grows faster than that code (float16 head_dim
    128 prefill, shader cache off, this 2-core machine: 6.4 s to compile at 32 query vectors, 2.4 s
    at 16, 1.3 s at 8; the call then takes 72 / 74 / 91 ms from an empty cache, and on a 1536-token
    past 363-376 ms at 32 against 415-419 ms at 16). The budget of 128 keeps 16 at head_dim 128:
    13% on a prefill over a long past, for a cold test suite of about 5 min instead of more than
    7 (perf/RESULTS.md, session 9); calls of LANE_LONG_ROWS rows or more (long prefills, rare in
    the suite) get LANE_STATE_VEC4_LONG. Rows per workgroup are the fewest covering s in halvings,
    so odd short prefills share pipelines."""
    wg = device.lane_subgroup()          # probed: one subgroup, shuffles work
    per_qv = (-(-dk4 // wg) + -(-dv4 // wg)) * ch
    budget = LANE_STATE_VEC4_LONG if s >= LANE_LONG_ROWS else LANE_STATE_VEC4
    nq = max(1, min(LANE_NQ, budget // per_qv))
    bq = max(1, nq // group)
    while bq // 2 >= s:             # fewest rows covering s, in powers of two (fewer pipelines)
        bq //= 2
    if splits is None:
        splits = decode_splits(device, "lane", num_kv_heads, capacity, nseq) if s == 1 else 1
    # one loop iteration per key and invocation: stay far below lavapipe's per-invocation cap
    splits = max(splits, -(-capacity // LANE_MAX_KEYS))
    splits = max(1, min(splits, -(-capacity // 16)))
    return AttnConfig(kernel="lane", wg=wg, bq=bq, splits=splits)


def decode_splits(device, kernel: str, num_kv_heads: int, capacity: int, nseq: int = 1) -> int:
    """Key splits for decode of up to ``capacity`` keys (a decode plan's key bound,
    decode_key_bound; VKATTN_DECODE_SPLITS overrides) by ``nseq`` sequences at once (a paged
    batch). The lane kernel: as many workgroups in all as the CPU has cores, no more -- kv heads
    times sequences, split only where those are fewer. A split costs more than the balance it
    buys on lavapipe (each split's workgroup reads its queries, writes a partial and takes part
    in the merge, with or without keys): 2-core Zen 4, lavapipe 22.3, device time of a decode
    step, 9/3 heads d64 one sequence of 4096 keys 0.73-0.97 ms in 1 split against 1.36-2.08 in
    3 (the rule before: four workgroups a core); 16 sequences of 16 keys 0.27 against 0.98 ms;
    4/1 heads d256, 4096 keys, 2 splits 1.03-1.07 against 1.54-1.57 in 1 (perf/RESULTS.md,
    session 28; session 4 found the same for 32/8 heads). attn.comp on a GPU about
    DECODE_SPLIT_KEYS keys per split, 32 to DECODE_MAX_SPLITS splits."""
    env = os.environ.get("VKATTN_DECODE_SPLITS")
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"VKATTN_DECODE_SPLITS={env!r}: expected a positive integer")
        if int(env) > device.max_workgroup_count[0]:     # a split is a workgroup in x
            raise ValueError(f"VKATTN_DECODE_SPLITS={env!r}: the device allows {device.max_workgroup_count[0]} "
                             f"workgroups in x, one a split")
        return int(env)
    cores = os.cpu_count() or 1
    if kernel == "lane":
        return -(-cores // (num_kv_heads * max(1, nseq)))
    want = 2 * cores if device.is_software else max(32, min(DECODE_MAX_SPLITS, -(-capacity // DECODE_SPLIT_KEYS)))
    return max(1, min(want, -(-capacity // WORKGROUP)))


def own_splits(device, kernel: str, num_kv_heads: int, nseq: int, span: int) -> int | None:
    """Key splits of a cascade's own dispatch (vkattn.cascade) on attn.comp, or None where the
    decode rule stands (the lane kernel, VKATTN_DECODE_SPLITS): ``nseq`` sequences of
    a decode step, each attending its own keys after the shared prefix, ``span`` of them at most
    (a power-of-two bucket). Its workgroups already number nseq x num_kv_heads per split, so it
    splits only as many ways as it takes to reach TILE_TARGET_WGS workgroups, or to give each
    about DECODE_SPLIT_KEYS keys where the own parts are long, never below MIN_CHUNK keys a split.
    The decode rule (32 splits at least, for one sequence's grid) left most of them with no key
    that still read their queries and new rows and wrote a partial: RADV navi21's plan, 16
    sequences, 64..256 own keys, 32/8 heads d128, read 30 MiB for 10 MiB of own keys."""
    if kernel != "tile" or os.environ.get("VKATTN_DECODE_SPLITS"):
        return None
    span = max(span, 1)
    fill = -(-TILE_TARGET_WGS // max(1, nseq * num_kv_heads))
    want = max(fill, -(-span // DECODE_SPLIT_KEYS))
    return max(1, min(want, -(-span // MIN_CHUNK), DECODE_MAX_SPLITS))


def row_bucket(n: int) -> int:
    """The row count a plan is built for when a call brings ``n`` query or new rows: ``n`` rounded
    up to a power of two. Every count in (2^(k-1), 2^k] runs on the plan of 2^k (its buffers and
    grid sized for 2^k; the kernels take the call's own counts from the aux buffer and skip the
    tiles beyond them), so a new prompt length rarely builds anything."""
    b = 1
    while b < n:
        b *= 2
    return b


def decode_key_bound(live: int, capacity: int) -> int:
    """The key count a decode plan is sized for (its split count follows it): ``live`` keys rounded
    up to a power of two, at least DECODE_BOUND_MIN, at most ``capacity``. A cache decoding from
    empty to L keys builds about log2(L / DECODE_BOUND_MIN) + 1 decode plans (same pipeline, one
    recording each); a cache of capacity 131072 holding 4096 keys splits them 32 ways, not 256."""
    bound = DECODE_BOUND_MIN
    while bound < live:
        bound *= 2
    return min(bound, capacity)


def tile_decode_forced() -> tuple | None:
    """VKATTN_TILE_DECODE="RPT,KB" (a GPU tuning experiment: perf/gpu_session.sh's sweep): attn.comp
    decode with RPT query vectors per thread (each K/V load serves that many of the group's heads;
    1 to 8) and KB keys per column and step (1 to 8), in place of 1 and TILE_KB_DECODE; None when
    unset. A malformed value is a ValueError naming it."""
    env = os.environ.get("VKATTN_TILE_DECODE", "")
    if not env:
        return None
    parts = env.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and 1 <= int(p) <= 8 for p in parts):
        raise ValueError(f"VKATTN_TILE_DECODE={env!r}: expected RPT,KB, each 1 to 8 (e.g. 4,2)")
    return int(parts[0]), int(parts[1])


def tile_decode_shape(device, ch: int = 2) -> tuple:
    """attn.comp decode's (query vectors per thread, keys per column and step) on ``device`` for a
    format of ``ch`` float vec4 per storage word: TILE_DECODE_NVIDIA on NVIDIA's GPUs for the 16-
    and 32-bit formats, where float16 was timed faster; int8 (ch 4), whose sweep rows were no
    faster, and every other device (1, TILE_KB_DECODE)."""
    vendor = getattr(getattr(device, "info", None), "vendor_id", 0)     # (a planner stub may carry no info)
    if not device.is_software and vendor == NVIDIA_VENDOR and ch != 4:
        return TILE_DECODE_NVIDIA
    return 1, TILE_KB_DECODE


def tile_config(device, group: int, s: int, dk4: int, dv4: int, ch: int, capacity: int,
                num_kv_heads: int, splits: int | None = None) -> AttnConfig:
    """attn.comp: a cluster of DS threads per key row, RPT query vectors per thread (decode: 1, the
    fewest registers; prefill: as many as TILE_ROW_FLOATS allows, so each K/V load serves several
    rows), key columns to fill a WORKGROUP-thread workgroup.

    DS is the smallest power of two covering the row's 16-byte units, at most TILE_CLUSTER and the
    device's shuffle cluster (``device.tile_cluster()``: probed, or VKATTN_TILE_CLUSTER), the
    partial dot products summed with xor shuffles -- unless that leaves a thread more than
    TILE_MAX_UNITS vec4 of a row (a shuffle cluster of 1, 2 or 4 at a large head dim): then DS is
    the covering power of two up to TILE_SHARED_CLUSTER and the cluster sums through shared memory
    (attn.comp's TILE_SHUFFLE 0 path: barriers, no subgroup operation). Either way a thread holds a
    few units of a row, so no head dim spills, and the column merge gives up columns until the
    workgroup's shared memory fits TILE_SHARED_BUDGET."""
    # float vec4 per load unit (attn.comp's UV): int8 and fp8 rows are read by 8 bytes (2 vec4), q4
    # rows by 4 (one uint, 8 values: 2 vec4), the others by the 16-byte word
    uv = 2 if ch in (4, 8) else ch
    dku, dvu = dk4 * ch // uv, dv4 * ch // uv
    units = max(dku, dvu)
    cluster = min(TILE_CLUSTER, device.tile_cluster())
    ds = 1
    while ds < min(units, cluster):
        ds *= 2
    shuffle = -(-units // ds) * uv <= TILE_MAX_UNITS
    if not shuffle:
        while ds < min(units, TILE_SHARED_CLUSTER):
            ds *= 2
    row_floats = (-(-dku // ds) + -(-dvu // ds)) * uv * 4 + 2
    max_wg = min(TILE_MAX_WG, device.max_workgroup_size)
    if s == 1:
        bq = 1
        rpt, kb = tile_decode_forced() or tile_decode_shape(device, ch)
        while ds * -(-group // rpt) > max_wg:
            rpt *= 2
    else:
        rpt, kb = 1, TILE_KB_PREFILL
        while 2 * rpt * row_floats <= TILE_ROW_FLOATS and 2 * rpt <= TILE_MAX_RPT:
            rpt *= 2
        # a power of two: whole subgroups even when s is odd. Cascade's shared pass (``splits``
        # given: a batch's rows against keys they all see) takes them all in one workgroup where
        # the threads allow, so each split reads its share of the prefix once (RADV navi21's plan,
        # 16 rows x 4 heads: two query tiles read the prefix twice)
        nq_max = PREFILL_NQ if splits is None else max(PREFILL_NQ, max_wg * rpt // ds)
        bq = 1
        while bq < s and 2 * bq * group <= nq_max:
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
    if splits is not None:
        pass
    elif s == 1:
        splits = decode_splits(device, "tile", num_kv_heads, capacity)
    else:       # a few query tiles over a long past (a chunk, speculative verify): split the keys too
        want = 2 * (os.cpu_count() or 1) if device.is_software else TILE_TARGET_WGS
        tiles = num_kv_heads * -(-s // bq)
        splits = max(1, min(32, -(-want // tiles), -(-capacity // TILE_SPLIT_KEYS)))
    if device.is_software:
        splits = max(splits, -(-capacity // TILE_MAX_KEYS))

    def make(c: int) -> AttnConfig:
        return AttnConfig(kernel="tile", wg=threads * c, bq=bq, splits=splits, ds=ds, rpt=rpt, cols=c, kb=kb,
                          shuffle=shuffle or ds == 1)

    cfg = make(cols)
    budget = min(TILE_SHARED_BUDGET, device.max_shared_memory)
    while cfg.cols > 1 and cfg.shared_bytes(group, dv4, ch) > budget:
        cfg = make(cfg.cols // 2)
    need = cfg.shared_bytes(group, dv4, ch)
    if need > device.max_shared_memory:
        raise DeviceLimitError(f"attention tile needs {need} bytes of shared memory; the device has "
                               f"{device.max_shared_memory}")
    return cfg


def attention_config(device, group: int, s: int, dk4: int, dv4: int, ch: int, capacity: int,
                     num_kv_heads: int, splits: int | None = None, matrices: bool = True,
                     nseq: int = 1) -> AttnConfig:
    """Kernel and tile sizes; raises DeviceLimitError if even the smallest tile does not fit.
    ``splits``: the key splits wanted instead of the shape's own choice (cascade's shared pass:
    ``s`` rows split like a decode step; software devices still bound the keys per workgroup).
    Calls of more than one query row go to attn_coopmat.comp where coopmat_wanted and
    coopmat_config takes them (not with ``splits`` given) and the storage format's values fit its
    float16 matrices (``matrices``, vkattn.formats: not bfloat16, whatever VKATTN_KERNEL says);
    decode and the rest to kernel_for's kernel. ``nseq``: the sequences a decode dispatch serves
    (a paged batch; the lane kernel's split count counts their workgroups)."""
    if matrices and coopmat_wanted(device) and s > 1 and splits is None:
        cfg = coopmat_config(device, group, s, dk4, dv4, ch, capacity, num_kv_heads)
        if cfg is not None:
            return cfg
    if kernel_for(device) == "lane":
        return lane_config(device, group, s, dk4, dv4, ch, num_kv_heads, capacity, splits, nseq)
    return tile_config(device, group, s, dk4, dv4, ch, capacity, num_kv_heads, splits)

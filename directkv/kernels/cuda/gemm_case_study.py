"""CUDA GEMM case study: C = A B with B in pinned host memory (csrc/include/directkv/gemm_case_study.cuh,
gemm_stationary.cuh).

Variants
--------
naive     : output-stationary 128x128 C tiles; B crosses the link once per 128-row tile of A.
tiled     : B-stationary: a 512x128 B chunk sits in shared memory while the CTA sweeps every row tile of
            A; each chunk's fp32 product added into one fp32 C in L2 (accumulate "atomic", the default) or a
            partial C per k-split summed by a reduce kernel ("splits"). B crosses the link once. Math on Hopper
            wgmma, A tiles by TMA when A's rows are 16-byte aligned (since 2026-12-03; mma.sync before).
pipelined : tiled plus warp specialisation: producer warps (an mbarrier ring of A per consumer warpgroup; the
            next B chunk staged in HBM, or prefetched into L2) and two consumer warpgroups taking 64-row blocks
            in turn. By default (where it applies) persistent CTAs, one an SM, in pairs that take two adjacent
            column strips of one chunk at a time and share each A tile by TMA multicast (`cluster`); while a CTA
            computes one (strip, chunk) item its B producers copy the next item's chunk from the host into an HBM
            slot, moved into shared memory when that item starts (`persistent`). H200, 2026-12-04, 10240^3: 5.12
            ms against 6.5-6.8 with a CTA an item and 7.45 a session earlier; with B in HBM 4.51.
raster    : naive's kernel with the CTAs ordered down the m tiles first, so the CTAs resident together request
            the same B tiles at about the same time: B crosses the link once per tile if L2 serves the
            repeats, and not otherwise. An experiment on L2 and host memory beyond the paper's variants; its
            Traffic is naive's closed form (what the SMs request), so only ncu's pcie__read_bytes tells
            what crossed the link.
ring      : beyond the paper (gemm_ring.cuh): persistent CTAs, one an SM; three stager warps in each copy B from
            the host by SM loads, 64 k rows of one column strip at a time, into an HBM ring of a few bands of
            strips shared by every CTA (written once in the shared-memory layout, each piece flagged when
            stored), while the consumers compute output-stationary 256 x 128 tiles of C over all of k with A and
            the ring's B by TMA, then write the tile once: no fp32 C, no reductions, no reduce kernel. B crosses
            the link once (ncu: PCIe reads 1.0001x a plain read of B). Needs 16-byte rows (k, n multiples of 8,
            aligned A and B), and every CTA of its grid resident at once: on a GPU shared with other streams'
            kernels a CTA that cannot start stalls the others until a 4 s watchdog traps (the CUDA context is
            lost). H200, 2026-12-04, 14 runs over five calls at 10240^3: 4.26-4.69 ms, 0.98-1.07x the
            target (met once, within 1.5% in four); 10 runs at 4096^3: 0.678-0.883 ms, 0.975-1.27x (met in four;
            1.15-1.27x in a call whose link ran pipelined 20% slower than usual); the spread follows the GPU's
            pace (cuBLAS 2.79-3.29 ms in the same calls, ring with B in HBM 3.35-4.67), as the kernel's math takes
            ~85-100% of the link's time.
stream    : beyond the paper, no kernel of ours: the copy engine moves B a column panel at a time (one 2-D
            cudaMemcpy2DAsync per panel, on a side stream) into a 2-slot HBM ring while cuBLAS (torch.mm on
            the current stream) multiplies A by the previous panel into C's matching columns. B crosses the
            link once, by DMA instead of SM loads (on the H200 the copy engine moves 55.5 GB/s where SM reads
            top out at 51.4), and the math is cuBLAS's on HBM operands; what is left un-overlapped is the first
            panel's copy and the last panel's product. As decode / prefill's stream: events, no host sync per
            panel. See plan_panel_cols. Measured on the H200 (2026-11-29, 10240^3): 5.73 ms against tiled's
            17.2 and cuBLAS-in-HBM's 2.78, B at 36.6 GB/s effective (the copy engine moves 55): the target
            of 1.15 x the 3.79 ms link floor is missed by 1.31x (results/h200/README.md), the 2-D copies
            running at ~39 GB/s. copy_streams=2 splits each panel's copy over two side streams so two copy
            engines share it (bench row stream:2ce): 5.65 ms against 5.69 in one run, so one engine is not
            the limit. copy="sm" copies each panel with a kernel of a few CTAs reading B zero-copy on the side
            stream instead of the copy engine (copy_panel_kernel; bench rows stream:sm*; written after the last
            H200 run, not yet measured): SM reads of 2.8 KB rows may keep near the 51.4 GB/s SM ceiling where
            the 2-D DMA fell to ~39, if the copy CTAs and cuBLAS share the SMs well. Measured in the sixth
            session: no faster (5.58-6.98 ms at 10240). Two ways around the 2-D copies, both with one
            contiguous copy per panel:
            split="k" cuts B into row panels instead, contiguous in row-major B, and accumulates C over
            them (cuBLAS with beta = 1: C read back once per panel after the first, fp16 C rounded once per
            panel); B given as HostPanels (host_panels: B stored column panel by column panel in pinned
            memory, a layout chosen once when B is placed on the host, as DirectKV chooses the KV layout)
            keeps the column cut with contiguous panels and no C accumulation. Measured on the H200
            (2026-11-29, two runs, 10240^3): split "k" 4.35 / 4.37 ms, HostPanels 4.25 / 4.26, against
            targets of 4.38 / 4.39 (1.15 x the link floor): both meet the GEMM target there; at 4096^3 both
            stayed 1.06-1.14x over it then (on 2026-12-02, two runs, HostPanels met it at both sizes, 0.96-0.99x,
            and split "k" at 4096 came to 1.02x / 0.99x). Each
            panel costs ~30-40 us of host work (Python issues its copy, events and cuBLAS call);
            gemm_graph.capture_gemm captures a call once and replays it as one graph: 16 panels from a graph met
            the target at both sizes in both of those runs (0.93-0.96x), within 1.3% of each other.

The k-split plan (plan_k_splits) gives each CTA one 512-row chunk of B as far as the partial-C workspace allows.

host_load picks the cp.async form that copies B (every variant): "ca" goes through L1, "cg" caches in L2 only.
Default: "ca" for naive / raster, "cg" for tiled / pipelined (HOST_LOAD_DEFAULT). Measured on the H200 (2026-11-29,
10240^3, one run, the mma.sync kernels of then): ca 17.1 ms and 229 MB of PCIe reads for 210 MB of B (1.09x), cg
19.1 ms and 366 MB (1.75x); the decode kernel had shown the same (.cg stalled near 21 GB/s over host memory, .ca
streams at the link's rate). With the wgmma kernels and a partial C per split (2026-12-04, eight runs at 10240^3) cg
was the faster in every pair, tiled 8.7-9.1 ms against 9.2-9.9 and pipelined 7.9-9.0 against 8.6-9.2, with the same
PCIe bytes as ca (ncu: 1.0004x a plain read's); with accumulate "atomic" the two were level (one run). No CTA
writes B, so L1's lack of coherence within a launch cannot serve stale bytes; A and the partial C stay out of L1.
Shapes that take the element-load path (K or N not a multiple of 8) copy B through registers, and there the option
changes nothing.

accumulate picks how tiled / pipelined sum the chunks' products (default "atomic"): with "splits" every chunk's
fp32 partial C goes to DRAM and back once (stationary_hbm_floor_bytes: 17.2 GB at 10240^3, 4.1 ms at the H200's
HBM copy rate against a target of 4.36); with "atomic" L2 absorbs most of the additions. H200, 2026-12-04, 10240^3,
two runs (B by cg): pipelined 7.16 / 7.44 ms against 8.01 / 8.36, tiled 7.55 / 7.98 against 8.74 / 9.08, with B in
HBM pipelined 5.40 / 5.48 against 6.82 / 6.64; ncu: 12.7 GB of DRAM traffic a call against 17.8; 4096^3 1.02 against
1.06 ms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

from directkv.errors import check, unknown_name
from directkv.kernels.cuda import build
from directkv.kernels.cuda.gemm_ring import ring_options, run_ring
from directkv.kernels.cuda.side_stream import side_stream
from directkv.kernels.cuda.zero_copy import pinned_empty
from directkv.kernels.traffic import Traffic
from directkv.kernels.traffic_model import STREAM_RING_BYTES, gemm_traffic

KERNEL_VARIANTS = ("naive", "tiled", "pipelined", "raster")  # index = the launcher's variant code
VARIANTS = (*KERNEL_VARIANTS, "ring", "stream")
OUTPUT_STATIONARY = ("naive", "raster")  # no k-split workspace
STATIONARY = ("tiled", "pipelined")  # B-stationary: k-splits, accumulate
TILE_M, TILE_N, TILE_K = 128, 128, 64
CHUNK_K = 512  # B rows per stationary chunk (tiled, pipelined)
OUT_CODES = {torch.float16: 0, torch.float32: 2}
HOST_LOADS = ("cg", "ca")  # index = the kernel's host-load code (csrc/include/directkv/dispatch.h)
PREFETCHES = ("none", "hint", "load")  # index = the kernel's kPrefetch* code (pipelined)
ACCUMULATES = ("splits", "atomic")  # tiled / pipelined: how the chunks' products are summed
CLUSTERS = (1, 2)  # pipelined: CTAs per cluster (2: column-strip pairs sharing A tiles by TMA multicast)
STAGE_SLOT_BYTES = CHUNK_K * TILE_N * 2  # pipelined, persistent: a B chunk (fp16) in its shared-memory layout
STAGE_SLOTS = (1, 2)  # pipelined, persistent: HBM slots a CTA stages B chunks in
HOST_LOAD_DEFAULT = {"naive": "ca", "raster": "ca", "tiled": "cg", "pipelined": "cg", "ring": "cg", "stream": "ca"}
WORKSPACE_CAP = 3 << 30  # bytes of fp32 partial C at most, or WORKSPACE_SHARE of the GPU's memory if that is more
WORKSPACE_SHARE = 8  # ... 1 / WORKSPACE_SHARE of it (H200: 17.6 GB, one chunk a CTA at 10240^3: 8.4 GB)
STREAM_SLOTS = 2  # ring slots: the copy engine fills one while cuBLAS reads the other
COPY_STREAMS = (1, 2)  # stream: side streams a panel's copy may be split over
COPIES = ("ce", "sm")  # stream: who copies a panel, the copy engine or copy_panel_kernel's SM loads
COPY_CTAS = 32  # copy "sm": CTAs of the copy kernel by default
SPLITS = ("n", "k")  # stream: B cut into column panels (n) or row panels (k)
STREAM_MIN_PANELS = 8  # the default plan's panels at least, so copy and math overlap
PANEL_ALIGN = 64  # default panel widths are multiples of this many columns


def workspace_cap(total_memory: int) -> int:
    """Bytes of fp32 partial C the k-split plan may use on a GPU of `total_memory` bytes."""
    return max(WORKSPACE_CAP, total_memory // WORKSPACE_SHARE)


def check_k_splits(k_splits: object) -> None:
    check(k_splits is None or (isinstance(k_splits, int) and not isinstance(k_splits, bool) and k_splits >= 1),
          f"k_splits must be a positive int; got {k_splits!r}")


def plan_k_splits(m: int, n: int, k: int, *, workspace: int | None = WORKSPACE_CAP, k_splits: int | None = None) -> int:
    """CTAs per 128-column strip for tiled / pipelined: one 512-row chunk of B a CTA, as far as `workspace` bytes of
    partial C allow (fewer splits, each CTA owning several chunks, beyond it; None: no cap, as for accumulate
    "atomic", whose one shared C does not grow with the splits); a given value is clipped the same way.

    A CTA with one chunk writes its partial C once and never reads it back; with several it reads and rewrites it
    once per further chunk, and those reads stall the block ends (ncu, H200, 2026-12-03). Measured with the wgmma
    kernels (f9e2fff; device-logs-20261203k, L2 flushed before each call, the reduce included), 10240^3, B on the
    host / in HBM: 20 splits (one chunk a CTA, 8.4 GB) tiled 9.65 / 7.14 ms, pipelined 9.30 / 7.27; 10 splits 10.33 /
    8.70 and 9.67 / 8.03; 7 (the 3 GiB cap) 10.85 / 9.10 and 10.16 / 8.83. 4096^3 takes its 8 chunks in 8 splits
    either way."""
    strips, chunks = math.ceil(n / TILE_N), math.ceil(k / CHUNK_K)
    cap = chunks if workspace is None else max(1, workspace // (m * strips * TILE_N * 4))
    check_k_splits(k_splits)
    return max(1, min(chunks if k_splits is None else k_splits, chunks, cap))


def stationary_hbm_floor_bytes(m: int, n: int, k: int, *, c_bytes: int = 2) -> int:
    """HBM bytes tiled / pipelined move whatever L2 does, at any k-split: every 512-row chunk's fp32 partial C
    `[m, 128 * ceil(n / 128)]` written once and read once (in the kernel before the next chunk, or by the reduce),
    A read once, C written once. The partial C of a chunk is read back after its CTA has swept all m rows (tens of
    MB later, across 132 SMs), so L2 cannot keep it. 10240^3: 20 passes of 419 MB each way, 17.2 GB in all."""
    check(min(m, n, k, c_bytes) >= 1, f"m, n, k, c_bytes must be >= 1; got {m}, {n}, {k}, {c_bytes}")
    passes = math.ceil(k / CHUNK_K)
    return 2 * passes * m * math.ceil(n / TILE_N) * TILE_N * 4 + m * k * 2 + m * n * c_bytes


def plan_panel_cols(k: int, n: int, *, panel_cols: int | None = None) -> int:
    """B columns per ring panel of the stream variant (split "n"), for fp16 B `[k, n]`.

    The ring holds STREAM_SLOTS panels `[k, panel_cols]` in at most STREAM_RING_BYTES (64 MiB). Default: the
    widest multiple of 64 columns that fits and still cuts B into at least 8 panels (the first panel's copy
    is not overlapped; a narrower last panel also shortens the product left after the last copy), 64 when
    B is too narrow for 8 such panels, the widest that fits when 64 do not; never more than n. A given
    panel_cols is checked against the ring and clipped to n.
    """
    check(min(k, n) >= 1, f"K and N must be >= 1; got {k}, {n}")
    return _plan_panel(n, k, panel_cols, "K", "column", "rows")


def plan_panel_rows(k: int, n: int, *, panel_rows: int | None = None) -> int:
    """B rows per ring panel of the stream variant with split "k": panels `[panel_rows, n]`, planned as
    plan_panel_cols plans columns (the same ring, the same rule with K and N swapped)."""
    check(min(k, n) >= 1, f"K and N must be >= 1; got {k}, {n}")
    return _plan_panel(k, n, panel_rows, "N", "row", "columns")


def stream_cut(k: int, n: int, split: str, panel: int | None = None) -> dict[str, int]:
    """The stream variant's cut of fp16 B `[k, n]` as gemm_traffic takes it: {"panel_cols": ...} (split "n")
    or {"panel_rows": ...} (split "k"), planned (plan_panel_cols / plan_panel_rows) unless `panel` is given."""
    if split not in SPLITS:
        raise unknown_name("gemm split", split, SPLITS)
    if split == "n":
        return {"panel_cols": plan_panel_cols(k, n, panel_cols=panel)}
    return {"panel_rows": plan_panel_rows(k, n, panel_rows=panel)}


def _plan_panel(length: int, depth: int, given: int | None, depth_name: str, unit: str, across: str) -> int:
    """Panels cut `length` (B's columns or rows, `unit`s); each panel is `depth` elements (`across`) deep."""
    ring_mib = STREAM_RING_BYTES >> 20
    fit = STREAM_RING_BYTES // (STREAM_SLOTS * depth * 2)  # the widest panel the ring holds
    check(fit >= 1, f"{depth_name}={depth} is too large for the stream variant's ring: one {unit} in {STREAM_SLOTS} "
          f"slots needs {STREAM_SLOTS * depth * 2} B > {STREAM_RING_BYTES} B ({ring_mib} MiB)")
    if given is not None:
        check(isinstance(given, int) and not isinstance(given, bool) and 1 <= given <= fit,
              f"panel {given!r} ({unit}s per panel) must be an int in 1..{fit} ({STREAM_SLOTS} slots x "
              f"{depth_name}={depth} {across} <= {ring_mib} MiB)")
        return min(given, length)
    if fit < PANEL_ALIGN:
        return min(fit, length)
    widest = (length - 1) // (STREAM_MIN_PANELS - 1)  # ceil(length / w) >= 8 exactly when 7 w < length
    width = max(PANEL_ALIGN, widest // PANEL_ALIGN * PANEL_ALIGN)
    return min(width, fit // PANEL_ALIGN * PANEL_ALIGN, length)


@dataclass(frozen=True, eq=False)  # eq would compare the tensors
class HostPanels:
    """B `[k, n]` fp16 in pinned host memory stored panel by panel (host_panels): the columns n0:n0 + w of
    panel i are one contiguous row-major `[k, w]` block at element k * n0 of `data`, so the stream variant
    moves each panel with one contiguous copy instead of a 2-D copy of k short rows. A layout chosen when B
    is placed in host memory, as DirectKV lays out the KV cache for the link; made once, never per call."""

    data: torch.Tensor  # [k * n] fp16, pinned CPU
    k: int
    n: int
    panel_cols: int

    def __post_init__(self) -> None:
        # gemm copies panels by raw pointer: a buffer that does not hold [k, n] would be read past its end
        check(min(self.k, self.n) >= 1 and self.data.dtype == torch.float16 and self.data.dim() == 1
              and self.data.numel() == self.k * self.n and self.data.is_contiguous(), f"HostPanels needs a "
              f"contiguous 1-D float16 buffer of k * n = {self.k * self.n} elements; got {self.data.dtype} "
              f"{tuple(self.data.shape)}")
        plan_panel_cols(self.k, self.n, panel_cols=self.panel_cols)  # fits the ring

    @property
    def shape(self) -> tuple[int, int]:
        return self.k, self.n


def host_panels(b: torch.Tensor, *, panel_cols: int | None = None) -> HostPanels:
    """Copy fp16 B `[k, n]` (a CPU tensor, a zero-copy view or an HBM tensor) into a new pinned buffer in
    panel order (HostPanels), panels of plan_panel_cols columns unless given."""
    check(b.dim() == 2 and b.dtype == torch.float16, f"b must be a 2-D float16 tensor; got {b.dtype} "
          f"{tuple(b.shape)}")
    k, n = b.shape
    cols = plan_panel_cols(k, n, panel_cols=panel_cols)
    data = pinned_empty((k * n,), torch.float16)
    for n0 in range(0, n, cols):
        w = min(cols, n - n0)
        data[k * n0 : k * (n0 + w)].view(k, w).copy_(b[:, n0 : n0 + w])
    return HostPanels(data, k, n, cols)


@cache
def _total_memory(device: int) -> int:
    return torch.cuda.get_device_properties(device).total_memory


def pipelined_options(a: torch.Tensor, b: torch.Tensor, accumulate: str, k_splits: int | None, cluster: int | None,
                      persistent: bool | None, prefetch_given: bool = False) -> tuple[int, bool]:
    """pipelined's (cluster, persistent) for A `[M, K]` and B `[K, N]`: the given ones, checked against the shape, or
    the defaults: cluster 2 where A's and B's rows are 16-byte aligned (A by TMA) and the 128-column strips pair up,
    persistent where the rows are aligned, accumulate is "atomic", k_splits None and no prefetch is asked for."""
    k, n = b.shape
    aligned = k % 8 == 0 and n % 8 == 0 and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
    strips = math.ceil(n / TILE_N)
    got = (f"k = {k}, n = {n} ({strips} strips), A at {a.data_ptr() % 16} and B at {b.data_ptr() % 16} bytes past a "
           f"16-byte boundary")
    check(cluster != 2 or (aligned and strips % 2 == 0), f"gemm cluster 2 needs k and n multiples of 8, 16-byte "
          f"aligned A and B and an even number of {TILE_N}-column strips; got {got}; use cluster 1 or None")
    check(not persistent or aligned, f"gemm persistent needs k and n multiples of 8 and 16-byte aligned A and B; got "
          f"{got}")
    check(not persistent or accumulate == "atomic", f"gemm persistent needs accumulate 'atomic'; got {accumulate!r}")
    check(not persistent or k_splits is None, f"gemm persistent CTAs take one chunk an item: k_splits must be None; "
          f"got {k_splits!r}")
    check(not persistent or not prefetch_given, "gemm persistent CTAs stage the next chunk in HBM and take no "
          "prefetch; pass persistent=False with prefetch")
    if cluster is None:
        cluster = 2 if aligned and strips % 2 == 0 else 1
    if persistent is None:
        persistent = aligned and accumulate == "atomic" and k_splits is None and not prefetch_given
    return cluster, persistent


@cache
def _persistent_ctas(device: int, cluster: int) -> int:
    with torch.cuda.device(device):
        return build.load("gemm_case_study").persistent_ctas(cluster)


def b_tier(b: torch.Tensor) -> str:
    """'host' when b's memory is page-locked host memory (a zero-copy view or a pinned CPU tensor), else 'hbm'."""
    return build.load("gemm_case_study").pointer_tier(b.data_ptr())


def gemm(
    a: torch.Tensor,
    b: torch.Tensor | HostPanels,
    *,
    variant: str,
    out: torch.Tensor | None = None,
    tile_m: int = TILE_M,
    tile_n: int = TILE_N,
    tile_k: int = TILE_K,
    k_splits: int | None = None,
    prefetch: str | None = None,
    accumulate: str | None = None,
    cluster: int | None = None,
    persistent: bool | None = None,
    stage_slots: int = 1,
    band: int | None = None,
    host_load: str | None = None,
    split: str = "n",
    panel: int | None = None,
    copy_streams: int = 1,
    copy: str = "ce",
    copy_ctas: int | None = None,
) -> tuple[torch.Tensor, Traffic]:
    """C = A B on the tensor cores (fp16 operands, fp32 accumulation).

    Parameters
    ----------
    a : `[M, K]` contiguous fp16 CUDA tensor (HBM).
    b : `[K, N]` contiguous fp16: a zero-copy view of pinned memory (zero_copy.device_view), a pinned CPU
        tensor, or an HBM tensor; or, for variant "stream" only, B stored panel by panel in pinned memory
        (HostPanels, from host_panels: each panel one contiguous copy).
    variant : "naive", "tiled", "pipelined", "raster", "ring" or "stream" (module docstring).
    out : optional `[M, N]` contiguous CUDA output, fp16 or fp32 (default fp16).
    tile_m, tile_n, tile_k : must be 128, 128, 64 (the kernels' tiles).
    k_splits : tiled / pipelined: force the CTAs per column strip (a positive int, clipped to the chunks); None
        plans it: one chunk a CTA (with "splits" as far as the workspace allows, plan_k_splits).
    prefetch : pipelined only, not persistent: how the producer pulls the CTA's next B chunk into L2 once the
        current one has landed, which only a CTA owning several chunks (k_splits < chunks) does: "hint" (the default;
        prefetch.global.L2::evict_last per 128-byte line), "load" (plain loads whose values are dropped, one per
        32-byte sector) or "none". Measured on the H200: none of them faster than "none".
    accumulate : tiled / pipelined only: "atomic" (the default: every chunk's product is added into one zeroed
        fp32 C by red.global.add, the CTAs resident together a few column strips x a group of 8 splits, so L2
        holds those rows of C between their additions; a workspace of one m x n fp32 C whatever the split count;
        the summation order, and so the last bits, vary from call to call) or "splits" (each k-split writes its
        own fp32 partial C, which a reduce kernel sums: deterministic).
    cluster : pipelined only: 2 runs the CTAs in pairs over adjacent 128-column strips of the same k-split, each
        fetching half of every A tile by TMA multicast into both, so A crosses L2 once per two strips; it needs
        k and n multiples of 8, 16-byte aligned A and B and an even number of strips (else the launch is refused).
        1 runs single CTAs. None: 2 where those hold, else 1.
        ring: 2 runs the CTAs in pairs on adjacent strips of one row tile, each fetching half of every A tile into
        both; it needs an even number of strips and an even band. None: 1 (gemm_ring.ring_cluster says why).
    persistent : pipelined only: True runs one CTA (pair) per SM, walking the (column strip, chunk) items in the
        one-chunk-a-CTA order; its B-loading producer warps copy the next item's chunk from the host into an HBM
        slot of the CTA (128 KB, already in the shared-memory layout) while the consumers compute the current one,
        then move it into shared memory at HBM speed, so B's link transfer overlaps the math. Needs accumulate
        "atomic", k_splits None, no prefetch and 16-byte rows (k, n multiples of 8, aligned A and B). None: True
        where those hold, else False (pipelined_options). The staging copies read B by ld.global.cg whatever
        host_load says; host_load applies to each CTA's first chunk, loaded straight into shared memory.
    stage_slots : persistent only: HBM slots a CTA stages B chunks in. 1 (default): the two B producer warps move
        a staged chunk into shared memory, then stage the next one, so a CTA's share of the link idles while they
        wait for the consumers; 2: one warp stages chunks into the two slots in turn, as far ahead as a free slot
        allows, while the other moves them into shared memory. Measured on the H200 (2026-12-04, seven runs at
        10240^3): level with 1 (4.97-5.11 ms against 4.94-5.15), so 1 stays the default.
    band : ring only: 128-column strips a band (gemm_ring.plan_ring plans it: about one 256 x 128 tile a CTA).
    host_load : "ca" (through L1) or "cg" (L2 only): how B tiles are copied; None: HOST_LOAD_DEFAULT of the variant
        (module docstring); ring's stagers read B by ld.global.cg: "cg" only.
    split : stream only: "n" cuts B into column panels, each a 2-D copy of K rows (C's columns written once);
        "k" cuts it into row panels, each one contiguous copy, and C (float16 only) is accumulated over
        them (cuBLAS with beta = 1 reads C back once per panel after the first and rounds it once per
        panel). HostPanels B is cut by its own columns.
    panel : stream only: B columns (split "n") or rows (split "k") per ring panel; None plans it
        (plan_panel_cols / plan_panel_rows); HostPanels B takes its own panel_cols.
    copy_streams : stream only: side streams each panel's copy is split over (1 or 2, by halves of its
        rows), so two copy engines can share it (measured for the strided 2-D column-panel copies, which one
        engine moved at ~39 GB/s of the H200's 55: no faster).
    copy : stream only: "ce" (copy engine, cudaMemcpy2DAsync) or "sm" (copy_panel_kernel, zero-copy SM loads).
    copy_ctas : copy "sm" only: CTAs of the copy kernel (default COPY_CTAS).

    Returns
    -------
    (c `[M, N]`, Traffic from traffic_model.gemm_traffic; for tiled / pipelined at tile_k = 512, the
    stationary chunk, i.e. one fp32 partial-C pass per chunk through HBM (what "splits" moves, less the split
    reduction's extra pass; "atomic" keeps most of those passes in L2; persistent's round trip of B through its HBM
    slots, 2 k n 2 bytes, is not counted); raster states naive's schedule; stream at its split and panel)
    """
    if variant not in VARIANTS:
        raise unknown_name("gemm variant", variant, VARIANTS)
    if host_load is None:
        host_load = HOST_LOAD_DEFAULT[variant]
    if host_load not in HOST_LOADS:
        raise unknown_name("gemm host_load", host_load, HOST_LOADS)
    check(variant == "pipelined" or prefetch is None, f"prefetch is an option of gemm variant 'pipelined'; got "
          f"{prefetch!r} for {variant!r}")
    check(variant in STATIONARY or (accumulate is None and k_splits is None), f"accumulate / k_splits are options of "
          f"gemm variants 'tiled' and 'pipelined'; got {accumulate!r} / {k_splits!r} for {variant!r}")
    check(variant in ("pipelined", "ring") or cluster is None, f"cluster is an option of gemm variants 'pipelined' and "
          f"'ring'; got {cluster!r} for {variant!r}")
    check(cluster is None or (type(cluster) is int and cluster in CLUSTERS), f"gemm cluster {cluster!r} is not "
          f"supported; valid: None, 1, 2")
    check(variant == "pipelined" or persistent is None, f"persistent is an option of gemm variant 'pipelined'; got "
          f"{persistent!r} for {variant!r}")
    check(persistent is None or isinstance(persistent, bool), f"gemm persistent must be None, True or False; got "
          f"{persistent!r}")
    check(variant == "ring" or band is None, f"band is an option of gemm variant 'ring'; got {band!r} for "
          f"{variant!r}")
    check(variant != "ring" or host_load == "cg", f"gemm variant 'ring' reads B by ld.global.cg: host_load must be "
          f"None or 'cg'; got {host_load!r}")
    check(stage_slots in STAGE_SLOTS and type(stage_slots) is int, f"gemm stage_slots {stage_slots!r} is not "
          f"supported; valid: 1, 2")
    prefetch_given = prefetch is not None
    prefetch, accumulate = prefetch or "hint", accumulate or "atomic"
    if prefetch not in PREFETCHES:
        raise unknown_name("gemm prefetch", prefetch, PREFETCHES)
    if accumulate not in ACCUMULATES:
        raise unknown_name("gemm accumulate", accumulate, ACCUMULATES)
    check_k_splits(k_splits)
    if split not in SPLITS:
        raise unknown_name("gemm split", split, SPLITS)
    check(variant == "stream" or (panel is None and copy_streams == 1 and split == "n"), f"split / panel / "
          f"copy_streams are options of gemm variant 'stream'; got {split!r} / {panel!r} / {copy_streams!r} for "
          f"{variant!r}")
    check(copy_streams in COPY_STREAMS, f"copy_streams {copy_streams!r} is not supported; valid: 1, 2")
    if copy not in COPIES:
        raise unknown_name("gemm copy", copy, COPIES)
    check(variant == "stream" or copy == "ce", f"copy is an option of gemm variant 'stream'; got {copy!r} for "
          f"{variant!r}")
    check(copy == "sm" or copy_ctas is None, f"copy_ctas is an option of copy 'sm'; got {copy_ctas!r} with {copy!r}")
    check(copy == "ce" or copy_streams == 1, f"copy 'sm' runs on one side stream; got copy_streams {copy_streams}")
    copy_ctas = COPY_CTAS if copy_ctas is None else copy_ctas
    check(isinstance(copy_ctas, int) and copy_ctas >= 1, f"copy_ctas must be an int >= 1; got {copy_ctas!r}")
    check((tile_m, tile_n, tile_k) == (TILE_M, TILE_N, TILE_K), f"tiles ({tile_m}, {tile_n}, {tile_k}) are not "
          f"supported by the CUDA kernels; valid: ({TILE_M}, {TILE_N}, {TILE_K})")
    panels = isinstance(b, HostPanels)
    check(not panels or (variant == "stream" and split == "n" and panel in (None, b.panel_cols)), f"B stored in "
          f"panels (HostPanels of {b.panel_cols if panels else 0} columns) takes variant 'stream', split 'n' and "
          f"its own panel width; got {variant!r}, {split!r}, panel {panel!r}")
    check(a.dim() == 2 and len(b.shape) == 2 and a.shape[1] == b.shape[0], f"need a [M, K] and b [K, N]; got "
          f"{tuple(a.shape)} and {tuple(b.shape)}")
    b_tensor = b.data if panels else b
    check(a.dtype == torch.float16 and b_tensor.dtype == torch.float16, f"a and b must be float16; got {a.dtype}, "
          f"{b_tensor.dtype}")
    check(a.device.type == "cuda" and a.is_contiguous(), f"a must be a contiguous CUDA tensor; got {a.device}")
    check(b_tensor.is_contiguous() and (b_tensor.device.type == "cuda" or b_tensor.is_pinned()),
          f"b must be a contiguous CUDA tensor (zero-copy view or HBM) or pinned CPU tensor; got {b_tensor.device}")
    m, k = a.shape
    n = b.shape[1]
    check(min(m, n, k) >= 1, f"M, N, K must be >= 1; got {m}, {n}, {k}")
    if variant == "stream":  # planned before out is allocated: fails cheaply
        cut = {"panel_cols": b.panel_cols} if panels else stream_cut(k, n, split, panel)
    strips = math.ceil(n / TILE_N)
    # planned before out is allocated: a bad option fails cheaply
    if variant == "pipelined":
        cluster, persistent = pipelined_options(a, b_tensor, accumulate, k_splits, cluster, persistent, prefetch_given)
    elif variant == "ring":
        cluster, persistent = ring_options(a, b_tensor, band, cluster), False
    else:
        cluster, persistent = 1, False
    check(persistent or stage_slots == 1, f"stage_slots is an option of persistent pipelined CTAs; got {stage_slots} "
          f"for variant {variant!r}, persistent {persistent}")
    if out is None:
        out = torch.empty(m, n, dtype=torch.float16, device=a.device)
    check(out.shape == (m, n) and out.dtype in OUT_CODES and out.device == a.device and out.is_contiguous(),
          f"out must be a contiguous float16 or float32 [{m}, {n}] tensor on {a.device}")
    c_bytes = out.element_size()
    # beta = 1 into fp32 C from fp16 operands (addmm's out_dtype) is refused by some torch versions' checks
    check(split == "n" or out.dtype == torch.float16, f"split 'k' accumulates C in place with torch's addmm_, "
          f"which takes fp16 C only across torch versions: out must be float16; got {out.dtype}")
    if variant == "stream":
        (panel,) = cut.values()
        _run_stream(a, b, out, split, panel, copy_streams, copy, copy_ctas)
        return out, gemm_traffic(m, n, k, dtype_bytes=2, c_bytes=c_bytes, variant="stream",
                                 b_tier=b_tier(b_tensor), **cut)
    if variant == "ring":
        run_ring(a, b, out, band, cluster, OUT_CODES[out.dtype])
        return out, gemm_traffic(m, n, k, dtype_bytes=2, c_bytes=c_bytes, variant="ring", b_tier=b_tier(b))
    part, stage, ctas, ldp, splits = None, None, 0, 0, 1
    if variant not in OUTPUT_STATIONARY:
        device = a.device.index if a.device.index is not None else torch.cuda.current_device()
        ldp = strips * TILE_N
        atomic = accumulate == "atomic"  # one shared sum: no workspace per split, so no cap on the splits
        splits = plan_k_splits(m, n, k, workspace=None if atomic else workspace_cap(_total_memory(device)),
                               k_splits=k_splits)
        part = (torch.zeros(1, m, ldp, dtype=torch.float32, device=a.device) if atomic
                else torch.empty(splits, m, ldp, dtype=torch.float32, device=a.device))
        if persistent:  # the CTAs resident at once, at most one an item; an HBM slot each for the next B chunk
            ctas = min(_persistent_ctas(device, cluster), strips * splits)  # splits: one chunk each (atomic)
            stage = torch.empty(ctas * stage_slots * STAGE_SLOT_BYTES, dtype=torch.uint8, device=a.device)
    build.load("gemm_case_study").run(
        a.data_ptr(), b.data_ptr(), out.data_ptr(), 0 if part is None else part.data_ptr(),
        0 if stage is None else stage.data_ptr(), stage_slots, ctas, m, n, k, ldp, splits,
        KERNEL_VARIANTS.index(variant), PREFETCHES.index(prefetch), accumulate == "atomic", cluster,
        OUT_CODES[out.dtype],
        HOST_LOADS.index(host_load), torch.cuda.current_stream(a.device).cuda_stream,
    )  # fmt: skip
    schedule = "naive" if variant in OUTPUT_STATIONARY else variant
    return out, gemm_traffic(m, n, k, dtype_bytes=2, c_bytes=c_bytes, variant=schedule, b_tier=b_tier(b),
                             tile_m=TILE_M, tile_n=TILE_N, tile_k=TILE_K if schedule == "naive" else CHUNK_K)


# --- stream variant -------------------------------------------------------------------------------


def _run_stream(a: torch.Tensor, b: torch.Tensor | HostPanels, out: torch.Tensor, split: str, panel: int,
                copy_streams: int = 1, copy: str = "ce", copy_ctas: int = COPY_CTAS) -> None:
    """out = a @ B panel by panel: each panel's copy on the side stream(s) into a ring slot, its product on
    the current stream, ordered by the slots' filled / freed events; no host sync.

    split "n": out[:, n0:n0 + w] = a @ B[:, n0:n0 + w]; split "k": out (+)= a[:, k0:k0 + h] @ B[k0:k0 + h]."""
    k, n = b.shape
    panels = isinstance(b, HostPanels)
    src = b.data if panels else b
    e = src.element_size()
    main = torch.cuda.current_stream(a.device)
    lanes = [side_stream(a.device, STREAM_SLOTS, lane) for lane in range(copy_streams)]
    freed = lanes[0][2]  # recorded once on the current stream; every lane waits on it
    # Allocated on the current stream and written by the side stream, without record_stream: every side-stream
    # write of the ring is followed by main.wait_event(filled), so all of them are ordered before any later
    # work of the current stream, which is the only stream the caching allocator hands this block to once it
    # is freed. record_stream would only delay that reuse (and grow the pool when calls come back to back).
    # A slot holds one panel row-major and gapless, whatever its width: a narrower last panel is a prefix.
    ring = torch.empty(STREAM_SLOTS, panel * (k if split == "n" else n), dtype=torch.float16, device=a.device)
    # One copy per panel (and lane), issued from C++: torch's copy_ of a strided (column-panel) view of pinned
    # memory may stage it through a contiguous host-side copy first.
    mod = build.load("gemm_case_study")
    if copy == "sm":
        def copy_panel(dst, dst_pitch, src, src_pitch, width, height, stream):  # copy_panel_async's arguments
            mod.copy_panel_sm_async(dst, dst_pitch, src, src_pitch, width, height, copy_ctas, stream)
    else:
        copy_panel = mod.copy_panel_async
    # fp32 C: cuBLAS accumulates in fp32 and writes fp32 itself (mm's out_dtype), as the kernels do; no fp16
    # temporary, so no fp16 rounding of C.
    widen = {} if out.dtype == torch.float16 else {"out_dtype": out.dtype}
    for side, _, _ in lanes:
        side.wait_stream(main)  # earlier writers of B and of the ring's memory come first
    extent = n if split == "n" else k
    for i, p0 in enumerate(range(0, extent, panel)):
        w, slot = min(panel, extent - p0), i % STREAM_SLOTS
        rows, cols = (k, w) if split == "n" else (w, n)  # the panel's shape
        if panels:  # the panel's rows follow each other in host memory
            base, pitch = src.data_ptr() + k * p0 * e, w * e
        elif split == "n":  # k rows of w columns, a row of B apart
            base, pitch = src.data_ptr() + p0 * e, n * e
        else:  # w whole rows of B: contiguous
            base, pitch = src.data_ptr() + p0 * n * e, n * e
        dst = ring[slot].data_ptr()
        for lane, (side, filled, _) in enumerate(lanes):
            r0, r1 = rows * lane // copy_streams, rows * (lane + 1) // copy_streams
            if i >= STREAM_SLOTS:
                side.wait_event(freed[slot])  # the product of panel i - STREAM_SLOTS is done with the slot
            copy_panel(dst + r0 * cols * e, cols * e, base + r0 * pitch, pitch, cols * e, r1 - r0, side.cuda_stream)
            filled[slot].record(side)
        for _, filled, _ in lanes:
            main.wait_event(filled[slot])
        b_panel = ring[slot, : rows * cols].view(rows, cols)
        if split == "n":
            # A column view of row-major C has strides (N, 1): torch's CUDA addmm takes it as is, as a
            # transposed result with leading dimension N (prepare_matrix_for_cublas borrows any (ld >= cols, 1)
            # matrix), so cuBLAS writes C's columns in place: no temporary, no copy.
            torch.mm(a, b_panel, out=out[:, p0 : p0 + w], **widen)
        elif i == 0:  # a's column slice (strides (K, 1)) is borrowed the same way
            torch.mm(a[:, p0 : p0 + w], b_panel, out=out, **widen)
        else:  # beta = 1: cuBLAS reads C back and adds this panel's product
            out.addmm_(a[:, p0 : p0 + w], b_panel)
        freed[slot].record(main)

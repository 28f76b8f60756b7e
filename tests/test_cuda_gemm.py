"""CUDA GEMM case study (naive, tiled, pipelined, raster, stream; ring: test_cuda_gemm_ring) against float64 on
the GPU.

B lives in pinned host memory read through a zero-copy view; fresh random inputs, C poisoned with NaN,
odd shapes (unaligned rows take the element-load path), several chunks per k-split, fp16 and fp32 C, both
host-load forms (cp.async.cg and .ca). stream: B as a zero-copy view, a pinned CPU tensor or in HBM, N not
a multiple of the panel width, back-to-back calls sharing the ring. The GPU tests skip without CUDA; the
argument checks, the panel plan and the simulated stream pipeline run anywhere.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from directkv.errors import ConfigError
from directkv.kernels.cuda.gemm_case_study import (
    ACCUMULATES,
    HOST_LOAD_DEFAULT,
    HOST_LOADS,
    KERNEL_VARIANTS,
    PREFETCHES,
    VARIANTS,
    HostPanels,
    gemm,
    host_panels,
    pipelined_options,
    plan_k_splits,
    plan_panel_cols,
    plan_panel_rows,
    stationary_hbm_floor_bytes,
    stream_cut,
    workspace_cap,
)
from directkv.kernels.cuda.zero_copy import device_view, pinned_empty
from directkv.kernels.reference import gemm as reference_gemm
from directkv.kernels.traffic_model import gemm_traffic
from experiments.gemm_case_study import stream_ms

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOL = {torch.float16: 5e-3, torch.float32: 1e-4}
SHAPES = [  # (m, n, k)
    (1000, 777, 1111),  # odd everywhere: element loads, ragged tiles and chunks
    (256, 384, 640),
    (1, 8, 8),
    (130, 136, 1032),  # aligned, not tile multiples, 3 chunks of 512
    (300, 520, 2048),
]
KERNELS = ["naive", "tiled", "pipelined", "raster"]
# (variant, accumulate): the B-stationary kernels with each way of summing their chunks
KERNEL_CASES = [("naive", None), ("raster", None)] + [(v, acc) for v in ("tiled", "pipelined") for acc in ACCUMULATES]


def host_b(k: int, n: int) -> torch.Tensor:
    pinned = pinned_empty((k, n), torch.float16)
    pinned.copy_(torch.randn(k, n, device="cuda").half())
    return device_view(pinned)


def check_product(a, b, variant, out_dtype, *, b_ref=None, **kwargs):
    """gemm into a NaN-poisoned `out` against float64; b_ref: B as a tensor where b is not one (HostPanels)."""
    out = torch.full((a.shape[0], b.shape[1]), math.nan, dtype=out_dtype, device="cuda")
    c, traffic = gemm(a, b, variant=variant, out=out, **kwargs)
    torch.cuda.synchronize()
    assert c.data_ptr() == out.data_ptr()
    assert not out.isnan().any(), "unwritten or NaN output elements"
    ref = a.double() @ (b if b_ref is None else b_ref).to(a.device).double()
    assert float((out.double() - ref).norm() / ref.norm()) < TOL[out_dtype]
    return traffic


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("host_load", HOST_LOADS)
@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32], ids=["c16", "c32"])
@pytest.mark.parametrize("variant,accumulate", KERNEL_CASES, ids=[f"{v}-{a}" if a else v for v, a in KERNEL_CASES])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemm_matches_float64(shape, variant, accumulate, out_dtype, host_load):
    m, n, k = shape
    a = torch.randn(m, k, device="cuda").half()
    b = host_b(k, n)
    traffic = check_product(a, b, variant, out_dtype, host_load=host_load, accumulate=accumulate)
    # The SMs request B once per row tile (naive, and raster: the same schedule in another CTA order) or once
    # (tiled, pipelined); the reference agrees.
    schedule = "naive" if variant == "raster" else variant
    meta = lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta")  # noqa: E731
    _, ref = reference_gemm(meta(a), meta(b), variant=schedule, compute=False, tile_k=64 if schedule == "naive" else 512)
    per_row_tile = math.ceil(m / 128) if schedule == "naive" else 1
    assert traffic.link_read_bytes == ref.link_read_bytes == k * n * 2 * per_row_tile


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("accumulate", ACCUMULATES)
@pytest.mark.parametrize("host_load", HOST_LOADS)
@pytest.mark.parametrize("variant", ["tiled", "pipelined"])
@pytest.mark.parametrize("k_splits", [1, 2, None], ids=["s1", "s2", "planned"])
def test_gemm_partial_c_round_trips(variant, k_splits, host_load, accumulate):
    """Forced few k-splits: each CTA owns several chunks and read-modify-writes its partial C (or adds each chunk's
    product into the one fp32 C); planned: one chunk a CTA."""
    for m, n, k in [(1000, 777, 1111), (300, 520, 2048)]:
        a = torch.randn(m, k, device="cuda").half()
        check_product(a, host_b(k, n), variant, torch.float16, k_splits=k_splits, host_load=host_load,
                      accumulate=accumulate)


# Edge cases of the wgmma kernels' block hand-out, one split so a CTA walks every chunk: (m, n, k)
WGMMA_EDGES = [
    (64, 256, 2048),  # one 64-row block: pipelined's second consumer warpgroup gets none in any chunk
    (130, 136, 1600),  # three blocks: each chunk starts with the other warpgroup, so a block's partial C changes hands
    (130, 135, 1600),  # the same with odd n (element loads, producer-thread stores into the rings)
    (1, 8, 1024),  # one row, two chunks
]


# (variant, its options): tiled, and pipelined with each form of its next-chunk prefetch
HAND_OUT_CASES = [("tiled", {})] + [("pipelined", {"prefetch": p}) for p in PREFETCHES]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("variant,opts", HAND_OUT_CASES, ids=["tiled"] + [f"pipelined-{p}" for p in PREFETCHES])
@pytest.mark.parametrize("shape", WGMMA_EDGES, ids=lambda s: "x".join(map(str, s)))
def test_gemm_wgmma_block_hand_out(shape, variant, opts):
    m, n, k = shape
    a = torch.randn(m, k, device="cuda").half()
    b = host_b(k, n)
    for accumulate in ACCUMULATES:  # "splits": the partial C changes hands between the consumer warpgroups
        check_product(a, b, variant, torch.float32, k_splits=1, accumulate=accumulate, **opts)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("accumulate", ACCUMULATES)
@pytest.mark.parametrize("variant", ["tiled", "pipelined"])
def test_gemm_unaligned_a_takes_element_loads(variant, accumulate):
    """A whose rows are 16-byte aligned in stride but whose first element is not (a view 2 bytes into its
    storage): the launcher must not hand it to TMA, which needs a 16-byte aligned base."""
    m, k = 130, 1088
    a = torch.randn(m * k + 1, device="cuda").half()[1:].view(m, k)
    assert a.data_ptr() % 16 != 0
    check_product(a, host_b(k, 264), variant, torch.float16, k_splits=1, accumulate=accumulate)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("accumulate", ACCUMULATES)
@pytest.mark.parametrize("variant", ["tiled", "pipelined"])
@pytest.mark.parametrize("k_splits", [None, 10, 3], ids=["planned", "s10", "s3"])
def test_gemm_many_chunks(variant, accumulate, k_splits):
    """12 chunks (k = 5732, the last ragged): more splits than one atomic group of 8 (planned: 8 + 4; 10: 8 + 2)
    and, at 3 splits, four chunks a CTA."""
    m, n, k = 200, 300, 5732
    a = torch.randn(m, k, device="cuda").half()
    check_product(a, host_b(k, n), variant, torch.float16, k_splits=k_splits, accumulate=accumulate)


# pipelined in cluster pairs (TMA multicast of A): (m, n, k) with an even number of 128-column strips and 16-byte rows
CLUSTER_SHAPES = [
    (130, 136, 1032),  # one pair, ragged strip, three chunks
    (1, 256, 1024),  # one row: the second CTA's half of every A tile is wholly past m (zeros)
    (333, 1024, 1544),  # four pairs, m not a multiple of 32, a ragged last chunk
    (64, 512, 4096),  # one 64-row block (one consumer warpgroup idle), eight chunks
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("accumulate", ACCUMULATES)
@pytest.mark.parametrize("k_splits", [1, 3, None], ids=["s1", "s3", "planned"])
@pytest.mark.parametrize("cluster", [1, 2], ids=["c1", "c2"])
@pytest.mark.parametrize("shape", CLUSTER_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_gemm_pipelined_cluster_pairs(shape, cluster, k_splits, accumulate):
    m, n, k = shape
    a = torch.randn(m, k, device="cuda").half()
    check_product(a, host_b(k, n), "pipelined", torch.float32, cluster=cluster, k_splits=k_splits,
                  accumulate=accumulate)


# persistent pipelined: (m, n, k, clusters tried, staged) with more items (strips x chunks) than resident CTAs, so
# CTAs walk several and stage the next chunk in HBM, or fewer (a CTA an item, nothing staged)
PERSISTENT_CASES = [
    (256, 2048, 8192, (1, 2), True),  # 16 strips x 16 chunks: 256 items
    (130, 4096, 5000, (1, 2), True),  # 32 x 10 items, ragged m, ragged last chunk (392 rows)
    (130, 2184, 8192, (1, 2), True),  # 18 x 16 items, the last strip 8 columns wide (zeros staged past n)
    (200, 264, 5736, (1,), False),  # 3 strips (pairs impossible), 12 chunks
    (1, 256, 1024, (1, 2), False),  # 4 items
]
PERSISTENT_RUNS = [(m, n, k, c, staged) for m, n, k, cs, staged in PERSISTENT_CASES for c in cs]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("stage_slots", [1, 2], ids=["slots1", "slots2"])
@pytest.mark.parametrize("m,n,k,cluster,staged", PERSISTENT_RUNS,
                         ids=[f"{m}x{n}x{k}-c{c}" for m, n, k, c, _ in PERSISTENT_RUNS])
def test_gemm_pipelined_persistent(m, n, k, cluster, staged, stage_slots):
    from directkv.kernels.cuda.gemm_case_study import _persistent_ctas

    items = math.ceil(n / 128) * math.ceil(k / 512)
    assert (items > _persistent_ctas(torch.cuda.current_device(), cluster)) == staged  # the case tests what it says
    a = torch.randn(m, k, device="cuda").half()
    b = host_b(k, n)
    opts = {"cluster": cluster, "persistent": True, "stage_slots": stage_slots}
    check_product(a, b, "pipelined", torch.float32, **opts)
    b.copy_(torch.randn(b.shape, device="cuda").half())  # new values in the same pinned bytes: no stale slot
    torch.cuda.synchronize()
    check_product(a, b, "pipelined", torch.float16, **opts)


@pytest.mark.gpu
@needs_cuda
def test_gemm_cluster_pairs_refused_where_strips_do_not_pair():
    a = torch.randn(130, 1024, device="cuda").half()
    with pytest.raises(ConfigError, match=r"cluster 2 needs .* got k = 1024, n = 264 \(3 strips\)"):
        gemm(a, host_b(1024, 264), variant="pipelined", cluster=2)
    check_product(a, host_b(1024, 264), "pipelined", torch.float16)  # None: single CTAs there
    a = torch.randn(130, 1001, device="cuda").half()
    with pytest.raises(ConfigError, match=r"got k = 1001, n = 256"):
        gemm(a, host_b(1001, 256), variant="pipelined", cluster=2)
    check_product(a, host_b(1001, 256), "pipelined", torch.float16)
    with pytest.raises(ConfigError, match=r"persistent needs k and n multiples of 8 .* got k = 1001, n = 256"):
        gemm(a, host_b(1001, 256), variant="pipelined", persistent=True)
    a = torch.randn(130, 1024, device="cuda").half()
    with pytest.raises(ConfigError, match=r"persistent needs accumulate 'atomic'; got 'splits'"):
        gemm(a, host_b(1024, 256), variant="pipelined", persistent=True, accumulate="splits")
    with pytest.raises(ConfigError, match=r"k_splits must be None; got 2"):
        gemm(a, host_b(1024, 256), variant="pipelined", persistent=True, k_splits=2)
    with pytest.raises(ConfigError, match=r"persistent CTAs stage the next chunk in HBM and take no prefetch"):
        gemm(a, host_b(1024, 256), variant="pipelined", persistent=True, prefetch="hint")
    with pytest.raises(ConfigError, match=r"stage_slots is an option of persistent pipelined CTAs; got 2 for variant "
                                          r"'pipelined', persistent False"):
        gemm(a, host_b(1024, 256), variant="pipelined", persistent=False, stage_slots=2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("host_load", HOST_LOADS)
def test_gemm_b_in_hbm_and_pinned_cpu(host_load):
    a = torch.randn(200, 300, device="cuda").half()
    b = torch.randn(300, 264, device="cuda").half()
    traffic = check_product(a, b, "tiled", torch.float16, host_load=host_load)
    assert traffic.link_read_bytes == 0
    check_product(a, b.cpu().pin_memory(), "pipelined", torch.float32, host_load=host_load)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("host_load", HOST_LOADS)
@pytest.mark.parametrize("variant", KERNELS)
def test_gemm_sees_b_rewritten_between_launches(variant, host_load):
    """B rewritten in place between two calls: the second call must read the new bytes (an L1 line cached
    by the first launch must not survive into the next one)."""
    a = torch.randn(300, 520, device="cuda").half()
    b = host_b(520, 264)
    check_product(a, b, variant, torch.float16, host_load=host_load)
    b.copy_(torch.randn(b.shape, device="cuda").half())  # the same pinned bytes, new values
    torch.cuda.synchronize()
    check_product(a, b, variant, torch.float16, host_load=host_load)


def test_host_load_default_names_every_variant():
    assert set(HOST_LOAD_DEFAULT) == set(VARIANTS) and set(HOST_LOAD_DEFAULT.values()) <= set(HOST_LOADS)


def test_gemm_rejects_bad_host_load_before_touching_cuda():
    """Runs without a GPU: host_load is checked first, and a valid value passes on to the device checks."""
    a = torch.randn(64, 64).half()
    with pytest.raises(ConfigError, match=r"host_load 'lru'; valid: ca, cg"):
        gemm(a, a, variant="tiled", host_load="lru")
    with pytest.raises(ConfigError, match=r"prefetch True; valid: hint, load, none"):
        gemm(a, a, variant="pipelined", prefetch=True)
    with pytest.raises(ConfigError, match=r"accumulate 'sum'; valid: atomic, splits"):
        gemm(a, a, variant="tiled", accumulate="sum")
    with pytest.raises(ConfigError, match=r"prefetch is an option of gemm variant 'pipelined'; got 'none' for 'tiled'"):
        gemm(a, a, variant="tiled", prefetch="none")
    with pytest.raises(ConfigError, match=r"accumulate / k_splits are options of gemm variants 'tiled' and "
                                          r"'pipelined'; got 'atomic' / None for 'naive'"):
        gemm(a, a, variant="naive", accumulate="atomic")
    with pytest.raises(ConfigError, match=r"got None / 2 for 'raster'"):
        gemm(a, a, variant="raster", k_splits=2)
    for bad in (0, True, 1.5):
        with pytest.raises(ConfigError, match=rf"k_splits must be a positive int; got {bad!r}"):
            gemm(a, a, variant="tiled", k_splits=bad)
    with pytest.raises(ConfigError, match=r"cluster is an option of gemm variants 'pipelined' and 'ring'; got 2 "
                                          r"for 'tiled'"):
        gemm(a, a, variant="tiled", cluster=2)
    for bad in (0, 3, True, 2.0):
        with pytest.raises(ConfigError, match=rf"gemm cluster {bad!r} is not supported; valid: None, 1, 2"):
            gemm(a, a, variant="pipelined", cluster=bad)
    with pytest.raises(ConfigError, match=r"persistent is an option of gemm variant 'pipelined'; got True for 'tiled'"):
        gemm(a, a, variant="tiled", persistent=True)
    for bad in ("yes", 1, 0):
        with pytest.raises(ConfigError, match=rf"persistent must be None, True or False; got {bad!r}"):
            gemm(a, a, variant="pipelined", persistent=bad)
    for bad in (0, 3, True, None):
        with pytest.raises(ConfigError, match=rf"gemm stage_slots {bad!r} is not supported; valid: 1, 2"):
            gemm(a, a, variant="pipelined", stage_slots=bad)
    with pytest.raises(ConfigError, match="CUDA tensor"):
        gemm(a, a, variant="tiled", host_load="ca")


def test_pipelined_options_by_hand():
    """The defaults and refusals of pipelined's cluster / persistent (CPU tensors: only shapes and addresses count)."""
    a = torch.empty(64, 1024, dtype=torch.float16)
    b = lambda n: torch.empty(1024, n, dtype=torch.float16)  # noqa: E731
    assert pipelined_options(a, b(256), "atomic", None, None, None) == (2, True)
    assert pipelined_options(a, b(384), "atomic", None, None, None) == (1, True)  # 3 strips: no pairs
    assert pipelined_options(a, b(256), "splits", None, None, None) == (2, False)
    assert pipelined_options(a, b(256), "atomic", 4, None, None) == (2, False)
    assert pipelined_options(a, b(256), "atomic", None, None, None, prefetch_given=True) == (2, False)
    assert pipelined_options(a, b(256), "atomic", None, 1, False) == (1, False)
    assert pipelined_options(a, b(260), "atomic", None, None, None) == (1, False)  # n % 8: element loads
    unaligned = torch.empty(64 * 1024 + 1, dtype=torch.float16)[1:].view(64, 1024)
    assert pipelined_options(unaligned, b(256), "atomic", None, None, None) == (1, False)
    with pytest.raises(ConfigError, match=r"got k = 1024, n = 256 \(2 strips\), A at 2 and B at 0 bytes"):
        pipelined_options(unaligned, b(256), "atomic", None, 2, None)
    with pytest.raises(ConfigError, match=r"\(3 strips\)"):
        pipelined_options(a, b(384), "atomic", None, 2, None)


@pytest.mark.gpu
@needs_cuda
def test_gemm_rejects_bad_arguments():
    a = torch.randn(64, 64, device="cuda").half()
    b = host_b(64, 64)
    with pytest.raises(ConfigError, match="variant"):
        gemm(a, b, variant="fused")
    with pytest.raises(ConfigError, match="tiles"):
        gemm(a, b, variant="naive", tile_k=32)
    with pytest.raises(ConfigError, match="float16"):
        gemm(a.float(), b, variant="naive")


# ---- stream: copy-engine panels into an HBM ring, cuBLAS per panel ---------------------------------------


def test_launcher_codes_are_the_kernel_variants_in_order():
    """KERNEL_VARIANTS.index is the launcher's variant code; ring has its own entry point, stream none (cuBLAS)."""
    cu = (Path(__file__).parents[1] / "csrc" / "ops" / "gemm_case_study.cu").read_text()
    codes = {name.lower(): int(code) for name, code in re.findall(r"k(Naive|Tiled|Pipelined|Raster) = (\d+)", cu)}
    assert codes == {v: i for i, v in enumerate(KERNEL_VARIANTS)}
    assert VARIANTS == (*KERNEL_VARIANTS, "ring", "stream")


@pytest.mark.parametrize("k,n,cols", [
    (10240, 10240, 1408),  # (10240 - 1) // 7 = 1462 -> 1408 (8 panels: 7 x 1408 + 384); the ring fits 1638
    (4096, 4096, 576),  # 4095 // 7 = 585 -> 576 (8 panels)
    (517, 1000, 128),  # 999 // 7 = 142 -> 128: ceil(1000 / 128) = 8
    (64, 449, 64),  # 7 x 64 = 448 < 449: 8 panels of at most 64
    (64, 448, 64),  # too narrow for 8 panels of 64: 64 all the same (7 panels)
    (64, 40, 40),  # never more than n
    (262144, 10240, 64),  # the ring fits exactly 64 columns of 262144 rows (2 x 262144 x 64 x 2 B = 64 MiB)
    (1 << 20, 10240, 16),  # 64 columns do not fit: the widest that does, 64 MiB // (2 x 2^20 x 2 B)
    (1 << 24, 3, 1),  # one column of 2^24 rows: 2 x 2^24 x 2 B = 64 MiB exactly
])  # fmt: skip
def test_plan_panel_cols_by_hand(k, n, cols):
    assert plan_panel_cols(k, n) == cols


@pytest.mark.parametrize("size,splits", [
    (10240, 7),  # 20 chunks; a 3 GiB workspace holds 7 splits of 10240 x 10240 fp32
    (4096, 8),   # one chunk a CTA
    (1024, 2),   # k of two chunks
    (512, 1),    # one chunk
])
def test_plan_k_splits_one_chunk_a_cta_within_the_workspace(size, splits):
    assert plan_k_splits(size, size, size) == splits


def test_plan_k_splits_by_workspace():
    assert workspace_cap(24 << 30) == 3 << 30  # a 24 GB GPU: the 3 GiB floor
    assert workspace_cap(141 << 30) == (141 << 30) // 8  # H200
    assert plan_k_splits(10240, 10240, 10240, workspace=workspace_cap(141 << 30)) == 20  # 8.4 GB
    assert plan_k_splits(10240, 10240, 10240, workspace=10240 * 10240 * 4 * 10) == 10
    assert plan_k_splits(10240, 10240, 10240, workspace=1) == 1  # at least one split, whatever the cap
    # 1024 x 1024 output (8 strips) over k = 65536: 128 chunks, 4 MiB of partial C per split
    assert plan_k_splits(1024, 1024, 65536) == 128
    assert plan_k_splits(1024, 1024, 65536, k_splits=500) == 128  # a given count: clipped to the chunks
    assert plan_k_splits(1024, 1024, 65536, k_splits=3) == 3
    assert plan_k_splits(16384, 16384, 65536, workspace=None) == 128  # no cap (accumulate "atomic"): every chunk
    assert plan_k_splits(16384, 16384, 65536) == 3  # the 3 GiB workspace holds 3 splits of 16384^2 fp32
    with pytest.raises(ConfigError, match="k_splits must be a positive int; got 0"):
        plan_k_splits(1024, 1024, 65536, k_splits=0)


def test_stationary_hbm_floor_by_hand():
    # 10240^3: 20 chunks, each an fp32 partial C of 10240 x 10240 written and read once; A read, C written once
    assert stationary_hbm_floor_bytes(10240, 10240, 10240) == 2 * 20 * 10240 * 10240 * 4 + 2 * 10240 * 10240 * 2
    # ragged: 3 chunks (1025 rows), partial rows padded to 256 columns, fp32 C
    assert stationary_hbm_floor_bytes(7, 130, 1025, c_bytes=4) == 2 * 3 * 7 * 256 * 4 + 7 * 1025 * 2 + 7 * 130 * 4
    with pytest.raises(ConfigError, match="m, n, k, c_bytes must be >= 1; got 0, 1, 1, 2"):
        stationary_hbm_floor_bytes(0, 1, 1)


def test_plan_panel_cols_given_and_refused():
    assert plan_panel_cols(517, 1000, panel_cols=100) == 100
    assert plan_panel_cols(517, 1000, panel_cols=5000) == 1000  # clipped to n; the ring still had to fit it
    fit = (64 << 20) // (2 * 517 * 2)  # 32451
    assert plan_panel_cols(517, 40000, panel_cols=fit) == fit
    for bad in (0, -3, fit + 1, 1.5, True, "64"):
        with pytest.raises(ConfigError, match=rf"panel {re.escape(repr(bad))} \(columns per panel\) must be an int "
                                              rf"in 1\.\.{fit} "
                                              r"\(2 slots x K=517 rows <= 64 MiB\)"):
            plan_panel_cols(517, 1000, panel_cols=bad)
    with pytest.raises(ConfigError, match=r"K=16777217 is too large for the stream variant's ring: one column in 2 "
                                          r"slots needs 67108868 B > 67108864 B \(64 MiB\)"):
        plan_panel_cols((1 << 24) + 1, 8)
    with pytest.raises(ConfigError, match="K and N must be >= 1; got 0, 8"):
        plan_panel_cols(0, 8)


def test_plan_panel_rows_is_the_column_plan_with_k_and_n_swapped():
    assert plan_panel_rows(10240, 10240) == 1408  # 8 row panels: 7 x 1408 + 384; the ring fits 1638 rows
    assert plan_panel_rows(1000, 517) == 128  # 999 // 7 = 142 -> 128: 8 row panels
    assert plan_panel_rows(448, 64) == 64 and plan_panel_rows(40, 64) == 40  # as the column plan's cases above
    assert plan_panel_rows(1000, 517, panel_rows=100) == 100
    fit = (64 << 20) // (2 * 517 * 2)
    with pytest.raises(ConfigError, match=rf"panel 0 \(rows per panel\) must be an int in 1\.\.{fit} \(2 slots x N=517 "
                                          r"columns "
                                          r"<= 64 MiB\)"):
        plan_panel_rows(1000, 517, panel_rows=0)
    with pytest.raises(ConfigError, match=r"N=16777217 is too large for the stream variant's ring: one row in 2 "):
        plan_panel_rows(8, (1 << 24) + 1)


def test_simulated_stream_pipeline_by_hand():
    """experiments.gemm_case_study.stream_ms: a 2-slot ring, copies in order, each product after its copy."""
    # copy-bound, 4 equal panels (copy 2, product 1): copies end at 2, 4, 6, 8; the last product ends at 9
    assert stream_ms(8.0, 4.0, 4, 1) == pytest.approx(9e3)
    # compute-bound (copy 1, product 2): copy 2 waits for product 0 (ends 3), copy 3 for product 1 (5);
    # products end at 3, 5, 7, 9
    assert stream_ms(4.0, 8.0, 4, 1) == pytest.approx(9e3)
    # uneven panels (2 + 1 columns of 3): copy 0-2, product 2-4; copy 2-3, product 4-5
    assert stream_ms(3.0, 3.0, 3, 2) == pytest.approx(5e3)
    assert stream_ms(3.0, 3.0, 3, 3) == pytest.approx(6e3)  # one panel: nothing overlaps


# (gemm keyword arguments, the error it must raise): every option checked before CUDA is touched
STREAM_OPTION_ERRORS = [
    ({"variant": "tiled", "panel": 64},
     "split / panel / copy_streams are options of gemm variant 'stream'; got 'n' / 64 / 1 for 'tiled'"),
    ({"variant": "naive", "copy_streams": 2}, "got 'n' / None / 2 for 'naive'"),
    ({"variant": "pipelined", "split": "k"}, "got 'k' / None / 1 for 'pipelined'"),
    ({"variant": "stream", "split": "m"}, "unknown gemm split 'm'; valid: k, n"),
    ({"variant": "stream", "copy_streams": 3}, "copy_streams 3 is not supported; valid: 1, 2"),
    ({"variant": "stream", "panel": 64}, "CUDA tensor"),
    ({"variant": "stream", "copy": "dma"}, "unknown gemm copy 'dma'; valid: ce, sm"),
    ({"variant": "tiled", "copy": "sm"}, "copy is an option of gemm variant 'stream'; got 'sm' for 'tiled'"),
    ({"variant": "stream", "copy_ctas": 8}, "copy_ctas is an option of copy 'sm'; got 8 with 'ce'"),
    ({"variant": "stream", "copy": "sm", "copy_streams": 2}, "copy 'sm' runs on one side stream; got copy_streams 2"),
    ({"variant": "stream", "copy": "sm", "copy_ctas": 0}, "copy_ctas must be an int >= 1; got 0"),
]


def test_gemm_rejects_stream_options_outside_stream_before_touching_cuda():
    a = torch.randn(64, 64).half()
    for kwargs, message in STREAM_OPTION_ERRORS:
        with pytest.raises(ConfigError, match=re.escape(message)):
            gemm(a, a, **kwargs)
    panels = host_panels(a, panel_cols=16)  # a CPU tensor a: gemm refuses the call before touching CUDA
    for bad, kwargs in [("'tiled', 'n', panel None", {"variant": "tiled"}),
                        ("'stream', 'k', panel None", {"variant": "stream", "split": "k"}),
                        ("'stream', 'n', panel 32", {"variant": "stream", "panel": 32})]:
        with pytest.raises(ConfigError, match=f"B stored in panels \\(HostPanels of 16 columns\\) takes variant "
                                              f"'stream', split 'n' and its own panel width; got {bad}"):
            gemm(a, panels, **kwargs)


def stream_b(kind: str, k: int, n: int, panel: int | None = None) -> tuple[torch.Tensor | HostPanels, torch.Tensor]:
    """(B `[k, n]` fp16 of fresh random values: a zero-copy view, a pinned CPU tensor, in HBM, or stored in
    panels of `panel` columns in pinned memory; the same values as a plain HBM tensor, for the reference)."""
    if kind == "zero_copy":
        b = host_b(k, n)
        return b, b
    b = torch.randn(k, n, device="cuda").half()
    if kind == "panels":
        return host_panels(b, panel_cols=panel), b
    return (b.cpu().pin_memory() if kind == "pinned_cpu" else b), b


STREAM_SHAPES = [  # (m, n, k)
    (333, 1000, 517),  # odd M and K, N (and K) not a multiple of the panel width (default 128, forced 96)
    (1, 8, 8),  # one row, one panel narrower than any plan
    (1000, 777, 1111),
    (64, 3000, 64),  # many column panels
    (40, 64, 3000),  # many row panels
]
C16, C32 = torch.float16, torch.float32
# (where B is, how it is cut, C's dtype): column panels from every home of B, row panels from every tensor home
# (fp16 C only: fp32 is refused, test_gemm_stream_row_panels_refuse_fp32_c), and B stored in panels (cut by
# its own columns)
STREAM_CUTS = [(kind, "n", c) for kind in ("zero_copy", "pinned_cpu", "hbm", "panels") for c in (C16, C32)] + [
    (kind, "k", C16) for kind in ("zero_copy", "pinned_cpu", "hbm")]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("b_kind,split,out_dtype", STREAM_CUTS,
                         ids=[f"{kind}-{split}-c{c.itemsize * 8}" for kind, split, c in STREAM_CUTS])
@pytest.mark.parametrize("panel", [None, 96], ids=["planned", "p96"])
@pytest.mark.parametrize("shape", STREAM_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("copy_streams,copy", [(1, "ce"), (2, "ce"), (1, "sm")], ids=["1ce", "2ce", "sm"])
def test_gemm_stream_matches_float64(shape, panel, out_dtype, b_kind, split, copy_streams, copy):
    """Every copy path: copy engine on one or two streams, or the SM copy kernel (16-byte loads where rows
    are aligned, 2-byte ones for odd N); column panels 2-D (contiguous when B is stored in panels), row panels
    contiguous with C accumulated over them."""
    m, n, k = shape
    a = torch.randn(m, k, device="cuda").half()
    b, b_ref = stream_b(b_kind, k, n, panel)
    traffic = check_product(a, b, "stream", out_dtype, b_ref=b_ref, split=split,
                            panel=None if b_kind == "panels" else panel, copy_streams=copy_streams, copy=copy)
    cut = stream_cut(k, n, split, panel)
    model = gemm_traffic(m, n, k, dtype_bytes=2, variant="stream", b_tier="hbm" if b_kind == "hbm" else "host",
                         c_bytes=out_dtype.itemsize, **cut)
    assert traffic == model
    assert traffic.link_read_bytes == (0 if b_kind == "hbm" else k * n * 2)


@pytest.mark.gpu
@needs_cuda
def test_gemm_stream_row_panels_refuse_fp32_c():
    a = torch.randn(64, 64, device="cuda").half()
    out = torch.full((64, 64), math.nan, dtype=torch.float32, device="cuda")
    with pytest.raises(ConfigError, match="split 'k' accumulates C in place with torch's addmm_, which takes fp16 C "
                                          "only across torch versions: out must be float16; got torch.float32"):
        gemm(a, host_b(64, 64), variant="stream", out=out, split="k")
    assert out.isnan().all()  # refused before any copy or product


def test_host_panels_are_checked():
    """Runs without a GPU: a HostPanels whose buffer does not hold [k, n], or whose panels overflow the ring,
    is refused when made (gemm copies it by raw pointer)."""
    with pytest.raises(ConfigError, match=r"HostPanels needs a contiguous 1-D float16 buffer of k \* n = 12 elements; "
                                          r"got torch.float16 \(10,\)"):
        HostPanels(torch.zeros(10, dtype=torch.float16), 3, 4, 2)
    with pytest.raises(ConfigError, match=r"panel 0 \(columns per panel\) must be an int in 1\.\."):
        HostPanels(torch.zeros(12, dtype=torch.float16), 3, 4, 0)
    p = HostPanels(torch.zeros(12, dtype=torch.float16), 3, 4, 2)
    assert p != HostPanels(p.data, 3, 4, 2) and p == p  # identity, never an elementwise tensor comparison


def test_host_panels_layout_by_hand():
    """Runs without a GPU (pinned_empty falls back to a CPU tensor): panel i's columns, row after row, at
    element k * n0."""
    b = torch.arange(3 * 5, dtype=torch.float16).view(3, 5)  # k=3, n=5
    p = host_panels(b, panel_cols=2)  # panels of 2, 2, 1 columns
    assert (p.k, p.n, p.panel_cols, p.shape) == (3, 5, 2, (3, 5))
    assert p.data.tolist() == [0, 1, 5, 6, 10, 11, 2, 3, 7, 8, 12, 13, 4, 9, 14]
    assert host_panels(b).panel_cols == 5  # narrower than one aligned panel: one panel of every column
    assert host_panels(b).data.tolist() == b.flatten().tolist()
    with pytest.raises(ConfigError, match=r"b must be a 2-D float16 tensor; got torch.float32 \(3, 5\)"):
        host_panels(b.float())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("split", ["n", "k"])
@pytest.mark.parametrize("copy_streams,copy", [(1, "ce"), (2, "ce"), (1, "sm")], ids=["1ce", "2ce", "sm"])
def test_gemm_stream_back_to_back_calls_share_the_ring(copy_streams, copy, split):
    """Three calls with no sync between them: each call's ring is most likely the previous one's memory (the
    same size, freed on the same stream), so its copies must wait for the previous call's products; and B
    rewritten on the current stream between two calls must be copied after the rewrite."""
    # a panel's product (16384 x 256 x 1536 or 16384 x 2000 x 256, 13-17 GFLOP) takes longer than its copy
    # (<= 1 MiB), so the copies run ahead as far as the events let them: an early copy into a slot still being
    # read would show
    m, n, k = 16384, 2000, 1536
    a = torch.randn(m, k, device="cuda").half()
    b1, b2 = host_b(k, n), host_b(k, n)
    ref1 = a.double() @ b1.double()
    outs = [torch.full((m, n), math.nan, dtype=torch.float16, device="cuda") for _ in range(3)]
    opts = {"panel": 256, "split": split, "copy_streams": copy_streams, "copy": copy}
    gemm(a, b1, variant="stream", out=outs[0], **opts)
    gemm(a, b2, variant="stream", out=outs[1], **opts)
    new = torch.randn(k, n, device="cuda").half()
    b1.copy_(new)  # on the current stream, no sync: the next call's first copy waits for it
    gemm(a, b1, variant="stream", out=outs[2], **opts)
    torch.cuda.synchronize()
    for out, ref in zip(outs, (ref1, a.double() @ b2.double(), a.double() @ new.double()), strict=True):
        assert not out.isnan().any(), "unwritten or NaN output elements"
        assert float((out.double() - ref).norm() / ref.norm()) < TOL[torch.float16]


@pytest.mark.gpu
@needs_cuda
def test_gemm_stream_rejects_bad_panel_cols():
    a = torch.randn(64, 64, device="cuda").half()
    b = host_b(64, 64)
    with pytest.raises(ConfigError, match=r"panel 0 \(columns per panel\) must be an int in 1\.\.262144"):
        gemm(a, b, variant="stream", panel=0)
    with pytest.raises(ConfigError, match=r"panel 0 \(rows per panel\) must be an int in 1\.\.262144"):
        gemm(a, b, variant="stream", split="k", panel=0)

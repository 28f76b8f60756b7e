"""Zero-copy views: the CUDA tensor aliases the pinned memory (writes visible both ways, no copy)."""

from __future__ import annotations

import pytest
import torch

from directkv.errors import ConfigError
from directkv.kernels.cuda.zero_copy import _HostArray, device_view, pinned_empty

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_array_interface_describes_the_memory():
    t = torch.randn(4, 6, dtype=torch.float16)[:, 1:5]  # strided on purpose
    iface = _HostArray(t).__cuda_array_interface__
    assert iface["shape"] == (4, 4)
    assert iface["typestr"] == "<f2"
    assert iface["strides"] == (12, 2)
    assert iface["data"] == (t.data_ptr(), False)
    assert iface["version"] == 3
    with pytest.raises(TypeError):
        _HostArray(torch.randn(2, dtype=torch.bfloat16))  # bf16 must travel as int16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_cpu_fallback_returns_the_tensor():
    t = pinned_empty((3, 5), torch.bfloat16)
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and t.device.type == "cpu"
    assert device_view(t) is t


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("alloc", ["torch", "host_alloc", "register"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int32])
def test_view_aliases_pinned_memory(dtype, alloc):
    pinned = pinned_empty((37, 5, 8), dtype, alloc=alloc)
    assert pinned.is_pinned()
    pinned.copy_(torch.randn(pinned.shape).to(dtype))
    view = device_view(pinned)
    assert view.device.type == "cuda" and view.dtype == dtype and view.shape == pinned.shape
    assert view.data_ptr() == pinned.data_ptr()  # same address: nothing was copied
    assert torch.equal(view.cpu(), pinned)

    fresh = torch.randn(pinned.shape, device="cuda").to(dtype)
    view.copy_(fresh)  # GPU writes land in host memory
    torch.cuda.synchronize()
    assert torch.equal(pinned, fresh.cpu())

    pinned[3].copy_(torch.randn(pinned.shape[1:]).to(dtype))  # host writes are seen by the GPU
    assert torch.equal(view[3].cpu(), pinned[3])
    assert torch.equal((view * 1).cpu(), pinned)  # a kernel reading the view sees host data


@pytest.mark.gpu
@needs_gpu
def test_view_of_a_strided_slice_and_lifetime():
    pinned = pinned_empty((8, 16), torch.bfloat16)
    pinned.copy_(torch.randn(8, 16))
    part = pinned[2:6, 4:12]
    view = device_view(part)
    assert view.data_ptr() == part.data_ptr() and view.stride() == part.stride()
    expected = part.clone()
    del pinned, part  # the view keeps the pinned memory alive
    assert torch.equal(view.cpu(), expected)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("alloc", ["host_alloc", "register"])
def test_exact_size_pinned_memory_copies_exactly(alloc):
    """Exact-size pinned memory: reported pinned, async copies both ways exact, zero-copy view aliases it."""
    host = pinned_empty((1000, 33), torch.bfloat16, alloc=alloc)
    assert host.is_pinned() and host.shape == (1000, 33) and host.dtype == torch.bfloat16
    src = torch.randn(host.shape, device="cuda").to(torch.bfloat16)
    host.copy_(src, non_blocking=True)
    back = torch.empty_like(src)
    back.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    assert torch.equal(device_view(host).cpu(), src.cpu())


@pytest.mark.gpu
@needs_gpu
def test_host_alloc_memory_lives_as_long_as_any_view():
    import gc

    host = pinned_empty((64, 128), torch.float16, alloc="host_alloc")
    part = host[8:16]
    del host
    gc.collect()
    fresh = torch.randn(part.shape, device="cuda").to(torch.float16)
    part.copy_(fresh)  # would fault if the memory had been freed with the base tensor
    assert torch.equal(part, fresh.cpu())


def test_unknown_pinned_allocation_is_one_line_error():
    if not torch.cuda.is_available():
        pytest.skip("the allocation kind is only checked where pinning happens")
    with pytest.raises(ConfigError, match="valid: host_alloc, register, torch"):
        pinned_empty((4,), torch.float16, alloc="mmap")


@pytest.mark.gpu
@needs_gpu
def test_measure_ceilings_reports_the_concurrent_link_rates():
    from directkv.kernels.cuda.probe import measure_ceilings

    got = measure_ceilings(64 << 20, repeats=2)
    assert set(got) >= {"sm_read_gbps", "ce_h2d_gbps", "ce_h2d_2x_gbps", "ce_plus_sm_gbps"}
    assert all(v > 1.0 for v in got.values()), got
    # two sources of one link: together never above the sum of each alone (10% timing slack)
    assert got["ce_plus_sm_gbps"] <= 1.1 * (got["ce_h2d_gbps"] + got["sm_read_gbps"]), got
    assert got["ce_h2d_2x_gbps"] <= 1.1 * 2 * got["ce_h2d_gbps"], got


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("sm_half", [True, False])
def test_concurrent_probe_moves_each_half_its_way(sm_half):
    """The first half is copied; the second is copied too (two copies) or read in place, never written."""
    from directkv.kernels.cuda.probe import _concurrent_gbps

    n = 8 << 20
    host = pinned_empty((n,), torch.uint8, alloc="host_alloc")
    host.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    hbm = torch.full((n,), 7, dtype=torch.uint8, device="cuda")
    assert _concurrent_gbps(host, hbm, sm_half=sm_half, repeats=1) > 0
    torch.cuda.synchronize()
    assert torch.equal(hbm[: n // 2].cpu(), host[: n // 2])
    if sm_half:
        assert bool((hbm[n // 2:] == 7).all())
    else:
        assert torch.equal(hbm[n // 2:].cpu(), host[n // 2:])

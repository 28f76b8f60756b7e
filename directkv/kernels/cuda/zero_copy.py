"""Zero-copy views: a CUDA tensor over page-locked CPU memory, no copy made.

With UVA (every 64-bit CUDA platform) the address of a pinned allocation is also a valid device address,
so a CUDA tensor built on that pointer lets any kernel read and write the host memory across the link.
The view is built through the `__cuda_array_interface__` protocol, which torch imports without copying;
the holder object keeps the pinned tensor alive for as long as the view lives.

Large buffers (>= EXACT_MIN_BYTES) are allocated with cudaHostAlloc at their exact size (csrc/ops/
host_memory.cu): torch's pinned allocator rounds every block up to a power of two, so two 43 GB K/V arenas
would lock 128 GB. Locking ordinary memory after the fact (cudaHostRegister, alloc="register") also works
but SM zero-copy loads read it more slowly on the H200 (measure_ceilings reports both).

Without CUDA the same calls degrade to ordinary CPU tensors. A CPU run on a machine with a GPU does not call them:
host_buffer(pin=False) gives it plain tensors (the KV manager's arena and flexgen's pools pin by the run's device).
"""

from __future__ import annotations

import ctypes
import math
import weakref

import torch

from directkv.errors import unknown_name

EXACT_MIN_BYTES = 1 << 30  # from this size on, pinned_empty allocates exactly (cudaHostAlloc, see above)
ALLOCS = ("torch", "host_alloc", "register")
_REGISTERED = 3  # cudaHostRegisterPortable | cudaHostRegisterMapped: visible to every device, UVA-mapped

# Array-interface type strings; bf16 has none and travels as int16 (same size), then is viewed back.
_TYPESTR = {
    torch.float16: "<f2",
    torch.float32: "<f4",
    torch.float64: "<f8",
    torch.int8: "|i1",
    torch.uint8: "|u1",
    torch.int16: "<i2",
    torch.int32: "<i4",
    torch.int64: "<i8",
}
_CARRIER = {torch.bfloat16: torch.int16}


class _HostArray:
    """Exposes a pinned CPU tensor's memory as a CUDA array (protocol version 3) and keeps it alive."""

    def __init__(self, pinned: torch.Tensor, base: torch.Tensor | None = None):
        if pinned.dtype not in _TYPESTR:
            raise TypeError(f"no array-interface type for {pinned.dtype}")
        self.pinned = pinned
        self.base = base  # the tensor whose death unregisters the memory (pinned_empty): kept alive with the view
        item = pinned.element_size()
        self.__cuda_array_interface__ = {
            "shape": tuple(pinned.shape),
            "typestr": _TYPESTR[pinned.dtype],
            "strides": tuple(s * item for s in pinned.stride()),
            "data": (pinned.data_ptr(), False),
            "version": 3,
        }


def pinned_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, *, alloc: str | None = None
                 ) -> torch.Tensor:
    """A page-locked CPU tensor of `shape`, uninitialised (an ordinary CPU tensor without CUDA).

    alloc : "torch" (torch's pinned allocator: cached, rounded up to a power of two), "host_alloc" (exact
        size, cudaHostAlloc; freed when the last tensor viewing it is freed) or "register" (exact size,
        torch memory zeroed then cudaHostRegister'ed; unregistered when this tensor object is collected, so
        keep it, not only slices of it). None: "host_alloc" from EXACT_MIN_BYTES on, else "torch".
    """
    shape = tuple(shape)
    if not torch.cuda.is_available():
        return torch.empty(shape, dtype=dtype)
    if alloc is not None and alloc not in ALLOCS:
        raise unknown_name("pinned allocation", alloc, ALLOCS)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if alloc is None:
        alloc = "host_alloc" if nbytes >= EXACT_MIN_BYTES else "torch"
    if alloc == "torch" or nbytes == 0:
        return torch.empty(shape, dtype=dtype, pin_memory=nbytes > 0)
    if alloc == "host_alloc":
        from directkv.kernels.cuda import build

        mod = build.load("host_memory")
        ptr = mod.host_alloc(nbytes)
        owner = (ctypes.c_ubyte * nbytes).from_address(ptr)  # the buffer torch.frombuffer keeps alive
        weakref.finalize(owner, mod.host_free, ptr)  # runs once the last tensor over the memory is gone
        return torch.frombuffer(owner, dtype=torch.uint8).view(dtype).view(shape)
    t = torch.zeros(shape, dtype=dtype)
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), nbytes, _REGISTERED)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes / 1e9:.1f} GB failed with CUDA error {int(err)} "
                           "(not enough lockable host memory?)")
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t


def device_view(pinned: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over the same memory as `pinned` (same shape, dtype and data_ptr; nothing copied).

    Parameters
    ----------
    pinned : a page-locked CPU tensor of any shape and strides (see `pinned_empty`).

    Returns
    -------
    The zero-copy CUDA view; without CUDA, `pinned` itself.
    """
    if not torch.cuda.is_available():
        return pinned
    if pinned.device.type != "cpu" or not pinned.is_pinned():
        raise ValueError(f"device_view needs a pinned CPU tensor; got device={pinned.device}, "
                         f"pinned={pinned.device.type == 'cpu' and pinned.is_pinned()}")
    if pinned.numel() == 0:  # a null pointer has no device address; nothing to share
        return torch.empty(pinned.shape, dtype=pinned.dtype, device="cuda")
    carrier = _CARRIER.get(pinned.dtype, pinned.dtype)
    holder = _HostArray(pinned.view(carrier), base=pinned)
    try:
        view = torch.as_tensor(holder, device="cuda")
    except (RuntimeError, TypeError, ValueError):
        view = _view_through_cupy(holder)
    view = view.view(pinned.dtype)
    if view.data_ptr() != pinned.data_ptr():
        raise RuntimeError("zero-copy view does not alias the pinned memory (a copy was made)")
    return view


def host_buffer(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, *, pin: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A host tensor and the tensor kernels read it through: for a CUDA run (pin) page-locked memory and its
    zero-copy view, for a CPU run on any machine a plain tensor that is its own view."""
    if not pin:
        host = torch.empty(tuple(shape), dtype=dtype)
        return host, host
    host = pinned_empty(shape, dtype)
    return host, device_view(host)


def _view_through_cupy(holder: _HostArray) -> torch.Tensor:
    """Fallback for torch versions whose as_tensor refuses host pointers: wrap the memory in CuPy first."""
    import cupy

    iface = holder.__cuda_array_interface__
    pinned = holder.pinned
    nbytes = pinned.untyped_storage().nbytes() - pinned.storage_offset() * pinned.element_size()
    mem = cupy.cuda.UnownedMemory(iface["data"][0], nbytes, owner=holder)
    arr = cupy.ndarray(iface["shape"], dtype=iface["typestr"], memptr=cupy.cuda.MemoryPointer(mem, 0),
                       strides=iface["strides"])
    return torch.as_tensor(arr, device="cuda")

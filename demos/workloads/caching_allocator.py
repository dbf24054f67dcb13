"""A caching allocator in the manner of PyTorch's CUDACachingAllocator, over a CUDA runtime
loaded with ctypes (the project's simulated one, or a real one).

Segments come from cudaMalloc: requests up to 1 MiB are served from 2 MiB segments (small pool),
1-10 MiB from 20 MiB segments, larger ones from segments rounded up to 2 MiB (large pool).
Segments are split into blocks; freed blocks stay cached and merge with free neighbours. When
cudaMalloc fails, the allocator frees its unused cached segments and retries once (counted in
num_alloc_retries); if that fails too it raises OutOfMemoryError with the numbers PyTorch prints
(num_ooms). Each segment serves one stream; a block used on other streams (record_stream) is
kept out of its pool when freed until the CUDA events recorded on those streams complete
(PyTorch's insert_events / process_events, with cudaEventRecord called from the allocator's own
library, cudaEventQuery at the next malloc, cudaEventSynchronize before releasing the cache).
raw_alloc / raw_delete hand blocks out and take them back without the probes, as PyTorch's do.
With expandable=True it works as PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True does:
one reserved address range per pool (cuMemAddressReserve), mapped and unmapped in chunks of 2 MiB
(small pool) or 20 MiB (large pool) with cuMemCreate + cuMemMap and cuMemUnmap + cuMemRelease.
stats() reports the allocator's own truth (allocated, reserved, blocks, largest free block) for
tests, memory_stats() the counters torch.cuda.memory_stats() has, under the same keys.

CUDA graphs as PyTorch captures them (c10/cuda/CUDACachingAllocator.cpp, CUDAGraph.cpp):
capture_begin(graph, stream, pool) routes every request on the capturing stream, and on streams
joined to it (wait_stream during the capture), to the capture's private pool: a new one numbered
(1, 0), (2, 0), ... unless a pool is given (graph_pool_handle() makes (0, 1), (0, 2), ... for
graphs that share one). A private pool's segments serve only requests routed to it. No cache
flush (and so no retry) runs while any capture is underway. capture_end ends the routing and
instantiates the graph; reset() lets go of the pool, which becomes freeable once no graph uses
it: its segments with no live block go back at the next flush. The out-of-memory message counts
the private pools' free blocks as allocated ("with X allocated in private pools"). PyTorch's
CUDAGraph::capture_begin / capture_end / reset are called (libsimtorch.so exports them under
their mangled names) where PyTorch's would run, and the runtime's capture calls inside them.

As PyTorch's allocator, it fires the USDT probes `pytorch:malloc(ptr, device, size, stream)` and
`pytorch:free(ptr)` and constructs c10::OutOfMemoryError with its message: through
libsimtorch.so (demos/simcuda/torchprobes.c, beside the runtime), whose probe sites are C built
with sys/sdt.h. With SIMTORCH_TRUTH=FILE it writes its own layout after every malloc and free
(one JSON line each), which tests compare with what tracer reconstructs from the probes.
"""

import ctypes
import json
import os
import threading

KIB = 1024
MIB = 1024 * KIB
SMALL_SIZE = 1 * MIB
SMALL_SEGMENT = 2 * MIB
LARGE_SEGMENT = 20 * MIB
MIN_LARGE_ALLOC = 10 * MIB
ROUND_LARGE = 2 * MIB
MIN_BLOCK = 512


class OutOfMemoryError(RuntimeError):
    pass


class Block:
    __slots__ = ("segment", "offset", "size", "free", "requested", "mapped", "stream_uses", "event_count")

    def __init__(self, segment, offset, size, free=True, mapped=True):
        self.segment = segment
        self.offset = offset
        self.size = size
        self.free = free
        self.requested = 0
        # Streams other than its segment's it was used on, and its events not yet complete.
        self.stream_uses = set()
        self.event_count = 0
        # Only blocks of expandable segments are ever unmapped (address space without memory).
        self.mapped = mapped

    @property
    def ptr(self):
        return self.segment.ptr + self.offset


DEFAULT_POOL = (0, 0)

CAPTURE_BEGIN = "_ZN2at4cuda9CUDAGraph13capture_beginESt4pairIyyE21cudaStreamCaptureMode"
CAPTURE_END = "_ZN2at4cuda9CUDAGraph11capture_endEv"
GRAPH_RESET = "_ZN2at4cuda9CUDAGraph5resetEv"


class Graph:
    """A torch.cuda.CUDAGraph: its object's address (what PyTorch's methods get as `this`), its
    pool, the stream it was captured on and the executable graph."""

    def __init__(self):
        self.this = ctypes.create_string_buffer(64)
        self.pool = None
        self.stream = None
        self.exec = None

    @property
    def address(self):
        return ctypes.addressof(self.this)


class Segment:
    __slots__ = ("ptr", "size", "small", "blocks", "chunk", "handles", "stream", "pool")

    def __init__(self, ptr, size, small, chunk=None, stream=0, pool=DEFAULT_POOL):
        self.ptr = ptr
        self.size = size
        self.small = small
        self.stream = stream
        self.pool = pool
        # Expandable segments: the mapping granularity, and the physical handle of each chunk.
        self.chunk = chunk
        self.handles = {}
        self.blocks = [Block(self, 0, size, mapped=chunk is None)]

    def mapped_bytes(self):
        return len(self.handles) * self.chunk if self.chunk else self.size


def round_up(n, unit):
    return (n + unit - 1) // unit * unit


def format_size(n):
    """As PyTorch's format_size."""
    if n <= 1024:
        return f"{n} bytes"
    if n <= 1024 * 1024:
        return f"{n / 1024:.2f} KiB"
    if n <= 1024 * 1024 * 1024:
        return f"{n / MIB:.2f} MiB"
    return f"{n / (1024 * MIB):.2f} GiB"


def round_size(size):
    return max(MIN_BLOCK, (size + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK)


def segment_size(size):
    if size <= SMALL_SIZE:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE


class CachingAllocator:
    def __init__(self, cudart_path, device=0, expandable=False, driver_path=None):
        self.rt = ctypes.CDLL(cudart_path)
        self.cudart_path = cudart_path
        self.rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        self.rt.cudaFree.argtypes = [ctypes.c_void_p]
        self.rt.cudaMemGetInfo.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
        self.rt.cudaSetDevice.argtypes = [ctypes.c_int]
        self.rt.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        self.device = device
        self.segments = []
        self.lock = threading.Lock()
        self.num_alloc_retries = 0
        self.num_ooms = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self.reserved_allocated = 0
        self.reserved_freed = 0
        self.reserved_peak = 0
        # As PyTorch: the device is set only to change it (c10::cuda::SetDevice asks first); a
        # thread that sets none is on device 0, CUDA's default.
        self.rt.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        current = ctypes.c_int(0)
        self.check(self.rt.cudaGetDevice(ctypes.byref(current)), "cudaGetDevice")
        if current.value != device:
            self.check(self.rt.cudaSetDevice(device), "cudaSetDevice")
        self.expandable = expandable
        probes = os.path.join(os.path.dirname(os.path.abspath(cudart_path)), "libsimtorch.so")
        self.probes = ctypes.CDLL(probes) if os.path.exists(probes) else None
        if self.probes:
            self.probes.simtorch_malloc.argtypes = [ctypes.c_uint64, ctypes.c_int8, ctypes.c_uint64, ctypes.c_uint64]
            self.probes.simtorch_free.argtypes = [ctypes.c_uint64]
            self.probes.simtorch_oom.argtypes = [ctypes.c_char_p]
            self.probes.simtorch_error.argtypes = [ctypes.c_char_p]
            # PyTorch raises other c10 errors through the constructor its out-of-memory error
            # is built from (a bad argument caught by Python, say): they are not OOMs.
            self.probes.simtorch_error(b"Expected all tensors to be on the same device")
            self.probes.simtorch_record_event.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        for name, args in (
            ("cudaStreamCreate", [ctypes.POINTER(ctypes.c_void_p)]),
            ("cudaMemsetAsync", [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p]),
            ("cudaEventCreateWithFlags", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]),
            ("cudaEventRecord", [ctypes.c_void_p, ctypes.c_void_p]),
            ("cudaEventQuery", [ctypes.c_void_p]),
            ("cudaEventSynchronize", [ctypes.c_void_p]),
            ("cudaStreamWaitEvent", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]),
        ):
            getattr(self.rt, name).argtypes = args
        # CUDA graphs: streams capturing now -> their pool; graphs using each private pool;
        # pools no graph uses any more; PyTorch's two id counters.
        self.captures = {}
        # Threads whose requests use_mem_pool routes to a pool; pools a request may fall back
        # on before an OOM (use_on_oom).
        self.thread_routes = {}
        self.use_on_oom = set()
        # Pools whose segments come from another allocator (NCCL's ncclMemAlloc): pool -> library.
        self.pool_allocators = {}
        self.pool_use = {}
        self.freeable = set()
        self.next_graph_pool = 1
        self.next_user_pool = 1
        # Per stream, (event, block) in the order recorded; events to reuse (PyTorch's pool).
        self.cuda_events = {}
        self.event_pool = []
        truth = os.environ.get("SIMTORCH_TRUTH")
        self.truth = open(truth, "a", buffering=1) if truth else None
        nvml = os.path.join(os.path.dirname(os.path.abspath(cudart_path)), "libnvidia-ml.so.1")
        self.nvml = ctypes.CDLL(nvml) if os.path.exists(nvml) else None
        self.drv = None
        if expandable:
            self.drv = ctypes.CDLL(driver_path or os.path.join(os.path.dirname(cudart_path), "libcuda.so.1"))
            u64, size_t = ctypes.c_uint64, ctypes.c_size_t
            self.drv.cuMemAddressReserve.argtypes = [ctypes.POINTER(u64), size_t, size_t, u64, ctypes.c_ulonglong]
            self.drv.cuMemCreate.argtypes = [ctypes.POINTER(u64), size_t, ctypes.c_void_p, ctypes.c_ulonglong]
            self.drv.cuMemMap.argtypes = [u64, size_t, size_t, u64, ctypes.c_ulonglong]
            self.drv.cuMemUnmap.argtypes = [u64, size_t]
            self.drv.cuMemRelease.argtypes = [u64]

    @staticmethod
    def check(ret, what):
        if ret != 0:
            raise RuntimeError(f"{what} failed with CUDA error {ret}")

    def mem_get_info(self):
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self.check(self.rt.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)), "cudaMemGetInfo")
        return free.value, total.value

    def synchronize(self):
        self.rt.cudaDeviceSynchronize()

    def _cuda_malloc(self, size):
        ptr = ctypes.c_void_p()
        ret = self.rt.cudaMalloc(ctypes.byref(ptr), size)
        return ptr.value if ret == 0 else None

    def _best_fit(self, size, small, stream, pool=DEFAULT_POOL):
        """As PyTorch's get_free_block: the smallest free block of the pool and stream that
        fits, the lowest address among equals; in an expandable segment, a block that cannot
        grow is taken before a larger-growing one (the next in that order while its size with
        the unmapped space after it is smaller)."""
        fits = sorted(
            (block for seg in self.segments if seg.small == small and seg.stream == stream and seg.pool == pool
             for block in seg.blocks if block.free and block.mapped and block.size >= size),
            key=lambda b: (b.size, b.ptr),
        )
        if not fits:
            return None
        i = 0
        while fits[i].segment.chunk and i + 1 < len(fits) and fits[i + 1].segment.chunk \
                and self._growable(fits[i + 1]) < self._growable(fits[i]):
            i += 1
        return fits[i]

    @staticmethod
    def _growable(block):
        blocks = block.segment.blocks
        i = blocks.index(block)
        after = blocks[i + 1] if i + 1 < len(blocks) else None
        return block.size + (after.size if after is not None and not after.mapped else 0)

    def _reserved_changed(self, delta):
        if delta > 0:
            self.num_device_alloc += 1
            self.reserved_allocated += delta
        else:
            self.num_device_free += 1
            self.reserved_freed -= delta
        self.reserved_peak = max(self.reserved_peak, self.reserved_allocated - self.reserved_freed)

    def _release_cached(self):
        """Returns every unused cached segment, or with expandable segments every unused chunk,
        to the device (what a failed allocation and empty_cache() do)."""
        self._synchronize_and_free_events()
        self.synchronize()
        if self.expandable:
            for seg in self.segments:
                if self._releasable_pool(seg.pool) and seg.chunk:
                    self._unmap_free_chunks(seg)
            if not self.pool_allocators:
                return True
        # (Under expandable segments, only the whole segments of pools with their own allocator.)
        kept = []
        for seg in self.segments:
            whole = seg.chunk is None and len(seg.blocks) == 1 and seg.blocks[0].free
            if whole and self._releasable_pool(seg.pool):
                self._free_segment(seg)
                self._reserved_changed(-seg.size)
            else:
                kept.append(seg)
        self.segments = kept
        # A freeable pool left with no segment is gone.
        self.freeable = {p for p in self.freeable if any(seg.pool == p for seg in self.segments)}
        return True

    def _releasable_pool(self, pool):
        """A flush gives back the default pools' free segments and those of private pools no
        graph uses any more."""
        return pool == DEFAULT_POOL or pool in self.freeable

    def _new_segment(self, size, small, stream, pool=DEFAULT_POOL):
        """A new cudaMalloc'ed segment for `size` (from the pool's own allocator where it has
        one: NCCL's ncclMemAlloc), or None when the device has no room."""
        seg_size = segment_size(size)
        ptr = self._pool_malloc(pool, seg_size) if pool in self.pool_allocators else self._cuda_malloc(seg_size)
        if ptr is None:
            return None
        self._reserved_changed(seg_size)
        seg = Segment(ptr, seg_size, small, stream=stream, pool=pool)
        self.segments.append(seg)
        return seg.blocks[0]

    def _pool_malloc(self, pool, size):
        """A segment from the pool's pluggable allocator (ncclMemAlloc), as PyTorch's raw_alloc."""
        ptr = ctypes.c_void_p()
        ret = self.pool_allocators[pool].ncclMemAlloc(ctypes.byref(ptr), ctypes.c_size_t(size))
        return ptr.value if ret == 0 else None

    def _free_segment(self, seg):
        if seg.pool in self.pool_allocators:
            self.check(self.pool_allocators[seg.pool].ncclMemFree(ctypes.c_void_p(seg.ptr)), "ncclMemFree")
        else:
            self.check(self.rt.cudaFree(ctypes.c_void_p(seg.ptr)), "cudaFree")

    def _grow(self, size, small, stream, pool=DEFAULT_POOL):
        if self.expandable and pool not in self.pool_allocators:
            return self._grow_expandable(size, small, stream, pool)
        return self._new_segment(size, small, stream, pool)

    def malloc(self, size, stream=0):
        return self._malloc(size, stream, probes=True)

    def raw_alloc(self, size, stream=0):
        """As torch.cuda.caching_allocator_alloc (raw_alloc): a block, no probe fires."""
        return self._malloc(size, stream, probes=False)

    def _malloc(self, size, stream, probes):
        with self.lock:
            self._process_events()
            requested = size
            size = round_size(size)
            small = size <= SMALL_SIZE
            pool = self._pool_of(stream)
            block = self._best_fit(size, small, stream, pool)
            if block is None:
                block = self._grow(size, small, stream, pool)
            if block is None and not self._routing():
                # As PyTorch: release the cache, then one retry, counted whether or not it
                # helps; never while a capture (or any routing to a pool) is underway.
                self._release_cached()
                self.num_alloc_retries += 1
                block = self._grow(size, small, stream, pool)
            if block is None and pool == DEFAULT_POOL:
                # As PyTorch, a last resort before the OOM: a free block of a use_on_oom pool
                # (PyTorch routes to it with the device allocator's own beginAllocateToPool, not
                # the probed one, and its use count ends where it began).
                for oom_pool in sorted(self.use_on_oom):
                    block = self._best_fit(size, small, stream, oom_pool)
                    if block is not None:
                        break
            if block is None:
                self.num_ooms += 1
                message = self._oom_message(size)
                if self.probes:
                    self.probes.simtorch_oom(message.encode())
                raise OutOfMemoryError(message)
            self._split(block, size, small)
            block.free = False
            block.requested = size
            if self.probes and probes:
                self.probes.simtorch_malloc(block.ptr, self.device, requested, stream)
            self._record_truth("malloc", block.ptr, requested)
            return block

    def _oom_message(self, size):
        """The message current PyTorch raises, with this allocator's figures."""
        free, total = self.mem_get_info()
        s = self.stats()
        # PyTorch counts the private pools' free blocks as allocated.
        private = sum(b.size for seg in self.segments if seg.pool != DEFAULT_POOL
                      for b in seg.blocks if b.free and b.mapped)
        in_private = f"with {format_size(private)} allocated in private pools (e.g., CUDA Graphs), " if private else ""
        return (
            f"CUDA out of memory. Tried to allocate {format_size(size)}. GPU {self.device} has a total capacity "
            f"of {format_size(total)} of which {format_size(free)} is free. {self._processes_said(total - free)}"
            "Of the allocated memory "
            f"{format_size(s['allocated'] + private)} is allocated by PyTorch, {in_private}"
            f"and {format_size(s['reserved'] - s['allocated'] - private)} "
            "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for "
            "Memory Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
        )

    def _processes_said(self, in_use):
        """What PyTorch says of each process on the device, from NVML (its order): "Process N has
        X memory in use. ", and for itself "Including non-PyTorch memory, this process has ...".
        Nothing where NVML cannot be loaded; without a shared device (no other process) the
        device's use is this process's."""
        if os.environ.get("SIMCUDA_NVML") == "0":
            return ""
        if not os.environ.get("SIMCUDA_SHARED_DEVICES") or self.nvml is None:
            return f"Including non-PyTorch memory, this process has {format_size(in_use)} memory in use. "
        if self.nvml.nvmlInit_v2() != 0:
            return ""

        class ProcessInfo(ctypes.Structure):
            _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                        ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]

        handle = ctypes.c_void_p()
        if self.nvml.nvmlDeviceGetHandleByIndex_v2(self.device, ctypes.byref(handle)) != 0:
            return ""
        infos = (ProcessInfo * 64)()
        count = ctypes.c_uint(64)
        if self.nvml.nvmlDeviceGetComputeRunningProcesses_v3(handle, ctypes.byref(count), infos) != 0:
            return ""
        said = ""
        for info in infos[: count.value]:
            who = "Including non-PyTorch memory, this process" if info.pid == os.getpid() else f"Process {info.pid}"
            said += f"{who} has {format_size(info.usedGpuMemory)} memory in use. "
        return said

    def _record_truth(self, op, ptr, requested):
        if not self.truth:
            return
        s = self.stats()
        pools = {}
        for name, small in (("small", True), ("large", False)):
            segs = [seg for seg in self.segments if seg.small == small and seg.pool == DEFAULT_POOL]
            free = [b.size for seg in segs for b in seg.blocks if b.free and b.mapped]
            pools[name] = {
                "allocated": sum(b.size for seg in segs for b in seg.blocks if not b.free and not b.event_count),
                "reserved": sum(seg.mapped_bytes() for seg in segs),
                "free_blocks": len(free),
                "largest_free": max(free, default=0),
            }
        self.truth.write(json.dumps({
            "op": op, "ptr": ptr, "requested": requested, "allocated": s["allocated"],
            "reserved": s["reserved"], "free_blocks": len([1 for seg in self.segments for b in seg.blocks if b.free and b.mapped]),
            "largest_free": s["largest_free_block"], "pools": pools, "pending": self.pending()[1],
            "private_pools": self.private_pools(),
        }) + "\n")

    def private_pools(self):
        """Each private pool's figures, as tracer's layout gives them: id, segments, reserved,
        allocated, free, free blocks, largest free block."""
        out = []
        for pool in sorted({seg.pool for seg in self.segments} - {DEFAULT_POOL}):
            segs = [seg for seg in self.segments if seg.pool == pool]
            free = [b.size for seg in segs for b in seg.blocks if b.free and b.mapped]
            out.append({
                "id": list(pool), "segments": len(segs),
                "reserved": sum(seg.mapped_bytes() for seg in segs),
                "allocated": sum(b.size for seg in segs for b in seg.blocks if not b.free and b.mapped),
                "free": sum(free), "free_blocks": len(free), "largest_free": max(free, default=0),
                "segment_ptrs": sorted(seg.ptr for seg in segs),
            })
        return out

    # Expandable segments -------------------------------------------------------------------

    def _expandable_segment(self, small, stream, pool=DEFAULT_POOL):
        for seg in self.segments:
            if seg.small == small and seg.stream == stream and seg.pool == pool:
                return seg
        chunk = SMALL_SEGMENT if small else LARGE_SEGMENT
        _free, total = self.mem_get_info()
        # As PyTorch: address space for the device's memory and an eighth more.
        size = round_up(total + total // 8, chunk)
        ptr = ctypes.c_uint64()
        self.check(self.drv.cuMemAddressReserve(ctypes.byref(ptr), size, 0, 0, 0), "cuMemAddressReserve")
        seg = Segment(ptr.value, size, small, chunk, stream, pool)
        self.segments.append(seg)
        return seg

    def _map_chunks(self, seg, start, end):
        """Backs [start, end) of the segment with memory, chunk by chunk; False (and nothing
        kept) when the device runs out."""
        prop = (ctypes.c_int * 8)(1, 0, 1, self.device)  # pinned, on location device
        created = []
        for off in range(start, end, seg.chunk):
            handle = ctypes.c_uint64()
            if self.drv.cuMemCreate(ctypes.byref(handle), seg.chunk, prop, 0) != 0:
                for h in created:
                    self.drv.cuMemRelease(h)
                return False
            created.append(handle.value)
        for off, h in zip(range(start, end, seg.chunk), created):
            self.check(self.drv.cuMemMap(seg.ptr + off, seg.chunk, 0, h, 0), "cuMemMap")
            seg.handles[off] = h
        self._reserved_changed(end - start)
        return True

    def _grow_expandable(self, size, small, stream, pool=DEFAULT_POOL):
        """As PyTorch's find_expandable_block and try_allocate_expandable_block: the lowest
        unmapped range (with the free block just before it) that, with the free and unmapped
        blocks after it, holds `size`, mapped chunk by chunk until its free block does. None
        when the device is full."""
        seg = self._expandable_segment(small, stream, pool)
        blocks = seg.blocks
        start = None
        for i, b in enumerate(blocks):
            if b.mapped:
                continue
            j = i - 1 if i > 0 and blocks[i - 1].free and blocks[i - 1].mapped else i
            total, k = 0, j
            while k < len(blocks) and blocks[k].free and total < size:
                total += blocks[k].size
                k += 1
            if total >= size:
                start = j
                break
        if start is None:
            return None
        i = start
        if not blocks[i].mapped:
            i = self._map_front(seg, i, size)
        while i is not None and blocks[i].size < size:
            if i + 1 >= len(blocks) or blocks[i + 1].mapped:
                return None
            i = self._map_front(seg, i + 1, size - blocks[i].size)
        return None if i is None else blocks[i]

    def _map_front(self, seg, i, length):
        """Maps whole chunks covering the first `length` bytes of unmapped block i; they become
        a free block merged with free mapped neighbours. Its index, or None."""
        blocks = seg.blocks
        b = blocks[i]
        end = b.offset + min(round_up(length, seg.chunk), b.size)
        if not self._map_chunks(seg, b.offset, end):
            return None
        if end < b.offset + b.size:
            blocks.insert(i + 1, Block(seg, end, b.offset + b.size - end, mapped=False))
            b.size = end - b.offset
        b.mapped = True
        if i + 1 < len(blocks) and blocks[i + 1].free and blocks[i + 1].mapped:
            b.size += blocks[i + 1].size
            del blocks[i + 1]
        if i > 0 and blocks[i - 1].free and blocks[i - 1].mapped:
            blocks[i - 1].size += b.size
            del blocks[i]
            i -= 1
        return i

    def _unmap_free_chunks(self, seg):
        """Unmaps the whole chunks inside free blocks (empty_cache with expandable segments)."""
        new_blocks = []
        for b in seg.blocks:
            lo, hi = round_up(b.offset, seg.chunk), (b.offset + b.size) // seg.chunk * seg.chunk
            if not (b.free and b.mapped and lo < hi):
                new_blocks.append(b)
                continue
            for off in range(lo, hi, seg.chunk):
                self.check(self.drv.cuMemUnmap(seg.ptr + off, seg.chunk), "cuMemUnmap")
                self.check(self.drv.cuMemRelease(seg.handles.pop(off)), "cuMemRelease")
            self._reserved_changed(-(hi - lo))
            if lo > b.offset:
                new_blocks.append(Block(seg, b.offset, lo - b.offset))
            new_blocks.append(Block(seg, lo, hi - lo, mapped=False))
            if b.offset + b.size > hi:
                new_blocks.append(Block(seg, hi, b.offset + b.size - hi))
        # Neighbouring unmapped ranges are one.
        seg.blocks = []
        for b in new_blocks:
            last = seg.blocks[-1] if seg.blocks else None
            if last is not None and not last.mapped and not b.mapped:
                last.size += b.size
            else:
                seg.blocks.append(b)

    def _split(self, block, size, small):
        remaining = block.size - size
        # As PyTorch: small blocks split off 512 B or more, large ones more than 1 MiB; in an
        # expandable segment any remainder of 512 B or more is split.
        if remaining >= (MIN_BLOCK if small or block.segment.chunk else SMALL_SIZE + 1):
            seg = block.segment
            rest = Block(seg, block.offset + size, remaining)
            seg.blocks.insert(seg.blocks.index(block) + 1, rest)
            block.size = size

    def new_stream(self):
        s = ctypes.c_void_p()
        self.check(self.rt.cudaStreamCreate(ctypes.byref(s)), "cudaStreamCreate")
        return s.value

    def fill(self, block, stream):
        """Work on `stream` that uses the block (a kernel, here a memset)."""
        self.check(self.rt.cudaMemsetAsync(ctypes.c_void_p(block.ptr), 0, block.size, ctypes.c_void_p(stream)), "cudaMemsetAsync")

    def record_stream(self, block, stream):
        """As Tensor.record_stream: the block is used on `stream` too; no CUDA call."""
        with self.lock:
            if stream != block.segment.stream:
                block.stream_uses.add(stream)

    def free(self, block):
        self._free(block, probes=True)

    def raw_delete(self, block):
        """As torch.cuda.caching_allocator_delete (raw_delete): no probe fires."""
        self._free(block, probes=False)

    def _free(self, block, probes):
        with self.lock:
            if self.probes and probes:
                self.probes.simtorch_free(block.ptr)
            block.requested = 0
            if block.stream_uses:
                self._insert_events(block)
            else:
                self._free_block(block)

    def _insert_events(self, block):
        """As PyTorch's insert_events: one event per stream the block was used on, recorded from
        the allocator's library; the block stays out of its pool until they complete."""
        for stream in block.stream_uses:
            if self.event_pool:
                event = self.event_pool.pop()
            else:
                e = ctypes.c_void_p()
                self.check(self.rt.cudaEventCreateWithFlags(ctypes.byref(e), 2), "cudaEventCreateWithFlags")
                event = e.value
            self.check(self.probes.simtorch_record_event(event, stream), "cudaEventRecord")
            block.event_count += 1
            self.cuda_events.setdefault(stream, []).append((event, block))
        block.stream_uses = set()
        self._record_truth("free_requested", block.ptr, 0)

    def _process_events(self):
        """As PyTorch's process_events (at each malloc): blocks whose events completed return
        to their pool; a stream's queue stops at its first event not ready."""
        for stream in list(self.cuda_events):
            queue = self.cuda_events[stream]
            while queue:
                event, block = queue[0]
                ret = self.rt.cudaEventQuery(ctypes.c_void_p(event))
                if ret == 600:
                    break
                self.check(ret, "cudaEventQuery")
                self._event_done(event, block)
                queue.pop(0)
            if not queue:
                del self.cuda_events[stream]

    def _synchronize_and_free_events(self):
        for queue in self.cuda_events.values():
            for event, block in queue:
                self.check(self.rt.cudaEventSynchronize(ctypes.c_void_p(event)), "cudaEventSynchronize")
                self._event_done(event, block)
        self.cuda_events = {}

    def _event_done(self, event, block):
        self.event_pool.append(event)
        block.event_count -= 1
        if block.event_count == 0:
            self._free_block(block, "free_completed")

    def pending(self):
        """Blocks freed and kept for other streams' work: (blocks, bytes)."""
        blocks = [b for q in self.cuda_events.values() for _, b in q]
        unique = {id(b): b for b in blocks}.values()
        return len(unique), sum(b.size for b in unique)

    def _free_block(self, block, op="free"):
        """The block back in its pool, merged with free neighbours."""
        ptr = block.ptr
        block.free = True
        blocks = block.segment.blocks
        i = blocks.index(block)
        if i + 1 < len(blocks) and blocks[i + 1].free and blocks[i + 1].mapped:
            block.size += blocks[i + 1].size
            del blocks[i + 1]
        if i > 0 and blocks[i - 1].free and blocks[i - 1].mapped:
            blocks[i - 1].size += block.size
            del blocks[i]
        self._record_truth(op, ptr, 0)

    def _pool_of(self, stream):
        """The pool a request on `stream` from this thread goes to (PyTorch's get_pool: a
        capture routes by stream, use_mem_pool by thread)."""
        if stream in self.captures:
            return self.captures[stream]
        return self.thread_routes.get(threading.get_ident(), DEFAULT_POOL)

    def _routing(self):
        return bool(self.captures or self.thread_routes)

    def empty_cache(self):
        with self.lock:
            # As PyTorch: no flush while a capture is underway.
            return False if self.captures else self._release_cached()

    # Memory pools (torch.cuda.MemPool) ------------------------------------------------------

    def _pool_call(self, kind, pool, flag=0):
        """PyTorch's allocator's pool method `kind` (0 begin, 1 end, 2 release, 3 create, 4
        use_on_oom) for `pool`, through libsimtorch's copies of NativeCachingAllocator's, with
        the use count as PyTorch keeps it."""
        if self.probes:
            f = self.probes.simtorch_pool
            f.argtypes = [ctypes.c_int, ctypes.c_int8, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int]
            f.restype = None
            f(kind, self.device, pool[0], pool[1], flag)
        if kind in (0, 3):
            self.pool_use[pool] = self.pool_use.get(pool, 0) + 1
            self.freeable.discard(pool)
        elif kind == 2:
            self.pool_use[pool] -= 1
            if self.pool_use[pool] == 0:
                del self.pool_use[pool]
                self.freeable.add(pool)

    def mem_pool(self, use_on_oom=False, nccl=False):
        """As torch.cuda.MemPool(use_on_oom=...): a user pool (0, n), made with its use count
        at 1 (createOrIncrefPool), marked use_on_oom where asked. With nccl=True, as
        torch.cuda.MemPool(backend.mem_allocator) for NCCL's symmetric memory: its segments come
        from ncclMemAlloc (libsimnccl.so beside the runtime), not cudaMalloc."""
        with self.lock:
            pool = (0, self.next_user_pool)
            self.next_user_pool += 1
            if nccl:
                lib = ctypes.CDLL(os.path.join(os.path.dirname(os.path.abspath(self.cudart_path)), "libsimnccl.so"))
                lib.ncclMemAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
                lib.ncclMemFree.argtypes = [ctypes.c_void_p]
                self.pool_allocators[pool] = lib
            self._pool_call(3, pool)
            if use_on_oom:
                self._pool_call(4, pool, 1)
                self.use_on_oom.add(pool)
        return pool

    def use_mem_pool(self, pool):
        """As torch.cuda.use_mem_pool(pool): this thread's requests go to `pool` until the
        returned context ends (beginAllocateToPool .. endAllocateToPool, releasePool)."""
        allocator = self

        class Routed:
            def __enter__(self):
                with allocator.lock:
                    allocator._pool_call(0, pool)
                    allocator.thread_routes[threading.get_ident()] = pool

            def __exit__(self, *exc):
                with allocator.lock:
                    allocator._pool_call(1, pool)
                    allocator.thread_routes = {t: p for t, p in allocator.thread_routes.items() if p != pool}
                    allocator._pool_call(2, pool)
                return False

        return Routed()

    def drop_mem_pool(self, pool):
        """As ~MemPool: unmarked use_on_oom, released, then emptyCache for the pool: its
        segments with no live block go back if nothing else holds it."""
        with self.lock:
            if pool in self.use_on_oom:
                self._pool_call(4, pool, 0)
                self.use_on_oom.discard(pool)
            self._pool_call(2, pool)
            if not self._routing():
                self._release_cached()

    # CUDA graphs ---------------------------------------------------------------------------

    def graph_pool_handle(self):
        """As torch.cuda.graph_pool_handle(): a pool id graphs captured with it share."""
        with self.lock:
            pool = (0, self.next_user_pool)
            self.next_user_pool += 1
            return pool

    def _graph_call(self, symbol, *args):
        if self.probes:
            f = getattr(self.probes, symbol)
            f.restype = None
            f(*args)

    def capture_begin(self, graph, stream, pool=None):
        """As CUDAGraph::capture_begin on `stream` (a side stream, as torch.cuda.graph uses):
        the pool chosen, requests on the stream routed to it, the stream's capture begun."""
        given = pool or DEFAULT_POOL
        self._graph_call(CAPTURE_BEGIN, ctypes.c_void_p(graph.address), ctypes.c_uint64(given[0]),
                         ctypes.c_uint64(given[1]), ctypes.c_int(0))
        with self.lock:
            if given == DEFAULT_POOL:
                given = (self.next_graph_pool, 0)
                self.next_graph_pool += 1
            self._pool_call(0, given)
            self.captures[stream] = given
        graph.pool, graph.stream = given, stream
        self.rt.cudaStreamBeginCapture.argtypes = [ctypes.c_void_p, ctypes.c_int]
        self.check(self.rt.cudaStreamBeginCapture(ctypes.c_void_p(stream), 0), "cudaStreamBeginCapture")

    def wait_stream(self, waiter, stream):
        """As Stream.wait_stream: an event recorded on `stream`, waited on by `waiter`; a
        capturing stream's event joins the waiter to its capture."""
        e = ctypes.c_void_p()
        self.check(self.rt.cudaEventCreateWithFlags(ctypes.byref(e), 2), "cudaEventCreateWithFlags")
        self.check(self.rt.cudaEventRecord(e, ctypes.c_void_p(stream)), "cudaEventRecord")
        self.check(self.rt.cudaStreamWaitEvent(ctypes.c_void_p(waiter), e, 0), "cudaStreamWaitEvent")
        with self.lock:
            if stream in self.captures:
                self.captures[waiter] = self.captures[stream]

    def capture_end(self, graph, keep_graph=False):
        """As CUDAGraph::capture_end: the stream's capture ended (and every stream joined to
        it), routing to the pool ended, the graph instantiated; without keep_graph the
        cudaGraph is destroyed at once, the pool stays."""
        self._graph_call(CAPTURE_END, ctypes.c_void_p(graph.address))
        g = ctypes.c_void_p()
        self.rt.cudaStreamEndCapture.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
        self.check(self.rt.cudaStreamEndCapture(ctypes.c_void_p(graph.stream), ctypes.byref(g)), "cudaStreamEndCapture")
        with self.lock:
            self._pool_call(1, graph.pool)
            self.captures = {s: p for s, p in self.captures.items() if p != graph.pool}
        exe = ctypes.c_void_p()
        self.rt.cudaGraphInstantiateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_ulonglong]
        self.check(self.rt.cudaGraphInstantiateWithFlags(ctypes.byref(exe), g, 0), "cudaGraphInstantiateWithFlags")
        graph.exec = exe.value
        if not keep_graph:
            self.rt.cudaGraphDestroy.argtypes = [ctypes.c_void_p]
            self.check(self.rt.cudaGraphDestroy(g), "cudaGraphDestroy")

    def replay(self, graph):
        """As CUDAGraph::replay: the executable graph launched; nothing is allocated."""
        self.rt.cudaGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self.check(self.rt.cudaGraphLaunch(ctypes.c_void_p(graph.exec), ctypes.c_void_p(graph.stream)), "cudaGraphLaunch")

    def reset(self, graph):
        """As CUDAGraph::reset (and its destructor): the executable graph destroyed, the pool
        let go of; freeable once no graph uses it."""
        self._graph_call(GRAPH_RESET, ctypes.c_void_p(graph.address))
        if graph.exec:
            self.rt.cudaGraphExecDestroy.argtypes = [ctypes.c_void_p]
            self.check(self.rt.cudaGraphExecDestroy(ctypes.c_void_p(graph.exec)), "cudaGraphExecDestroy")
            graph.exec = None
        with self.lock:
            if graph.pool is not None:
                self._pool_call(2, graph.pool)
            graph.pool = None

    def memory_stats(self):
        """The counters of torch.cuda.memory_stats(), under its keys."""
        s = self.stats()
        return {
            "num_device_alloc": self.num_device_alloc,
            "num_device_free": self.num_device_free,
            "num_alloc_retries": self.num_alloc_retries,
            "num_ooms": self.num_ooms,
            "reserved_bytes.all.current": s["reserved"],
            "reserved_bytes.all.peak": self.reserved_peak,
            "reserved_bytes.all.allocated": self.reserved_allocated,
            "reserved_bytes.all.freed": self.reserved_freed,
            "allocated_bytes.all.current": s["allocated"],
            "segment.all.current": s["segments"],
            "inactive_split_bytes.all.current": s["inactive_split"],
        }

    def stats(self):
        # As PyTorch: a block freed and kept for other streams' work is no longer allocated,
        # and not free either.
        allocated = sum(b.size for s in self.segments for b in s.blocks if not b.free and not b.event_count)
        reserved = sum(s.mapped_bytes() for s in self.segments)
        free_blocks = [b.size for s in self.segments for b in s.blocks if b.free and b.mapped]
        return {
            "allocated": allocated,
            "reserved": reserved,
            "segments": len(self.segments),
            "blocks": sum(len(s.blocks) for s in self.segments),
            "largest_free_block": max(free_blocks, default=0),
            # What a cache flush would give back: segments (or chunks) with nothing allocated.
            "releasable": sum(
                s.mapped_bytes() for s in self.segments
                if all(b.free for b in s.blocks) and not s.chunk and self._releasable_pool(s.pool)
            ),
            "inactive_split": sum(free_blocks),
            "num_alloc_retries": self.num_alloc_retries,
            "num_ooms": self.num_ooms,
        }

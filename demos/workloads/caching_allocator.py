"""A caching allocator in the manner of PyTorch's CUDACachingAllocator, over a CUDA runtime
loaded with ctypes (the project's simulated one, or a real one).

Segments come from cudaMalloc: requests up to 1 MiB are served from 2 MiB segments (small pool),
1-10 MiB from 20 MiB segments, larger ones from segments rounded up to 2 MiB (large pool).
Segments are split into blocks; freed blocks stay cached and merge with free neighbours. When
cudaMalloc fails, the allocator frees its unused cached segments and retries once; if that fails
too it raises OutOfMemoryError with the numbers PyTorch prints. stats() reports the allocator's own
truth (allocated, reserved, blocks, largest free block) for tests.
"""

import ctypes
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
    __slots__ = ("segment", "offset", "size", "free", "requested")

    def __init__(self, segment, offset, size, free=True):
        self.segment = segment
        self.offset = offset
        self.size = size
        self.free = free
        self.requested = 0

    @property
    def ptr(self):
        return self.segment.ptr + self.offset


class Segment:
    __slots__ = ("ptr", "size", "small", "blocks")

    def __init__(self, ptr, size, small):
        self.ptr = ptr
        self.size = size
        self.small = small
        self.blocks = [Block(self, 0, size)]


def round_size(size):
    return max(MIN_BLOCK, (size + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK)


def segment_size(size):
    if size <= SMALL_SIZE:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE


class CachingAllocator:
    def __init__(self, cudart_path, device=0):
        self.rt = ctypes.CDLL(cudart_path)
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
        self.check(self.rt.cudaSetDevice(device), "cudaSetDevice")

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

    def _best_fit(self, size, small):
        best = None
        for seg in self.segments:
            if seg.small != small:
                continue
            for block in seg.blocks:
                if block.free and block.size >= size and (best is None or block.size < best.size):
                    best = block
        return best

    def _release_cached(self):
        """Frees every segment that is entirely unused (what a failed cudaMalloc triggers)."""
        self.synchronize()
        kept = []
        for seg in self.segments:
            if len(seg.blocks) == 1 and seg.blocks[0].free:
                self.check(self.rt.cudaFree(ctypes.c_void_p(seg.ptr)), "cudaFree")
            else:
                kept.append(seg)
        released = len(self.segments) - len(kept)
        self.segments = kept
        return released

    def malloc(self, size):
        with self.lock:
            size = round_size(size)
            small = size <= SMALL_SIZE
            block = self._best_fit(size, small)
            if block is None:
                seg_size = segment_size(size)
                ptr = self._cuda_malloc(seg_size)
                if ptr is None:
                    self.num_alloc_retries += 1
                    if self._release_cached():
                        ptr = self._cuda_malloc(seg_size)
                if ptr is None:
                    self.num_ooms += 1
                    free, total = self.mem_get_info()
                    s = self.stats()
                    raise OutOfMemoryError(
                        f"CUDA out of memory. Tried to allocate {size / MIB:.2f} MiB (GPU {self.device}; "
                        f"{total / MIB:.2f} MiB total capacity; {s['allocated'] / MIB:.2f} MiB already allocated; "
                        f"{free / MIB:.2f} MiB free; {s['reserved'] / MIB:.2f} MiB reserved in total by the allocator)"
                    )
                seg = Segment(ptr, seg_size, small)
                self.segments.append(seg)
                block = seg.blocks[0]
            self._split(block, size, small)
            block.free = False
            block.requested = size
            return block

    def _split(self, block, size, small):
        remaining = block.size - size
        if remaining >= (MIN_BLOCK if small else SMALL_SIZE + 1):
            seg = block.segment
            rest = Block(seg, block.offset + size, remaining)
            seg.blocks.insert(seg.blocks.index(block) + 1, rest)
            block.size = size

    def free(self, block):
        with self.lock:
            block.free = True
            block.requested = 0
            blocks = block.segment.blocks
            i = blocks.index(block)
            if i + 1 < len(blocks) and blocks[i + 1].free:
                block.size += blocks[i + 1].size
                del blocks[i + 1]
            if i > 0 and blocks[i - 1].free:
                blocks[i - 1].size += block.size
                del blocks[i]

    def empty_cache(self):
        with self.lock:
            return self._release_cached()

    def stats(self):
        allocated = sum(b.size for s in self.segments for b in s.blocks if not b.free)
        reserved = sum(s.size for s in self.segments)
        free_blocks = [b.size for s in self.segments for b in s.blocks if b.free]
        return {
            "allocated": allocated,
            "reserved": reserved,
            "segments": len(self.segments),
            "blocks": sum(len(s.blocks) for s in self.segments),
            "largest_free_block": max(free_blocks, default=0),
            "inactive_split": sum(free_blocks),
            "num_alloc_retries": self.num_alloc_retries,
            "num_ooms": self.num_ooms,
        }

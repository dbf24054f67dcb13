//! The probe table: every traced API is one line here, read by both the eBPF programs (through
//! [`PLANS`]) and the `tracer` binary (symbols to attach, names to store).
//!
//! Over 700 lines because the table is one entry per traced API (63 of them), each a few lines
//! as rustfmt lays it out: split, a reader would look in several files for one table.

/// Arguments the probes look at (x86-64 passes up to six in registers).
pub const MAX_ARGS: usize = 5;
/// [`OpPlan`] field value for "no such argument".
pub const NO_ARG: u8 = 0xff;

/// Which library exports the symbol.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Library {
    /// libcudart (or an executable that links it statically).
    Runtime = 0,
    /// libcuda, the driver API.
    Driver = 1,
    /// PyTorch's own probes: the USDT sites of libc10_cuda (its caching allocator) and the
    /// OutOfMemoryError constructor of libc10.
    Torch = 2,
    /// Not a library: what tracer itself did to the probes of a process (arming PyTorch's
    /// allocator probes, `--allocator auto`), stored in the call stream so that every reader
    /// replays it in order.
    Tracer = 3,
}

impl Library {
    pub const fn name(self) -> &'static str {
        match self {
            Library::Runtime => "libcudart",
            Library::Driver => "libcuda",
            Library::Torch => "pytorch",
            Library::Tracer => "tracer",
        }
    }
}

/// Kinds of pointer a call hands out; an allocation and its free share one.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Space {
    None = 0,
    /// Device (and managed) memory: cudaMalloc*, cuMemAlloc*.
    Device = 1,
    /// Pinned host memory: cudaMallocHost, cudaHostAlloc.
    Host = 2,
    /// Physical allocation handles: cuMemCreate / cuMemRelease.
    Handle = 3,
    /// Reserved virtual address ranges: cuMemAddressReserve / cuMemAddressFree.
    AddressRange = 4,
    /// Mappings of handles into ranges: cuMemMap / cuMemUnmap.
    Mapping = 5,
    /// Blocks the framework's caching allocator hands out inside its segments.
    Block = 6,
}

/// What a call does, for the probes and for analysis.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpClass {
    Alloc = 1,
    Free = 2,
    /// Reports free and total memory (cudaMemGetInfo, cuMemGetInfo).
    MemInfo = 3,
    SetDevice = 4,
    Sync = 5,
    /// The framework's allocator handed out a block (pytorch:malloc): not device memory of its own.
    BlockAlloc = 6,
    /// The framework's allocator took a block back into its cache (pytorch:free).
    BlockFree = 7,
    /// The framework raised out-of-memory (c10::OutOfMemoryError), with its message.
    Oom = 8,
    /// An event recorded on a stream (cudaEventRecord): the caching allocator records one per
    /// stream a freed block was used on (`record_stream`) and keeps the block until they complete.
    EventRecord = 9,
    /// An event found complete (cudaEventQuery, cudaEventSynchronize returning success).
    EventWait = 10,
    /// A driver context made the calling thread's current one (cuCtxSetCurrent): its device is
    /// the thread's device from then on. The context is the pointer.
    SetContext = 11,
    /// A device's context handed out (cuDevicePrimaryCtxRetain): the pointer is the context,
    /// the device is its device.
    Context = 12,
    /// tracer armed or disarmed PyTorch's allocator probes in a process (no call of the
    /// program): from then on its block events are seen, or no longer.
    Probes = 13,
    /// A stream began capturing work into a CUDA graph (cudaStreamBeginCapture): the stream in
    /// aux0, the capture mode in aux1.
    CaptureBegin = 14,
    /// A stream's capture ended (cudaStreamEndCapture): the stream in aux0, the graph made is
    /// the pointer. Every stream joined to the capture leaves it too.
    CaptureEnd = 15,
    /// A stream waits on an event (cudaStreamWaitEvent): the stream in aux0, the event the
    /// pointer. An event recorded on a capturing stream joins the waiting stream to that capture.
    StreamWait = 16,
    /// A thread's capture mode exchanged (cudaThreadExchangeStreamCaptureMode): PyTorch relaxes
    /// it around each cudaMalloc it makes during a capture.
    CaptureMode = 17,
    /// A CUDA graph made executable, replayed or destroyed (cudaGraphInstantiate, Launch,
    /// Destroy): the graph or executable graph is the pointer. No memory of the caching
    /// allocator moves: a replay allocates nothing.
    Graph = 18,
    /// PyTorch began a capture into a private pool (at::cuda::CUDAGraph::capture_begin): the
    /// CUDAGraph object is the pointer, the pool id it was given in aux0 and aux1 ((0, 0): a new
    /// pool, which PyTorch numbers itself).
    PoolCapture = 19,
    /// PyTorch's capture ended (CUDAGraph::capture_end): the CUDAGraph object is the pointer.
    PoolCaptured = 20,
    /// A CUDA graph let go of its private pool (CUDAGraph::reset, also run by its destructor):
    /// the CUDAGraph object is the pointer. The pool's free segments go back at the next flush
    /// once no graph uses it.
    PoolReset = 21,
    /// PyTorch's allocator began routing requests to a pool (NativeCachingAllocator::
    /// beginAllocateToPool): a capture's, `use_mem_pool`'s (the calling thread's requests), or
    /// torch.compile's graph trees' warm-up (the current stream's). The pool id in aux0 and
    /// aux1; the pool's use count grows by one.
    PoolRoute = 22,
    /// Routing to a pool ended (endAllocateToPool): the pool id in aux0 and aux1.
    PoolUnroute = 23,
    /// A pool's use count fell by one (releasePool): at 0 it is freeable, and its segments with
    /// no live block go back at the next flush. The pool id in aux0 and aux1.
    PoolRelease = 24,
    /// A pool made or its use count raised (createOrIncrefPool: a `torch.cuda.MemPool` made).
    /// The pool id in aux0 and aux1.
    PoolCreate = 25,
    /// A pool marked, or unmarked, as one an out-of-memory request may use as a last resort
    /// (setUseOnOOM: `MemPool(use_on_oom=True)`): the pool id in aux0 and aux1, the mark in
    /// size (1 or 0).
    PoolOnOom = 26,
}

impl OpClass {
    /// PyTorch's own calls about private pools (CUDAGraph's and the caching allocator's
    /// methods): they move no memory, they say where requests go.
    pub const fn is_pool_call(self) -> bool {
        matches!(
            self,
            OpClass::PoolCapture
                | OpClass::PoolCaptured
                | OpClass::PoolReset
                | OpClass::PoolRoute
                | OpClass::PoolUnroute
                | OpClass::PoolRelease
                | OpClass::PoolCreate
                | OpClass::PoolOnOom
        )
    }
}

/// The meaning of one argument.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgRole {
    Ignored,
    /// Bytes requested or released.
    Size,
    /// Out-parameter receiving the new pointer or handle.
    PtrOut,
    /// A pointer or handle passed in (freed, or mapped at).
    Ptr,
    Device,
    /// Stored in aux0.
    Stream,
    /// Stored in aux1.
    Flags,
    /// Out-parameter receiving free bytes (stored in aux0).
    FreeOut,
    /// Out-parameter receiving total bytes (stored in aux1).
    TotalOut,
    /// Out-parameter receiving the pitch (aux0); size = pitch * height.
    PitchOut,
    /// Row width in bytes (aux1).
    Width,
    Height,
    /// Stored in aux0.
    Alignment,
    /// A physical allocation handle passed in (aux0).
    Handle,
    /// A `const CUmemAllocationProp *`: the device is read from its `location.id`.
    AllocProp,
    /// The first half of PyTorch's `MempoolId_t` (a pair of u64 passed in two registers):
    /// stored in aux0.
    PoolFirst,
    /// Its second half: stored in aux1.
    PoolSecond,
    /// Not an argument: the call's return address (who called it), read from the stack at
    /// entry into this position and stored in aux1. Listed after the real arguments.
    Caller,
}

/// One traced API.
#[derive(Clone, Copy, Debug)]
pub struct ProbeSpec {
    pub op: Op,
    /// The name stored and shown: the base symbol, or `provider:name` of a USDT probe.
    pub name: &'static str,
    /// The base symbol; exported variants `<symbol>_ptsz` and `<symbol>_ptds` are attached too.
    /// Empty for USDT probes, which are found by their notes (see [`crate::usdt`]).
    pub symbol: &'static str,
    pub library: Library,
    pub class: OpClass,
    pub space: Space,
    pub args: &'static [ArgRole],
}

/// Symbol suffixes of the per-thread-default-stream variants.
pub const VARIANT_SUFFIXES: [&str; 2] = ["_ptsz", "_ptds"];

macro_rules! ops {
    ($($variant:ident = $value:literal,)*) => {
        /// The traced APIs. Values are stable (stored in databases) and index [`PROBES`].
        #[repr(u32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Op { $($variant = $value,)* }

        impl Op {
            pub const ALL: [Op; OP_COUNT] = [$(Op::$variant,)*];

            pub const fn from_u32(value: u32) -> Option<Op> {
                match value {
                    $($value => Some(Op::$variant),)*
                    _ => None,
                }
            }
        }
    };
}

ops! {
    CudaMalloc = 0,
    CudaFree = 1,
    CudaMallocAsync = 2,
    CudaFreeAsync = 3,
    CudaMallocManaged = 4,
    CudaMallocHost = 5,
    CudaHostAlloc = 6,
    CudaFreeHost = 7,
    CudaMallocPitch = 8,
    CudaMemGetInfo = 9,
    CudaSetDevice = 10,
    CudaDeviceSynchronize = 11,
    CudaStreamSynchronize = 12,
    CudaMallocFromPoolAsync = 13,
    CuMemAlloc = 14,
    CuMemFree = 15,
    CuMemAllocAsync = 16,
    CuMemFreeAsync = 17,
    CuMemAllocManaged = 18,
    CuMemGetInfo = 19,
    CuMemAddressReserve = 20,
    CuMemAddressFree = 21,
    CuMemCreate = 22,
    CuMemRelease = 23,
    CuMemMap = 24,
    CuMemUnmap = 25,
    CuMemAllocFromPoolAsync = 26,
    TorchMalloc = 27,
    TorchFree = 28,
    TorchOom = 29,
    CudaEventRecord = 30,
    CudaEventQuery = 31,
    CudaEventSynchronize = 32,
    CuCtxSetCurrent = 33,
    CuDevicePrimaryCtxRetain = 34,
    AllocatorArmed = 35,
    AllocatorDisarmed = 36,
    AllocatorArming = 37,
    CudaStreamBeginCapture = 38,
    CudaStreamEndCapture = 39,
    CudaStreamWaitEvent = 40,
    CudaThreadExchangeStreamCaptureMode = 41,
    CudaGraphInstantiate = 42,
    CudaGraphInstantiateWithFlags = 43,
    CudaGraphLaunch = 44,
    CudaGraphExecDestroy = 45,
    CudaGraphDestroy = 46,
    CuStreamBeginCapture = 47,
    CuStreamEndCapture = 48,
    CuStreamWaitEvent = 49,
    CuThreadExchangeStreamCaptureMode = 50,
    CuGraphInstantiate = 51,
    CuGraphLaunch = 52,
    CuGraphExecDestroy = 53,
    CuGraphDestroy = 54,
    TorchCaptureBegin = 55,
    TorchCaptureEnd = 56,
    TorchGraphReset = 57,
    TorchPoolRoute = 58,
    TorchPoolUnroute = 59,
    TorchPoolRelease = 60,
    TorchPoolCreate = 61,
    TorchPoolOnOom = 62,
}

pub const OP_COUNT: usize = 63;

use ArgRole::*;
use Library::{Driver, Runtime, Torch};

const fn probe(
    op: Op,
    symbol: &'static str,
    library: Library,
    class: OpClass,
    space: Space,
    args: &'static [ArgRole],
) -> ProbeSpec {
    ProbeSpec {
        op,
        name: symbol,
        symbol,
        library,
        class,
        space,
        args,
    }
}

/// A USDT probe: no symbol, found by its note; `args` in the order the note lists them.
const fn usdt(op: Op, name: &'static str, class: OpClass, args: &'static [ArgRole]) -> ProbeSpec {
    ProbeSpec {
        op,
        name,
        symbol: "",
        library: Torch,
        class,
        space: Space::Block,
        args,
    }
}

/// What tracer did to a process's probes: no symbol, no note, never attached. The mark's `ret`
/// says why (tracer-cli's model/arming.rs), `size` and `aux0` the figures behind it.
const fn tracer_mark(op: Op, name: &'static str) -> ProbeSpec {
    ProbeSpec {
        op,
        name,
        symbol: "",
        library: Library::Tracer,
        class: OpClass::Probes,
        space: Space::None,
        args: &[],
    }
}

/// `c10::Error::Error(c10::SourceLocation, std::string)` (the base object constructor, which
/// a derived error's constructor calls): the real wheels build OutOfMemoryError inline from it
/// (2.11 exports no constructor of its own; 2.15's calls this one), so PyTorch's out-of-memory
/// message passes here; the program keeps only those ([`crate::usdt::OOM_MESSAGE_PREFIX`]).
/// `this` in the first register, the 24-byte SourceLocation on the stack, so the message (a
/// std::string, passed by reference) is the second register argument.
pub const TORCH_OOM_SYMBOL: &str =
    "_ZN3c105ErrorC2ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE";

/// `at::cuda::CUDAGraph::capture_begin(MempoolId_t, cudaStreamCaptureMode)` (libtorch_cuda.so):
/// `this`, then the pool id's two halves in registers (a trivially copyable pair), then the mode.
pub const TORCH_CAPTURE_BEGIN_SYMBOL: &str =
    "_ZN2at4cuda9CUDAGraph13capture_beginESt4pairIyyE21cudaStreamCaptureMode";
/// `at::cuda::CUDAGraph::capture_end()`.
pub const TORCH_CAPTURE_END_SYMBOL: &str = "_ZN2at4cuda9CUDAGraph11capture_endEv";
/// `at::cuda::CUDAGraph::reset()`.
pub const TORCH_GRAPH_RESET_SYMBOL: &str = "_ZN2at4cuda9CUDAGraph5resetEv";

/// PyTorch's caching allocator's pool methods (c10::cuda::CUDACachingAllocator::Native::
/// NativeCachingAllocator, libc10_cuda.so): local symbols, found in the library's own symbol
/// table (the wheels keep it), called through the allocator's vtable. `this`, the device (a
/// signed byte), the pool id's two halves in registers.
pub const TORCH_POOL_ROUTE_SYMBOL: &str = "_ZN3c104cuda20CUDACachingAllocator6Native22NativeCachingAllocator19beginAllocateToPoolEaSt4pairIyyESt8functionIFbP11CUstream_stEE";
/// `endAllocateToPool(DeviceIndex, MempoolId_t)`.
pub const TORCH_POOL_UNROUTE_SYMBOL: &str =
    "_ZN3c104cuda20CUDACachingAllocator6Native22NativeCachingAllocator17endAllocateToPoolEaSt4pairIyyE";
/// `releasePool(DeviceIndex, MempoolId_t)`.
pub const TORCH_POOL_RELEASE_SYMBOL: &str =
    "_ZN3c104cuda20CUDACachingAllocator6Native22NativeCachingAllocator11releasePoolEaSt4pairIyyE";
/// `createOrIncrefPool(DeviceIndex, MempoolId_t, std::shared_ptr<CUDAAllocator>)`.
pub const TORCH_POOL_CREATE_SYMBOL: &str = "_ZN3c104cuda20CUDACachingAllocator6Native22NativeCachingAllocator18createOrIncrefPoolEaSt4pairIyyESt10shared_ptrINS1_13CUDAAllocatorEE";
/// `setUseOnOOM(DeviceIndex, MempoolId_t, bool)`.
pub const TORCH_POOL_ON_OOM_SYMBOL: &str =
    "_ZN3c104cuda20CUDACachingAllocator6Native22NativeCachingAllocator11setUseOnOOMEaSt4pairIyyEb";

/// A member function of PyTorch's (CUDAGraph's, the caching allocator's): found by its mangled
/// symbol, stored by `name`. It returns nothing: the return program's `ret` is whatever rax held (read as 0).
const fn torch_graph(
    op: Op,
    name: &'static str,
    symbol: &'static str,
    class: OpClass,
    args: &'static [ArgRole],
) -> ProbeSpec {
    ProbeSpec {
        op,
        name,
        symbol,
        library: Torch,
        class,
        space: Space::None,
        args,
    }
}

/// The table. Indexed by `Op as usize` (checked at compile time below).
pub const PROBES: [ProbeSpec; OP_COUNT] = [
    probe(
        Op::CudaMalloc,
        "cudaMalloc",
        Runtime,
        OpClass::Alloc,
        Space::Device,
        &[PtrOut, Size],
    ),
    probe(
        Op::CudaFree,
        "cudaFree",
        Runtime,
        OpClass::Free,
        Space::Device,
        &[Ptr],
    ),
    probe(
        Op::CudaMallocAsync,
        "cudaMallocAsync",
        Runtime,
        OpClass::Alloc,
        Space::Device,
        &[PtrOut, Size, Stream],
    ),
    probe(
        Op::CudaFreeAsync,
        "cudaFreeAsync",
        Runtime,
        OpClass::Free,
        Space::Device,
        &[Ptr, Stream],
    ),
    probe(
        Op::CudaMallocManaged,
        "cudaMallocManaged",
        Runtime,
        OpClass::Alloc,
        Space::Device,
        &[PtrOut, Size, Flags],
    ),
    probe(
        Op::CudaMallocHost,
        "cudaMallocHost",
        Runtime,
        OpClass::Alloc,
        Space::Host,
        &[PtrOut, Size],
    ),
    probe(
        Op::CudaHostAlloc,
        "cudaHostAlloc",
        Runtime,
        OpClass::Alloc,
        Space::Host,
        &[PtrOut, Size, Flags],
    ),
    probe(
        Op::CudaFreeHost,
        "cudaFreeHost",
        Runtime,
        OpClass::Free,
        Space::Host,
        &[Ptr],
    ),
    probe(
        Op::CudaMallocPitch,
        "cudaMallocPitch",
        Runtime,
        OpClass::Alloc,
        Space::Device,
        &[PtrOut, PitchOut, Width, Height],
    ),
    probe(
        Op::CudaMemGetInfo,
        "cudaMemGetInfo",
        Runtime,
        OpClass::MemInfo,
        Space::None,
        &[FreeOut, TotalOut],
    ),
    probe(
        Op::CudaSetDevice,
        "cudaSetDevice",
        Runtime,
        OpClass::SetDevice,
        Space::None,
        &[Device],
    ),
    probe(
        Op::CudaDeviceSynchronize,
        "cudaDeviceSynchronize",
        Runtime,
        OpClass::Sync,
        Space::None,
        &[],
    ),
    probe(
        Op::CudaStreamSynchronize,
        "cudaStreamSynchronize",
        Runtime,
        OpClass::Sync,
        Space::None,
        &[Stream],
    ),
    probe(
        Op::CudaMallocFromPoolAsync,
        "cudaMallocFromPoolAsync",
        Runtime,
        OpClass::Alloc,
        Space::Device,
        &[PtrOut, Size, Ignored, Stream],
    ),
    probe(
        Op::CuMemAlloc,
        "cuMemAlloc_v2",
        Driver,
        OpClass::Alloc,
        Space::Device,
        &[PtrOut, Size],
    ),
    probe(
        Op::CuMemFree,
        "cuMemFree_v2",
        Driver,
        OpClass::Free,
        Space::Device,
        &[Ptr],
    ),
    probe(
        Op::CuMemAllocAsync,
        "cuMemAllocAsync",
        Driver,
        OpClass::Alloc,
        Space::Device,
        &[PtrOut, Size, Stream],
    ),
    probe(
        Op::CuMemFreeAsync,
        "cuMemFreeAsync",
        Driver,
        OpClass::Free,
        Space::Device,
        &[Ptr, Stream],
    ),
    probe(
        Op::CuMemAllocManaged,
        "cuMemAllocManaged",
        Driver,
        OpClass::Alloc,
        Space::Device,
        &[PtrOut, Size, Flags],
    ),
    probe(
        Op::CuMemGetInfo,
        "cuMemGetInfo_v2",
        Driver,
        OpClass::MemInfo,
        Space::None,
        &[FreeOut, TotalOut],
    ),
    probe(
        Op::CuMemAddressReserve,
        "cuMemAddressReserve",
        Driver,
        OpClass::Alloc,
        Space::AddressRange,
        &[PtrOut, Size, Alignment, Ignored, Flags],
    ),
    probe(
        Op::CuMemAddressFree,
        "cuMemAddressFree",
        Driver,
        OpClass::Free,
        Space::AddressRange,
        &[Ptr, Size],
    ),
    probe(
        Op::CuMemCreate,
        "cuMemCreate",
        Driver,
        OpClass::Alloc,
        Space::Handle,
        &[PtrOut, Size, AllocProp, Flags],
    ),
    probe(
        Op::CuMemRelease,
        "cuMemRelease",
        Driver,
        OpClass::Free,
        Space::Handle,
        &[Ptr],
    ),
    probe(
        Op::CuMemMap,
        "cuMemMap",
        Driver,
        OpClass::Alloc,
        Space::Mapping,
        &[Ptr, Size, Ignored, Handle, Flags],
    ),
    probe(
        Op::CuMemUnmap,
        "cuMemUnmap",
        Driver,
        OpClass::Free,
        Space::Mapping,
        &[Ptr, Size],
    ),
    probe(
        Op::CuMemAllocFromPoolAsync,
        "cuMemAllocFromPoolAsync",
        Driver,
        OpClass::Alloc,
        Space::Device,
        &[PtrOut, Size, Ignored, Stream],
    ),
    // PyTorch's caching allocator (libc10_cuda.so, provider `pytorch`): a block handed out, with
    // the size requested (before rounding), at the end of allocate; a block taken back.
    usdt(
        Op::TorchMalloc,
        "pytorch:malloc",
        OpClass::BlockAlloc,
        &[Ptr, Device, Size, Stream],
    ),
    usdt(Op::TorchFree, "pytorch:free", OpClass::BlockFree, &[Ptr]),
    ProbeSpec {
        op: Op::TorchOom,
        name: "pytorch:oom",
        symbol: TORCH_OOM_SYMBOL,
        library: Torch,
        class: OpClass::Oom,
        space: Space::None,
        args: &[Ignored, Ignored],
    },
    // Stream events: how the caching allocator keeps a block freed while other streams still
    // use it (`record_stream`) until their work is done. The event handle is the pointer.
    probe(
        Op::CudaEventRecord,
        "cudaEventRecord",
        Runtime,
        OpClass::EventRecord,
        Space::None,
        &[Ptr, Stream, Caller],
    ),
    probe(
        Op::CudaEventQuery,
        "cudaEventQuery",
        Runtime,
        OpClass::EventWait,
        Space::None,
        &[Ptr],
    ),
    probe(
        Op::CudaEventSynchronize,
        "cudaEventSynchronize",
        Runtime,
        OpClass::EventWait,
        Space::None,
        &[Ptr],
    ),
    // A thread's device through the driver: the context it makes current, and which device
    // each context is (the primary contexts the runtime and PyTorch use).
    probe(
        Op::CuCtxSetCurrent,
        "cuCtxSetCurrent",
        Driver,
        OpClass::SetContext,
        Space::None,
        &[Ptr],
    ),
    probe(
        Op::CuDevicePrimaryCtxRetain,
        "cuDevicePrimaryCtxRetain",
        Driver,
        OpClass::Context,
        Space::None,
        &[PtrOut, Device],
    ),
    tracer_mark(Op::AllocatorArmed, "tracer:allocator_armed"),
    tracer_mark(Op::AllocatorDisarmed, "tracer:allocator_disarmed"),
    tracer_mark(Op::AllocatorArming, "tracer:allocator_arming"),
    // CUDA graphs: captures route the caching allocator's requests to private pools. The
    // runtime's calls (any framework), then the driver's, then PyTorch's own.
    probe(
        Op::CudaStreamBeginCapture,
        "cudaStreamBeginCapture",
        Runtime,
        OpClass::CaptureBegin,
        Space::None,
        &[Stream, Flags],
    ),
    probe(
        Op::CudaStreamEndCapture,
        "cudaStreamEndCapture",
        Runtime,
        OpClass::CaptureEnd,
        Space::None,
        &[Stream, PtrOut],
    ),
    probe(
        Op::CudaStreamWaitEvent,
        "cudaStreamWaitEvent",
        Runtime,
        OpClass::StreamWait,
        Space::None,
        &[Stream, Ptr],
    ),
    // The mode is an in-out int: its pointer is not read (what matters is that it happened).
    probe(
        Op::CudaThreadExchangeStreamCaptureMode,
        "cudaThreadExchangeStreamCaptureMode",
        Runtime,
        OpClass::CaptureMode,
        Space::None,
        &[],
    ),
    probe(
        Op::CudaGraphInstantiate,
        "cudaGraphInstantiate",
        Runtime,
        OpClass::Graph,
        Space::None,
        &[PtrOut, Handle],
    ),
    probe(
        Op::CudaGraphInstantiateWithFlags,
        "cudaGraphInstantiateWithFlags",
        Runtime,
        OpClass::Graph,
        Space::None,
        &[PtrOut, Handle, Flags],
    ),
    probe(
        Op::CudaGraphLaunch,
        "cudaGraphLaunch",
        Runtime,
        OpClass::Graph,
        Space::None,
        &[Ptr, Stream],
    ),
    probe(
        Op::CudaGraphExecDestroy,
        "cudaGraphExecDestroy",
        Runtime,
        OpClass::Graph,
        Space::None,
        &[Ptr],
    ),
    probe(
        Op::CudaGraphDestroy,
        "cudaGraphDestroy",
        Runtime,
        OpClass::Graph,
        Space::None,
        &[Ptr],
    ),
    probe(
        Op::CuStreamBeginCapture,
        "cuStreamBeginCapture_v2",
        Driver,
        OpClass::CaptureBegin,
        Space::None,
        &[Stream, Flags],
    ),
    probe(
        Op::CuStreamEndCapture,
        "cuStreamEndCapture",
        Driver,
        OpClass::CaptureEnd,
        Space::None,
        &[Stream, PtrOut],
    ),
    probe(
        Op::CuStreamWaitEvent,
        "cuStreamWaitEvent",
        Driver,
        OpClass::StreamWait,
        Space::None,
        &[Stream, Ptr],
    ),
    probe(
        Op::CuThreadExchangeStreamCaptureMode,
        "cuThreadExchangeStreamCaptureMode",
        Driver,
        OpClass::CaptureMode,
        Space::None,
        &[],
    ),
    probe(
        Op::CuGraphInstantiate,
        "cuGraphInstantiateWithFlags",
        Driver,
        OpClass::Graph,
        Space::None,
        &[PtrOut, Handle, Flags],
    ),
    probe(
        Op::CuGraphLaunch,
        "cuGraphLaunch",
        Driver,
        OpClass::Graph,
        Space::None,
        &[Ptr, Stream],
    ),
    probe(
        Op::CuGraphExecDestroy,
        "cuGraphExecDestroy",
        Driver,
        OpClass::Graph,
        Space::None,
        &[Ptr],
    ),
    probe(
        Op::CuGraphDestroy,
        "cuGraphDestroy",
        Driver,
        OpClass::Graph,
        Space::None,
        &[Ptr],
    ),
    torch_graph(
        Op::TorchCaptureBegin,
        "pytorch:capture_begin",
        TORCH_CAPTURE_BEGIN_SYMBOL,
        OpClass::PoolCapture,
        &[Ptr, PoolFirst, PoolSecond],
    ),
    torch_graph(
        Op::TorchCaptureEnd,
        "pytorch:capture_end",
        TORCH_CAPTURE_END_SYMBOL,
        OpClass::PoolCaptured,
        &[Ptr],
    ),
    torch_graph(
        Op::TorchGraphReset,
        "pytorch:graph_reset",
        TORCH_GRAPH_RESET_SYMBOL,
        OpClass::PoolReset,
        &[Ptr],
    ),
    // PyTorch's allocator's pools: which requests go where, and when a pool may be freed.
    torch_graph(
        Op::TorchPoolRoute,
        "pytorch:pool_begin",
        TORCH_POOL_ROUTE_SYMBOL,
        OpClass::PoolRoute,
        &[Ignored, Device, PoolFirst, PoolSecond],
    ),
    torch_graph(
        Op::TorchPoolUnroute,
        "pytorch:pool_end",
        TORCH_POOL_UNROUTE_SYMBOL,
        OpClass::PoolUnroute,
        &[Ignored, Device, PoolFirst, PoolSecond],
    ),
    torch_graph(
        Op::TorchPoolRelease,
        "pytorch:pool_release",
        TORCH_POOL_RELEASE_SYMBOL,
        OpClass::PoolRelease,
        &[Ignored, Device, PoolFirst, PoolSecond],
    ),
    torch_graph(
        Op::TorchPoolCreate,
        "pytorch:pool_create",
        TORCH_POOL_CREATE_SYMBOL,
        OpClass::PoolCreate,
        &[Ignored, Device, PoolFirst, PoolSecond],
    ),
    torch_graph(
        Op::TorchPoolOnOom,
        "pytorch:pool_use_on_oom",
        TORCH_POOL_ON_OOM_SYMBOL,
        OpClass::PoolOnOom,
        &[Ignored, Device, PoolFirst, PoolSecond, Size],
    ),
];

const _: () = {
    let mut i = 0;
    while i < OP_COUNT {
        assert!(PROBES[i].op as usize == i, "PROBES must be indexed by Op");
        assert!(PROBES[i].args.len() <= MAX_ARGS);
        assert!(Op::ALL[i] as usize == i);
        i += 1;
    }
};

impl Op {
    pub const fn spec(self) -> &'static ProbeSpec {
        &PROBES[self as usize]
    }

    /// Whether the function returns a status (a cudaError_t, a CUresult): PyTorch's CUDAGraph
    /// and pool methods return nothing.
    pub const fn returns_status(self) -> bool {
        !self.spec().class.is_pool_call()
    }

    /// The name stored in the database and shown to users: the base symbol, or the USDT
    /// probe's `provider:name`.
    pub const fn name(self) -> &'static str {
        self.spec().name
    }
}

/// The table in the form the eBPF programs use: argument indices per role.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpPlan {
    /// An [`OpClass`] value.
    pub class: u32,
    /// A [`Space`] value.
    pub space: u32,
    pub size_arg: u8,
    pub ptr_out_arg: u8,
    pub ptr_arg: u8,
    pub device_arg: u8,
    pub free_out_arg: u8,
    pub total_out_arg: u8,
    pub pitch_out_arg: u8,
    pub height_arg: u8,
    /// Copied into aux0 (stream, alignment or handle).
    pub aux0_arg: u8,
    /// Copied into aux1 (flags or width).
    pub aux1_arg: u8,
    pub prop_arg: u8,
    /// The argument position that holds the return address instead (read at entry).
    pub caller_arg: u8,
    pub _pad: [u8; 4],
}

/// Offset of `location.id` in CUmemAllocationProp (type, requestedHandleTypes, location.type
/// are 4-byte enums before it), the same in CUDA 11 to 13.
pub const ALLOC_PROP_DEVICE_OFFSET: u64 = 12;

const fn plan(spec: &ProbeSpec) -> OpPlan {
    let mut p = OpPlan {
        class: spec.class as u32,
        space: spec.space as u32,
        size_arg: NO_ARG,
        ptr_out_arg: NO_ARG,
        ptr_arg: NO_ARG,
        device_arg: NO_ARG,
        free_out_arg: NO_ARG,
        total_out_arg: NO_ARG,
        pitch_out_arg: NO_ARG,
        height_arg: NO_ARG,
        aux0_arg: NO_ARG,
        aux1_arg: NO_ARG,
        prop_arg: NO_ARG,
        caller_arg: NO_ARG,
        _pad: [0; 4],
    };
    let mut i = 0;
    while i < spec.args.len() {
        let idx = i as u8;
        match spec.args[i] {
            Ignored => {}
            Size => p.size_arg = idx,
            PtrOut => p.ptr_out_arg = idx,
            Ptr => p.ptr_arg = idx,
            Device => p.device_arg = idx,
            Stream | Alignment | Handle | PoolFirst => p.aux0_arg = idx,
            Flags | Width | PoolSecond => p.aux1_arg = idx,
            FreeOut => p.free_out_arg = idx,
            TotalOut => p.total_out_arg = idx,
            PitchOut => p.pitch_out_arg = idx,
            Height => p.height_arg = idx,
            AllocProp => p.prop_arg = idx,
            Caller => {
                p.caller_arg = idx;
                p.aux1_arg = idx;
            }
        }
        i += 1;
    }
    p
}

const fn plans() -> [OpPlan; OP_COUNT] {
    let mut out = [plan(&PROBES[0]); OP_COUNT];
    let mut i = 0;
    while i < OP_COUNT {
        out[i] = plan(&PROBES[i]);
        i += 1;
    }
    out
}

/// [`PROBES`] compiled for the eBPF side, indexed by `Op as usize`.
pub const PLANS: [OpPlan; OP_COUNT] = plans();

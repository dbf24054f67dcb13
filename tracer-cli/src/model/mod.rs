//! The types the rooms share: the in-memory event analysis works on, off-CPU intervals, call-site
//! labels, and the live per-op statistics. (The allocator layout model comes here too.)

pub mod arming;
pub mod attempts;
pub mod devices;
pub mod discovery;
mod event;
pub mod figures;
pub mod job;
pub mod layout;
pub mod live;
pub mod policy;
pub mod pools;
pub mod pressure;
mod process;
pub mod run_series;
pub mod series;
pub mod simulator;
pub mod state;
pub mod stats;

pub use event::{
    advise_huge_pages, moves_memory, span, stack_id, Event, FastMap, HostRecord, MessageRow,
    OffSlice, SeededMap, SeededSet, SiteLabels, StackId, Window, FOLLOWED_WHILE_ARMED, NO_DEVICE,
};
pub use process::{
    env_map, Gpu, GpuSample, Placement, ProcessInfo, Rank, VisibleGpus, KEPT_ENV, NVIDIA_MAJOR,
};

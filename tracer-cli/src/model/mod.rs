//! The types the rooms share: the in-memory event analysis works on, off-CPU intervals, call-site
//! labels, and the live per-op statistics. (The allocator layout model comes here too.)

mod event;
pub mod layout;
mod process;
pub mod stats;

pub use event::{
    advise_huge_pages, span, stack_id, Event, FastMap, HostRecord, MessageRow, OffSlice,
    SiteLabels, StackId, Window, NO_DEVICE,
};
pub use process::{ProcessInfo, KEPT_ENV};

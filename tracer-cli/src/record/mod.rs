//! Recording: the threads `tracer trace` runs. The session attaches the probes (crate::probe)
//! and ties the threads together from start to the final flush: the reader drains the ring
//! buffer and hands over (crate::probe::stage empties the CPUs' stages), the registry learns what is slow
//! to learn (crate::traced: /proc, interpreters, call sites) beside it and `join` what the
//! kernel no longer keeps, the writer stores batches, `signals` turns signals into stops and
//! `on_warning` runs the user's command, `arming` carries out `--allocator auto`'s decisions, `discovery` probes each CUDA library a process opens
//! before it calls into it (the kernel's notice). `import` records from the simulated runtime's own log
//! instead of the ring, `memory_snapshot` from a PyTorch memory snapshot.

mod arming;
mod callers;
pub mod discovery;
pub mod dump;
pub mod import;
pub mod join;
pub mod memory_snapshot;
pub mod on_warning;
mod reader;
mod registry;
mod restore;
pub mod session;
mod shared;
pub mod signals;
mod snapshot_before;
mod writer;

pub use session::{Finished, RecordOptions, Recording, RecordingStatus, Started, Stop, Summary};

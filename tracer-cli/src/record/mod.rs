//! Recording: everything `tracer trace` runs. Discovery finds the CUDA libraries, `attach` loads
//! the eBPF programs and probes them, the reader drains the ring buffer and hands over, the
//! registry reads what is slow to learn (/proc, interpreters, call sites) beside it, the writer
//! stores batches, and the session ties them together from start to the final flush. `import`
//! records from the simulated runtime's own log instead of the ring; `check` says whether this
//! machine can record at all.

pub mod attach;
mod callers;
pub mod check;
pub mod discover;
pub mod elf;
pub mod import;
pub mod join;
pub mod mappings;
pub mod memmap;
pub mod memory_snapshot;
pub mod on_warning;
mod perf;
pub mod pods;
pub mod privileges;
pub mod procinfo;
pub mod python;
mod reader;
mod registry;
mod restore;
pub mod safe_file;
pub mod session;
mod shared;
pub mod signals;
pub mod sites;
mod stage;
pub mod usdt;
mod writer;

pub use session::{Finished, RecordOptions, Recording, Snapshot, Started, Stop, Summary};

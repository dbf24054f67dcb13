//! What tracer saw of each process that opened a CUDA library (issue 52; SCHEMA.md,
//! `discovery`): whether its library was probed before its first call, and if not, why; and
//! the processes found late, which the registry marks at their first call.

use std::collections::HashMap;

use serde::Serialize;

/// What tracer saw of a process that opened a watched library.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Stopped until its library was probed: traced from its first call.
    Held,
    /// Its library was probed before it opened it: traced from its first call.
    Probed,
    /// Probed after it opened the library, while it ran: calls before were not seen.
    Late,
    /// It had ended when tracer came to probe its library: none of its calls was seen (whether
    /// it mapped the library, or only read it, is then not known).
    Missed,
    /// The file has nothing tracer probes (a stub, another library of the name).
    Unprobeable,
    /// Opened without being mapped (a copy, an installer): no call can come of it.
    Read,
}

impl Outcome {
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Held => "held",
            Outcome::Probed => "probed",
            Outcome::Late => "late",
            Outcome::Missed => "missed",
            Outcome::Unprobeable => "unprobeable",
            Outcome::Read => "read",
        }
    }
}

/// One process's open of a watched library, as stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DiscoveryRow {
    pub pid: u32,
    pub comm: Option<String>,
    pub library: String,
    /// When it opened it (wall ns).
    pub opened_ns: i64,
    /// When the library's probes were on (wall ns; None: never).
    pub probed_ns: Option<i64>,
    /// How long the kernel kept it stopped (None: not stopped).
    pub held_us: Option<u64>,
    pub outcome: Outcome,
    /// Why it was not stopped, or why it could not be probed.
    pub why: Option<String>,
}

impl Outcome {
    pub fn parse(s: &str) -> Option<Outcome> {
        [
            Outcome::Held,
            Outcome::Probed,
            Outcome::Late,
            Outcome::Missed,
            Outcome::Unprobeable,
            Outcome::Read,
        ]
        .into_iter()
        .find(|o| o.name() == s)
    }

    /// Its calls were not all seen: found late, or never traced.
    pub fn unseen(self) -> bool {
        matches!(self, Outcome::Late | Outcome::Missed)
    }
}

/// A process found late, for the registry to mark at its first call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Late {
    /// When it opened the library (wall ns), or (found by the periodic scan) when it started.
    pub from_ns: Option<i64>,
    pub library: String,
    /// How tracer found it: "opened" (the kernel told) or "scan" (the once-a-second scan).
    pub how: &'static str,
}

/// What the main thread found, for the registry (late processes) and the writer (rows).
#[derive(Default)]
pub struct Found {
    pub late: HashMap<u32, Late>,
    pub rows: Vec<DiscoveryRow>,
}

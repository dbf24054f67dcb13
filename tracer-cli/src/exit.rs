//! Exit codes (documented in the README):
//! 0 success; 1 a runtime failure; 2 bad input (arguments, files, databases, SQL);
//! 3 missing privileges or kernel support.

use std::fmt;

pub const FAILURE: u8 = 1;
pub const BAD_INPUT: u8 = 2;
pub const NO_PRIVILEGE: u8 = 3;

/// An error whose exit code is not the generic 1. Its message is complete (names the object and
/// the fix), so it is printed without a cause chain.
#[derive(Debug)]
pub struct Coded {
    pub code: u8,
    pub message: String,
}

impl fmt::Display for Coded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Coded {}

pub fn user_error(message: impl Into<String>) -> anyhow::Error {
    Coded {
        code: BAD_INPUT,
        message: message.into(),
    }
    .into()
}

pub fn privilege_error(message: impl Into<String>) -> anyhow::Error {
    Coded {
        code: NO_PRIVILEGE,
        message: message.into(),
    }
    .into()
}

/// The exit code for an error: that of the first [`Coded`] in its chain, else [`FAILURE`].
pub fn code_of(err: &anyhow::Error) -> u8 {
    err.chain()
        .find_map(|e| e.downcast_ref::<Coded>())
        .map_or(FAILURE, |c| c.code)
}

/// True when the error is a closed stdout (`tracer query ... | head`): that is success.
pub fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            // serde_json keeps the write's error inside its own.
            || e.downcast_ref::<serde_json::Error>()
                .is_some_and(|j| j.io_error_kind() == Some(std::io::ErrorKind::BrokenPipe))
            // And csv (tracer query --format csv).
            || e.downcast_ref::<csv::Error>().is_some_and(|c| {
                matches!(c.kind(), csv::ErrorKind::Io(io) if io.kind() == std::io::ErrorKind::BrokenPipe)
            })
    })
}

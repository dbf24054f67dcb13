//! Host-side stub so tracer-cli can name this crate as a build dependency (rebuilds track it).
#![no_std]

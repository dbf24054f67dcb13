pub mod check;
pub mod explain;
pub mod query;
pub mod trace;

pub mod check;
pub mod query;
pub mod trace;

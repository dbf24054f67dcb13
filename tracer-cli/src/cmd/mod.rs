pub mod check;
pub mod demo;
pub mod explain;
pub mod import;
pub mod layout;
pub mod query;
pub mod stacks;
pub mod trace;

//! What tracer serves to others, read-only: the metrics endpoint (`metrics.rs`, beside
//! `tracer trace`) and the MCP server for assistants (`mcp.rs`, `tracer mcp`).

pub mod mcp;
pub mod metrics;
pub mod otlp;
mod otlp_config;

//! Project tasks: `cargo xtask bench` (needs root: it runs the tracer and bpftrace).

mod bench;
mod discovery_bench;
mod explain_bench;
mod flight_bench;
mod graph_bench;
mod prologue;
mod step_bench;
mod step_modes;
mod tensor_bench;
mod whatif_bench;

use clap::{Parser, Subcommand};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Measure the cost of tracing side by side: untraced, floor, traced, bpftrace; and throughput;
    /// then the training-shaped steps (`bench-step`).
    Bench(AllBenchArgs),
    /// Time `tracer explain` over a session of N synthetic events.
    BenchExplain(explain_bench::ExplainBenchArgs),
    /// Measure tracing PyTorch's allocator probes: cost per tensor allocation, sustained rate.
    BenchTensor(tensor_bench::TensorBenchArgs),
    /// The flight recorder on a long job under --max-db: keyframes' cost, eviction, the OOM
    /// layout against the job's own, the read side over 1, 10 and 30 minutes of history.
    BenchFlight(flight_bench::FlightBenchArgs),
    /// Time `tracer whatif` over N recorded allocator requests under 12 settings.
    BenchWhatif(whatif_bench::WhatIfBenchArgs),
    /// Only `bench`'s training-shaped steps: what tracer costs a step, whole and part by part.
    BenchStep(step_bench::StepBenchArgs),
    /// A serving loop replaying a captured CUDA graph every step, untraced and traced.
    BenchGraphs(graph_bench::GraphBenchArgs),
    /// Discovery in the kernel: tracer's CPU while nothing runs, what an open costs others.
    BenchDiscovery(discovery_bench::DiscoveryBenchArgs),
}

/// `cargo xtask bench`: its own sections' options and the step bench's.
#[derive(clap::Args)]
struct AllBenchArgs {
    #[command(flatten)]
    bench: bench::BenchArgs,
    #[command(flatten)]
    step: step_bench::StepBenchArgs,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().task {
        Task::Bench(args) => {
            bench::run(args.bench)?;
            step_modes::run(args.step)
        }
        Task::BenchExplain(args) => explain_bench::explain(args),
        Task::BenchTensor(args) => tensor_bench::run(args),
        Task::BenchFlight(args) => flight_bench::run(args),
        Task::BenchWhatif(args) => whatif_bench::run(args),
        Task::BenchStep(args) => step_modes::run(args),
        Task::BenchGraphs(args) => graph_bench::run(args),
        Task::BenchDiscovery(args) => discovery_bench::run(args),
    }
}

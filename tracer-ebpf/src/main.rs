//! eBPF programs of tracer. Built for bpfel-unknown-none by tracer-cli's build.rs.
#![no_std]
#![no_main]

mod call;
mod counters;
mod deliver;
mod inflight;
mod libwatch;
mod maps;
mod sched;
mod stack;
mod stage;
mod usdt;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // SAFETY: the verifier rejects programs that can reach this; it only satisfies no_std.
    unsafe { core::hint::unreachable_unchecked() }
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

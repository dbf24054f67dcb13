//! Decoder of the simulated runtime's own event log (SIMCUDA_EVENTS), used by `tracer demo`
//! when eBPF is not available: "ts_ns dur_ns pid tid op ret device size ptr aux0 aux1", with
//! '-' for unknown values.

use tracer_common::Op;

use super::Call;

/// Parses one line; None for a malformed line or an op this tracer does not know.
pub fn parse_line(line: &str) -> Option<Call> {
    let f: Vec<&str> = line.split_ascii_whitespace().collect();
    if f.len() != 11 {
        return None;
    }
    let opt = |s: &str| {
        if s == "-" {
            Some(None)
        } else {
            s.parse::<u64>().ok().map(Some)
        }
    };
    let op = Op::ALL.iter().copied().find(|o| o.name() == f[4])?;
    let device: i32 = f[6].parse().ok()?;
    Some(Call {
        ts_mono_ns: f[0].parse().ok()?,
        duration_ns: f[1].parse().ok()?,
        pid: f[2].parse().ok()?,
        tid: f[3].parse().ok()?,
        op,
        ret: f[5].parse().ok()?,
        device: (device >= 0).then_some(device),
        size: opt(f[7])?,
        ptr: opt(f[8])?,
        aux0: opt(f[9])?.unwrap_or(0),
        aux1: opt(f[10])?.unwrap_or(0),
        flags: 0,
        comm: String::new(),
        site: None,
        stack: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_simulated_runtimes_lines() {
        let c = parse_line(
            "1795326684373497239 2035 22534 22536 cudaMalloc 0 1 1048576 139637976727552 - -",
        )
        .unwrap();
        assert_eq!(
            (c.op, c.pid, c.tid, c.ret, c.device),
            (Op::CudaMalloc, 22534, 22536, 0, Some(1))
        );
        assert_eq!(
            (c.size, c.ptr, c.duration_ns),
            (Some(1048576), Some(139637976727552), 2035)
        );
        let f = parse_line("1795326684373507386 1902 1 2 cudaFree 1 0 - 57005 - -").unwrap();
        assert_eq!((f.size, f.ptr, f.ret), (None, Some(57005), 1));
        let i = parse_line("1 2 3 4 cudaMemGetInfo 0 0 - - 100 200").unwrap();
        assert_eq!((i.aux0, i.aux1), (100, 200));
    }

    #[test]
    fn rejects_malformed_lines() {
        assert!(parse_line("").is_none());
        assert!(
            parse_line("1 2 3 4 cudaMalloc 0 0 1 2 -").is_none(),
            "10 fields"
        );
        assert!(
            parse_line("1 2 3 4 cudaFrobnicate 0 0 1 2 - -").is_none(),
            "unknown op"
        );
        assert!(parse_line("x 2 3 4 cudaMalloc 0 0 1 2 - -").is_none());
    }
}

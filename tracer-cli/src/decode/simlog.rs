//! Decoder of the simulated runtime's own event log (SIMCUDA_EVENTS), used by `tracer demo`
//! when eBPF is not available: "ts_ns dur_ns pid tid op ret device size ptr aux0 aux1", with
//! '-' for unknown values. A message (PyTorch's out-of-memory text) is the same fields, then
//! its text to the end of the line.

use tracer_common::{usdt::MESSAGE_BYTES, Op};

use super::{usdt::Message, Call};

/// One line of the log.
#[derive(Debug)]
pub enum Line {
    Call(Call),
    Message(Message),
}

/// Parses one line; None for a malformed line or an op this tracer does not know.
pub fn parse_line(line: &str) -> Option<Line> {
    // Calls are nearly every line: only a line whose op is PyTorch's OOM is split for its text.
    if line.split_ascii_whitespace().nth(4) == Some(Op::TorchOom.name()) {
        let f: Vec<&str> = line
            .trim_start()
            .splitn(12, |c: char| c.is_ascii_whitespace())
            .collect();
        if f.len() == 12 {
            return parse_message(&f);
        }
    }
    parse_call(line).map(Line::Call)
}

fn parse_message(f: &[&str]) -> Option<Line> {
    let mut text = f[11].trim_end().to_owned();
    let truncated = text.len() > MESSAGE_BYTES;
    if truncated {
        let mut cut = MESSAGE_BYTES;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    Some(Line::Message(Message {
        ts_mono_ns: f[0].parse().ok()?,
        pid: f[2].parse().ok()?,
        tid: f[3].parse().ok()?,
        op: Op::TorchOom,
        text,
        truncated,
    }))
}

fn parse_call(line: &str) -> Option<Call> {
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

    fn call(line: &str) -> Option<Call> {
        match parse_line(line)? {
            Line::Call(c) => Some(c),
            Line::Message(_) => None,
        }
    }

    #[test]
    fn parses_the_simulated_runtimes_lines() {
        let c =
            call("1795326684373497239 2035 22534 22536 cudaMalloc 0 1 1048576 139637976727552 - -")
                .unwrap();
        assert_eq!(
            (c.op, c.pid, c.tid, c.ret, c.device),
            (Op::CudaMalloc, 22534, 22536, 0, Some(1))
        );
        assert_eq!(
            (c.size, c.ptr, c.duration_ns),
            (Some(1048576), Some(139637976727552), 2035)
        );
        let f = call("1795326684373507386 1902 1 2 cudaFree 1 0 - 57005 - -").unwrap();
        assert_eq!((f.size, f.ptr, f.ret), (None, Some(57005), 1));
        let i = call("1 2 3 4 cudaMemGetInfo 0 0 - - 100 200").unwrap();
        assert_eq!((i.aux0, i.aux1), (100, 200));
    }

    #[test]
    fn parses_the_out_of_memory_message() {
        let Some(Line::Message(m)) = parse_line(
            "17 0 5 6 pytorch:oom 0 0 - - - - CUDA out of memory. Tried to allocate 36.83 MiB. \n",
        ) else {
            panic!("not a message");
        };
        assert_eq!((m.ts_mono_ns, m.pid, m.tid, m.op), (17, 5, 6, Op::TorchOom));
        assert_eq!(m.text, "CUDA out of memory. Tried to allocate 36.83 MiB.");
        assert!(!m.truncated);
        let long = format!(
            "1 0 2 3 pytorch:oom 0 0 - - - - {}",
            "é".repeat(MESSAGE_BYTES)
        );
        let Some(Line::Message(m)) = parse_line(&long) else {
            panic!("not a message");
        };
        assert!(
            m.truncated && m.text.len() == MESSAGE_BYTES,
            "{}",
            m.text.len()
        );
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

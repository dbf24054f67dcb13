//! The few kernel structure offsets discovery's eBPF program reads (task_struct's `real_parent`,
//! `comm` and `ptrace`), taken from the running kernel's BTF (/sys/kernel/btf/vmlinux): a
//! reader of the format's type section, enough to find a struct's members, anonymous
//! unions and structs within it included.

use anyhow::{anyhow, ensure, Context as _, Result};

const BTF_MAGIC: u16 = 0xeb9f;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;

/// The members discovery reads, as byte offsets: task_struct's `real_parent`, `comm`,
/// `ptrace` and `signal`; signal_struct's `pids` (its process group's struct pid is entry
/// PIDTYPE_PGID); struct pid's `numbers` and struct upid's `nr` (the id as the machine sees it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TaskOffsets {
    pub real_parent: u32,
    pub comm: u32,
    pub ptrace: u32,
    pub signal: u32,
    pub signal_pids: u32,
    pub pid_numbers: u32,
    pub upid_nr: u32,
}

/// The running kernel's offsets, or why they are unknown.
pub fn task_offsets() -> Result<TaskOffsets> {
    let path = "/sys/kernel/btf/vmlinux";
    let data = std::fs::read(path).with_context(|| format!("read {path}"))?;
    let btf = Btf::parse(&data).with_context(|| format!("parse {path}"))?;
    let at = |name: &str, member: &str| {
        let id = btf
            .struct_named(name)
            .ok_or_else(|| anyhow!("{path} has no struct {name}"))?;
        btf.member_offset(id, member)
            .ok_or_else(|| anyhow!("struct {name} in {path} has no member {member}"))
    };
    Ok(TaskOffsets {
        real_parent: at("task_struct", "real_parent")?,
        comm: at("task_struct", "comm")?,
        ptrace: at("task_struct", "ptrace")?,
        signal: at("task_struct", "signal")?,
        signal_pids: at("signal_struct", "pids")?,
        pid_numbers: at("pid", "numbers")?,
        upid_nr: at("upid", "nr")?,
    })
}

/// One type: its kind, name and (for structs and unions) members as (name, type id, bit offset).
struct Type {
    kind: u32,
    name: u32,
    members: Vec<(u32, u32, u32)>,
}

struct Btf<'a> {
    strings: &'a [u8],
    /// Index 0 is BTF's `void`.
    types: Vec<Type>,
}

fn u32_at(b: &[u8], at: usize) -> Result<u32> {
    let bytes = b
        .get(at..at + 4)
        .ok_or_else(|| anyhow!("truncated at byte {at}"))?;
    Ok(u32::from_le_bytes(bytes.try_into()?))
}

impl<'a> Btf<'a> {
    fn parse(data: &'a [u8]) -> Result<Btf<'a>> {
        ensure!(data.len() >= 24, "shorter than a BTF header");
        let magic = u16::from_le_bytes([data[0], data[1]]);
        ensure!(magic == BTF_MAGIC, "not BTF (magic {magic:#x})");
        let hdr_len = u32_at(data, 4)? as usize;
        let (type_off, type_len) = (u32_at(data, 8)? as usize, u32_at(data, 12)? as usize);
        let (str_off, str_len) = (u32_at(data, 16)? as usize, u32_at(data, 20)? as usize);
        let section = |off: usize, len: usize| {
            data.get(hdr_len + off..hdr_len + off + len)
                .ok_or_else(|| anyhow!("a section lies past the end"))
        };
        let type_data = section(type_off, type_len)?;
        let strings = section(str_off, str_len)?;
        let mut types = vec![Type {
            kind: 0,
            name: 0,
            members: Vec::new(),
        }];
        let mut at = 0;
        while at < type_data.len() {
            let (ty, next) = parse_type(type_data, at)?;
            types.push(ty);
            at = next;
        }
        Ok(Btf { strings, types })
    }

    fn name(&self, off: u32) -> &[u8] {
        let rest = self.strings.get(off as usize..).unwrap_or_default();
        &rest[..rest.iter().position(|&b| b == 0).unwrap_or(rest.len())]
    }

    /// The id of the struct `name` that has members (not a forward declaration).
    fn struct_named(&self, name: &str) -> Option<u32> {
        self.types
            .iter()
            .position(|t| {
                t.kind == KIND_STRUCT
                    && !t.members.is_empty()
                    && self.name(t.name) == name.as_bytes()
            })
            .map(|i| i as u32)
    }

    /// Byte offset of `member` in type `id`, looking into anonymous structs and unions.
    fn member_offset(&self, id: u32, member: &str) -> Option<u32> {
        self.member_bits(id, member, 0).map(|bits| bits / 8)
    }

    fn member_bits(&self, id: u32, member: &str, depth: u32) -> Option<u32> {
        let ty = self.types.get(id as usize)?;
        if depth > 8 {
            return None;
        }
        for &(name, type_id, bits) in &ty.members {
            if name == 0 {
                let inner = self.resolve(type_id)?;
                if let Some(b) = self.member_bits(inner, member, depth + 1) {
                    return Some(bits + b);
                }
            } else if self.name(name) == member.as_bytes() {
                return Some(bits);
            }
        }
        None
    }

    /// An anonymous member's struct or union (its type id is that type, for anonymous ones).
    fn resolve(&self, id: u32) -> Option<u32> {
        let ty = self.types.get(id as usize)?;
        matches!(ty.kind, KIND_STRUCT | KIND_UNION).then_some(id)
    }
}

/// One type record at `at`, and where the next begins.
fn parse_type(d: &[u8], at: usize) -> Result<(Type, usize)> {
    let name = u32_at(d, at)?;
    let info = u32_at(d, at + 4)?;
    let vlen = (info & 0xffff) as usize;
    let kind = (info >> 24) & 0x1f;
    let bitfields = info >> 31 == 1;
    let body = at + 12;
    let extra = match kind {
        1 | 14 | 17 => 4,
        3 => 12,
        4 | 5 | 15 | 19 => 12 * vlen,
        6 | 13 => 8 * vlen,
        2 | 7..=12 | 16 | 18 => 0,
        k => return Err(anyhow!("unknown BTF kind {k} at byte {at}")),
    };
    let mut members = Vec::new();
    if kind == KIND_STRUCT || kind == KIND_UNION {
        for i in 0..vlen {
            let m = body + 12 * i;
            let offset = u32_at(d, m + 8)?;
            let bits = if bitfields {
                offset & 0xff_ffff
            } else {
                offset
            };
            members.push((u32_at(d, m)?, u32_at(d, m + 4)?, bits));
        }
    }
    Ok((
        Type {
            kind,
            name,
            members,
        },
        body + extra,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_running_kernels_task_struct_is_read() {
        // Every kernel this project runs on has BTF (ARCHITECTURE.md, the machine's notes).
        let t = task_offsets().expect("BTF of the running kernel");
        // comm is a 16-byte array well inside the struct; the three are distinct.
        assert!(t.comm > 0 && t.real_parent > 0 && t.ptrace > 0, "{t:?}");
        assert!(
            t.signal > 0 && t.signal_pids > 0 && t.pid_numbers > 0,
            "{t:?}"
        );
        // upid's nr is its first member.
        assert_eq!(t.upid_nr, 0, "{t:?}");
        assert_ne!(t.comm, t.real_parent);
        assert_ne!(t.ptrace, t.comm);
    }

    #[test]
    fn a_truncated_or_foreign_blob_is_refused() {
        assert!(Btf::parse(&[0u8; 10]).is_err());
        assert!(Btf::parse(&[0u8; 64]).is_err());
        let mut hdr = vec![0x9f, 0xeb, 1, 0, 24, 0, 0, 0];
        hdr.extend([0, 0, 0, 0, 200, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        assert!(Btf::parse(&hdr).is_err(), "a section past the end");
    }
}

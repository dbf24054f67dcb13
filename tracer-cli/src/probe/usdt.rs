//! USDT sites (sys/sdt.h): reading a file's `.note.stapsdt`, decoding each site's argument
//! specs (`-8@%rbp`, `-1@%al`, `8@-56(%rbp)`, `4@$5`, ...) into the plan the generic eBPF program
//! follows, and turning the site's and its semaphore's addresses into file offsets (what a
//! uprobe and its reference counter are given).

use std::path::Path;

use anyhow::{anyhow, Context as _, Result};
use object::{Object as _, ObjectSection as _};
use tracer_common::{
    probes::ArgRole,
    usdt::{arg_kind, reg, role, UsdtArg, UsdtPlan, MAX_USDT_ARGS},
    Library, Op, PROBES,
};

/// One probe site, as its note describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Site {
    pub provider: String,
    pub name: String,
    /// File offset of the site's `nop` (where the uprobe goes).
    pub offset: u64,
    /// File offset of the semaphore (the uprobe's reference counter), 0 when it has none.
    pub semaphore: u64,
    /// The argument specs, as written in the note.
    pub args: String,
}

impl Site {
    /// The traced op of this site and the plan for its arguments, when the probe table names
    /// it; an error names the argument spec that cannot be read.
    pub fn plan(&self) -> Option<Result<UsdtPlan>> {
        // Only PyTorch's: tracer's own marks have no symbol either, and a note a library
        // ships must never forge one.
        let spec = PROBES.iter().find(|p| {
            p.library == Library::Torch
                && p.symbol.is_empty()
                && p.name.split_once(':') == Some((&self.provider, &self.name))
        })?;
        Some(plan_for(spec.op, spec.args, &self.args))
    }
}

fn plan_for(op: Op, roles: &[ArgRole], args: &str) -> Result<UsdtPlan> {
    let specs: Vec<&str> = args.split_ascii_whitespace().collect();
    if specs.len() < roles.len() {
        return Err(anyhow!(
            "{}: the site has {} arguments ({args:?}), the probe table expects {}",
            op.name(),
            specs.len(),
            roles.len()
        ));
    }
    let mut plan = UsdtPlan {
        op: op as u32,
        nargs: roles.len().min(MAX_USDT_ARGS) as u32,
        ..Default::default()
    };
    for (i, (spec, r)) in specs.iter().zip(roles).take(MAX_USDT_ARGS).enumerate() {
        plan.args[i] =
            parse_arg(spec).with_context(|| format!("{}: argument {}", op.name(), i + 1))?;
        plan.roles[i] = match r {
            ArgRole::Ptr => role::PTR,
            ArgRole::Device => role::DEVICE,
            ArgRole::Size => role::SIZE,
            ArgRole::Stream => role::STREAM,
            _ => role::IGNORED,
        };
    }
    Ok(plan)
}

/// A register's pt_regs index and the width its name implies (`%eax` is 4 bytes of rax).
fn register(name: &str) -> Option<(u8, u8)> {
    const FAMILIES: [(&str, &str, &str, &str, u8); 17] = [
        ("rax", "eax", "ax", "al", reg::RAX),
        ("rbx", "ebx", "bx", "bl", reg::RBX),
        ("rcx", "ecx", "cx", "cl", reg::RCX),
        ("rdx", "edx", "dx", "dl", reg::RDX),
        ("rsi", "esi", "si", "sil", reg::RSI),
        ("rdi", "edi", "di", "dil", reg::RDI),
        ("rbp", "ebp", "bp", "bpl", reg::RBP),
        ("rsp", "esp", "sp", "spl", reg::RSP),
        ("r8", "r8d", "r8w", "r8b", reg::R8),
        ("r9", "r9d", "r9w", "r9b", reg::R9),
        ("r10", "r10d", "r10w", "r10b", reg::R10),
        ("r11", "r11d", "r11w", "r11b", reg::R11),
        ("r12", "r12d", "r12w", "r12b", reg::R12),
        ("r13", "r13d", "r13w", "r13b", reg::R13),
        ("r14", "r14d", "r14w", "r14b", reg::R14),
        ("r15", "r15d", "r15w", "r15b", reg::R15),
        ("rip", "eip", "ip", "", reg::RIP),
    ];
    FAMILIES.iter().find_map(|&(q, d, w, b, idx)| {
        if name == q {
            Some((idx, 8))
        } else if name == d {
            Some((idx, 4))
        } else if name == w {
            Some((idx, 2))
        } else if !b.is_empty() && name == b {
            Some((idx, 1))
        } else {
            None
        }
    })
}

/// One argument spec: `[-]SIZE@OPERAND` where OPERAND is `%reg`, `$const` or `DISP(%reg)`
/// (the size prefix is optional in old notes: then the register's width, unsigned).
pub fn parse_arg(spec: &str) -> Result<UsdtArg> {
    let (size, signed, operand) = match spec.split_once('@') {
        Some((sz, op)) => {
            let n: i64 = sz
                .parse()
                .map_err(|_| anyhow!("bad size in argument spec {spec:?}"))?;
            if ![1, 2, 4, 8].contains(&n.unsigned_abs()) {
                return Err(anyhow!(
                    "size {n} in argument spec {spec:?} is not 1, 2, 4 or 8"
                ));
            }
            (Some(n.unsigned_abs() as u8), n < 0, op)
        }
        None => (None, false, spec),
    };
    let mut arg = UsdtArg {
        signed: u8::from(signed),
        ..Default::default()
    };
    if let Some(value) = operand.strip_prefix('$') {
        arg.kind = arg_kind::CONST;
        arg.offset =
            parse_int(value).ok_or_else(|| anyhow!("bad constant in argument spec {spec:?}"))?;
        arg.size = size.unwrap_or(8);
    } else if let Some(name) = operand.strip_prefix('%') {
        let (idx, width) =
            register(name).ok_or_else(|| anyhow!("unknown register in argument spec {spec:?}"))?;
        arg.kind = arg_kind::REG;
        arg.reg = idx;
        arg.size = size.unwrap_or(width);
    } else if let (Some(open), true) = (operand.find('('), operand.ends_with(')')) {
        let disp = &operand[..open];
        let inner = &operand[open + 1..operand.len() - 1];
        if inner.contains(',') {
            return Err(anyhow!(
                "indexed memory operand in argument spec {spec:?} is not supported"
            ));
        }
        let name = inner
            .strip_prefix('%')
            .ok_or_else(|| anyhow!("bad base register in argument spec {spec:?}"))?;
        let (idx, _) =
            register(name).ok_or_else(|| anyhow!("unknown register in argument spec {spec:?}"))?;
        arg.kind = arg_kind::MEM;
        arg.reg = idx;
        arg.offset = if disp.is_empty() {
            0
        } else {
            parse_int(disp).ok_or_else(|| anyhow!("bad displacement in argument spec {spec:?}"))?
        };
        arg.size = size.unwrap_or(8);
    } else {
        return Err(anyhow!("unknown operand in argument spec {spec:?}"));
    }
    Ok(arg)
}

fn parse_int(text: &str) -> Option<i64> {
    let (neg, digits) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let v = match digits.strip_prefix("0x") {
        Some(hex) => i64::from_str_radix(hex, 16).ok()?,
        None => digits.parse::<i64>().ok()?,
    };
    Some(if neg { -v } else { v })
}

/// The sites of `path`'s `.note.stapsdt` (none when it has no such section).
pub fn read_sites(path: &Path) -> Result<Vec<Site>> {
    let sites = match crate::traced::safe_file::bytes(path)? {
        crate::traced::safe_file::Bytes::Mapped(map) => sites_of(&*map),
        crate::traced::safe_file::Bytes::Read(cache) => sites_of(&cache),
    };
    sites.with_context(|| format!("read the USDT notes of {}", path.display()))
}

/// The sites of an ELF image (a 64-bit one: USDT notes of 32-bit images are not read).
pub fn sites_of<'a, R: object::ReadRef<'a>>(data: R) -> Result<Vec<Site>> {
    use object::{
        read::elf::{ElfFile64, SectionHeader as _},
        Endian as _, Endianness,
    };
    if object::FileKind::parse(data)? != object::FileKind::Elf64 {
        return Ok(Vec::new());
    }
    let elf = ElfFile64::<Endianness, R>::parse(data)?;
    let Some(section) = elf.section_by_name(".note.stapsdt") else {
        return Ok(Vec::new());
    };
    let endian = elf.endian();
    let Some(mut notes) = section.elf_section_header().notes(endian, data)? else {
        return Ok(Vec::new());
    };
    let base_actual = elf.section_by_name(".stapsdt.base").map(|s| s.address());
    let segments = crate::traced::elf::FileOffsets::of(&elf);
    let file_offset = |addr: u64| segments.of_address(addr);
    let mut sites = Vec::new();
    while let Some(note) = notes
        .next()
        .context("a note runs past the end of .note.stapsdt")?
    {
        // Type 3, owner "stapsdt": a probe site (version 3 notes).
        let desc = note.desc();
        if note.n_type(endian) != 3 || note.name() != b"stapsdt" || desc.len() < 24 {
            continue;
        }
        let u64_at = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&desc[i..i + 8]);
            endian.read_u64_bytes(b)
        };
        let (pc, base, semaphore) = (u64_at(0), u64_at(8), u64_at(16));
        // A prelinked or relocated image: the note's base is where .stapsdt.base was then.
        let shift = |addr: u64| match base_actual {
            Some(actual) if base != 0 => addr.wrapping_add(actual).wrapping_sub(base),
            _ => addr,
        };
        let mut strings = desc[24..]
            .split(|&b| b == 0)
            .map(|s| String::from_utf8_lossy(s).into_owned());
        let provider = strings.next().unwrap_or_default();
        let name = strings.next().unwrap_or_default();
        let args = strings.next().unwrap_or_default();
        let offset = file_offset(shift(pc))
            .ok_or_else(|| anyhow!("USDT site {provider}:{name} at {pc:#x} lies in no segment"))?;
        let semaphore = if semaphore == 0 {
            0
        } else {
            file_offset(shift(semaphore)).ok_or_else(|| {
                anyhow!("the semaphore of {provider}:{name} at {semaphore:#x} lies in no segment")
            })?
        };
        sites.push(Site {
            provider,
            name,
            offset,
            semaphore,
            args,
        });
    }
    Ok(sites)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arg(kind: u8, reg: u8, size: u8, signed: u8, offset: i64) -> UsdtArg {
        UsdtArg {
            kind,
            reg,
            size,
            signed,
            _pad: 0,
            offset,
        }
    }

    #[test]
    fn every_operand_form() {
        // PyTorch 2.15's malloc sites.
        assert_eq!(
            parse_arg("-8@%rbp").unwrap(),
            arg(arg_kind::REG, reg::RBP, 8, 1, 0)
        );
        assert_eq!(
            parse_arg("-1@%al").unwrap(),
            arg(arg_kind::REG, reg::RAX, 1, 1, 0)
        );
        assert_eq!(
            parse_arg("-8@%r12").unwrap(),
            arg(arg_kind::REG, reg::R12, 8, 1, 0)
        );
        assert_eq!(
            parse_arg("-8@56(%rsp)").unwrap(),
            arg(arg_kind::MEM, reg::RSP, 8, 1, 56)
        );
        assert_eq!(
            parse_arg("-8@-56(%rbp)").unwrap(),
            arg(arg_kind::MEM, reg::RBP, 8, 1, -56)
        );
        // 2.2's int32 device, unsigned sizes, 16-bit registers, hex displacements, constants.
        assert_eq!(
            parse_arg("-4@%r14d").unwrap(),
            arg(arg_kind::REG, reg::R14, 4, 1, 0)
        );
        assert_eq!(
            parse_arg("4@%eax").unwrap(),
            arg(arg_kind::REG, reg::RAX, 4, 0, 0)
        );
        assert_eq!(
            parse_arg("2@%r9w").unwrap(),
            arg(arg_kind::REG, reg::R9, 2, 0, 0)
        );
        assert_eq!(
            parse_arg("1@%sil").unwrap(),
            arg(arg_kind::REG, reg::RSI, 1, 0, 0)
        );
        assert_eq!(
            parse_arg("8@0x10(%rdi)").unwrap(),
            arg(arg_kind::MEM, reg::RDI, 8, 0, 16)
        );
        assert_eq!(
            parse_arg("8@(%rdx)").unwrap(),
            arg(arg_kind::MEM, reg::RDX, 8, 0, 0)
        );
        assert_eq!(
            parse_arg("-4@$-5").unwrap(),
            arg(arg_kind::CONST, 0, 4, 1, -5)
        );
        assert_eq!(
            parse_arg("8@$0x20").unwrap(),
            arg(arg_kind::CONST, 0, 8, 0, 32)
        );
        // Old notes without a size: the register's width.
        assert_eq!(
            parse_arg("%ecx").unwrap(),
            arg(arg_kind::REG, reg::RCX, 4, 0, 0)
        );
        for bad in [
            "3@%rax",
            "8@%xmm0",
            "8@8(%rax,%rbx,2)",
            "x@%rax",
            "8@",
            "8@5(rax)",
        ] {
            assert!(parse_arg(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn plans_follow_the_probe_table() {
        let site = Site {
            provider: "pytorch".into(),
            name: "malloc".into(),
            offset: 0x4a173,
            semaphore: 0x867ca,
            args: "-8@%rax -1@%dl -8@%r14 -8@-56(%rbp)".into(),
        };
        let plan = site.plan().unwrap().unwrap();
        assert_eq!(plan.op, Op::TorchMalloc as u32);
        assert_eq!(plan.nargs, 4);
        assert_eq!(
            &plan.roles[..4],
            &[role::PTR, role::DEVICE, role::SIZE, role::STREAM]
        );
        assert_eq!(plan.args[1], arg(arg_kind::REG, reg::RDX, 1, 1, 0));
        let free = Site {
            name: "free".into(),
            args: "-8@%rdi".into(),
            ..site.clone()
        };
        assert_eq!(free.plan().unwrap().unwrap().op, Op::TorchFree as u32);
        let unknown = Site {
            name: "segment_alloc".into(),
            ..site.clone()
        };
        assert!(unknown.plan().is_none());
        // A library's note named like tracer's own arming mark is no probe.
        let forged = Site {
            provider: "tracer".into(),
            name: "allocator_armed".into(),
            args: String::new(),
            ..site.clone()
        };
        assert!(forged.plan().is_none());
        let short = Site {
            args: "-8@%rax".into(),
            ..site
        };
        assert!(short.plan().unwrap().is_err());
    }

    #[test]
    fn a_library_truncated_under_the_reader_is_an_error_not_a_crash() {
        use crate::traced::safe_file::truncation::{truncate, writable_elf};
        let dir = tempfile::tempdir().unwrap();
        let lib = writable_elf(dir.path());
        assert!(read_sites(&lib).is_ok(), "the whole file reads");
        truncate(&lib, 0);
        assert!(read_sites(&lib).is_err());
    }
}

//! What a uprobe costs depends on the instruction it replaces: x86 uprobes emulate `push` and
//! `nop` but single-step most others out of line, about 12x dearer on the project's VM. A
//! benchmark over a site no user has measures that artefact, so every probed site is checked.

use std::path::Path;

use anyhow::{anyhow, Context as _, Result};
use object::{Object as _, ObjectSection as _, ObjectSymbol as _};

/// The first instruction at a probed site, and whether the kernel emulates it.
pub struct Site {
    pub what: String,
    pub bytes: Vec<u8>,
    pub instruction: &'static str,
    pub emulated: bool,
}

impl std::fmt::Display for Site {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let hex: Vec<String> = self.bytes.iter().map(|b| format!("{b:02x}")).collect();
        write!(
            f,
            "{}: {} ({}), {}",
            self.what,
            self.instruction,
            hex.join(" "),
            if self.emulated {
                "emulated"
            } else {
                "single-stepped"
            }
        )
    }
}

/// The x86-64 instruction starting `code`, as far as uprobes care.
fn classify(code: &[u8]) -> (&'static str, usize, bool) {
    match code {
        [0x55, ..] => ("push %rbp", 1, true),
        [0x41, 0x50..=0x57, ..] => ("push %r8-%r15", 2, true),
        [0x50..=0x57, ..] => ("push", 1, true),
        [0x90, ..] => ("nop", 1, true),
        [0x0f, 0x1f, ..] => ("nopl", 3, true),
        [0xf3, 0x0f, 0x1e, 0xfa, ..] => ("endbr64", 4, false),
        [0x48 | 0x49 | 0x4c | 0x4d, 0x89 | 0x8b, ..] => ("mov", 3, false),
        _ => ("another instruction", 4, false),
    }
}

/// Reads `size` bytes at virtual address `addr` of an ELF file.
fn bytes_at<'a>(elf: &'a object::File<'a>, addr: u64, size: u64) -> Result<&'a [u8]> {
    let section = elf
        .sections()
        .find(|s| s.address() <= addr && addr < s.address() + s.size())
        .ok_or_else(|| anyhow!("no section holds address {addr:#x}"))?;
    let data = section.data()?;
    let at = (addr - section.address()) as usize;
    Ok(&data[at..(at + size as usize).min(data.len())])
}

fn site(what: String, code: &[u8]) -> Site {
    let (instruction, len, emulated) = classify(code);
    Site {
        what,
        bytes: code[..len.min(code.len())].to_vec(),
        instruction,
        emulated,
    }
}

/// The first instruction of each exported `symbols` of `lib`.
pub fn symbols(lib: &Path, symbols: &[&str]) -> Result<Vec<Site>> {
    let data = std::fs::read(lib).with_context(|| format!("read {}", lib.display()))?;
    let elf = object::File::parse(&*data).with_context(|| format!("parse {}", lib.display()))?;
    symbols
        .iter()
        .map(|name| {
            let sym = elf
                .dynamic_symbols()
                .chain(elf.symbols())
                .find(|s| {
                    s.name()
                        .is_ok_and(|n| n == *name || n.starts_with(&format!("{name}@")))
                })
                .ok_or_else(|| anyhow!("{} exports no {name}", lib.display()))?;
            let code = bytes_at(&elf, sym.address(), 8)?;
            Ok(site(format!("{name} in {}", lib.display()), code))
        })
        .collect()
}

/// The instruction at each USDT site of `exe` (its `.note.stapsdt`): a `nop` by construction.
pub fn usdt_sites(exe: &Path) -> Result<Vec<Site>> {
    let data = std::fs::read(exe).with_context(|| format!("read {}", exe.display()))?;
    let elf = object::File::parse(&*data).with_context(|| format!("parse {}", exe.display()))?;
    let notes = elf
        .section_by_name(".note.stapsdt")
        .ok_or_else(|| anyhow!("{} has no .note.stapsdt", exe.display()))?
        .data()?;
    let base_section = elf.section_by_name(".stapsdt.base").map(|s| s.address());
    let mut sites = Vec::new();
    let mut rest = notes;
    // Note: namesz, descsz, type, "stapsdt\0", then pc, base, semaphore (u64 each), strings.
    while rest.len() >= 12 {
        let word = |i: usize| u32::from_le_bytes([rest[i], rest[i + 1], rest[i + 2], rest[i + 3]]);
        let (namesz, descsz) = (word(0) as usize, word(4) as usize);
        let desc_at = 12 + namesz.next_multiple_of(4);
        let end = desc_at + descsz.next_multiple_of(4);
        if end > rest.len() || descsz < 24 {
            break;
        }
        let desc = &rest[desc_at..desc_at + descsz];
        let u64_at = |i: usize| u64::from_le_bytes(desc[i..i + 8].try_into().unwrap_or([0; 8]));
        let (pc, base) = (u64_at(0), u64_at(8));
        let pc = match base_section {
            Some(actual) => pc.wrapping_add(actual).wrapping_sub(base),
            None => pc,
        };
        let names: Vec<&str> = desc[24..]
            .split(|&b| b == 0)
            .filter_map(|s| std::str::from_utf8(s).ok())
            .collect();
        let what = format!(
            "USDT {}:{} in {}",
            names.first().unwrap_or(&"?"),
            names.get(1).unwrap_or(&"?"),
            exe.display()
        );
        sites.push(site(what, bytes_at(&elf, pc, 8)?));
        rest = &rest[end..];
    }
    Ok(sites)
}

#[cfg(test)]
mod tests {
    #[test]
    fn classifies_what_uprobes_emulate() {
        assert!(super::classify(&[0x55, 0x48, 0x89, 0xe5]).2);
        assert!(super::classify(&[0x41, 0x57]).2);
        assert!(super::classify(&[0x90]).2);
        let (name, len, emulated) = super::classify(&[0x48, 0x89, 0xfa]);
        assert_eq!((name, len, emulated), ("mov", 3, false));
        assert!(!super::classify(&[0xf3, 0x0f, 0x1e, 0xfa]).2);
    }
}

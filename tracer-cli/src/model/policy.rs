//! PyTorch's caching allocator's rules (c10/cuda/CUDACachingAllocator.cpp), in one place for
//! the code that observes where the allocator put blocks (the layout model, the early warning)
//! and the code that decides it (the what-if simulator): the settings, rounding, pools, segment
//! sizes, when a block is split, and which cached block a request may take.

use serde::{Deserialize, Serialize};

const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * KIB;
/// The smallest block, and the unit sizes are rounded to.
pub const MIN_BLOCK: u64 = 512;
/// Requests up to this size go to the small pool (2 MiB segments).
pub const SMALL_SIZE: u64 = MIB;
pub const SMALL_SEGMENT: u64 = 2 * MIB;
pub const LARGE_SEGMENT: u64 = 20 * MIB;
pub const MIN_LARGE_ALLOC: u64 = 10 * MIB;
pub const ROUND_LARGE: u64 = 2 * MIB;

/// The allocator's settings (PYTORCH_CUDA_ALLOC_CONF) that shape the layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocConf {
    /// Blocks at least this large are never split (max_split_size_mb; default: no limit).
    pub max_split_size: u64,
    /// roundup_power2_divisions (0: plain 512-byte rounding).
    pub roundup_power2_divisions: u64,
}

impl Default for AllocConf {
    fn default() -> Self {
        AllocConf {
            max_split_size: u64::MAX,
            roundup_power2_divisions: 0,
        }
    }
}

impl AllocConf {
    /// From a PYTORCH_CUDA_ALLOC_CONF value ("expandable_segments:True,max_split_size_mb:128").
    pub fn parse(value: &str) -> AllocConf {
        let mut conf = AllocConf::default();
        for item in value.split(',') {
            let Some((key, v)) = item.split_once(':') else {
                continue;
            };
            match key.trim() {
                "max_split_size_mb" => {
                    if let Ok(mb) = v.trim().parse::<u64>() {
                        conf.max_split_size = mb.saturating_mul(MIB);
                    }
                }
                "roundup_power2_divisions" => {
                    if let Ok(d) = v.trim().parse::<u64>() {
                        conf.roundup_power2_divisions = d;
                    }
                }
                _ => {}
            }
        }
        conf
    }

    /// From a process's environment: PYTORCH_CUDA_ALLOC_CONF, else PYTORCH_ALLOC_CONF.
    pub fn from_env<'a>(get: impl Fn(&str) -> Option<&'a str>) -> Option<AllocConf> {
        get("PYTORCH_CUDA_ALLOC_CONF")
            .or_else(|| get("PYTORCH_ALLOC_CONF"))
            .map(AllocConf::parse)
    }

    /// The process's settings turn on expandable segments (PYTORCH_CUDA_ALLOC_CONF, else
    /// PYTORCH_ALLOC_CONF: "expandable_segments:True").
    pub fn expandable_from_env<'a>(get: impl Fn(&str) -> Option<&'a str>) -> bool {
        get("PYTORCH_CUDA_ALLOC_CONF")
            .or_else(|| get("PYTORCH_ALLOC_CONF"))
            .is_some_and(|v| {
                v.split(',').any(|item| {
                    item.split_once(':').is_some_and(|(k, v)| {
                        k.trim() == "expandable_segments" && v.trim().eq_ignore_ascii_case("true")
                    })
                })
            })
    }

    /// The block size a request gets (PyTorch's round_size).
    pub fn round_size(&self, size: u64) -> u64 {
        if size < MIN_BLOCK {
            return MIN_BLOCK;
        }
        let divisions = self.roundup_power2_divisions;
        if divisions > 1 && size > MIN_BLOCK * divisions {
            // The next of `divisions` equal steps between two powers of two.
            if size.is_power_of_two() {
                return size;
            }
            let floor = 1u64 << (63 - size.leading_zeros());
            let step = floor >> (63 - divisions.leading_zeros());
            if step == 0 {
                return floor << 1;
            }
            let down = size & !(step - 1);
            return if down == size {
                size
            } else {
                down.saturating_add(step)
            };
        }
        size.div_ceil(MIN_BLOCK).saturating_mul(MIN_BLOCK)
    }
}

/// PyTorch's two pools: small requests (up to 1 MiB) share 2 MiB segments.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pool {
    Small,
    Large,
}

/// The pool a request of `rounded` bytes is served from.
pub fn pool_of(rounded: u64) -> Pool {
    if rounded <= SMALL_SIZE {
        Pool::Small
    } else {
        Pool::Large
    }
}

/// The device segment a request of `rounded` bytes needs (PyTorch's get_allocation_size).
pub fn segment_size(rounded: u64) -> u64 {
    if rounded <= SMALL_SIZE {
        SMALL_SEGMENT
    } else if rounded < MIN_LARGE_ALLOC {
        LARGE_SEGMENT
    } else {
        rounded.div_ceil(ROUND_LARGE).saturating_mul(ROUND_LARGE)
    }
}

/// The requests (rounded, lowest and highest) a device segment of `segment` bytes is made
/// for: [`segment_size`] turned round. A 20 MiB segment serves a request of 1-10 MiB or one of
/// 18-20 MiB, so its lowest is the smaller.
pub fn requests_for_segment(segment: u64) -> (u64, u64) {
    match segment {
        SMALL_SEGMENT => (MIN_BLOCK, SMALL_SIZE),
        LARGE_SEGMENT => (SMALL_SIZE + 1, LARGE_SEGMENT),
        _ => (segment.saturating_sub(ROUND_LARGE) + 1, segment),
    }
}

/// Whether a block taken for a request of `rounded` bytes, `remaining` bytes larger, is split
/// (should_split): in the small pool and in expandable segments any remainder of a block's
/// size; in the large pool only a remainder over 1 MiB of a request under max_split_size.
pub fn should_split(
    pool: Pool,
    expandable: bool,
    conf: AllocConf,
    rounded: u64,
    remaining: u64,
) -> bool {
    if pool == Pool::Small || expandable {
        remaining >= MIN_BLOCK
    } else {
        rounded < conf.max_split_size && remaining > SMALL_SIZE
    }
}

/// Whether a cached block of `block` bytes may serve a request of `rounded` bytes of its pool
/// (get_free_block): it fits, and an oversize block (max_split_size and above) serves only
/// requests that are oversize too and within 20 MiB of it.
pub fn serves(pool: Pool, conf: AllocConf, rounded: u64, block: u64) -> bool {
    let max_split = conf.max_split_size;
    block >= rounded
        && (pool == Pool::Small
            || !((rounded < max_split && block >= max_split)
                || (rounded >= max_split && block >= rounded.saturating_add(LARGE_SEGMENT))))
}

//! Who holds each GPU, as NVIDIA's management library says (libnvidia-ml.so.1, loaded by tracer
//! itself, as nvidia-smi loads it): each device's memory in use and the processes using it, with
//! their bytes (their CUDA contexts included). It names the processes that allocated before the
//! trace began, which no probe saw, and tells what a process holds beyond its traced calls.
//!
//! The library is the system's (found by the dynamic loader), or the file `tracer trace --nvml`
//! names; it is loaded only when asked (never from a traced process's files).

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void, CStr, CString};

use anyhow::{anyhow, Result};

use crate::model::GpuSample;

/// nvmlProcessInfo_t (v2 and later).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct ProcessInfo {
    pid: c_uint,
    used_gpu_memory: c_ulonglong,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

/// nvmlMemory_t.
#[repr(C)]
#[derive(Default)]
struct Memory {
    total: c_ulonglong,
    free: c_ulonglong,
    used: c_ulonglong,
}

type Device = *mut c_void;
type Status = c_int;
const SUCCESS: Status = 0;
const INSUFFICIENT_SIZE: Status = 7;
/// Processes asked for at most, per device.
const MAX_PROCESSES: usize = 1024;

type NoArgs = unsafe extern "C" fn() -> Status;
type Count = unsafe extern "C" fn(*mut c_uint) -> Status;
type ByIndex = unsafe extern "C" fn(c_uint, *mut Device) -> Status;
type Minor = unsafe extern "C" fn(Device, *mut c_uint) -> Status;
type MemoryOf = unsafe extern "C" fn(Device, *mut Memory) -> Status;
type Processes = unsafe extern "C" fn(Device, *mut c_uint, *mut ProcessInfo) -> Status;

/// The loaded library and the calls tracer makes.
pub struct Nvml {
    library: *mut c_void,
    count: Count,
    by_index: ByIndex,
    minor: Minor,
    memory: MemoryOf,
    processes: Processes,
    shutdown: NoArgs,
}

// SAFETY: NVML's calls are thread-safe (its documentation); the handle is only used through them.
unsafe impl Send for Nvml {}

impl Nvml {
    /// Loads `path` (a file, or a name the dynamic loader finds) and initialises it.
    pub fn open(path: &str) -> Result<Nvml> {
        let name = CString::new(path).map_err(|_| anyhow!("--nvml {path:?}: a NUL in the path"))?;
        // SAFETY: dlopen with a NUL-terminated name; the result is checked.
        let library = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if library.is_null() {
            return Err(anyhow!("load {path}: {}", last_error()));
        }
        let symbol = |name: &CStr| -> Result<*mut c_void> {
            // SAFETY: dlsym on the handle dlopen returned, with a NUL-terminated name.
            let f = unsafe { libc::dlsym(library, name.as_ptr()) };
            if f.is_null() {
                Err(anyhow!("{path} has no {}", name.to_string_lossy()))
            } else {
                Ok(f)
            }
        };
        let resolved = (|| -> Result<Nvml> {
            // SAFETY: each symbol is NVML's function of that name and C signature (nvml.h).
            unsafe {
                use std::mem::transmute;
                type Raw = *mut c_void;
                let init = transmute::<Raw, NoArgs>(symbol(c"nvmlInit_v2")?);
                let nvml = Nvml {
                    library,
                    count: transmute::<Raw, Count>(symbol(c"nvmlDeviceGetCount_v2")?),
                    by_index: transmute::<Raw, ByIndex>(symbol(c"nvmlDeviceGetHandleByIndex_v2")?),
                    minor: transmute::<Raw, Minor>(symbol(c"nvmlDeviceGetMinorNumber")?),
                    memory: transmute::<Raw, MemoryOf>(symbol(c"nvmlDeviceGetMemoryInfo")?),
                    processes: transmute::<Raw, Processes>(symbol(
                        c"nvmlDeviceGetComputeRunningProcesses_v3",
                    )?),
                    shutdown: transmute::<Raw, NoArgs>(symbol(c"nvmlShutdown")?),
                };
                match init() {
                    SUCCESS => Ok(nvml),
                    status => Err(anyhow!("{path}: nvmlInit failed ({status})")),
                }
            }
        })();
        if resolved.is_err() {
            // SAFETY: the handle dlopen returned, closed once.
            unsafe { libc::dlclose(library) };
        }
        resolved
    }

    /// Every device's memory and processes now, at wall time `ts_ns`. A device NVML cannot
    /// answer for is left out.
    pub fn sample(&self, ts_ns: i64) -> Vec<GpuSample> {
        let mut count: c_uint = 0;
        // SAFETY: NVML's call with a valid out pointer.
        if unsafe { (self.count)(&mut count) } != SUCCESS {
            return Vec::new();
        }
        (0..count.min(64))
            .filter_map(|i| self.device(i, ts_ns))
            .collect()
    }

    fn device(&self, index: c_uint, ts_ns: i64) -> Option<GpuSample> {
        let mut device: Device = std::ptr::null_mut();
        let (mut minor, mut memory) = (0, Memory::default());
        // SAFETY: NVML's calls with valid out pointers, on a handle NVML gave.
        unsafe {
            if (self.by_index)(index, &mut device) != SUCCESS
                || (self.minor)(device, &mut minor) != SUCCESS
                || (self.memory)(device, &mut memory) != SUCCESS
            {
                return None;
            }
        }
        let mut infos = vec![ProcessInfo::default(); MAX_PROCESSES];
        let mut n = MAX_PROCESSES as c_uint;
        // SAFETY: `infos` has room for `n` entries, as NVML is told.
        let status = unsafe { (self.processes)(device, &mut n, infos.as_mut_ptr()) };
        if status != SUCCESS && status != INSUFFICIENT_SIZE {
            return None;
        }
        infos.truncate((n as usize).min(MAX_PROCESSES));
        Some(GpuSample {
            ts_ns,
            gpu: format!("GPU {minor}"),
            total: memory.total,
            used: memory.used,
            processes: infos.iter().map(|p| (p.pid, p.used_gpu_memory)).collect(),
        })
    }
}

impl Drop for Nvml {
    fn drop(&mut self) {
        // SAFETY: shut down once, then the handle dlopen returned closed once.
        unsafe {
            (self.shutdown)();
            libc::dlclose(self.library);
        }
    }
}

fn last_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl call.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: checked non-null above; copied at once.
        unsafe { CStr::from_ptr(e as *const c_char) }
            .to_string_lossy()
            .into_owned()
    }
}

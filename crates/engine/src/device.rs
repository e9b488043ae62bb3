//! Which device MLX computes on: the GPU when the linked MLX has one (Metal on macOS, CUDA
//! on Linux), else the CPU. MLX picks the same default; this only reports it.

use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Metal,
    Cuda,
    Cpu,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Metal => "gpu (Metal)",
            Backend::Cuda => "gpu (CUDA)",
            Backend::Cpu => "cpu",
        })
    }
}

/// The backend MLX runs on in this process.
pub fn backend() -> Backend {
    if gpu_available() {
        if cfg!(target_os = "macos") {
            Backend::Metal
        } else {
            Backend::Cuda
        }
    } else {
        Backend::Cpu
    }
}

/// Whether MLX computes on a GPU in this process (asked once).
pub fn on_gpu() -> bool {
    static GPU: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *GPU.get_or_init(|| backend() != Backend::Cpu)
}

/// The version of the MLX library this process runs on (e.g. "0.32.2").
pub fn mlx_version() -> String {
    // SAFETY: mlx_version fills a string we own; its data is read before the string is freed.
    unsafe {
        let mut s = mlx_sys::mlx_string_new();
        let version = if mlx_sys::mlx_version(&mut s) == 0 {
            let data = mlx_sys::mlx_string_data(s);
            if data.is_null() {
                String::new()
            } else {
                std::ffi::CStr::from_ptr(data).to_string_lossy().into_owned()
            }
        } else {
            String::new()
        };
        mlx_sys::mlx_string_free(s);
        if version.is_empty() {
            "unknown".into()
        } else {
            version
        }
    }
}

/// The machine's physical memory in bytes (0 if the system will not say).
pub fn total_memory() -> u64 {
    // SAFETY: sysconf only reads system configuration values.
    let (pages, page_size) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    if pages <= 0 || page_size <= 0 {
        0
    } else {
        pages as u64 * page_size as u64
    }
}

#[cfg(target_os = "macos")]
fn gpu_available() -> bool {
    let mut available = false;
    // SAFETY: writes one bool through a valid pointer.
    let rc = unsafe { mlx_sys::mlx_metal_is_available(&mut available) };
    rc == 0 && available
}

#[cfg(not(target_os = "macos"))]
fn gpu_available() -> bool {
    let mut available = false;
    // SAFETY: writes one bool through a valid pointer.
    let rc = unsafe { mlx_sys::mlx_cuda_is_available(&mut available) };
    rc == 0 && available
}

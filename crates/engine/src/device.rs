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
    keep_constructor();
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

/// The version of the MLX library this process runs on (e.g. "0.32.4").
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

/// MLX's CUDA backend keeps the CUDA graphs it captured (400 by default) and the cuDNN
/// attention graphs it built (256), and stops with an error ("Cache thrashing is happening")
/// once a process has missed twice that many in its life: batched decoding (`batch.rs`) meets
/// many graph shapes, and every prompt length is an attention shape of its own
/// (`layers/sdpa.rs` keeps decoding's shapes away from cuDNN). A constructor run before `main`
/// raises both defaults to 8000 and turns the check off where MLX offers that, unless the user
/// set them; MLX reads them when the GPU is first used.
#[cfg(target_os = "linux")]
extern "C" fn raise_cuda_graph_cache(_: libc::c_int, _: *const *const libc::c_char, _: *const *const libc::c_char) {
    // SAFETY: this runs before main, while the program has one thread, so nothing reads the
    // environment meanwhile; the strings are NUL-terminated literals, and `overwrite = 0`
    // keeps a value the user set.
    unsafe {
        libc::setenv(c"MLX_CUDA_GRAPH_CACHE_SIZE".as_ptr(), c"8000".as_ptr(), 0);
        libc::setenv(c"MLX_CUDA_SDPA_CACHE_SIZE".as_ptr(), c"8000".as_ptr(), 0);
        libc::setenv(c"MLX_ENABLE_CACHE_THRASHING_CHECK".as_ptr(), c"0".as_ptr(), 0);
    }
}

#[cfg(target_os = "linux")]
#[used]
#[link_section = ".init_array"]
static RAISE_CUDA_GRAPH_CACHE: extern "C" fn(libc::c_int, *const *const libc::c_char, *const *const libc::c_char) =
    raise_cuda_graph_cache;

/// Keeps [`RAISE_CUDA_GRAPH_CACHE`] in every program that uses the engine (a linker takes an
/// object from a library only when something refers to it).
fn keep_constructor() {
    #[cfg(target_os = "linux")]
    std::hint::black_box(&RAISE_CUDA_GRAPH_CACHE);
    crate::kernel_cache::keep_constructor();
}

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

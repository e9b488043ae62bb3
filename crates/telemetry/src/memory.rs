//! Memory: the system's, this process's (sysinfo) and MLX's allocator (active, peak, cache),
//! with the kernel's memory-pressure figure where it has one. MLX's figures are filled in by
//! the caller ([`Memory::with_mlx`]) on a thread that uses MLX anyway: a sampling thread that
//! called into MLX could still be doing so while MLX's statics are torn down at exit.

use serde::Serialize;

#[derive(Debug, Clone, Default, Serialize)]
pub struct Memory {
    pub system_total_bytes: u64,
    pub system_used_bytes: u64,
    pub system_available_bytes: u64,
    pub process_resident_bytes: Option<u64>,
    pub mlx_active_bytes: u64,
    pub mlx_peak_bytes: u64,
    pub mlx_cache_bytes: u64,
    /// Linux: share of the last 10 s some task stalled on memory (PSI `some avg10`, percent);
    /// macOS: the kernel's pressure level (1 normal, 2 warning, 4 critical).
    pub pressure: Option<f64>,
    /// Which of the two `pressure` is: "psi_stall_percent" or "macos_level".
    pub pressure_kind: Option<&'static str>,
}

/// Reads memory figures; `sys` is reused between calls (sysinfo keeps state).
pub fn read(sys: &mut sysinfo::System) -> Memory {
    sys.refresh_memory();
    let me = sysinfo::Pid::from_u32(std::process::id());
    sys.refresh_processes_specifics(
        sysinfo::ProcessesToUpdate::Some(&[me]),
        false,
        sysinfo::ProcessRefreshKind::nothing().with_memory(),
    );
    let pressure = pressure();
    Memory {
        system_total_bytes: sys.total_memory(),
        system_used_bytes: sys.used_memory(),
        system_available_bytes: sys.available_memory(),
        process_resident_bytes: sys.process(me).map(|p| p.memory()),
        mlx_active_bytes: 0,
        mlx_peak_bytes: 0,
        mlx_cache_bytes: 0,
        pressure_kind: pressure.map(|_| if cfg!(target_os = "macos") { "macos_level" } else { "psi_stall_percent" }),
        pressure,
    }
}

impl Memory {
    /// The same figures with MLX's allocator counters (active, peak, cache) filled in.
    pub fn with_mlx(mut self, active: u64, peak: u64, cache: u64) -> Memory {
        self.mlx_active_bytes = active;
        self.mlx_peak_bytes = peak;
        self.mlx_cache_bytes = cache;
        self
    }
}

#[cfg(target_os = "linux")]
fn pressure() -> Option<f64> {
    let text = std::fs::read_to_string("/proc/pressure/memory").ok()?;
    parse_psi(&text)
}

/// `some avg10=0.31 ...` → 0.31.
#[cfg(any(target_os = "linux", test))]
fn parse_psi(text: &str) -> Option<f64> {
    let some = text.lines().find(|l| l.starts_with("some "))?;
    some.split_whitespace().find_map(|f| f.strip_prefix("avg10="))?.parse().ok()
}

#[cfg(target_os = "macos")]
fn pressure() -> Option<f64> {
    // kern.memorystatus_vm_pressure_level: 1 normal, 2 warning, 4 critical.
    let mut level: i32 = 0;
    let mut size = std::mem::size_of::<i32>();
    let name = c"kern.memorystatus_vm_pressure_level";
    // SAFETY: sysctlbyname writes at most `size` bytes into `level`.
    let rc = unsafe {
        libc_sysctlbyname(name.as_ptr(), (&mut level as *mut i32).cast(), &mut size, std::ptr::null_mut(), 0)
    };
    (rc == 0).then_some(level as f64)
}

#[cfg(target_os = "macos")]
extern "C" {
    #[link_name = "sysctlbyname"]
    fn libc_sysctlbyname(
        name: *const std::ffi::c_char,
        oldp: *mut std::ffi::c_void,
        oldlenp: *mut usize,
        newp: *mut std::ffi::c_void,
        newlen: usize,
    ) -> i32;
}

#[cfg(not(any(target_os = "linux", target_os = "macos")))]
fn pressure() -> Option<f64> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psi_lines_parse() {
        assert_eq!(
            parse_psi(
                "some avg10=1.25 avg60=0.00 avg300=0.00 total=10\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
            ),
            Some(1.25)
        );
        assert_eq!(parse_psi("garbage"), None);
    }

    #[test]
    fn reads_real_figures() {
        let mut sys = sysinfo::System::new().unwrap();
        let m = read(&mut sys);
        assert!(m.system_total_bytes > 0 && m.system_used_bytes <= m.system_total_bytes);
        assert!(m.process_resident_bytes.unwrap_or(0) > 0);
    }
}

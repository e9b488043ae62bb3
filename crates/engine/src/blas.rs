//! Which BLAS library MLX's CPU matmuls run on in this process. On Linux `scripts/setup.sh`
//! points the MLX wheel at OpenBLAS in place of the reference BLAS it bundles (about ten times
//! slower); this reads what was really loaded, so a machine where that did not happen says so.
//! On macOS MLX uses Accelerate.
//!
//! OpenBLAS chooses its kernels for the CPU when it is loaded, and the one Debian ships (0.3.21)
//! does not recognise CPUs newer than itself: it falls back to its generic SSE3 kernels
//! ("Prescott"), several times slower than its AVX-512 ones on the same CPU
//! (bench/results/cpu.md). Its one setting for this is `OPENBLAS_CORETYPE`, read when it
//! chooses; so when it fell back, a constructor of the program (run once every library is
//! initialised and before `main`, while no thread does BLAS work) sets that variable from the
//! CPU's features, unless the user set it, and has OpenBLAS choose again.

/// A one-line description of the BLAS in use, e.g. "OpenBLAS 0.3.21 (SkylakeX, 2 threads)
/// from /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so".
pub fn describe() -> String {
    if cfg!(target_os = "macos") {
        return "Accelerate".into();
    }
    keep_constructor();
    let file = library();
    let location = file.as_ref().map(|f| format!(" from {}", f.display())).unwrap_or_default();
    match openblas_config() {
        Some(OpenBlas { config, core, threads }) => {
            // The config reads "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY SkylakeX MAX_THREADS=64".
            let version = config.split_whitespace().nth(1).unwrap_or("?");
            let chosen = if CHOSEN_CORE.get().is_some() { " kernels chosen by Ferrite" } else { "" };
            format!("OpenBLAS {version} ({core}{chosen}, {threads} threads){location}")
        }
        None if file.is_some() => format!("reference BLAS{location}"),
        None => "unknown (no BLAS library is mapped)".into(),
    }
}

/// The kernels Ferrite asked OpenBLAS for, if it did (the user's `OPENBLAS_CORETYPE` wins).
static CHOSEN_CORE: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();

/// OpenBLAS's kernel family for this CPU's features: the AVX-512 ones where the CPU has what
/// they use, else the AVX2 ones.
#[cfg(target_arch = "x86_64")]
fn core_for_this_cpu() -> Option<&'static str> {
    use std::arch::is_x86_feature_detected as has;
    if has!("avx512f") && has!("avx512bw") && has!("avx512dq") && has!("avx512vl") && has!("avx512cd") {
        Some("SkylakeX")
    } else if has!("avx2") && has!("fma") {
        Some("Haswell")
    } else {
        None
    }
}

#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
extern "C" fn choose_openblas_kernels(
    _argc: libc::c_int,
    _argv: *const *const libc::c_char,
    _env: *const *const libc::c_char,
) {
    type Call = unsafe extern "C" fn();
    // SAFETY: this runs before main, while the program has one thread and nothing has called
    // BLAS yet, so no thread reads the environment or OpenBLAS's kernel table meanwhile. The
    // strings are NUL-terminated literals. `gotoblas_dynamic_quit` and `gotoblas_dynamic_init`
    // are OpenBLAS's exported functions (no arguments) that forget and choose the kernel table,
    // the second one reading OPENBLAS_CORETYPE; each pointer is checked for null first.
    unsafe {
        if !libc::getenv(c"OPENBLAS_CORETYPE".as_ptr()).is_null() {
            return;
        }
        let (Some(openblas), Some(core)) = (openblas_config(), core_for_this_cpu()) else { return };
        if !openblas.core.eq_ignore_ascii_case("prescott") {
            return; // OpenBLAS knows this CPU
        }
        let quit = libc::dlsym(libc::RTLD_DEFAULT, c"gotoblas_dynamic_quit".as_ptr());
        let init = libc::dlsym(libc::RTLD_DEFAULT, c"gotoblas_dynamic_init".as_ptr());
        if quit.is_null() || init.is_null() {
            return; // not a build that chooses at run time
        }
        let value = if core == "SkylakeX" { c"SkylakeX" } else { c"Haswell" };
        if libc::setenv(c"OPENBLAS_CORETYPE".as_ptr(), value.as_ptr(), 0) != 0 {
            return;
        }
        std::mem::transmute::<*mut libc::c_void, Call>(quit)();
        std::mem::transmute::<*mut libc::c_void, Call>(init)();
        let _ = CHOSEN_CORE.set(core);
    }
}

/// Run before `main`, once every library is initialised (see the module's comment).
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
#[used]
#[link_section = ".init_array"]
static CHOOSE_OPENBLAS_KERNELS: extern "C" fn(libc::c_int, *const *const libc::c_char, *const *const libc::c_char) =
    choose_openblas_kernels;

/// Keeps [`CHOOSE_OPENBLAS_KERNELS`] in every program that uses the engine: a linker takes an
/// object from a library only when something refers to it.
fn keep_constructor() {
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    std::hint::black_box(&CHOOSE_OPENBLAS_KERNELS);
}

/// The BLAS library this process has loaded: the first mapped shared library whose file name
/// says BLAS, links resolved (Linux). Also for a peer process that should multiply with the
/// same one (the reference tests' mlx-lm).
pub fn library() -> Option<std::path::PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let path = maps.lines().filter_map(|line| line.split_whitespace().nth(5)).find(|path| {
        let name = path.rsplit('/').next().unwrap_or("");
        name.starts_with("libblas") || name.starts_with("libopenblas")
    })?;
    Some(std::fs::canonicalize(path).unwrap_or_else(|_| path.into()))
}

/// What OpenBLAS says of itself.
struct OpenBlas {
    /// Its build description.
    config: String,
    /// The CPU kernels it chose for this machine.
    core: String,
    threads: i32,
}

/// OpenBLAS's own description, when the process has OpenBLAS loaded.
#[cfg(not(target_os = "macos"))]
fn openblas_config() -> Option<OpenBlas> {
    type GetText = unsafe extern "C" fn() -> *const std::ffi::c_char;
    type GetThreads = unsafe extern "C" fn() -> std::ffi::c_int;
    // SAFETY: dlsym with RTLD_DEFAULT only looks symbols up in the objects already loaded.
    // When found, these are OpenBLAS's own exported functions with these signatures (no
    // arguments; the strings are static, NUL-terminated and owned by the library), and each
    // pointer is checked for null before it is called or read.
    unsafe {
        let symbol = |name: &std::ffi::CStr| libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr());
        let (config, core, threads) =
            (symbol(c"openblas_get_config"), symbol(c"openblas_get_corename"), symbol(c"openblas_get_num_threads"));
        if config.is_null() || core.is_null() || threads.is_null() {
            return None;
        }
        let text = |f: *mut libc::c_void| {
            let f: GetText = std::mem::transmute(f);
            let p = f();
            if p.is_null() {
                String::new()
            } else {
                std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        let threads: GetThreads = std::mem::transmute(threads);
        Some(OpenBlas { config: text(config), core: text(core), threads: threads() })
    }
}

#[cfg(target_os = "macos")]
fn openblas_config() -> Option<OpenBlas> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_a_blas_once_mlx_has_run() {
        // Any MLX computation maps libmlx and, with it, its BLAS.
        let a = mlx_rs::Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]);
        let b = mlx_rs::ops::matmul(&a, &a).unwrap();
        b.eval().unwrap();
        let text = describe();
        assert!(!text.starts_with("unknown"), "{text}");
        if cfg!(target_os = "linux") {
            assert!(text.contains("BLAS"), "{text}");
        }
    }

    /// The constructor ran in this test program too, so on a CPU that OpenBLAS 0.3.21 does
    /// not know, it runs the kernels for the CPU's features instead of the generic fallback.
    #[test]
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    fn openblas_gets_kernels_for_this_cpu() {
        let (Some(wanted), Some(openblas)) = (core_for_this_cpu(), openblas_config()) else { return };
        if std::env::var_os("OPENBLAS_CORETYPE").is_some() && CHOSEN_CORE.get().is_none() {
            return; // the user's choice
        }
        assert!(
            openblas.core.eq_ignore_ascii_case(wanted) || CHOSEN_CORE.get().is_none(),
            "asked for {wanted}: {}",
            describe()
        );
        assert!(!openblas.core.eq_ignore_ascii_case("prescott"), "{}", describe());
    }
}

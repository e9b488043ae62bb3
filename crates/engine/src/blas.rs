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

/// A one-line description of the BLAS in use, e.g. "OpenBLAS 0.3.21 (SkylakeX, 2 threads,
/// one-row products on gemv) from /work/ferrite/third_party/blas/libblas-sgemm-row.so".
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
            let rows = if forwards_one_row() { ", one-row products on gemv" } else { "" };
            format!("OpenBLAS {version} ({core}{chosen}, {threads} threads{rows}){location}")
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

/// The library MLX's f32 matmuls call into: the file that defines the `cblas_sgemm` this
/// process binds (on Linux after setup, the one-row forwarder in front of OpenBLAS), links
/// resolved. Also what a peer process should preload to multiply the same way (the reference
/// tests' mlx-lm).
#[cfg(target_os = "linux")]
pub fn library() -> Option<std::path::PathBuf> {
    // SAFETY: dlsym with RTLD_DEFAULT only looks a symbol up in the objects already loaded;
    // dladdr only reads the loader's tables into `info`, a plain C struct we own, and the file
    // name it points to is a NUL-terminated string the loader keeps while the object is loaded.
    unsafe {
        let sgemm = libc::dlsym(libc::RTLD_DEFAULT, c"cblas_sgemm".as_ptr());
        if sgemm.is_null() {
            return None;
        }
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(sgemm, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        let path = std::path::PathBuf::from(std::ffi::CStr::from_ptr(info.dli_fname).to_string_lossy().into_owned());
        Some(std::fs::canonicalize(&path).unwrap_or(path))
    }
}

#[cfg(not(target_os = "linux"))]
pub fn library() -> Option<std::path::PathBuf> {
    None
}

/// Whether MLX's one-row products go to gemv through `third_party/sgemm_row.c`.
fn forwards_one_row() -> bool {
    // SAFETY: as in `library`: a lookup among the objects already loaded, nothing is called.
    cfg!(target_os = "linux")
        && unsafe { !libc::dlsym(libc::RTLD_DEFAULT, c"ferrite_sgemm_row_forwarding".as_ptr()).is_null() }
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

    /// One-row products take the forwarder's gemv path on Linux: each way MLX can hand the
    /// operands over (weights stored n x k and used transposed, as every linear layer does;
    /// stored k x n; the row read from a column) gives the product a plain loop gives, also
    /// over a beta = 0 output, and addmm's alpha (on the product) and beta (on c) are kept.
    #[test]
    fn one_row_products_match_a_plain_loop() {
        use mlx_rs::{ops, Array};
        let (k, n) = (37usize, 53usize);
        let row: Vec<f32> = (0..k).map(|i| ((i * 7 % 11) as f32 - 5.0) / 4.0).collect();
        let weights: Vec<f32> = (0..n * k).map(|i| ((i * 13 % 17) as f32 - 8.0) / 8.0).collect();
        // expected[j] = sum_i row[i] * weights[j][i] (weights stored n x k).
        let expected: Vec<f32> = (0..n).map(|j| (0..k).map(|i| row[i] * weights[j * k + i]).sum()).collect();
        let close = |got: &Array, want: &[f32], what: &str| {
            got.eval().unwrap();
            let got = got.as_slice::<f32>();
            assert_eq!(got.len(), want.len(), "{what}");
            for (j, (g, w)) in got.iter().zip(want).enumerate() {
                assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{what}: [{j}] {g} vs {w}");
            }
        };
        let x = Array::from_slice(&row, &[1, k as i32]);
        let w = Array::from_slice(&weights, &[n as i32, k as i32]);
        close(&ops::matmul(&x, w.t()).unwrap(), &expected, "x @ w.T");
        let stored_kn: Vec<f32> = (0..k * n).map(|at| weights[(at % n) * k + at / n]).collect();
        let w_kn = Array::from_slice(&stored_kn, &[k as i32, n as i32]);
        close(&ops::matmul(&x, &w_kn).unwrap(), &expected, "x @ w (k x n stored)");
        let column = Array::from_slice(&row, &[k as i32, 1]);
        close(&ops::matmul(column.t(), w.t()).unwrap(), &expected, "column.T @ w.T");
        let bias: Vec<f32> = (0..n).map(|j| j as f32 / 10.0).collect();
        let c = Array::from_slice(&bias, &[1, n as i32]);
        let addmm = ops::addmm(&c, &x, w.t(), 0.5, 2.0).unwrap();
        let want: Vec<f32> = expected.iter().zip(&bias).map(|(e, b)| 0.5 * e + 2.0 * b).collect();
        close(&addmm, &want, "addmm");
        if cfg!(all(target_os = "linux", target_arch = "x86_64")) && openblas_config().is_some() {
            assert!(forwards_one_row(), "scripts/setup.sh builds third_party/sgemm_row.c: {}", describe());
        }
    }

    /// A few rows (a verify pass's) take the forwarder's gemv path a row at a time on Linux:
    /// each row of the product equals the plain loop's, in both layouts of the rows, and bit
    /// for bit the product of that row alone (what a decode step computes for it).
    #[test]
    fn a_few_rows_match_a_plain_loop_and_each_row_alone() {
        use mlx_rs::ops::indexing::IndexOp;
        use mlx_rs::{ops, Array};
        // Wide enough rows that OpenBLAS's sgemm sums them in another order than its gemv.
        let (k, n) = (384usize, 96usize);
        // Values that are not short binary fractions, so the order of a sum shows in its bits.
        let weights: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.618_034).fract() - 0.5).collect();
        let w = Array::from_slice(&weights, &[n as i32, k as i32]);
        for m in [2usize, 3, 5, 8] {
            let rows: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 11) as f32 - 5.0) / 4.0).collect();
            let x = Array::from_slice(&rows, &[m as i32, k as i32]);
            // The same rows stored k x m, read through a transpose.
            let stored_km: Vec<f32> = (0..k * m).map(|at| rows[(at % m) * k + at / m]).collect();
            let x_km = Array::from_slice(&stored_km, &[k as i32, m as i32]);
            for (what, product) in [("x @ w.T", ops::matmul(&x, w.t())), ("x_km.T @ w.T", ops::matmul(x_km.t(), w.t()))]
            {
                let product = product.unwrap();
                product.eval().unwrap();
                let got = product.as_slice::<f32>();
                for r in 0..m {
                    for j in 0..n {
                        let want: f32 = (0..k).map(|i| rows[r * k + i] * weights[j * k + i]).sum();
                        let g = got[r * n + j];
                        assert!(
                            (g - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{what}, {m} rows: [{r}][{j}] {g} vs {want}"
                        );
                    }
                    if cfg!(target_os = "linux") && forwards_one_row() {
                        let alone = ops::matmul(x.index(r as i32..r as i32 + 1), w.t()).unwrap();
                        alone.eval().unwrap();
                        assert_eq!(&got[r * n..(r + 1) * n], alone.as_slice::<f32>(), "{what}, {m} rows: row {r}");
                    }
                }
            }
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

//! Which implementation runs quantized matmuls over a few rows (decode steps, verify passes,
//! drafters' blocks) in this process, chosen once and checked before it is trusted:
//!
//! - `mlx`: MLX's `quantized_matmul`, on every backend; the reference, and what runs unless
//!   another path is asked for.
//! - `cuda-rows`: the engine's few-rows CUDA kernel (`qmm_rows.rs`) where it was measured
//!   faster than MLX's in isolation (`qmm_rows::pays`: up to 7 rows into 2048 or more
//!   outputs); everything else stays with MLX. Plain steps and verify passes up to 7
//!   positions then give a row the same bits; longer passes go to MLX's GEMM.
//! - `cuda-mma`: the engine's tensor-core kernel (`qmm_mma.rs`) for every product of up to 16
//!   bfloat16 rows.
//! - `mlx-pad8`: MLX's product, with fewer than 8 rows padded with zeros to 8. On CUDA MLX runs
//!   its one-row kernel once per row below 8 rows and a GEMM from 8, which costs about one
//!   row's time (bench/results/qmm-rows.md): a verify pass's 2-7 rows then cost one GEMM, and
//!   a decode step's row goes through the same GEMM shape as theirs, so it gets their bits.
//!
//! Both kernels win over MLX's product alone but lose inside a whole decode step (the 8B
//! shape's plain step and its graph building were slower with either on an H100:
//! bench/results/qmm-rows.md), and so does `mlx-pad8` (a decode step's one row padded to 8
//! costs a GEMM), so none is chosen unless asked for.
//!
//! A CUDA kernel compiles at run time, so it is trusted only after `choose` has run it against
//! float32 products on small inputs (4 and 8 bits, 1 to 32 rows) and seen every row agree
//! within `delta_check::Tolerance::BF16_OUTPUT`, and a row give the same bits alone and among
//! others. On a mismatch or an error it logs why and MLX's runs.

use std::fmt;
use std::sync::OnceLock;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{ops, random, Array, Dtype};

use super::kernel_check::{mismatch, relative_difference, Tolerance};
use super::packed::Packed;
use super::{qmm_mma, qmm_rows};
use crate::device::{self, Backend};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MatmulPath {
    Mlx,
    CudaRows,
    CudaMma,
    MlxPad8,
}

impl MatmulPath {
    pub fn name(self) -> &'static str {
        match self {
            MatmulPath::Mlx => "mlx",
            MatmulPath::CudaRows => "cuda-rows",
            MatmulPath::CudaMma => "cuda-mma",
            MatmulPath::MlxPad8 => "mlx-pad8",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        [MatmulPath::Mlx, MatmulPath::CudaRows, MatmulPath::CudaMma, MatmulPath::MlxPad8]
            .into_iter()
            .find(|p| p.name() == name)
    }
}

impl fmt::Display for MatmulPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What was chosen and why: the kernel's largest difference from float32, or why it was
/// turned down.
#[derive(Debug, Clone)]
pub struct MatmulReport {
    pub path: MatmulPath,
    pub why: String,
}

static CHOSEN: OnceLock<MatmulReport> = OnceLock::new();

/// The path this process runs: the one `choose` settled on, `mlx` before that.
pub fn current() -> MatmulPath {
    CHOSEN.get().map_or(MatmulPath::Mlx, |r| r.path)
}

/// What `choose` decided, if it ran.
pub fn report() -> Option<&'static MatmulReport> {
    CHOSEN.get()
}

/// Settles the path once per process: `wanted` when its self-check passes, else `mlx`. Later
/// calls return the first decision.
pub fn choose(wanted: Option<MatmulPath>) -> &'static MatmulReport {
    CHOSEN.get_or_init(|| {
        let report = match wanted {
            Some(MatmulPath::Mlx) => MatmulReport { path: MatmulPath::Mlx, why: "asked for".into() },
            None if device::backend() == Backend::Cuda => MatmulReport {
                path: MatmulPath::Mlx,
                why: "the engine's kernels slow a whole decode step on CUDA; --matmul-path asks for one".into(),
            },
            None => MatmulReport { path: MatmulPath::Mlx, why: format!("no kernel path on {}", device::backend()) },
            Some(kernel) => match self_check(kernel) {
                Ok(why) => MatmulReport { path: kernel, why },
                Err(e) => {
                    tracing::warn!("the {kernel} matmul path failed its self-check: {e}");
                    MatmulReport { path: MatmulPath::Mlx, why: format!("{kernel} failed its self-check: {e}") }
                }
            },
        };
        tracing::info!("quantized matmuls of a few rows: {} ({})", report.path, report.why);
        report
    })
}

/// A kernel's product of x and packed weights.
type KernelRun = fn(&Array, &Packed) -> Result<Array, mlx_rs::error::Exception>;

/// The kernel this process multiplies x [..., K] by `p` with: the chosen path's, where it
/// takes the product (and `cuda-rows` where it was measured faster); `None` for MLX's.
pub(super) fn kernel_for(x: &Array, p: &Packed) -> Option<KernelRun> {
    let path = current();
    if path == MatmulPath::Mlx {
        return None;
    }
    let (rows, k) = qmm_rows::rows_of(x);
    let takes = match path {
        MatmulPath::CudaRows => qmm_rows::pays(rows, p.weight.dim(-2)) && qmm_rows::fits(rows, k, x.dtype(), p),
        MatmulPath::CudaMma => qmm_mma::fits(rows, k, x.dtype(), p),
        MatmulPath::MlxPad8 => rows < PADDED_ROWS,
        MatmulPath::Mlx => false,
    };
    takes.then(|| kernel(path)).flatten().map(|(run, _)| run)
}

/// The kernel a path runs and the most rows it takes (`None` for MLX's).
fn kernel(path: MatmulPath) -> Option<(KernelRun, i32)> {
    match path {
        MatmulPath::CudaRows => Some((qmm_rows::run, qmm_rows::MAX_ROWS)),
        MatmulPath::CudaMma => Some((qmm_mma::run, qmm_mma::MAX_ROWS)),
        MatmulPath::MlxPad8 => Some((padded_to_eight, PADDED_ROWS - 1)),
        MatmulPath::Mlx => None,
    }
}

/// The rows `mlx-pad8` pads a smaller product to: where MLX's CUDA product turns to its GEMM.
const PADDED_ROWS: i32 = 8;

/// MLX's product of x [..., K] and `p` with x's rows padded with zeros to `PADDED_ROWS` (the
/// padding's products dropped).
fn padded_to_eight(x: &Array, p: &Packed) -> Result<Array, mlx_rs::error::Exception> {
    let (rows, k) = qmm_rows::rows_of(x);
    let flat = x.reshape(&[rows, k])?;
    let padded = match PADDED_ROWS - rows {
        missing if missing > 0 => ops::concatenate(&[flat, ops::zeros_dtype(&[missing, k], x.dtype())?], 0)?,
        _ => flat,
    };
    let (group, bits) = (p.spec.group_size, p.spec.bits);
    let y = ops::quantized_matmul(&padded, &p.weight, &p.scales, &p.biases, true, group, bits)?;
    let mut shape = x.shape().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = y.dim(-1);
    }
    y.index(..rows).reshape(&shape)
}

/// `kernel`'s products against float32 ones (dequantized weights times x) for 4- and 8-bit
/// weights and every row count it takes of bfloat16, and each row's bits against the same
/// row alone. Returns the largest difference seen.
pub fn self_check(kernel: MatmulPath) -> crate::error::Result<String> {
    let Some((run, max_rows)) = self::kernel(kernel) else {
        return Ok("the reference".into());
    };
    let (n, k) = (256, 1024);
    let mut largest = 0f32;
    for (i, bits) in [4, 8].into_iter().enumerate() {
        let packed = Packed::random(n, k, bits, 64, Some(&random::key(4000 + i as u64)?))?;
        let dequantized = ops::dequantize(&packed.weight, &packed.scales, &packed.biases, 64, bits)?;
        let key = random::key(4100 + i as u64)?;
        let x = random::normal::<f32>(&[max_rows, k], None, None, Some(&key))?.as_dtype(Dtype::Bfloat16)?;
        let alone = run(&x.index(..1), &packed)?;
        for rows in [1, 3, 8, 13, max_rows].into_iter().filter(|&r| r <= max_rows) {
            let x = x.index(..rows);
            let expected = ops::matmul(&x.as_dtype(Dtype::Float32)?, dequantized.t())?;
            let got = run(&x, &packed)?;
            let what = format!("{bits}-bit weights, {rows} rows");
            largest = largest.max(relative_difference(&what, &expected, &got, Tolerance::BF16_OUTPUT)?);
            if !got.index(..1).eq_values(&alone)? {
                return Err(mismatch(format!("{what}: the first row differs from the same row alone")));
            }
        }
    }
    Ok(format!("largest difference from float32 {largest:.1e}; a row alone and among others agree bit for bit"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_named_as_the_flag_takes_them() {
        for path in [MatmulPath::Mlx, MatmulPath::CudaRows, MatmulPath::CudaMma, MatmulPath::MlxPad8] {
            assert_eq!(MatmulPath::parse(path.name()), Some(path));
        }
        assert_eq!(MatmulPath::parse("cuda"), None);
    }

    /// `mlx-pad8` is MLX's own product, so it runs on any backend: on this CPU its check
    /// passes (float32 within tolerance, a row alone and among up to 7 others bit for bit), and
    /// it keeps x's leading shape.
    #[test]
    fn padding_to_eight_rows_keeps_the_product_and_the_shape() {
        let why = self_check(MatmulPath::MlxPad8).unwrap();
        assert!(why.contains("bit for bit"), "{why}");
        let p = Packed::random(96, 128, 4, 64, Some(&random::key(7).unwrap())).unwrap();
        let x = random::normal::<f32>(&[1, 3, 128], None, None, Some(&random::key(8).unwrap())).unwrap();
        let got = padded_to_eight(&x, &p).unwrap();
        let want = ops::quantized_matmul(&x, &p.weight, &p.scales, &p.biases, true, 64, 4).unwrap();
        assert_eq!(got.shape(), want.shape());
        let diff = got.subtract(&want).unwrap().abs().unwrap().max(None).unwrap().item_cast::<f32>();
        assert!(diff < 1e-4, "{diff}");
    }
}

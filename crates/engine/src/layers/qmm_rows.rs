//! The engine's CUDA kernel for an affine-quantized matmul over a few rows (a decode step, a
//! verify pass of a few positions), through MLX's custom CUDA kernel API. MLX's CUDA
//! `quantized_matmul` runs its one-row kernel once per row below 8 rows, so a verify pass of 2
//! to 7 positions costs as many plain steps' matmuls; this kernel reads each packed weight once
//! for all rows. Its multiply-adds run on the CUDA cores, so past a few rows it falls behind
//! MLX's tensor-core GEMM (from 8 rows on), and with few output columns it has too few warps
//! to hide memory latency: [`pays`] keeps it where it was measured faster
//! (bench/results/qmm-rows.md).
//!
//! Layout (`qmm_rows.cu`): one warp per `columns` output columns; each lane loads 16 bytes of
//! a column's packed weights per step and multiplies them with every row of x. A row's sums
//! run in the same order whatever the other rows, so a row gives the same bits in a one-row
//! step and in a verify pass: greedy speculation stays equal to plain decoding.

use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use super::packed::Packed;
use crate::ffi::{CudaKernel, KernelSlot, KernelSource, Launch, TemplateArg};

/// The kernel's body, shared with `bench/qmm_small_m.py`.
const SOURCE: &str = include_str!("qmm_rows.cu");

/// The most rows one launch takes; the self-check runs up to it.
pub const MAX_ROWS: i32 = 32;
/// Where the kernel beats MLX's (bench/results/qmm-rows.md): up to this many rows (MLX's GEMM
/// takes 8 or more at about one row's cost)...
const PAYS_UP_TO_ROWS: i32 = 7;
/// ...on matrices with at least this many output columns (fewer leave too few warps).
const PAYS_FROM_COLUMNS: i32 = 2048;

thread_local! {
    /// Made once per thread; MLX compiles one module per set of template arguments.
    static KERNEL: RefCell<Option<CudaKernel>> = const { RefCell::new(None) };
}

const KERNEL_SOURCE: KernelSource =
    KernelSource { name: "ferrite_qmm_rows", inputs: &["x", "w", "scales", "biases"], outputs: &["y"], body: SOURCE };

/// Whether the kernel takes `rows` rows of x (`dtype`, `k` inputs) against `p`: 2, 4 or 8
/// bits in groups whose packed words come in whole 16-byte loads, 16-bit activations.
pub fn fits(rows: i32, k: i32, dtype: Dtype, p: &Packed) -> bool {
    let (bits, group) = (p.spec.bits, p.spec.group_size);
    let n = p.weight.dim(-2);
    (1..=MAX_ROWS).contains(&rows)
        && matches!(dtype, Dtype::Bfloat16 | Dtype::Float16)
        && matches!(bits, 2 | 4 | 8)
        && p.is_matrix_over(k)
        && (group * bits) % 128 == 0
        && n % columns_for(rows) == 0
}

/// Whether the kernel was measured faster than MLX's for `rows` rows into `columns` outputs.
pub fn pays(rows: i32, columns: i32) -> bool {
    rows <= PAYS_UP_TO_ROWS && columns >= PAYS_FROM_COLUMNS
}

/// Output columns a warp owns: fewer as rows grow, so a lane's sums stay in registers (8 were
/// measured faster for one or two rows, 4 from three). Only the split of the work changes with
/// it, not the order of any column's sums.
fn columns_for(rows: i32) -> i32 {
    match rows {
        ..=2 => 8,
        3..=16 => 4,
        _ => 2,
    }
}

/// The smallest compiled row count that holds `rows` (one module for each).
fn rows_bucket(rows: i32) -> i32 {
    [1, 2, 4, 8, 16, MAX_ROWS].into_iter().find(|&b| rows <= b).unwrap_or(MAX_ROWS)
}

/// `x @ dequantize(p).T` for x [..., K] whose leading dimensions hold at most [`MAX_ROWS`]
/// rows (check [`fits`] first).
pub fn run(x: &Array, p: &Packed) -> Result<Array, Exception> {
    let (rows, k) = rows_of(x);
    if !fits(rows, k, x.dtype(), p) {
        return Err(refusal("few-rows matmul", x, p));
    }
    let n = p.weight.dim(-2);
    let columns = columns_for(rows);
    let warps = n / columns;
    let per_block = if warps % 4 == 0 { 4 } else { 1 };
    let template = [
        ("InT", TemplateArg::Dtype(x.dtype())),
        ("Bits", TemplateArg::Int(p.spec.bits)),
        ("GroupSize", TemplateArg::Int(p.spec.group_size)),
        ("C", TemplateArg::Int(columns)),
        ("MaxRows", TemplateArg::Int(rows_bucket(rows))),
    ];
    let launch = Launch {
        outputs: &[(&[rows, n], x.dtype())],
        grid: (32, warps, 1),
        block: (32, per_block, 1),
        template: &template,
    };
    run_on_rows(&KERNEL_SOURCE, &KERNEL, x, p, &launch)
}

/// x [..., K] as a matrix: its rows (every leading dimension) and K.
pub(super) fn rows_of(x: &Array) -> (i32, i32) {
    let k = x.dim(-1);
    ((x.size() as i32) / k.max(1), k)
}

/// Why a few-rows kernel (`what`) does not take x against `p`.
pub(super) fn refusal(what: &str, x: &Array, p: &Packed) -> Exception {
    let (rows, k) = rows_of(x);
    Exception::custom(format!(
        "the {what} kernel does not take {rows} rows of {k} ({:?}) at {} bits in groups of {}",
        x.dtype(),
        p.spec.bits,
        p.spec.group_size
    ))
}

/// Runs a few-rows kernel (inputs x, w, scales, biases; output y [rows, N]) on x's rows as a
/// [rows, K] matrix and gives its output x's leading shape.
pub(super) fn run_on_rows(
    kernel: &KernelSource,
    slot: &'static KernelSlot,
    x: &Array,
    p: &Packed,
    launch: &Launch,
) -> Result<Array, Exception> {
    let (rows, k) = rows_of(x);
    let x2 = x.reshape(&[rows, k])?;
    let out = kernel.apply(slot, &[&x2, &p.weight, &p.scales, &p.biases], launch)?;
    let y = out.into_iter().next().ok_or_else(|| Exception::custom(format!("{} returned nothing", kernel.name)))?;
    let mut shape = x.shape().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = p.weight.dim(-2);
    }
    y.reshape(&shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packed(n: i32, k: i32, bits: i32, group_size: i32) -> Packed {
        Packed::random(n, k, bits, group_size, None).unwrap()
    }

    #[test]
    fn it_takes_few_rows_of_16_bit_activations_in_whole_loads() {
        let p = packed(64, 256, 4, 64);
        assert!(fits(1, 256, Dtype::Bfloat16, &p));
        assert!(fits(MAX_ROWS, 256, Dtype::Float16, &p));
        assert!(!fits(MAX_ROWS + 1, 256, Dtype::Bfloat16, &p), "a prompt goes to MLX's GEMM");
        assert!(!fits(4, 256, Dtype::Float32, &p), "32-bit activations are not loaded 8 to 16 bytes");
        assert!(fits(4, 256, Dtype::Bfloat16, &packed(64, 256, 8, 64)));
        assert!(!fits(4, 256, Dtype::Bfloat16, &packed(64, 256, 2, 32)), "a group of 2-bit weights in 2 words");
        assert!(!fits(2, 256, Dtype::Bfloat16, &packed(60, 256, 4, 64)), "60 columns do not split into warps of 8");
        assert!(!fits(1, 512, Dtype::Bfloat16, &p), "x of 512 inputs against weights packed over 256: read past them");
    }

    #[test]
    fn it_runs_where_it_was_measured_faster_than_mlx() {
        assert!(pays(1, 4096) && pays(7, 12288));
        assert!(!pays(8, 4096), "MLX's GEMM from 8 rows");
        assert!(!pays(1, 1024), "a narrow matrix leaves too few warps");
    }

    #[test]
    fn each_row_count_has_a_compiled_bucket_and_columns_that_fit_its_registers() {
        for rows in 1..=MAX_ROWS {
            let bucket = rows_bucket(rows);
            assert!(bucket >= rows && bucket <= MAX_ROWS);
            assert!(columns_for(rows) * bucket <= 64, "{rows} rows: accumulators per lane");
        }
    }
}

//! The engine's tensor-core CUDA kernel for an affine-quantized matmul over up to 16 rows of
//! bfloat16 (a decode step, a verify pass, a block drafter's pass), through MLX's custom CUDA
//! kernel API. The few-rows kernel (`qmm_rows.rs`) reads the weights once but multiplies on the
//! CUDA cores, one multiply-add per weight and row, so its cost grows with the rows; here one
//! `mma.m16n8k16` multiplies all 16 rows at once, with the weights dequantized to bfloat16 in
//! registers, so a verify pass of up to 16 positions should cost about one row's time.
//! Not yet measured on a GPU: `--matmul-path cuda-mma` runs it (after its self-check);
//! `bench/qmm_small_m.py` times it beside MLX's and the few-rows kernel.
//!
//! Layout (`qmm_mma.cu`): a block of 4 warps owns 8 output columns, each warp a quarter of
//! the inputs; their sums are added in a fixed order. A row's products and sums are the same
//! instructions whatever the other rows hold: a row gives the same bits alone and among others.

use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use super::packed::Packed;
use super::qmm_rows::{refusal, rows_of, run_on_rows};
use crate::ffi::{CudaKernel, KernelSource, Launch, TemplateArg};

/// The kernel's body, shared with `bench/qmm_small_m.py`.
const SOURCE: &str = include_str!("qmm_mma.cu");

/// The rows one `mma` multiplies.
pub const MAX_ROWS: i32 = 16;

thread_local! {
    /// Made once per thread; MLX compiles one module per set of template arguments.
    static KERNEL: RefCell<Option<CudaKernel>> = const { RefCell::new(None) };
}

const KERNEL_SOURCE: KernelSource =
    KernelSource { name: "ferrite_qmm_mma", inputs: &["x", "w", "scales", "biases"], outputs: &["y"], body: SOURCE };

/// Whether the kernel takes `rows` rows of x (`dtype`, `k` inputs) against `p`: bfloat16
/// activations, 2, 4 or 8 bits in groups of a multiple of 16, inputs in quarters of whole
/// 16-input steps, outputs in blocks of 8.
pub fn fits(rows: i32, k: i32, dtype: Dtype, p: &Packed) -> bool {
    let (bits, group) = (p.spec.bits, p.spec.group_size);
    (1..=MAX_ROWS).contains(&rows)
        && dtype == Dtype::Bfloat16
        && matches!(bits, 2 | 4 | 8)
        && p.is_matrix_over(k)
        && group % 16 == 0
        && k % 64 == 0
        && p.weight.dim(-2) % 8 == 0
}

/// `x @ dequantize(p).T` for x [..., K] whose leading dimensions hold at most [`MAX_ROWS`]
/// rows (check [`fits`] first).
pub fn run(x: &Array, p: &Packed) -> Result<Array, Exception> {
    let (rows, k) = rows_of(x);
    if !fits(rows, k, x.dtype(), p) {
        return Err(refusal("tensor-core matmul", x, p));
    }
    let n = p.weight.dim(-2);
    let template = [
        ("InT", TemplateArg::Dtype(x.dtype())),
        ("Bits", TemplateArg::Int(p.spec.bits)),
        ("GroupSize", TemplateArg::Int(p.spec.group_size)),
    ];
    // One block (4 warps, the inputs' quarters) per 8 output columns.
    let launch = Launch {
        outputs: &[(&[rows, n], x.dtype())],
        grid: (32, 4 * (n / 8), 1),
        block: (32, 4, 1),
        template: &template,
    };
    run_on_rows(&KERNEL_SOURCE, &KERNEL, x, p, &launch)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn packed(n: i32, k: i32, bits: i32, group_size: i32) -> Packed {
        Packed::random(n, k, bits, group_size, None).unwrap()
    }

    #[test]
    fn it_takes_up_to_16_rows_of_bfloat16_in_whole_steps() {
        let p = packed(64, 256, 4, 64);
        assert!(fits(1, 256, Dtype::Bfloat16, &p) && fits(MAX_ROWS, 256, Dtype::Bfloat16, &p));
        assert!(!fits(MAX_ROWS + 1, 256, Dtype::Bfloat16, &p), "one mma holds 16 rows");
        assert!(!fits(4, 256, Dtype::Float16, &p), "the mma multiplies bfloat16");
        assert!(!fits(4, 256, Dtype::Bfloat16, &packed(60, 256, 4, 64)), "outputs in blocks of 8");
        assert!(fits(4, 256, Dtype::Bfloat16, &packed(64, 256, 8, 32)));
    }
}

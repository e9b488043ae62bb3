//! Which implementation runs the hybrids' gated delta rule in this process, chosen once and
//! checked before it is trusted:
//!
//! - `ops`: MLX operations, one compiled step per position (`gated_delta.rs`), on every
//!   backend; the reference the others are checked against.
//! - `mlx-native`: MLX's own `fast::gated_delta_update` (MLX >= 0.32.4), which runs Metal
//!   kernels on a Mac (elsewhere its operations fallback). A verify pass calls it once per
//!   position, so each position's state is there for a rollback and equals plain decoding's.
//! - `cuda-kernel`: the engine's CUDA kernel for the recurrence (`delta_cuda.rs`), one launch
//!   for all positions, the states of a verify pass included; conv, norms and gates as ops.
//! - `cuda-fused`: everything between a layer's input and output projections in one CUDA
//!   launch (`delta_fused.rs`): conv, norms, gates, recurrence and the gated norm; and, in the
//!   MoE layers, the routing and the combine around the gathered matmuls as one launch each
//!   (`moe_cuda.rs`). A CUDA machine tries it first, then `cuda-kernel`.
//!
//! A GPU's kernels cannot be trusted blind (a Metal kernel is never compiled off a Mac, and a
//! CUDA kernel compiles at run time): `delta_check::choose` runs the candidate against the operations on
//! small inputs, in float32 and bfloat16, through the same compiled layer code a model runs,
//! and keeps it only when every output agrees within `delta_check::Tolerance`; on a mismatch or an error
//! it logs why and the operations run.

use std::fmt;
use std::sync::OnceLock;

use crate::device::Backend;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeltaPath {
    Ops,
    Native,
    Cuda,
    CudaFused,
}

impl DeltaPath {
    pub fn name(self) -> &'static str {
        match self {
            DeltaPath::Ops => "ops",
            DeltaPath::Native => "mlx-native",
            DeltaPath::Cuda => "cuda-kernel",
            DeltaPath::CudaFused => "cuda-fused",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        [DeltaPath::Ops, DeltaPath::Native, DeltaPath::Cuda, DeltaPath::CudaFused]
            .into_iter()
            .find(|p| p.name() == name)
    }

    /// The kernel paths a backend offers, the one to try first first (none on the CPU).
    pub fn for_backend(backend: Backend) -> &'static [DeltaPath] {
        match backend {
            Backend::Metal => &[DeltaPath::Native],
            Backend::Cuda => &[DeltaPath::CudaFused, DeltaPath::Cuda],
            Backend::Cpu => &[],
        }
    }
}

impl fmt::Display for DeltaPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What was chosen and why: the candidate's largest differences from the operations, or why
/// it was turned down.
#[derive(Debug, Clone)]
pub struct DeltaReport {
    pub path: DeltaPath,
    pub why: String,
}

static CHOSEN: OnceLock<DeltaReport> = OnceLock::new();
/// The key head size that is not whole warps a model of this process asked the CUDA
/// recurrence kernel to take, and whether the kernel agreed with the operations on it
/// (`delta_check::check_odd_heads`; a failure keeps that model on the operations, not every
/// model).
static ODD_HEADS: OnceLock<(i32, bool)> = OnceLock::new();

/// The path this process runs: the one `delta_check::choose` settled on, `ops` before that.
pub fn current() -> DeltaPath {
    CHOSEN.get().map_or(DeltaPath::Ops, |r| r.path)
}

/// What `delta_check::choose` decided, if it ran.
pub fn report() -> Option<&'static DeltaReport> {
    CHOSEN.get()
}

/// Whether layers with key heads of `head_k_dim`, not whole warps, may run the CUDA recurrence
/// kernel: its check on that size passed.
pub fn takes_odd_heads(head_k_dim: i32) -> bool {
    ODD_HEADS.get() == Some(&(head_k_dim, true))
}

/// Settles once per process whether heads of `head_k_dim` run the kernel, with `check`.
pub(crate) fn settle_odd_heads(head_k_dim: i32, check: impl FnOnce() -> bool) {
    ODD_HEADS.get_or_init(|| (head_k_dim, check()));
}

/// Settles the path once per process with `decide` (the first call's; later calls return it).
pub(crate) fn settle(decide: impl FnOnce() -> DeltaReport) -> &'static DeltaReport {
    CHOSEN.get_or_init(decide)
}

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
//! CUDA kernel compiles at run time). On a Mac `delta_check::choose` runs MLX's op against the
//! operations on small inputs, in float32 and bfloat16, and keeps it only when every output
//! agrees within `delta_check::Tolerance`. The CUDA kernels are checked where they will run:
//! at a model's load, each kernel its layers launch (a [`KernelUse`]: the layer's heads, sizes
//! and dtypes, recording or not) runs against the operations on that layer's own weights
//! (`delta_check::check_model`); a layer launches a kernel only on a use that passed, else the
//! next path down. NVRTC compiles a module per use, at seconds each and never kept on disk by
//! MLX for custom kernels, so checking other shapes than the model's would compile modules no
//! layer runs, in every process; a use checked on the layer's own arrays is the module its
//! steps then find compiled. On a mismatch or an error the check logs why.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, OnceLock};

use mlx_rs::Dtype;

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

/// One CUDA kernel as a model's layers launch it: what decides the module NVRTC compiles (its
/// template arguments and its inputs' dtypes), so a verdict holds for exactly the code that runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelUse {
    /// A Gated DeltaNet layer's short step on `kernel` (`cuda-fused` or `cuda-kernel`).
    Delta {
        kernel: DeltaPath,
        /// Key heads, value heads, key size, value size, conv kernel.
        heads: [i32; 5],
        /// The activations' dtype.
        dtype: Dtype,
        /// The conv weights', `A_log`'s, `dt_bias`' and the gated norm's.
        weights: [Dtype; 4],
        /// A verify pass's step, keeping the state after each position.
        record: bool,
    },
    /// The `cuda-fused` path's MoE routing and combine, on activations of `dtype`.
    Moe { dtype: Dtype },
}

/// The uses checked in this process, and whether each passed.
static VERDICTS: Mutex<Option<HashMap<KernelUse, bool>>> = Mutex::new(None);

/// The path this process runs: the one `delta_check::choose` settled on, `ops` before that.
pub fn current() -> DeltaPath {
    CHOSEN.get().map_or(DeltaPath::Ops, |r| r.path)
}

/// What `delta_check::choose` decided, if it ran.
pub fn report() -> Option<&'static DeltaReport> {
    CHOSEN.get()
}

/// Whether `kernel_use` passed its check in this process (`false` before it ran).
pub fn passed(kernel_use: &KernelUse) -> bool {
    let verdicts = VERDICTS.lock().unwrap_or_else(|e| e.into_inner());
    verdicts.as_ref().and_then(|v| v.get(kernel_use)).copied().unwrap_or(false)
}

/// Every use checked in this process and whether it passed.
pub fn verdicts() -> Vec<(KernelUse, bool)> {
    let verdicts = VERDICTS.lock().unwrap_or_else(|e| e.into_inner());
    verdicts.as_ref().map_or_else(Vec::new, |v| v.iter().map(|(k, &ok)| (*k, ok)).collect())
}

/// The report's reason with what the checks of kernel uses found so far, for a status line.
pub fn describe(report: &DeltaReport) -> String {
    let verdicts = verdicts();
    if verdicts.is_empty() {
        return report.why.clone();
    }
    let passed = verdicts.iter().filter(|(_, ok)| *ok).count();
    format!("{}; {passed} of {} kernel uses checked in this process passed", report.why, verdicts.len())
}

/// Whether `kernel_use` has a verdict yet.
pub(crate) fn settled(kernel_use: &KernelUse) -> bool {
    let verdicts = VERDICTS.lock().unwrap_or_else(|e| e.into_inner());
    verdicts.as_ref().is_some_and(|v| v.contains_key(kernel_use))
}

/// Keeps the verdict of `kernel_use`'s check (the first one: a use is checked once).
pub(crate) fn settle_use(kernel_use: KernelUse, passed: bool) {
    let mut verdicts = VERDICTS.lock().unwrap_or_else(|e| e.into_inner());
    verdicts.get_or_insert_with(HashMap::new).entry(kernel_use).or_insert(passed);
}

/// Settles the path once per process with `decide` (the first call's; later calls return it).
pub(crate) fn settle(decide: impl FnOnce() -> DeltaReport) -> &'static DeltaReport {
    CHOSEN.get_or_init(decide)
}

//! The few MLX calls mlx-rs does not expose in the form the engine needs. All `unsafe` FFI
//! of the engine lives here (and in `device.rs`'s availability probes), behind safe wrappers.

use mlx_rs::error::Exception;
use mlx_rs::{Array, Stream};

/// `src[start..stop] = update` as one `slice_update` op. mlx-rs's `index_mut` gets there too
/// but first reshapes `update`, which costs a copy when it is not contiguous (a transposed
/// key or value block): one extra kernel per layer and token.
pub fn slice_update(src: &Array, update: &Array, start: &[i32], stop: &[i32]) -> Result<Array, Exception> {
    assert_eq!(start.len(), stop.len());
    let strides = vec![1i32; start.len()];
    let stream = Stream::thread_local_or_default();
    // SAFETY: all handles are valid for the call; `res` is a fresh array that MLX fills in,
    // owned by the returned `Array` on success and freed here on failure.
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        let rc = mlx_sys::mlx_slice_update(
            &mut res,
            src.as_ptr(),
            update.as_ptr(),
            start.as_ptr(),
            start.len(),
            stop.as_ptr(),
            stop.len(),
            strides.as_ptr(),
            strides.len(),
            stream.as_ptr(),
        );
        if rc != 0 {
            mlx_sys::mlx_array_free(res);
            return Err(Exception::custom(format!(
                "slice_update of {:?} into {:?} at {start:?}..{stop:?} failed",
                update.shape(),
                src.shape()
            )));
        }
        Ok(Array::from_ptr(res))
    }
}

/// The primitives MLX would run to evaluate `outputs` (one entry per operation still to
/// run, named as MLX prints them, e.g. `QuantizedMatmul`, `Compiled`): read from MLX's own
/// graph export, so it counts exactly what an `eval` would dispatch.
#[cfg(feature = "dev")]
pub fn pending_primitives(outputs: &[Array]) -> Result<Vec<String>, Exception> {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("ferrite-graph-{}-{n}.dot", std::process::id()));
    let c_path =
        std::ffi::CString::new(path.to_string_lossy().as_bytes()).map_err(|e| Exception::custom(e.to_string()))?;
    // SAFETY: the vector and namer are created and freed here; each array handle is valid
    // for the call (the vector keeps its own references); the FILE is opened and closed here.
    let rc = unsafe {
        let file = libc::fopen(c_path.as_ptr(), c"w".as_ptr());
        if file.is_null() {
            return Err(Exception::custom(format!("cannot write {}", path.display())));
        }
        let vec = mlx_sys::mlx_vector_array_new();
        for a in outputs {
            mlx_sys::mlx_vector_array_append_value(vec, a.as_ptr());
        }
        let namer = mlx_sys::mlx_node_namer_new();
        let rc = mlx_sys::mlx_export_to_dot(file.cast(), namer, vec);
        mlx_sys::mlx_node_namer_free(namer);
        mlx_sys::mlx_vector_array_free(vec);
        libc::fclose(file);
        rc
    };
    let dot = std::fs::read_to_string(&path).map_err(|e| Exception::custom(format!("{}: {e}", path.display())));
    let _ = std::fs::remove_file(&path);
    if rc != 0 {
        return Err(Exception::custom("MLX could not export the graph"));
    }
    // Primitive nodes: `{ 123 [label ="Name", shape=rectangle]; }`.
    Ok(dot?
        .lines()
        .filter(|l| l.contains("shape=rectangle"))
        .filter_map(|l| l.split("label =\"").nth(1)?.split('"').next().map(str::to_string))
        .collect())
}

/// mlx-rs registers its error handler (MLX's default one exits the process) with its first
/// op: makes sure that happened before a direct call that may fail — once per process, not
/// on every call (some run per layer and decode step).
fn error_handler_registered() -> Result<(), Exception> {
    static REGISTERED: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    if REGISTERED.get().is_none() {
        mlx_rs::ops::zeros::<f32>(&[1])?;
        let _ = REGISTERED.set(());
    }
    Ok(())
}

/// A group of processes that MLX's distributed layer connects (ring over TCP, JACCL, NCCL, or
/// MPI: MLX chooses from its environment, `MLX_RANK` and `MLX_HOSTFILE` for the ring).
pub struct RawGroup(mlx_sys::mlx_distributed_group);

// SAFETY: the group is an immutable handle to MLX's communicator after `init`; MLX's
// collectives may be issued from any thread (they are ops on the thread's stream).
unsafe impl Send for RawGroup {}
unsafe impl Sync for RawGroup {}

impl Drop for RawGroup {
    fn drop(&mut self) {
        // SAFETY: the handle came from `mlx_distributed_init` and is freed once, here.
        unsafe {
            mlx_sys::mlx_distributed_group_free(self.0);
        }
    }
}

fn backend_name(backend: Option<&str>) -> Result<Option<std::ffi::CString>, Exception> {
    backend
        .map(|b| std::ffi::CString::new(b).map_err(|_| Exception::custom(format!("backend name `{b}` has a NUL byte"))))
        .transpose()
}

/// Whether MLX was built with `backend` (`None`: any).
pub fn distributed_available(backend: Option<&str>) -> Result<bool, Exception> {
    let name = backend_name(backend)?;
    // SAFETY: the name is a valid C string for the call, or null.
    Ok(unsafe { mlx_sys::mlx_distributed_is_available(name.as_ref().map_or(std::ptr::null(), |n| n.as_ptr())) })
}

/// Joins the group this process's environment describes (a group of one without one, unless
/// `strict`).
pub fn distributed_init(backend: Option<&str>, strict: bool) -> Result<RawGroup, Exception> {
    let name = backend_name(backend)?;
    error_handler_registered()?;
    // SAFETY: `res` is a fresh group handle MLX fills in; the name is valid for the call.
    unsafe {
        let mut res = mlx_sys::mlx_distributed_group_new();
        let rc =
            mlx_sys::mlx_distributed_init(&mut res, strict, name.as_ref().map_or(std::ptr::null(), |n| n.as_ptr()));
        if rc != 0 {
            mlx_sys::mlx_distributed_group_free(res);
            return Err(Exception::custom(format!(
                "the distributed group did not start (backend {}): the environment must describe it, \
                 as mlx.launch sets it up (MLX_RANK and MLX_HOSTFILE for the ring backend)",
                backend.unwrap_or("any")
            )));
        }
        Ok(RawGroup(res))
    }
}

impl RawGroup {
    pub fn rank(&self) -> i32 {
        // SAFETY: a valid group handle.
        unsafe { mlx_sys::mlx_distributed_group_rank(self.0) }
    }

    pub fn size(&self) -> i32 {
        // SAFETY: a valid group handle.
        unsafe { mlx_sys::mlx_distributed_group_size(self.0) }
    }

    /// A collective over the group: `all_sum` or `all_gather` of `x` (lazy, like any op).
    pub fn collective(&self, x: &Array, gather: bool) -> Result<Array, Exception> {
        let stream = Stream::thread_local_or_default();
        // SAFETY: all handles are valid for the call; `res` is filled by MLX and owned by the
        // returned `Array`, or freed here on failure.
        unsafe {
            let mut res = mlx_sys::mlx_array_new();
            let rc = if gather {
                mlx_sys::mlx_distributed_all_gather(&mut res, x.as_ptr(), self.0, stream.as_ptr())
            } else {
                mlx_sys::mlx_distributed_all_sum(&mut res, x.as_ptr(), self.0, stream.as_ptr())
            };
            if rc != 0 {
                mlx_sys::mlx_array_free(res);
                return Err(Exception::custom(format!(
                    "{} of {:?} across the group failed",
                    if gather { "all_gather" } else { "all_sum" },
                    x.shape()
                )));
            }
            Ok(Array::from_ptr(res))
        }
    }
}

/// A vector of arrays MLX filled in, as owned `Array`s (the vector is freed here).
///
/// SAFETY (caller): `vec` is a valid vector handle this function may free.
unsafe fn take_arrays(vec: mlx_sys::mlx_vector_array) -> Result<Vec<Array>, Exception> {
    let n = mlx_sys::mlx_vector_array_size(vec);
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let mut a = mlx_sys::mlx_array_new();
        if mlx_sys::mlx_vector_array_get(&mut a, vec, i) != 0 {
            mlx_sys::mlx_array_free(a);
            mlx_sys::mlx_vector_array_free(vec);
            return Err(Exception::custom("MLX returned an unreadable array vector"));
        }
        out.push(Array::from_ptr(a));
    }
    mlx_sys::mlx_vector_array_free(vec);
    Ok(out)
}

/// MLX's own gated delta rule (`mlx::core::fast::gated_delta_update`, MLX >= 0.32.4; bound by
/// the shim in Ferrite's mlx-sys patch): q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; gamma, beta
/// [B, T, Hv]; state [B, Hv, Dv, Dk] f32. Returns y [B, T, Hv, Dv] in q's dtype and the final
/// state. Metal runs its kernels; other backends its operations.
pub fn gated_delta_update(
    q: &Array,
    k: &Array,
    v: &Array,
    gamma: &Array,
    beta: &Array,
    state: &Array,
) -> Result<(Array, Array), Exception> {
    let stream = Stream::thread_local_or_default();
    error_handler_registered()?;
    // SAFETY: all handles are valid for the call; the mask is a null handle, which the shim
    // reads as "no mask"; the result vector is created here and freed by `take_arrays`.
    let out = unsafe {
        let mut res = mlx_sys::mlx_vector_array_new();
        let no_mask = mlx_sys::mlx_array { ctx: std::ptr::null_mut() };
        let rc = mlx_sys::mlx_fast_gated_delta_update(
            &mut res,
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            gamma.as_ptr(),
            beta.as_ptr(),
            state.as_ptr(),
            no_mask,
            stream.as_ptr(),
        );
        if rc != 0 {
            mlx_sys::mlx_vector_array_free(res);
            return Err(Exception::custom(format!(
                "MLX's gated_delta_update refused q {:?}, v {:?}, state {:?}",
                q.shape(),
                v.shape(),
                state.shape()
            )));
        }
        take_arrays(res)?
    };
    let mut out = out.into_iter();
    match (out.next(), out.next()) {
        (Some(y), Some(state)) => Ok((y, state)),
        _ => Err(Exception::custom("MLX's gated_delta_update returned fewer than two arrays")),
    }
}

/// A compile-time argument of a custom CUDA kernel (`constexpr int`, `constexpr bool` or a
/// `using` type alias in its source).
#[derive(Debug, Clone, Copy)]
pub enum TemplateArg {
    Int(i32),
    Bool(bool),
    Dtype(mlx_rs::Dtype),
}

/// One launch of a custom kernel: its outputs' shapes and dtypes, the grid and thread block in
/// threads (MLX divides the one by the other), and its template arguments.
pub struct Launch<'a> {
    pub outputs: &'a [(&'a [i32], mlx_rs::Dtype)],
    pub grid: (i32, i32, i32),
    pub block: (i32, i32, i32),
    pub template: &'a [(&'a str, TemplateArg)],
}

/// A custom CUDA kernel's name, signature (MLX writes it from the input and output names) and
/// body.
pub struct KernelSource {
    pub name: &'static str,
    pub inputs: &'static [&'static str],
    pub outputs: &'static [&'static str],
    pub body: &'static str,
}

/// Where a thread keeps a kernel once made (a `thread_local!`): MLX compiles one module per
/// set of template arguments, so one kernel object serves every launch on that thread.
pub type KernelSlot = std::thread::LocalKey<std::cell::RefCell<Option<CudaKernel>>>;

impl KernelSource {
    /// Launches the kernel kept in `slot`, made there on first use (lazy, like any op).
    pub fn apply(
        &self,
        slot: &'static KernelSlot,
        inputs: &[&Array],
        launch: &Launch,
    ) -> Result<Vec<Array>, Exception> {
        slot.with_borrow_mut(|kept| {
            let kernel = match kept.take() {
                Some(kernel) => kernel,
                None => CudaKernel::new(self.name, self.inputs, self.outputs, self.body)?,
            };
            let out = kernel.apply(inputs, launch);
            *kept = Some(kernel);
            out
        })
    }
}

/// A custom CUDA kernel through MLX's `fast::cuda_kernel` (compiled by NVRTC at its first
/// evaluation; a compile error surfaces there).
pub struct CudaKernel(mlx_sys::mlx_fast_cuda_kernel);

impl Drop for CudaKernel {
    fn drop(&mut self) {
        // SAFETY: the handle came from `mlx_fast_cuda_kernel_new` and is freed once, here.
        unsafe { mlx_sys::mlx_fast_cuda_kernel_free(self.0) }
    }
}

fn c_string(s: &str) -> Result<std::ffi::CString, Exception> {
    std::ffi::CString::new(s).map_err(|_| Exception::custom(format!("`{s}` has a NUL byte")))
}

impl CudaKernel {
    /// `source` is the kernel's body; MLX writes its signature from the input and output
    /// names (inputs `const T* name`, outputs `T* name`). Inputs are made row-contiguous.
    pub fn new(name: &str, inputs: &[&str], outputs: &[&str], source: &str) -> Result<Self, Exception> {
        let (name, source, header) = (c_string(name)?, c_string(source)?, c_string("")?);
        let names =
            |list: &[&str]| -> Result<Vec<std::ffi::CString>, Exception> { list.iter().map(|s| c_string(s)).collect() };
        let (inputs, outputs) = (names(inputs)?, names(outputs)?);
        // SAFETY: the C strings outlive the calls; the string vectors are created and freed
        // here (MLX copies what it keeps).
        unsafe {
            let vec = |list: &[std::ffi::CString]| {
                let v = mlx_sys::mlx_vector_string_new();
                for s in list {
                    mlx_sys::mlx_vector_string_append_value(v, s.as_ptr());
                }
                v
            };
            let (ins, outs) = (vec(&inputs), vec(&outputs));
            let kernel =
                mlx_sys::mlx_fast_cuda_kernel_new(name.as_ptr(), ins, outs, source.as_ptr(), header.as_ptr(), true, 0);
            mlx_sys::mlx_vector_string_free(ins);
            mlx_sys::mlx_vector_string_free(outs);
            if kernel.ctx.is_null() {
                return Err(Exception::custom("MLX could not make the CUDA kernel"));
            }
            Ok(CudaKernel(kernel))
        }
    }

    /// The kernel's outputs for `inputs` (lazy, like any op).
    pub fn apply(&self, inputs: &[&Array], launch: &Launch) -> Result<Vec<Array>, Exception> {
        let stream = Stream::thread_local_or_default();
        error_handler_registered()?;
        let names: Vec<std::ffi::CString> =
            launch.template.iter().map(|(n, _)| c_string(n)).collect::<Result<_, _>>()?;
        // SAFETY: the config and the input vector are created and freed here; every array and
        // string handle is valid for the calls; the result vector is freed by `take_arrays`.
        unsafe {
            let config = mlx_sys::mlx_fast_cuda_kernel_config_new();
            let mut rc = 0;
            for (shape, dtype) in launch.outputs {
                rc |= mlx_sys::mlx_fast_cuda_kernel_config_add_output_arg(
                    config,
                    shape.as_ptr(),
                    shape.len(),
                    u32::from(*dtype) as mlx_sys::mlx_dtype,
                );
            }
            let ((gx, gy, gz), (bx, by, bz)) = (launch.grid, launch.block);
            rc |= mlx_sys::mlx_fast_cuda_kernel_config_set_grid(config, gx, gy, gz);
            rc |= mlx_sys::mlx_fast_cuda_kernel_config_set_thread_group(config, bx, by, bz);
            for ((_, arg), name) in launch.template.iter().zip(&names) {
                rc |= match *arg {
                    TemplateArg::Int(v) => {
                        mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_int(config, name.as_ptr(), v)
                    }
                    TemplateArg::Bool(v) => {
                        mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_bool(config, name.as_ptr(), v)
                    }
                    TemplateArg::Dtype(d) => mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_dtype(
                        config,
                        name.as_ptr(),
                        u32::from(d) as mlx_sys::mlx_dtype,
                    ),
                };
            }
            let ins = mlx_sys::mlx_vector_array_new();
            for a in inputs {
                mlx_sys::mlx_vector_array_append_value(ins, a.as_ptr());
            }
            let mut res = mlx_sys::mlx_vector_array_new();
            if rc == 0 {
                rc = mlx_sys::mlx_fast_cuda_kernel_apply(&mut res, self.0, ins, config, stream.as_ptr());
            }
            mlx_sys::mlx_vector_array_free(ins);
            mlx_sys::mlx_fast_cuda_kernel_config_free(config);
            if rc != 0 {
                mlx_sys::mlx_vector_array_free(res);
                return Err(Exception::custom("MLX refused the CUDA kernel's launch (inputs, outputs or grid)"));
            }
            take_arrays(res)
        }
    }
}

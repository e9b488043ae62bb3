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
    // mlx-rs registers its error handler (MLX's default one exits the process) with its first
    // op: make sure that happened before a call that may fail.
    mlx_rs::ops::zeros::<f32>(&[1])?;
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

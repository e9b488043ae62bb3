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

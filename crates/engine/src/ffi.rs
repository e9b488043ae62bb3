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

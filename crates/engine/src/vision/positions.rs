//! Where a prompt's tokens sit for the text model's multi-axis rotary embedding (MRoPE): text
//! tokens advance one step on all three axes (time, height, width) together; an image's
//! tokens form its merged grid — one time step, their row and column — after the text before
//! it, and the text after an image resumes one past the largest position so far. A prompt with
//! images therefore ends at a position below its length: `delta` (negative) is what every
//! later token's position is shifted by, so decoding after the prompt is plain rotary at
//! `offset + delta`. Qwen2-VL's `get_rope_index`, as mlx-vlm 0.7.10 computes it.
//!
//! And the angles themselves: Qwen3.5's interleaved layout gives frequency `i` the height
//! position when `i % 3 == 1` (within `3 × section[1]`), the width position when `i % 3 == 2`
//! (within `3 × section[2]`), and the time position otherwise.

use mlx_rs::{ops, Array};

use crate::error::{Error, Result};

/// Each token's (time, height, width) position, and the shift of the positions after them.
#[derive(Debug, Clone, PartialEq)]
pub struct RopePositions {
    pub positions: Vec<[i32; 3]>,
    pub delta: i32,
}

/// The positions of `tokens`, where each run of `image_token` holds one image whose merged
/// grid (frames, rows, columns, after the spatial merge) is the next of `grids`.
pub fn rope_positions(tokens: &[u32], image_token: u32, grids: &[[usize; 3]]) -> Result<RopePositions> {
    let mut positions = Vec::with_capacity(tokens.len());
    let mut next = 0i32; // one past the largest position so far
    let mut images = grids.iter();
    let mut i = 0;
    while i < tokens.len() {
        if tokens[i] != image_token {
            positions.push([next; 3]);
            next += 1;
            i += 1;
            continue;
        }
        let &[t, h, w] =
            images.next().ok_or_else(|| Error::Request("the prompt has more image placeholders than images".into()))?;
        let count = t * h * w;
        if tokens.len() < i + count || tokens[i..i + count].iter().any(|&x| x != image_token) {
            return Err(Error::Request(format!(
                "an image of {t}x{h}x{w} merged patches needs {count} placeholder tokens in a row"
            )));
        }
        let mut largest = next - 1;
        for f in 0..t {
            for r in 0..h {
                for c in 0..w {
                    let at = [next + f as i32, next + r as i32, next + c as i32];
                    largest = largest.max(at[0]).max(at[1]).max(at[2]);
                    positions.push(at);
                }
            }
        }
        next = largest + 1;
        i += count;
    }
    if images.next().is_some() {
        return Err(Error::Request("the prompt has fewer image placeholders than images".into()));
    }
    Ok(RopePositions { delta: next - tokens.len() as i32, positions })
}

/// Which position axis each rotary frequency follows (Qwen3.5's interleaved layout) for
/// `frequencies` frequencies and the checkpoint's `mrope_section`.
pub fn interleaved_axes(section: [usize; 3], frequencies: usize) -> Vec<usize> {
    let mut axes = vec![0; frequencies];
    for (axis, first) in [(1, 1), (2, 2)] {
        for i in (first..(3 * section[axis]).min(frequencies)).step_by(3) {
            axes[i] = axis;
        }
    }
    axes
}

/// The rotary angles [L, frequencies] (f32) of tokens at `positions`: each frequency times the
/// position on its axis ([`interleaved_axes`]), the frequencies `1 / base^(2i / dims)`.
pub fn angles(positions: &[[i32; 3]], dims: usize, base: f32, section: [usize; 3]) -> Result<Array> {
    let frequencies = dims / 2;
    let axes = interleaved_axes(section, frequencies);
    let picked: Vec<f32> = positions.iter().flat_map(|p| axes.iter().map(move |&a| p[a] as f32)).collect();
    let picked = Array::from_slice(&picked, &[positions.len() as i32, frequencies as i32]);
    // As MLX computes them (mlx-vlm's `compute_inv_freq`), so the angles agree bit for bit.
    let exponents = ops::arange::<_, f32>(0, dims as i32, 2)?.divide(Array::from_f32(dims as f32))?;
    let inv_freq = Array::from_f32(1.0).divide(ops::power(Array::from_f32(base), exponents)?)?;
    Ok(picked.multiply(inv_freq)?)
}

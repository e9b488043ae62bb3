//! Several processes serving one model through MLX's own distributed layer (the ring backend
//! over TCP or Thunderbolt, JACCL, NCCL on CUDA): the group a process belongs to, and the
//! collectives tensor parallelism needs. A safe wrapper over `ffi`'s calls; never a transport
//! of our own.
//!
//! The group comes from the process's environment, as `mlx.launch` sets it: `MLX_RANK` and
//! `MLX_HOSTFILE` (a JSON list, one entry per rank, of that rank's `ip:port` addresses) for the
//! ring backend.

use mlx_rs::Array;

use crate::error::{Error, Result};
use crate::ffi::{self, RawGroup};

/// This process's group.
pub struct Group {
    raw: RawGroup,
    /// Why the group can no longer be used, once a collective failed. MLX's ring backend
    /// stops a connection's worker thread when the connection fails, and a later collective
    /// on it would wait forever: after a failure no collective is issued again.
    broken: std::sync::Mutex<Option<String>>,
}

impl Group {
    /// Joins the group the environment describes, with `backend` (`ring`, `jaccl`, `nccl`,
    /// `mpi`; `None`: MLX's choice). Without a group in the environment this is a group of
    /// one, unless `strict`, which makes that an error.
    pub fn init(backend: Option<&str>, strict: bool) -> Result<Group> {
        if !ffi::distributed_available(backend)? {
            return Err(crate::error::Error::Request(format!(
                "this MLX has no {} distributed backend",
                backend.unwrap_or("usable")
            )));
        }
        Ok(Group { raw: ffi::distributed_init(backend, strict)?, broken: Default::default() })
    }

    pub fn rank(&self) -> usize {
        self.raw.rank().max(0) as usize
    }

    pub fn size(&self) -> usize {
        self.raw.size().max(1) as usize
    }

    /// The element-wise sum of `x` over every rank (what follows a row-split projection).
    pub fn all_sum(&self, x: &Array) -> Result<Array> {
        self.usable()?;
        Ok(self.raw.collective(x, false)?)
    }

    /// Every rank's `x`, concatenated along the first axis in rank order.
    pub fn all_gather(&self, x: &Array) -> Result<Array> {
        self.usable()?;
        Ok(self.raw.collective(x, true)?)
    }

    /// Records that a collective of this group failed (`why`, MLX's message): every later one
    /// is refused with it instead of being issued.
    pub fn mark_broken(&self, why: &str) {
        if let Ok(mut broken) = self.broken.lock() {
            broken.get_or_insert_with(|| brief(why));
        }
    }

    /// Why the group is broken, if it is.
    pub fn broken(&self) -> Option<String> {
        self.broken.lock().ok().and_then(|b| b.clone())
    }

    fn usable(&self) -> Result<()> {
        match self.broken() {
            Some(why) => Err(Error::GroupDown(why)),
            None => Ok(()),
        }
    }

    /// Evaluates `arrays`, which hold collectives of this group; a failure breaks the group.
    pub fn eval<'a>(&self, arrays: impl IntoIterator<Item = &'a Array>) -> Result<()> {
        mlx_rs::transforms::eval(arrays).map_err(|e| {
            self.mark_broken(&e.to_string());
            Error::GroupDown(brief(&e.to_string()))
        })
    }
}

/// MLX's message without the source locations mlx-rs appends (`... at /path/file.cpp:73`).
fn brief(message: &str) -> String {
    let text = message.trim_matches('"');
    let text = text.split(" at /").next().unwrap_or(text);
    text.trim_matches('"').to_string()
}

impl Group {}

/// What [`Group::check`] saw: this rank, the group's size, the sum over the ranks of
/// `[rank + 1; 4]` and every rank's `[rank]` gathered.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CheckResult {
    pub rank: usize,
    pub size: usize,
    pub sum: Vec<f32>,
    pub gathered: Vec<f32>,
}

impl Group {
    /// An all_sum and an all_gather across the group, evaluated: each rank should see the sum
    /// `size (size + 1) / 2` and `0..size`.
    pub fn check(&self) -> Result<CheckResult> {
        let rank = self.rank();
        let sum = self.all_sum(&Array::from_slice(&[rank as f32 + 1.0; 4], &[4]))?;
        let gathered = self.all_gather(&Array::from_slice(&[rank as f32], &[1]))?;
        self.eval([&sum, &gathered])?;
        Ok(CheckResult {
            rank,
            size: self.size(),
            sum: sum.as_slice::<f32>().to_vec(),
            gathered: gathered.as_slice::<f32>().to_vec(),
        })
    }
}

/// Starts evaluating `arrays` in the background (the host builds the next step meanwhile), or,
/// on a split model, evaluates them now. A collective that fails leaves MLX's ring with a dead
/// connection thread, and any collective queued behind it waits forever: on a split model no
/// collective is queued before the ones before it are known to have gone through.
pub(crate) fn schedule<'a>(split: bool, arrays: impl IntoIterator<Item = &'a mlx_rs::Array>) -> Result<()> {
    if split {
        mlx_rs::transforms::eval(arrays)?;
    } else {
        mlx_rs::transforms::async_eval(arrays)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn mlx_messages_lose_their_source_locations() {
        let raw = r#""[ring] connection to a peer was lost at /x/mlx-c/mlx/c/transforms.cpp:73" at /rustc/abc/function.rs:250:5"#;
        assert_eq!(super::brief(raw), "[ring] connection to a peer was lost");
    }
}

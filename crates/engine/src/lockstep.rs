//! The ranks of a split model in step. Every layer sums across the group, so every rank must
//! run the same forward passes in the same order: rank 0 decides what runs (the requests it is
//! given) and tells the others ([`Order`]), which run the same code on the same inputs; what a
//! rank could decide on its own — that a request was cancelled — is agreed across the group at
//! each point where generation checks it. The prompt cache stays in step because every rank
//! sees the same requests with the same budget (the smallest rank's, agreed at load).
//!
//! Rank 0's side is inside [`Engine::generate`] and [`Engine::clear_prompt_cache`]; the
//! others call [`Engine::follow`] once loaded.

use serde::{Deserialize, Serialize};

use crate::distributed::Group;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::request::{CancelToken, GenerateRequest};

/// What rank 0 tells the other ranks to do.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum Order {
    /// Run this request to its end (or its agreed cancellation).
    Generate(Box<GenerateRequest>),
    ClearPromptCache,
    /// Every rank's MLX memory in use, gathered (rank 0's check that the others are there).
    ReportMemory,
    /// Rank 0 is done: the others return from [`Engine::follow`].
    Dismiss,
}

impl Group {
    /// Rank 0's `bytes` on every rank (the others pass `None`): its length, then its bytes,
    /// each summed across the group with zeros from the others.
    pub fn broadcast_bytes(&self, bytes: Option<&[u8]>) -> Result<Vec<u8>> {
        let bytes = if self.rank() == 0 { bytes.unwrap_or_default() } else { &[] };
        let len = i32::try_from(bytes.len()).map_err(|_| Error::Request("a message over 2 GiB".into()))?;
        let len = self.all_sum(&mlx_rs::Array::from_slice(&[len], &[1]))?;
        self.eval([&len])?;
        let len = len.as_slice::<i32>()[0].max(0) as usize;
        let mine = if self.rank() == 0 { bytes.to_vec() } else { vec![0u8; len] };
        if mine.len() != len {
            return Err(Error::Request("the ranks disagree on a message's length".into()));
        }
        if len == 0 {
            return Ok(mine);
        }
        let summed = self.all_sum(&mlx_rs::Array::from_slice(&mine, &[len as i32]))?;
        self.eval([&summed])?;
        Ok(summed.as_slice::<u8>().to_vec())
    }

    /// Whether any rank says yes.
    pub fn any(&self, yes: bool) -> Result<bool> {
        let votes = self.all_sum(&mlx_rs::Array::from_slice(&[yes as i32], &[1]))?;
        self.eval([&votes])?;
        Ok(votes.as_slice::<i32>()[0] > 0)
    }
}

fn gather_memory(group: &Group) -> Result<Vec<u64>> {
    let mine = crate::memory::mlx_memory().active as i64;
    let all = group.all_gather(&mlx_rs::Array::from_slice(&[mine], &[1]))?;
    group.eval([&all])?;
    Ok(all.as_slice::<i64>().iter().map(|&b| b.max(0) as u64).collect())
}

fn send(group: &Group, order: &Order) -> Result<()> {
    let bytes = serde_json::to_vec(order).map_err(|e| Error::Request(format!("an order to the ranks: {e}")))?;
    group.broadcast_bytes(Some(&bytes))?;
    Ok(())
}

fn receive(group: &Group) -> Result<Order> {
    let bytes = group.broadcast_bytes(None)?;
    serde_json::from_slice(&bytes)
        .map_err(|e| Error::Request(format!("rank 0 sent an order this rank cannot read: {e}")))
}

impl Engine {
    /// Rank 0 of a split model: tells the other ranks `order`. Alone, or on another rank,
    /// nothing.
    fn tell_followers(&self, order: &Order) -> Result<()> {
        match self.group() {
            Some(group) if group.rank() == 0 => send(group, order),
            _ => Ok(()),
        }
    }

    /// Rank 0 of a split model: the other ranks run `request` too.
    pub(crate) fn tell_followers_generate(&self, request: &GenerateRequest) -> Result<()> {
        self.tell_followers(&Order::Generate(Box::new(request.clone())))
    }

    /// Rank 0 of a split model: the other ranks clear their prompt caches too.
    pub(crate) fn tell_followers_clear(&self) -> Result<()> {
        self.tell_followers(&Order::ClearPromptCache)
    }

    /// Whether this engine leads a split model (rank 0 of a group) — or runs alone.
    pub fn leads(&self) -> bool {
        self.group().is_none_or(|g| g.rank() == 0)
    }

    /// A rank other than 0: runs what rank 0 orders until it is dismissed. A lost rank ends
    /// it with the collective's error ("connection to a peer was lost").
    pub fn follow(&self) -> Result<()> {
        let Some(group) = self.group().filter(|g| g.rank() > 0) else {
            return Err(Error::Request("only a rank other than 0 of a split model follows".into()));
        };
        loop {
            match receive(group)? {
                Order::Generate(request) => {
                    // Errors a request meets are met by every rank alike: rank 0 reports them.
                    match self.generate(*request, CancelToken::default()) {
                        Ok(generation) => {
                            for event in generation {
                                if let Err(e) = event {
                                    tracing::warn!("a followed request failed: {e}");
                                }
                            }
                            if let Some(why) = group.broken() {
                                return Err(Error::GroupDown(why));
                            }
                        }
                        Err(e) => tracing::warn!("a followed request was refused: {e}"),
                    }
                }
                Order::ClearPromptCache => self.clear_prompt_cache(),
                Order::ReportMemory => {
                    gather_memory(group)?;
                }
                Order::Dismiss => return Ok(()),
            }
        }
    }

    /// The MLX memory each rank holds now, in rank order (alone: this process's). On a split
    /// model this asks every rank, so it fails when one is gone: a heartbeat too.
    pub fn rank_memory(&self) -> Result<Vec<u64>> {
        match self.group() {
            Some(group) => {
                self.tell_followers(&Order::ReportMemory)?;
                gather_memory(group)
            }
            None => Ok(vec![crate::memory::mlx_memory().active]),
        }
    }

    /// Rank 0 of a split model, when done: the other ranks return from [`Engine::follow`].
    pub fn dismiss_followers(&self) -> Result<()> {
        if self.dismissed.swap(true, std::sync::atomic::Ordering::Relaxed) {
            return Ok(());
        }
        self.tell_followers(&Order::Dismiss)
    }

    /// Whether `cancel` holds, agreed across a split model's ranks (any rank's says so; only
    /// rank 0's is ever set); alone, the token itself.
    pub(crate) fn agreed_cancel(&self, cancel: &CancelToken) -> Result<bool> {
        match self.group() {
            None => Ok(cancel.is_cancelled()),
            Some(group) => group.any(cancel.is_cancelled()),
        }
    }
}

/// Rank 0 going away dismisses the others, if it has not yet.
impl Drop for Engine {
    fn drop(&mut self) {
        if let Err(e) = self.dismiss_followers() {
            tracing::warn!("the other ranks could not be dismissed: {e}");
        }
    }
}

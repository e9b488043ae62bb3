//! `ferrite dev collectives`: joins the distributed group the environment describes (as
//! `mlx.launch` sets it up) and runs an all_sum and an all_gather across it, printing what this
//! rank got as one JSON line: the check that the engine's wrapper of MLX's distributed layer
//! connects real processes.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

use anyhow::Result;
use engine::distributed::Group;

/// How long one round may take before this rank gives up on its peers. A round is a few
/// small collectives (milliseconds on loopback); MLX's ring backend can leave one waiting for
/// ever on a peer that died, so a round past this limit means the peer is gone.
const ROUND_LIMIT: Duration = Duration::from_secs(15);

/// A failure ranks other than 0 act out, to test what rank 0 sees.
#[derive(Debug, Default, Clone, Copy)]
pub struct Failure {
    /// Killed after this many rounds (a crash: no clean-up).
    pub die_after: Option<usize>,
    /// Silent after this many rounds (alive, answering nothing).
    pub stall_after: Option<usize>,
}

/// `rounds` checks in a row, each bounded by [`ROUND_LIMIT`]; ranks other than 0 act out
/// `failure`.
pub fn run(backend: &str, rounds: usize, failure: Failure) -> Result<()> {
    let group = Group::init(Some(backend), true)?;
    let rank = group.rank();
    let round_done = watch_rounds(rank);
    for round in 0..rounds.max(1) {
        if rank > 0 && failure.die_after == Some(round) {
            die();
        }
        if rank > 0 && failure.stall_after == Some(round) {
            stay_silent(rank, round_done);
        }
        println!("{}", serde_json::to_string(&group.check()?)?);
        let _ = round_done.send(());
    }
    Ok(())
}

/// Ends this process with an error when a round takes longer than [`ROUND_LIMIT`] (a peer that
/// died without MLX noticing, or one that stopped answering). The returned sender is told of
/// each finished round; dropping it ends the watch.
fn watch_rounds(rank: usize) -> mpsc::Sender<()> {
    let (round_done, rounds) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        let mut round = 0;
        loop {
            match rounds.recv_timeout(ROUND_LIMIT) {
                Ok(()) => round += 1,
                Err(RecvTimeoutError::Disconnected) => return,
                Err(RecvTimeoutError::Timeout) => {
                    eprintln!(
                        "error: rank {rank}: round {round}'s collectives did not return in {} s: \
                         a peer stopped answering",
                        ROUND_LIMIT.as_secs()
                    );
                    std::process::exit(1);
                }
            }
        }
    });
    round_done
}

/// Answers nothing for twice [`ROUND_LIMIT`], then ends this process with an error. Its own
/// watch stops first: were it to fire at the same limit as the peers' watches, this rank could
/// end first and its peers would see a lost connection instead of a silent peer.
fn stay_silent(rank: usize, round_done: mpsc::Sender<()>) -> ! {
    drop(round_done);
    std::thread::sleep(2 * ROUND_LIMIT);
    eprintln!("error: rank {rank}: stayed silent for {} s on purpose", (2 * ROUND_LIMIT).as_secs());
    std::process::exit(1)
}

/// Ends this process the way a crash or `kill -9` does: no destructors run. (A clean exit would
/// run MLX's, and a group's teardown can block on its socket threads; a dead machine never
/// gets that far either.)
fn die() -> ! {
    // SAFETY: raise has no memory preconditions; SIGKILL cannot be caught, so it does not return.
    unsafe {
        libc::raise(libc::SIGKILL);
    }
    unreachable!("SIGKILL returned")
}

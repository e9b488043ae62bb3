//! `ferrite dev collectives`: joins the distributed group the environment describes (as
//! `mlx.launch` sets it up) and runs an all_sum and an all_gather across it, printing what this
//! rank got as one JSON line: the check that the engine's wrapper of MLX's distributed layer
//! connects real processes.

use anyhow::Result;
use engine::distributed::Group;

/// `rounds` checks in a row; with `die_after`, ranks other than 0 kill themselves after that
/// many (the test of what the others see when a rank dies).
pub fn run(backend: &str, rounds: usize, die_after: Option<usize>) -> Result<()> {
    let group = Group::init(Some(backend), true)?;
    for round in 0..rounds.max(1) {
        if group.rank() > 0 && die_after == Some(round) {
            die();
        }
        println!("{}", serde_json::to_string(&group.check()?)?);
    }
    Ok(())
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

//! `ferrite dev collectives`: joins the distributed group the environment describes (as
//! `mlx.launch` sets it up) and runs an all_sum and an all_gather across it, printing what this
//! rank got as one JSON line: the check that the engine's wrapper of MLX's distributed layer
//! connects real processes.

use anyhow::Result;
use engine::distributed::Group;

/// `rounds` checks in a row; with `leave_after`, ranks other than 0 exit after that many (the
/// test of what the others see when a rank dies).
pub fn run(backend: &str, rounds: usize, leave_after: Option<usize>) -> Result<()> {
    let group = Group::init(Some(backend), true)?;
    for round in 0..rounds.max(1) {
        if group.rank() > 0 && leave_after == Some(round) {
            std::process::exit(3);
        }
        println!("{}", serde_json::to_string(&group.check()?)?);
    }
    Ok(())
}

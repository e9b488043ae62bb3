//! `ferrite dev collectives`: joins the distributed group the environment describes (as
//! `mlx.launch` sets it up) and runs an all_sum and an all_gather across it, printing what this
//! rank got as one JSON line: the check that the engine's wrapper of MLX's distributed layer
//! connects real processes.

use anyhow::Result;
use engine::distributed::Group;

pub fn run(backend: &str) -> Result<()> {
    let group = Group::init(Some(backend), true)?;
    println!("{}", serde_json::to_string(&group.check()?)?);
    Ok(())
}

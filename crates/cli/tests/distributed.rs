//! The engine's wrapper of MLX's distributed layer connects real processes: two ranks on
//! loopback with the ring backend (the hostfile `mlx.launch` would write), each sees the sum
//! and the gather of both; without a group in the environment a strict start is refused.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn two_ranks_on_loopback_sum_and_gather() {
    let tmp = tempfile::tempdir().unwrap();
    let hostfile = tmp.path().join("hosts.json");
    let ports = [free_port(), free_port()];
    let hosts = serde_json::json!([[format!("127.0.0.1:{}", ports[0])], [format!("127.0.0.1:{}", ports[1])]]);
    std::fs::write(&hostfile, hosts.to_string()).unwrap();
    let mut ranks: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(env!("CARGO_BIN_EXE_ferrite"))
                .args(["dev", "collectives", "--backend", "ring"])
                .env("MLX_RANK", rank.to_string())
                .env("MLX_HOSTFILE", &hostfile)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // Bounded: a rank that cannot reach the other must not hang the test.
    let started = Instant::now();
    while ranks.iter_mut().any(|r| r.try_wait().unwrap().is_none()) {
        if started.elapsed() > Duration::from_secs(120) {
            for r in &mut ranks {
                let _ = r.kill();
            }
            panic!("the ranks did not finish in 120 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for (rank, r) in ranks.into_iter().enumerate() {
        let out = r.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "rank {rank}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        assert_eq!(v["rank"], rank, "{v}");
        assert_eq!(v["size"], 2, "{v}");
        assert_eq!(v["sum"], serde_json::json!([3.0, 3.0, 3.0, 3.0]), "1 + 2 on every rank: {v}");
        assert_eq!(v["gathered"], serde_json::json!([0.0, 1.0]), "{v}");
    }
}

#[test]
fn a_strict_start_without_a_group_is_refused() {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args(["dev", "collectives", "--backend", "ring"])
        .env_remove("MLX_RANK")
        .env_remove("MLX_HOSTFILE")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("distributed group did not start"), "{err}");
}

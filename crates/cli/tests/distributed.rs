//! The engine's wrapper of MLX's distributed layer connects real processes: two ranks on
//! loopback with the ring backend (the hostfile `mlx.launch` would write), each sees the sum
//! and the gather of both; without a group in the environment a strict start is refused.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Two distinct free ports (both listeners held until both are chosen).
fn free_ports() -> [u16; 2] {
    let listeners = [(); 2].map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap());
    listeners.map(|l| l.local_addr().unwrap().port())
}

/// Two `ferrite dev collectives` ranks on loopback (the ring hostfile `mlx.launch` would
/// write), waited for at most 120 s: each one's exit status, stdout and stderr.
fn two_ranks(args: &[&str]) -> Vec<(bool, String, String)> {
    let tmp = tempfile::tempdir().unwrap();
    let hostfile = tmp.path().join("hosts.json");
    let ports = free_ports();
    let hosts = serde_json::json!([[format!("127.0.0.1:{}", ports[0])], [format!("127.0.0.1:{}", ports[1])]]);
    std::fs::write(&hostfile, hosts.to_string()).unwrap();
    let mut ranks: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(env!("CARGO_BIN_EXE_ferrite"))
                .args(["dev", "collectives", "--backend", "ring"])
                .args(args)
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
            let said: Vec<String> = ranks
                .into_iter()
                .map(|r| {
                    let out = r.wait_with_output().unwrap();
                    format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr))
                })
                .collect();
            panic!("the ranks did not finish in 120 s: {said:#?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    ranks
        .into_iter()
        .map(|r| {
            let out = r.wait_with_output().unwrap();
            let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
            (out.status.success(), text(&out.stdout), text(&out.stderr))
        })
        .collect()
}

#[test]
fn two_ranks_on_loopback_sum_and_gather() {
    for (rank, (ok, stdout, stderr)) in two_ranks(&[]).into_iter().enumerate() {
        assert!(ok, "rank {rank}: {stdout}\n{stderr}");
        let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
        assert_eq!(v["rank"], rank, "{v}");
        assert_eq!(v["size"], 2, "{v}");
        assert_eq!(v["sum"], serde_json::json!([3.0, 3.0, 3.0, 3.0]), "1 + 2 on every rank: {v}");
        assert_eq!(v["gathered"], serde_json::json!([0.0, 1.0]), "{v}");
    }
}

/// Rank 1 is killed after the first round: rank 0's next collective ends with a clean error
/// saying the peer was lost (not a hang, not a crash).
#[test]
fn a_dead_rank_ends_the_others_collectives_with_a_clean_error() {
    let started = Instant::now();
    let ranks = two_ranks(&["--rounds", "3", "--die-after", "1"]);
    let (ok, stdout, stderr) = &ranks[0];
    assert!(!ok, "rank 0 cannot finish three rounds alone: {stdout}");
    assert_eq!(stdout.lines().count(), 1, "one round went through: {stdout}");
    assert!(stderr.contains("connection to a peer was lost"), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(60), "bounded: {:?}", started.elapsed());
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

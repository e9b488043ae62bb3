//! `ferrite serve` stops gracefully on SIGTERM as on Ctrl-C: with a generation in flight, it
//! stops listening, lets the engine finish or cancel its step, unloads and exits 0.
#![cfg(unix)]

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use engine::checkpoint::{self, Architecture, MakeOptions};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

#[test]
fn sigterm_stops_the_server_gracefully_mid_generation() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    checkpoint::make(&MakeOptions::new(Architecture::Qwen3, "tiny"), &model).unwrap();
    let port = free_port();
    let mut server = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .env("FERRITE_CONFIG_DIR", tmp.path().join("config"))
        .env("RUST_LOG", "info")
        .args([
            "serve",
            "--model",
            model.to_str().unwrap(),
            "--port",
            &port.to_string(),
            "--idle-minutes",
            "0",
            "--alias",
            "m",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "the server did not come up");
        assert!(server.try_wait().unwrap().is_none(), "the server exited before listening");
        std::thread::sleep(Duration::from_millis(200));
    }

    // A long streamed generation: the signal arrives while it runs.
    let mut client = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let body = r#"{"model":"m","prompt":"a","max_tokens":30000,"stream":true,"ignore_eos":true}"#;
    write!(
        client,
        "POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 256];
    let n = client.read(&mut first).unwrap();
    assert!(
        String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&first[..n])
    );

    // SAFETY: kill(2) with the child's own pid and a valid signal number; nothing is shared.
    assert_eq!(unsafe { libc::kill(server.id() as libc::pid_t, libc::SIGTERM) }, 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = server.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "the server was still running 60 s after SIGTERM");
        std::thread::sleep(Duration::from_millis(100));
    };
    let mut log = String::new();
    server.stderr.take().unwrap().read_to_string(&mut log).unwrap();
    assert!(status.success(), "exit {status:?} after SIGTERM:\n{log}");
    assert!(log.contains("terminated (SIGTERM): stopping"), "{log}");
    // The in-flight stream ended with the server, not with an error page.
    let mut rest = Vec::new();
    let _ = client.read_to_end(&mut rest);
    assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err(), "still listening after exit");
}

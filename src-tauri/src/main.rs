// No console window on Windows release builds; nothing on macOS or Linux.
#![cfg_attr(not(debug_assertions), windows_subsystem = "windows")]

fn main() {
    if let Err(e) = app::run() {
        eprintln!("ferrite-app: {e:#}");
        std::process::exit(1);
    }
}

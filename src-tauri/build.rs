//! Tauri's build step (the config, capabilities, embedded ui/), and on Linux an rpath to the
//! MLX wheel's libmlx.so, as for the `ferrite` binary.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_MLX_LIBDIR");
    if let Ok(dir) = std::env::var("DEP_MLX_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    tauri_build::build()
}

//! Tauri's build step (the config, capabilities, embedded ui/), and on Linux the rpaths to
//! libmlx.so: first where the .deb installs it (`make bundle`: /usr/lib/ferrite/mlx/lib beside
//! /usr/bin), then the MLX wheel's in third_party, as for the `ferrite` binary.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_MLX_LIBDIR");
    if let Ok(dir) = std::env::var("DEP_MLX_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/../lib/ferrite/mlx/lib");
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    tauri_build::build()
}

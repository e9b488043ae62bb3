//! On Linux the engine links the MLX wheel's libmlx.so; an rpath lets `ferrite` find it
//! when run directly (LD_LIBRARY_PATH still takes precedence, e.g. for MLX's CUDA build).
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_MLX_LIBDIR");
    if let Ok(dir) = std::env::var("DEP_MLX_LIBDIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
}

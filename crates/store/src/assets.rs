//! Where the models that ship with Ferrite are found.

/// Where the models that ship with Ferrite live: `$FERRITE_ASSETS`, else `assets/` beside the
/// executable (an installed or bundled Ferrite), else the source checkout's `assets/` (a
/// `cargo build` in the repository).
pub fn assets_dir() -> std::path::PathBuf {
    if let Some(dir) = std::env::var_os("FERRITE_ASSETS").filter(|d| !d.is_empty()) {
        return dir.into();
    }
    let exe_dir = std::env::current_exe().ok().and_then(|e| e.parent().map(|p| p.to_path_buf()));
    let candidates = exe_dir
        .iter()
        // Beside the binary; the source tree (target/<profile>/); Ferrite.app's Resources; the
        // .deb's resources (/usr/bin → /usr/lib/Ferrite).
        .flat_map(|d| {
            [d.join("assets"), d.join("../../assets"), d.join("../Resources/assets"), d.join("../lib/Ferrite/assets")]
        })
        .chain([std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets")]);
    let mut fallback = None;
    for c in candidates {
        if c.join("models").is_dir() {
            return c.canonicalize().unwrap_or(c);
        }
        fallback.get_or_insert(c);
    }
    fallback.unwrap_or_else(|| "assets".into())
}

//! The catalog: models Ferrite knows how to fetch and run. The built-in list is `models.toml`
//! at the repository root (compiled in); a user file in the config directory adds entries.
//! A bad entry is an error that names the file, the line and the field, never skipped.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The built-in catalog, as shipped.
pub const BUILTIN: &str = include_str!("../../../models.toml");
pub const BUILTIN_NAME: &str = "models.toml (built in)";

/// A figure a public source gave, or `"unknown"` (never a guess).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Known<T> {
    Value(T),
    Unknown(String),
}

impl<T> Known<T> {
    pub fn value(&self) -> Option<&T> {
        match self {
            Known::Value(v) => Some(v),
            Known::Unknown(_) => None,
        }
    }

    /// The text given instead of a figure (which must be "unknown").
    fn unknown_text(&self) -> Option<&str> {
        match self {
            Known::Value(_) => None,
            Known::Unknown(s) => Some(s),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// Ferrite's name for the model (`ferrite pull ID`).
    pub id: String,
    /// Other names API clients may use; stable across builds.
    #[serde(default)]
    pub aliases: Vec<String>,
    /// Hugging Face repository (`org/name`); empty for a model that ships with Ferrite.
    #[serde(default)]
    pub repo: String,
    /// A model that ships with Ferrite: its folder under the assets directory
    /// ([`crate::assets_dir`]); nothing to download.
    #[serde(default)]
    pub embedded: Option<PathBuf>,
    #[serde(default = "main")]
    pub revision: String,
    /// `model_type` of its config.json.
    pub architecture: String,
    pub quantization: String,
    pub size_bytes: Known<u64>,
    /// Parameters in billions, total and active per token.
    pub params_b: Known<f64>,
    pub active_params_b: Known<f64>,
    /// Whether the checkpoint carries the MTP head (`mtp.*` tensors).
    pub mtp: bool,
    /// Whether the checkpoint carries a vision tower (images in): `true`, `false`, or
    /// "unknown" where its page does not say (an installed folder says for itself:
    /// `models::Installed::sees`).
    #[serde(default = "unknown")]
    pub sees: Known<bool>,
    /// Memory needed to run at the default context.
    pub memory_bytes: Known<u64>,
    pub description: String,
    /// The block drafter (DFlash) published for this model: pulled with it, loaded beside it.
    #[serde(default)]
    pub drafter: Option<DrafterEntry>,
}

/// A DFlash block drafter paired with a catalog model: on the hub (`repo`) or shipped with
/// Ferrite (`embedded`, under the assets folder).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DrafterEntry {
    #[serde(default)]
    pub repo: String,
    #[serde(default)]
    pub embedded: Option<PathBuf>,
    #[serde(default = "main")]
    pub revision: String,
    pub size_bytes: Known<u64>,
    /// Tokens a block holds (the anchor and its drafts), as its config says.
    pub block_size: usize,
}

fn unknown<T>() -> Known<T> {
    Known::Unknown("unknown".into())
}

fn main() -> String {
    "main".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    model: Vec<toml::Spanned<Entry>>,
}

#[derive(Debug, thiserror::Error)]
#[error("{file}:{line}: {message}")]
pub struct CatalogError {
    pub file: String,
    pub line: usize,
    pub message: String,
}

#[derive(Debug, Clone, Default)]
pub struct Catalog {
    pub entries: Vec<Entry>,
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

impl Catalog {
    /// The built-in catalog plus the user's file, when there is one.
    pub fn load(user_file: Option<&Path>) -> Result<Catalog, CatalogError> {
        let mut catalog = Catalog::default();
        catalog.add(BUILTIN_NAME, BUILTIN)?;
        if let Some(path) = user_file.filter(|p| p.exists()) {
            let text = std::fs::read_to_string(path).map_err(|e| CatalogError {
                file: path.display().to_string(),
                line: 0,
                message: format!("cannot read: {e}"),
            })?;
            catalog.add(&path.display().to_string(), &text)?;
        }
        Ok(catalog)
    }

    /// Parses `text` (named `file` in errors) and adds its entries.
    pub fn add(&mut self, file: &str, text: &str) -> Result<(), CatalogError> {
        let err = |line: usize, message: String| CatalogError { file: file.to_string(), line, message };
        let parsed: File = toml::from_str(text).map_err(|e| {
            let line = e.span().map(|s| line_of(text, s.start)).unwrap_or(0);
            err(line, e.message().trim().to_string())
        })?;
        for spanned in parsed.model {
            let line = line_of(text, spanned.span().start);
            let entry = spanned.into_inner();
            let bad = |field: &str, why: &str| err(line, format!("model `{}`: field `{field}`: {why}", entry.id));
            if entry.id.trim().is_empty() {
                return Err(bad("id", "must not be empty"));
            }
            if let Some((field, why)) = source_problem(entry.embedded.as_deref(), &entry.repo, "model") {
                return Err(bad(field, &why));
            }
            if let Some(d) = &entry.drafter {
                if let Some((field, why)) = source_problem(d.embedded.as_deref(), &d.repo, "drafter") {
                    return Err(bad(&format!("drafter.{field}"), &why));
                }
                if let Some(text) = d.size_bytes.unknown_text().filter(|t| *t != "unknown") {
                    return Err(bad("drafter.size_bytes", &format!("`{text}` is neither a number nor \"unknown\"")));
                }
                if !(2..=64).contains(&d.block_size) {
                    return Err(bad("drafter.block_size", "must be 2 to 64 tokens"));
                }
            }
            let figures = [
                ("size_bytes", entry.size_bytes.unknown_text()),
                ("memory_bytes", entry.memory_bytes.unknown_text()),
                ("params_b", entry.params_b.unknown_text()),
                ("active_params_b", entry.active_params_b.unknown_text()),
            ];
            if let Some((field, text)) =
                figures.into_iter().find_map(|(f, t)| t.filter(|t| *t != "unknown").map(|t| (f, t)))
            {
                return Err(bad(field, &format!("`{text}` is neither a number nor \"unknown\"")));
            }
            if let Some(text) = entry.sees.unknown_text().filter(|t| *t != "unknown") {
                return Err(bad("sees", &format!("`{text}` is neither true, false nor \"unknown\"")));
            }
            for name in std::iter::once(&entry.id).chain(&entry.aliases) {
                if let Some(other) = self.find(name) {
                    return Err(bad("id/aliases", &format!("`{name}` is already used by model `{}`", other.id)));
                }
            }
            self.entries.push(entry);
        }
        Ok(())
    }

    /// The catalog models whose drafter is the repository `repo`.
    pub fn drafted_by<'a>(&'a self, repo: &'a str) -> impl Iterator<Item = &'a Entry> + 'a {
        self.entries.iter().filter(move |e| e.drafter.as_ref().is_some_and(|d| !d.repo.is_empty() && d.repo == repo))
    }

    /// The entry named by id, alias or repository.
    pub fn find(&self, name: &str) -> Option<&Entry> {
        self.entries
            .iter()
            .find(|e| e.id == name || e.aliases.iter().any(|a| a == name) || (!e.repo.is_empty() && e.repo == name))
    }
}

/// What is wrong with where a model (or its drafter, `what`) comes from, if anything: the field
/// and why. It ships under the assets folder (`embedded`, a relative path inside it) or comes
/// from a hub repository `org/name`, not both.
fn source_problem(embedded: Option<&Path>, repo: &str, what: &str) -> Option<(&'static str, String)> {
    match embedded {
        Some(_) if !repo.is_empty() => Some(("repo", format!("an embedded {what} has no repository"))),
        Some(dir) if !dir.components().all(|c| matches!(c, std::path::Component::Normal(_))) => {
            Some(("embedded", "must be a relative path inside the assets folder".to_string()))
        }
        Some(_) => None,
        None if repo.split('/').count() != 2 || repo.split('/').any(str::is_empty) => {
            Some(("repo", "must be `org/name`".to_string()))
        }
        None => None,
    }
}

/// Where the user's catalog lives.
pub fn user_file(config_dir: &Path) -> PathBuf {
    config_dir.join("models.toml")
}

#[cfg(test)]
mod tests {
    use super::*;

    const ONE: &str = r#"
[[model]]
id = "x"
aliases = ["x-latest"]
repo = "org/x"
architecture = "qwen3"
quantization = "4-bit affine g64"
size_bytes = 123
params_b = 0.6
active_params_b = "unknown"
mtp = false
memory_bytes = "unknown"
description = "a model"
"#;

    #[test]
    fn the_builtin_catalog_parses() {
        let c = Catalog::load(None).unwrap();
        assert!(c.entries.len() >= 5, "{}", c.entries.len());
        assert!(c.entries.iter().any(|e| e.mtp));
        // Text-only architectures say so; the embedded model reads text only.
        for e in &c.entries {
            if ["qwen3", "qwen3_moe", "qwen3_next"].contains(&e.architecture.as_str()) || e.embedded.is_some() {
                assert_eq!(e.sees.value(), Some(&false), "{}", e.id);
            }
        }
    }

    #[test]
    fn entries_are_found_by_id_alias_or_repo() {
        let mut c = Catalog::default();
        c.add("user.toml", ONE).unwrap();
        assert_eq!(c.find("x-latest").unwrap().id, "x");
        assert_eq!(c.find("org/x").unwrap().revision, "main");
        assert_eq!(c.entries[0].size_bytes.value(), Some(&123));
        assert!(c.find("y").is_none());
        // Whether it sees: unknown unless the entry says.
        assert_eq!(c.entries[0].sees, Known::Unknown("unknown".into()));
        let mut c = Catalog::default();
        c.add("user.toml", &ONE.replace("mtp = false", "mtp = false\nsees = true")).unwrap();
        assert_eq!(c.entries[0].sees.value(), Some(&true));
    }

    #[test]
    fn bad_entries_name_file_line_and_field() {
        let mut c = Catalog::default();
        let e = c.add("user.toml", &ONE.replace("size_bytes = 123", "size_bytes = \"big\"")).unwrap_err();
        assert_eq!((e.file.as_str(), e.line), ("user.toml", 2), "{e}");
        assert!(e.to_string().contains("size_bytes"), "{e}");
        let e = c.add("user.toml", &ONE.replace("mtp = false", "mtp = \"yes\"")).unwrap_err();
        assert!(e.line >= 2 && e.to_string().contains("user.toml"), "{e}");
        let e = c.add("user.toml", &ONE.replace("mtp = false", "mtp = false\nsees = \"yes\"")).unwrap_err();
        assert!(e.to_string().contains("field `sees`: `yes` is neither true, false nor"), "{e}");
        let e = c.add("user.toml", &ONE.replace("repo = \"org/x\"", "repo = \"x\"")).unwrap_err();
        assert!(e.to_string().contains("`repo`"), "{e}");
        let e = c.add("user.toml", &format!("{ONE}\nextra = 1\n")).unwrap_err();
        assert!(e.to_string().contains("extra"), "{e}");
        c.add("a.toml", ONE).unwrap();
        let e = c.add("b.toml", ONE).unwrap_err();
        assert!(e.to_string().contains("already used"), "{e}");
    }

    #[test]
    fn a_drafter_is_paired_and_checked() {
        let drafted = format!("{ONE}drafter = {{ repo = \"lab/x-dflash\", size_bytes = 9, block_size = 16 }}\n");
        let mut c = Catalog::default();
        c.add("user.toml", &drafted).unwrap();
        let d = c.entries[0].drafter.as_ref().unwrap();
        assert_eq!((d.repo.as_str(), d.revision.as_str(), d.block_size), ("lab/x-dflash", "main", 16));
        assert_eq!(c.drafted_by("lab/x-dflash").map(|e| e.id.as_str()).collect::<Vec<_>>(), ["x"]);
        for (from, to, field) in [
            ("lab/x-dflash", "x-dflash", "drafter.repo"),
            ("block_size = 16", "block_size = 99", "drafter.block_size"),
            ("size_bytes = 9", "size_bytes = \"big\"", "drafter.size_bytes"),
            ("block_size = 16", "block_size = 16, extra = 1", "extra"),
            ("repo = \"lab/x-dflash\"", "embedded = \"../../etc\"", "drafter.embedded"),
        ] {
            let e = Catalog::default().add("user.toml", &drafted.replace(from, to)).unwrap_err();
            assert!(e.to_string().contains(field), "{e}");
        }
    }

    #[test]
    fn the_builtin_drafters_name_their_repositories() {
        let c = Catalog::load(None).unwrap();
        let paired: Vec<&Entry> = c.entries.iter().filter(|e| e.drafter.is_some()).collect();
        assert!(paired.len() >= 2, "{}", paired.len());
        for e in paired {
            let d = e.drafter.as_ref().unwrap();
            match &d.embedded {
                // Shipped beside the embedded model (trained by train/drafter.py).
                Some(dir) => assert!(e.embedded.is_some() && dir.starts_with("models"), "{}: {}", e.id, dir.display()),
                None => assert!(d.repo.starts_with("z-lab/") && d.repo.contains("DFlash"), "{}: {}", e.id, d.repo),
            }
        }
    }
}

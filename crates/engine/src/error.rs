//! Errors the engine reports. Every load error names the file and, where there is one,
//! the field or tensor that was wrong, so a user can fix a checkpoint without a debugger.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: field `{field}`: {message}")]
    Config { path: PathBuf, field: String, message: String },
    #[error("{path}: {message}")]
    Malformed { path: PathBuf, message: String },
    #[error("{path}: unknown architecture `{model_type}` (supported: {supported})")]
    UnknownArchitecture { path: PathBuf, model_type: String, supported: String },
    #[error("{path}: unsupported quantization: {detail}")]
    UnsupportedQuantization { path: PathBuf, detail: String },
    #[error("{dir}: tensor `{name}` is missing from the checkpoint")]
    MissingTensor { dir: PathBuf, name: String },
    #[error("{file}: tensor `{name}` has shape {found:?}, expected {expected:?}")]
    Shape { file: PathBuf, name: String, expected: Vec<i32>, found: Vec<i32> },
    #[error("{dir}: {count} tensor(s) not used by the model, e.g. `{example}`")]
    UnusedTensors { dir: PathBuf, count: usize, example: String },
    #[error("tokenizer {path}: {message}")]
    Tokenizer { path: PathBuf, message: String },
    #[error("chat template: {0}")]
    Template(String),
    #[error("request: {0}")]
    Request(String),
    /// A request setting out of range: the field (as the APIs name it) and what is wrong with
    /// it, so a server can point at the field without reading the message.
    #[error("request: {field} {message}")]
    Field { field: &'static str, message: String },
    /// The model is split across ranks and one is gone: nothing runs until it restarts.
    #[error("the model's distributed group is down: {0}")]
    GroupDown(String),
    /// The caller stopped a long operation (a tune) before it ended.
    #[error("cancelled: {0}")]
    Cancelled(String),
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }

    pub(crate) fn config(path: impl Into<PathBuf>, field: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Config { path: path.into(), field: field.into(), message: message.into() }
    }

    pub(crate) fn malformed(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Malformed { path: path.into(), message: message.into() }
    }
}

impl From<mlx_rs::error::ConversionError> for Error {
    fn from(e: mlx_rs::error::ConversionError) -> Self {
        Error::Mlx(mlx_rs::error::Exception::custom(e.to_string()))
    }
}

impl From<mlx_rs::error::IoError> for Error {
    fn from(e: mlx_rs::error::IoError) -> Self {
        Error::Request(format!("MLX io: {e}"))
    }
}

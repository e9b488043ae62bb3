//! The model architectures Ferrite runs: one type for reading a checkpoint's `model_type`,
//! choosing the model file that builds it, and making test checkpoints of it.

use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Architecture {
    #[default]
    Qwen3,
    Qwen3Moe,
    Qwen3Next,
    Qwen35,
    Qwen35Moe,
}

impl Architecture {
    pub const ALL: [Architecture; 5] = [
        Architecture::Qwen3,
        Architecture::Qwen3Moe,
        Architecture::Qwen3Next,
        Architecture::Qwen35,
        Architecture::Qwen35Moe,
    ];

    /// The `model_type` of its `config.json` (for Qwen3.5, of the outer config).
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Qwen3 => "qwen3",
            Architecture::Qwen3Moe => "qwen3_moe",
            Architecture::Qwen3Next => "qwen3_next",
            Architecture::Qwen35 => "qwen3_5",
            Architecture::Qwen35Moe => "qwen3_5_moe",
        }
    }

    /// The architecture a checkpoint's `model_type` names, if Ferrite runs it.
    pub fn from_model_type(model_type: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.model_type() == model_type)
    }

    /// A name as a person types it: the `model_type`, or with `-` / `.` (`qwen3-moe`, `qwen3.5`).
    pub fn parse(name: &str) -> Result<Self> {
        let canonical = name.replace('-', "_").replace("3.5", "3_5");
        Self::from_model_type(&canonical)
            .ok_or_else(|| Error::Request(format!("unknown architecture `{name}` (known: {})", Self::known())))
    }

    /// The known `model_type`s, for messages.
    pub fn known() -> String {
        Self::ALL.map(Architecture::model_type).join(", ")
    }

    /// A Qwen3-Next / Qwen3.5 hybrid (Gated DeltaNet + gated full attention, MTP head).
    pub fn is_hybrid(self) -> bool {
        matches!(self, Architecture::Qwen3Next | Architecture::Qwen35 | Architecture::Qwen35Moe)
    }

    /// Qwen3.5 (dense or MoE): the text model nested under `text_config`, every layer's MLP
    /// MoE when it has experts, router weights normalised by default.
    pub fn is_qwen3_5(self) -> bool {
        matches!(self, Architecture::Qwen35 | Architecture::Qwen35Moe)
    }
}

impl std::fmt::Display for Architecture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.model_type())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_types_and_typed_names_round_trip() {
        for a in Architecture::ALL {
            assert_eq!(Architecture::from_model_type(a.model_type()), Some(a));
            assert_eq!(Architecture::parse(a.model_type()).unwrap(), a);
        }
        assert_eq!(Architecture::parse("qwen3-moe").unwrap(), Architecture::Qwen3Moe);
        assert_eq!(Architecture::parse("qwen3.5-moe").unwrap(), Architecture::Qwen35Moe);
        assert_eq!(Architecture::from_model_type("qwen3-moe"), None, "config.json spells it one way");
        let e = Architecture::parse("mamba").unwrap_err().to_string();
        assert!(e.contains("mamba") && e.contains("qwen3_5_moe"), "{e}");
    }
}

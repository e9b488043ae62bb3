//! `ferrite inspect`: what a model folder holds, read from its config and safetensors
//! headers (no weights are read), plus a real load to tell whether an MTP head is usable.

use std::fmt;
use std::path::Path;

use serde::Serialize;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::weights;

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub model_type: String,
    pub layers: i32,
    /// Gated DeltaNet layers (hybrid models).
    pub linear_layers: i32,
    pub experts: Option<(i32, i32)>,
    pub parameters: u64,
    /// Parameters used per token (MoE: only the routed experts count).
    pub active_parameters: u64,
    pub mtp_parameters: u64,
    pub quantization: String,
    /// `None` = no head; `Some(Ok)` = loads; `Some(Err(why))` = present but unusable.
    pub mtp: Option<std::result::Result<(), String>>,
    /// Whether the model sees: its vision tower's shape and parameters, or why not.
    pub vision: std::result::Result<String, String>,
    pub bytes_on_disk: u64,
    pub files: usize,
    /// Where it would run here: MLX's backend and version, the BLAS under its CPU matmuls, and
    /// the form its quantized matrices would load in.
    pub device: String,
    /// A hybrid's gated delta rule: the path that runs here and why (its self-check).
    pub delta_rule: Option<String>,
    /// Which implementation multiplies a few rows by quantized weights, and why.
    pub matmul: Option<String>,
    pub blas: String,
    pub weights: String,
}

/// The checks a model folder must pass before it counts as installed, without loading any
/// weights: its config (every size within bounds), its weight files (inside the folder, their
/// safetensors headers whole) and its tokenizer. A pull runs them on what it downloaded.
pub fn check_folder(dir: &Path) -> Result<()> {
    ModelConfig::load(dir)?;
    for file in weights::weight_files(dir)? {
        weights::check_header(&file)?;
    }
    crate::tokenizer::Tokenizer::load(dir)?;
    Ok(())
}

/// What `ferrite inspect` says of the checkpoint in `dir`, loaded as `options` would load it.
pub fn inspect(dir: &Path, options: &crate::EngineOptions) -> Result<Report> {
    let config = ModelConfig::load(dir)?;
    let files = weights::weight_files(dir)?;
    let (mut total, mut active, mut mtp, mut tower) = (0u64, 0u64, 0u64, 0u64);
    let bytes = weights::weight_bytes(dir)?;
    for file in &files {
        for (name, dtype, shape) in weights::tensor_infos(file)? {
            if name.ends_with(".scales") || name.ends_with(".biases") {
                continue;
            }
            let module = name.strip_suffix(".weight").unwrap_or(&name);
            let mut n: u64 = shape.iter().map(|&d| d as u64).product();
            // Packed weights hold 32 / bits values per uint32.
            if dtype == "U32" {
                let bits = config.quant.as_ref().and_then(|q| q.spec_for(module)).map_or(32, |s| s.bits);
                n = n * 32 / bits as u64;
            }
            if name.starts_with("mtp.") {
                mtp += n;
                continue;
            }
            if name.starts_with("model.visual.") || name.starts_with("vision_tower.") {
                tower += n;
                continue;
            }
            total += n;
            let routed = name.contains(".switch_mlp.") || name.contains(".experts.");
            active += if routed && config.num_experts > 0 {
                n * config.num_experts_per_tok as u64 / config.num_experts as u64
            } else {
                n
            };
        }
    }
    let quantization = match &config.quant {
        None => "none".to_string(),
        Some(q) => {
            let mut s = format!("affine {}-bit, group size {}", q.default.bits, q.default.group_size);
            let overridden = q.overrides.values().filter(|o| o.is_some()).count();
            if overridden > 0 {
                s.push_str(&format!(" ({overridden} modules overridden)"));
            }
            s
        }
    };
    let has_mtp = files.iter().any(|f| weights::check_header(f).is_ok_and(|n| n.iter().any(|t| t.starts_with("mtp."))));
    let mtp_status = if has_mtp && config.is_hybrid() {
        Some(match crate::models::load_with(dir, options).map(|(model, _)| model) {
            Ok(m) if m.mtp().is_some() => Ok(()),
            Ok(_) => Err("not used by this architecture".to_string()),
            Err(e) => Err(e.to_string()),
        })
    } else if has_mtp {
        Some(Err(format!("{} has no MTP head: ignored", config.model_type)))
    } else {
        None
    };
    let config_path = dir.join("config.json");
    let raw: serde_json::Value =
        serde_json::from_str(&crate::small_file::read_text(&config_path, crate::small_file::JSON_CAP)?)
            .unwrap_or_default();
    let vision = match crate::vision::VisionConfig::from_config(&raw, &config_path) {
        Ok(Some(v)) if tower > 0 => Ok(format!(
            "vision tower of {} parameters ({} blocks, {}-pixel patches merged {}x{}): images taken",
            human(tower),
            v.depth,
            v.patch_size,
            v.spatial_merge_size,
            v.spatial_merge_size
        )),
        Ok(Some(_)) => Err("its config describes a vision tower, but the weights hold none: text only".into()),
        Ok(None) => Err("text only".into()),
        Err(e) => Err(format!("text only: {e}")),
    };
    Ok(Report {
        vision,
        model_type: config.model_type.clone(),
        layers: config.num_hidden_layers,
        linear_layers: (0..config.num_hidden_layers).filter(|&i| config.is_linear_layer(i)).count() as i32,
        experts: (config.num_experts > 0).then_some((config.num_experts, config.num_experts_per_tok)),
        parameters: total,
        active_parameters: active,
        mtp_parameters: mtp,
        quantization,
        mtp: mtp_status,
        bytes_on_disk: bytes,
        files: files.len(),
        device: format!("{} on MLX {}", crate::device::backend(), crate::device::mlx_version()),
        delta_rule: config.is_hybrid().then(|| {
            let r = crate::layers::delta_check::choose(None);
            format!("{} ({})", r.path, crate::layers::delta_path::describe(r))
        }),
        matmul: config.quant.is_some().then(|| {
            let r = crate::layers::matmul_path::choose(None);
            format!("{} ({})", r.path, r.why)
        }),
        blas: crate::blas::describe(),
        weights: crate::weight_form::for_checkpoint(dir, options.weights)?.to_string(),
    })
}

fn human(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.2}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1}K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "architecture   {}", self.model_type)?;
        let mut layers = format!("{}", self.layers);
        if self.linear_layers > 0 {
            layers.push_str(&format!(
                " ({} Gated DeltaNet, {} full attention)",
                self.linear_layers,
                self.layers - self.linear_layers
            ));
        }
        writeln!(f, "layers         {layers}")?;
        if let Some((e, k)) = self.experts {
            writeln!(f, "experts        {e}, {k} per token")?;
        }
        writeln!(f, "parameters     {} total, {} active", human(self.parameters), human(self.active_parameters))?;
        writeln!(f, "quantization   {}", self.quantization)?;
        let mtp = match &self.mtp {
            None => "none (plain decoding)".to_string(),
            Some(Ok(())) => format!(
                "present and complete ({} parameters): speculative decoding available",
                human(self.mtp_parameters)
            ),
            Some(Err(why)) => format!("present but unusable: {why}"),
        };
        writeln!(f, "MTP head       {mtp}")?;
        match &self.vision {
            Ok(tower) => writeln!(f, "sees           yes: {tower}")?,
            Err(why) => writeln!(f, "sees           no ({why})")?,
        }
        writeln!(f, "on disk        {:.1} MB in {} file(s)", self.bytes_on_disk as f64 / 1e6, self.files)?;
        writeln!(f, "device         {}", self.device)?;
        if let Some(delta) = &self.delta_rule {
            writeln!(f, "delta rule     {delta}")?;
        }
        if let Some(matmul) = &self.matmul {
            writeln!(f, "few-row qmm    {matmul}")?;
        }
        writeln!(f, "BLAS           {}", self.blas)?;
        write!(f, "weights        {}", self.weights)
    }
}

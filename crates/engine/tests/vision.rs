//! Images in: Ferrite's image processor makes of PNG, JPEG and grey-with-alpha files of every
//! size class (kept, upscaled to the minimum, downscaled to the maximum, odd shapes) the
//! patches mlx-vlm 0.7.10's processor makes, with the checkpoint's settings or the defaults;
//! hostile files are refused by name before they are decoded.

mod common;

use std::io::Cursor;
use std::path::Path;

use engine::vision::{decode, ImageLimits, ImageProcessor};
use image::{DynamicImage, ImageFormat, RgbImage};

/// A deterministic picture: smooth gradients with a fine pattern over them (edges that a
/// resampling filter must treat as Pillow does).
fn picture(width: u32, height: u32, seed: u32) -> RgbImage {
    RgbImage::from_fn(width, height, |x, y| {
        let noise = (x.wrapping_mul(7919) ^ y.wrapping_mul(104_729) ^ seed.wrapping_mul(31)) % 61;
        let stripe = if (x / 3 + y / 5) % 2 == 0 { 40 } else { 0 };
        image::Rgb([
            ((x * 255 / width.max(1)) as u8).wrapping_add(noise as u8),
            ((y * 255 / height.max(1)) as u8).saturating_add(stripe),
            (((x + y) * 97 + seed) % 256) as u8,
        ])
    })
}

fn encoded(image: &DynamicImage, format: ImageFormat) -> Vec<u8> {
    let mut bytes = Vec::new();
    image.write_to(&mut Cursor::new(&mut bytes), format).unwrap();
    bytes
}

/// mlx-vlm's patches and grids for `files` with the settings in `checkpoint`.
fn reference(checkpoint: &Path, files: &[std::path::PathBuf]) -> Vec<(Vec<f32>, [usize; 3])> {
    let out = tempfile::tempdir().unwrap();
    let mut command = common::reference_command("mlx_vlm_image_processor.py");
    command.arg("--checkpoint").arg(checkpoint).arg("--out").arg(out.path()).args(files);
    let run = command.output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let grids: Vec<[usize; 3]> =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("grids.json")).unwrap()).unwrap();
    grids
        .into_iter()
        .enumerate()
        .map(|(i, grid)| {
            let bytes = std::fs::read(out.path().join(format!("{i}.f32"))).unwrap();
            (bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect(), grid)
        })
        .collect()
}

#[test]
fn patches_match_mlx_vlms_processor() {
    let dir = tempfile::tempdir().unwrap();
    let grey_alpha = DynamicImage::ImageLumaA8(image::ImageBuffer::from_fn(91, 77, |x, y| {
        image::LumaA([((x * 3 + y * 5) % 256) as u8, ((x * y) % 256) as u8])
    }));
    // 16 bits a channel, low bytes set: Pillow keeps the high byte.
    let rgb16 = DynamicImage::ImageRgb16(image::ImageBuffer::from_fn(70, 50, |x, y| {
        image::Rgb([(x * 937 + 0xff) as u16, (y * 1301 + 0x80) as u16, ((x + y) * 499) as u16])
    }));
    let cases: Vec<(&str, DynamicImage, ImageFormat)> = vec![
        ("kept.png", picture(64, 96, 1).into(), ImageFormat::Png),
        ("rounded.png", picture(150, 100, 2).into(), ImageFormat::Png),
        ("tiny.png", picture(30, 20, 3).into(), ImageFormat::Png),
        ("large.png", picture(1000, 1500, 4).into(), ImageFormat::Png),
        ("strip.png", picture(1900, 40, 5).into(), ImageFormat::Png),
        ("photo.jpg", picture(120, 90, 6).into(), ImageFormat::Jpeg),
        ("grey_alpha.png", grey_alpha, ImageFormat::Png),
        ("deep.png", rgb16, ImageFormat::Png),
    ];
    let files: Vec<_> = cases
        .iter()
        .map(|(name, image, format)| {
            let path = dir.path().join(name);
            std::fs::write(&path, encoded(image, *format)).unwrap();
            path
        })
        .collect();
    // Qwen3.5's settings (the defaults), and another checkpoint's: CLIP's normalisation,
    // 14-pixel patches and a tighter pixel budget, from processor_config.json over
    // preprocessor_config.json.
    let qwen = tempfile::tempdir().unwrap();
    std::fs::write(
        qwen.path().join("preprocessor_config.json"),
        r#"{"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5], "size": {"shortest_edge": 65536, "longest_edge": 16777216}}"#,
    )
    .unwrap();
    let other = tempfile::tempdir().unwrap();
    std::fs::write(other.path().join("preprocessor_config.json"), r#"{"patch_size": 16, "max_pixels": 9999999}"#)
        .unwrap();
    std::fs::write(
        other.path().join("processor_config.json"),
        r#"{"image_processor": {"patch_size": 14, "min_pixels": 3136, "max_pixels": 200704,
            "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}}"#,
    )
    .unwrap();
    for checkpoint in [qwen.path(), other.path()] {
        let processor = ImageProcessor::load(checkpoint).unwrap();
        let expected = reference(checkpoint, &files);
        for ((file, (name, _, _)), (values, grid)) in files.iter().zip(&cases).zip(expected) {
            let bytes = std::fs::read(file).unwrap();
            let image = decode(&bytes, None, &ImageLimits::default()).unwrap();
            let patches = processor.preprocess(&image).unwrap();
            let case = format!("{name} with {}", checkpoint.display());
            assert_eq!(patches.grid, grid, "{case}");
            assert_eq!(patches.values.len(), values.len(), "{case}");
            let (h, w) = (image.height() as usize, image.width() as usize);
            assert_eq!(processor.tokens(h, w).unwrap(), grid[1] * grid[2] / 4, "{case}");
            // The tolerance: both resample in two 8-bit passes with fixed-point weights, and
            // each pass may round a channel one level apart (normalised: 1 / (255 x std));
            // a JPEG's decoders (libjpeg's, zune-jpeg's) add a level of their own.
            let std = processor.normalize.map_or(1.0, |(_, std)| std.iter().copied().fold(f32::MAX, f32::min));
            let level = 1.0 / (255.0 * std);
            let (levels, percent) = if name.ends_with(".jpg") { (3.0, 5) } else { (2.0, 2) };
            let (mut worst, mut apart) = (0f32, 0usize);
            for (a, b) in patches.values.iter().zip(&values) {
                let d = (a - b).abs();
                worst = worst.max(d);
                apart += usize::from(d > 1e-6);
            }
            assert!(worst <= levels * level * 1.001, "{case}: values up to {} levels apart", worst / level);
            assert!(apart * 100 <= percent * values.len(), "{case}: {apart} of {} values apart", values.len());
        }
    }
}

#[test]
fn hostile_images_are_refused_by_name_before_decoding() {
    let limits = ImageLimits::default();
    let png = encoded(&DynamicImage::from(picture(40, 30, 9)), ImageFormat::Png);
    let refusal = |bytes: &[u8], label: Option<&str>| decode(bytes, label, &limits).unwrap_err().to_string();

    assert!(refusal(&[], None).contains("empty"));
    assert!(refusal(b"%PDF-1.7 not a picture", None).contains("not an image"));
    // Labelled one way, another inside.
    let err = refusal(&png, Some("image/jpeg"));
    assert!(err.contains("labelled image/jpeg") && err.contains("image/png"), "{err}");
    assert!(decode(&png, Some("image/png"), &limits).is_ok());
    // Truncated mid-way.
    let err = refusal(&png[..png.len() / 2], Some("image/png"));
    assert!(err.contains("cannot be decoded"), "{err}");
    // A 30-byte GIF that claims a 65535 x 65535 canvas: refused from its header.
    let mut bomb = b"GIF89a".to_vec();
    bomb.extend([0xff, 0xff, 0xff, 0xff, 0x00, 0x00, 0x00]);
    bomb.extend([0x2c, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0x00, 0x02, 0x02, 0x44, 0x01, 0x00, 0x3b]);
    let err = refusal(&bomb, None);
    assert!(err.contains("65535x65535") && err.contains("at most"), "{err}");
    // A PNG past the size a side may have, and a body past the byte cap.
    let wide = encoded(&DynamicImage::from(RgbImage::new(20_000, 1)), ImageFormat::Png);
    assert!(refusal(&wide, None).contains("20000x1"));
    let small = ImageLimits { max_bytes: 100, ..limits };
    assert!(decode(&png, None, &small).unwrap_err().to_string().contains("at most 100"));
    // An aspect ratio no checkpoint takes.
    let strip = decode(&wide, None, &ImageLimits { max_side: 20_000, ..limits }).unwrap();
    let err = ImageProcessor::default().preprocess(&strip).unwrap_err().to_string();
    assert!(err.contains("aspect ratio"), "{err}");
}

/// A checkpoint's processor settings are untrusted: values no processor has are refused with
/// the file and field named.
#[test]
fn processor_settings_out_of_range_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(ImageProcessor::load(dir.path()).unwrap(), ImageProcessor::default());
    for (settings, field) in [
        (r#"{"patch_size": 0}"#, "patch_size"),
        (r#"{"merge_size": 1000}"#, "merge_size"),
        (r#"{"image_std": [0.5, 0, 0.5]}"#, "image_std"),
        (r#"{"min_pixels": 5000, "max_pixels": 4000}"#, "min_pixels"),
        (r#"{"size": {"longest_edge": 1e30}}"#, "max_pixels"),
        (r#"{"do_normalize": "yes"}"#, "do_normalize"),
    ] {
        std::fs::write(dir.path().join("preprocessor_config.json"), settings).unwrap();
        let err = ImageProcessor::load(dir.path()).unwrap_err().to_string();
        assert!(err.contains("preprocessor_config.json") && err.contains(field), "{settings}: {err}");
    }
}

/// A vision config is untrusted too: out-of-range or inconsistent shapes are refused by field
/// before any tensor is read, and a text-only checkpoint has no tower.
#[test]
fn vision_configs_are_checked_and_text_only_models_have_no_tower() {
    use engine::vision::{VisionConfig, VisionTower};
    let good = serde_json::json!({
        "depth": 2, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4, "patch_size": 16,
        "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 48, "num_position_embeddings": 36,
    });
    let path = Path::new("config.json");
    let parse = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut v = good.clone();
        edit(&mut v);
        VisionConfig::from_config(&serde_json::json!({ "vision_config": v }), path)
    };
    assert_eq!(parse(&|_| {}).unwrap().unwrap().patch_values(), 3 * 2 * 16 * 16);
    assert!(VisionConfig::from_config(&serde_json::json!({"hidden_size": 8}), path).unwrap().is_none());
    for (edit, field) in [
        (
            &(|v: &mut serde_json::Value| v["num_position_embeddings"] = 35.into()) as &dyn Fn(&mut serde_json::Value),
            "num_position_embeddings",
        ),
        (&|v: &mut serde_json::Value| v["num_heads"] = 3.into(), "num_heads"),
        (&|v: &mut serde_json::Value| v["depth"] = 0.into(), "depth"),
        (&|v: &mut serde_json::Value| v["patch_size"] = "16".into(), "patch_size"),
        (&|v: &mut serde_json::Value| v["deepstack_visual_indexes"] = serde_json::json!([1]), "deepstack"),
        (&|v: &mut serde_json::Value| drop(v.as_object_mut().unwrap().remove("out_hidden_size")), "out_hidden_size"),
    ] {
        let err = parse(edit).unwrap_err().to_string();
        assert!(err.contains(&format!("vision_config.{field}")), "{field}: {err}");
    }
    let text_only = common::repo_root().join("assets/models/ferrite-code-20m");
    assert!(VisionTower::load_checkpoint(&text_only).unwrap().is_none());
}

/// The vision tower: mlx-vlm makes a Qwen3.5 tower with random weights and runs it on the
/// patches Ferrite's processor made of two images (different shapes, one call: each attends
/// to itself only); Ferrite loads the checkpoint as published and its features match, in f32
/// closely and in bf16 within bf16's rounding.
#[test]
fn the_vision_tower_matches_mlx_vlms() {
    use engine::vision::VisionTower;
    let processor = ImageProcessor { min_pixels: 64 * 64, max_pixels: 96 * 160, ..ImageProcessor::default() };
    let images = [picture(100, 70, 11), picture(60, 130, 12)];
    let patches: Vec<_> = images.iter().map(|i| processor.preprocess(i).unwrap()).collect();
    let grids: Vec<[usize; 3]> = patches.iter().map(|p| p.grid).collect();
    assert!(grids[0] != grids[1] && grids.iter().all(|g| g[1] * g[2] >= 16), "{grids:?}");
    let values: Vec<f32> = patches.iter().flat_map(|p| p.values.iter().copied()).collect();
    let dir = tempfile::tempdir().unwrap();
    let pixels = dir.path().join("pixels.f32");
    std::fs::write(&pixels, values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let config = serde_json::json!({
        "depth": 2, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4, "in_channels": 3,
        "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 48,
        "num_position_embeddings": 36, "deepstack_visual_indexes": [],
    });
    // f32 agrees to rounding; bf16 within a few of its steps (its 8-bit mantissa: 0.4%).
    for (dtype, tolerance) in [("float32", 1e-5f32), ("bfloat16", 2e-2)] {
        let out = tempfile::tempdir().unwrap();
        let mut command = common::reference_command("mlx_vlm_vision_tower.py");
        command.args(["--config", &config.to_string(), "--grids", &serde_json::to_string(&grids).unwrap()]);
        command.args(["--dtype", dtype]).arg("--pixels").arg(&pixels).arg("--out").arg(out.path());
        let run = command.output().unwrap();
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
        let expected: Vec<f32> = std::fs::read(out.path().join("features.f32"))
            .unwrap()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();

        // As this machine loads it (f32 on the CPU backend), and in the checkpoint's dtype as a
        // GPU computes: a bf16 tower stays in bf16 throughout, as mlx-vlm's does (lifted to f32,
        // a GPU multiplies many times slower).
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap()).unwrap();
        let here = VisionTower::load_checkpoint(out.path()).unwrap().expect("a tower");
        assert_eq!(here.dtype(), mlx_rs::Dtype::Float32, "the CPU backend computes in f32");
        let as_stored = VisionTower::load_in(out.path(), &config, None).unwrap().expect("a tower");
        for tower in [here, as_stored] {
            let vision = tower.config.clone();
            let input = mlx_rs::Array::from_slice(
                &values,
                &[values.len() as i32 / vision.patch_values() as i32, vision.patch_values() as i32],
            );
            let features = tower.forward(&input, &grids).unwrap();
            assert_eq!(features.dtype(), tower.dtype(), "{dtype}: the features leave in the tower's dtype");
            let features = features.as_dtype(mlx_rs::Dtype::Float32).unwrap();
            let tokens: usize = grids.iter().map(|g| g[1] * g[2] / 4).sum();
            assert_eq!(features.shape(), [tokens as i32, 48], "{dtype}");
            let got = features.as_slice::<f32>();
            let scale = expected.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = got.iter().zip(&expected).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                worst <= tolerance * scale,
                "{dtype} computed in {:?}: features up to {worst} apart (largest {scale})",
                tower.dtype()
            );
        }
    }
}

/// The text model's positions for a prompt with images: Ferrite's MRoPE positions, the shift
/// of the text after them and the rotary angles equal mlx-vlm's (`get_rope_index`, the
/// interleaved frequencies) — images first, in the middle, back to back, and at the end.
#[test]
fn mrope_positions_and_angles_match_mlx_vlms() {
    use engine::vision::{angles, rope_positions};
    let (image, start, end) = (7u32, 9u32, 8u32);
    // Grids as the tower sees them (before the 2x2 merge) and the prompt's placeholders.
    let grids = [[1usize, 4, 6], [1, 2, 4], [1, 6, 2]];
    let merged: Vec<[usize; 3]> = grids.iter().map(|g| [g[0], g[1] / 2, g[2] / 2]).collect();
    let block = |g: &[usize; 3]| -> Vec<u32> {
        [start].into_iter().chain(std::iter::repeat_n(image, g.iter().product())).chain([end]).collect()
    };
    let prompts: Vec<(Vec<u32>, Vec<[usize; 3]>)> = vec![
        ([vec![1, 2], block(&merged[0]), vec![3], block(&merged[1]), vec![4, 5]].concat(), merged[..2].to_vec()),
        ([block(&merged[2]), block(&merged[0]), vec![6]].concat(), vec![merged[2], merged[0]]),
        ([vec![1], block(&merged[1])].concat(), vec![merged[1]]),
    ];
    let tower_grids = |m: &[[usize; 3]]| -> Vec<[usize; 3]> { m.iter().map(|g| [g[0], g[1] * 2, g[2] * 2]).collect() };
    for (tokens, images) in prompts {
        let input = serde_json::json!({
            "tokens": tokens, "grids": tower_grids(&images), "merge": 2, "image_token": image,
            "vision_start": start, "dims": 64, "base": 10_000_000.0, "section": [11, 11, 10],
        });
        let mut command = common::reference_command("mlx_vlm_rope_index.py");
        command.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped());
        let mut child = command.spawn().unwrap();
        std::io::Write::write_all(child.stdin.as_mut().unwrap(), input.to_string().as_bytes()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let expected: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();

        let got = rope_positions(&tokens, image, &images).unwrap();
        let axes: Vec<Vec<i64>> = (0..3).map(|a| got.positions.iter().map(|p| p[a] as i64).collect()).collect();
        assert_eq!(serde_json::json!(axes), expected["positions"], "{tokens:?}");
        assert_eq!(got.delta as i64, expected["delta"].as_i64().unwrap(), "{tokens:?}");
        let a = angles(&got.positions, 64, 10_000_000.0, [11, 11, 10]).unwrap();
        let want: Vec<f32> = expected["angles"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|row| row.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect::<Vec<_>>())
            .collect();
        assert_eq!(a.shape(), [tokens.len() as i32, 32]);
        for (g, w) in a.as_slice::<f32>().iter().zip(&want) {
            assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{g} vs {w}");
        }
    }
    // Placeholders and images must agree.
    let err = rope_positions(&[1, image, image, 2], image, &[[1, 1, 3]]).unwrap_err().to_string();
    assert!(err.contains("needs 3 placeholder"), "{err}");
    assert!(rope_positions(&[1, image], image, &[]).unwrap_err().to_string().contains("more image placeholders"));
    assert!(rope_positions(&[1, 2], image, &[[1, 1, 1]]).unwrap_err().to_string().contains("fewer"));
    // Text only: every axis at the token's index, no shift.
    let plain = rope_positions(&[5, 6, 10], image, &[]).unwrap();
    assert_eq!((plain.positions, plain.delta), (vec![[0; 3], [1; 3], [2; 3]], 0));
}

/// A Qwen3.5-shaped vision tower of `depth` blocks, small image bounds for the checkpoint.
fn small_tower(dir: &Path, depth: usize) -> serde_json::Value {
    std::fs::write(dir.join("preprocessor_config.json"), r#"{"min_pixels": 4096, "max_pixels": 15360}"#).unwrap();
    serde_json::json!({
        "depth": depth, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4, "in_channels": 3,
        "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 256,
        "num_position_embeddings": 36, "deepstack_visual_indexes": [],
    })
}

/// A request run to its end: the tokens it generated and its summary.
fn run_to_end(e: &engine::Engine, request: engine::GenerateRequest) -> (Vec<u32>, engine::Summary) {
    let mut generation = e.generate(request, Default::default()).unwrap();
    let mut summary = None;
    for event in generation.by_ref() {
        if let engine::Event::Finished(s) = event.unwrap() {
            summary = Some(s);
        }
    }
    (generation.tokens().to_vec(), summary.expect("a finished event"))
}

/// Adds Qwen's vision tokens to a made checkpoint's tokenizer, as special tokens after its
/// own (its vocabulary is smaller than the model's): their ids (start, end, image).
pub fn add_vision_tokens(dir: &Path) -> (u32, u32, u32) {
    let path = dir.join("tokenizer.json");
    let mut t: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let added = t["added_tokens"].as_array_mut().unwrap();
    let next = added.iter().map(|a| a["id"].as_u64().unwrap()).max().unwrap() as u32 + 1;
    for (i, content) in ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"].iter().enumerate() {
        added.push(serde_json::json!({
            "id": next + i as u32, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
            "normalized": false, "special": true,
        }));
    }
    std::fs::write(&path, t.to_string()).unwrap();
    (next, next + 1, next + 2)
}

/// A whole prompt with images: on a Qwen3.5 checkpoint that sees (Ferrite's maker writes the
/// text model in Qwen's layout, mlx-vlm adds a random tower and loads it all with its own
/// loader), the logits at every prompt position — text before, between and after two images
/// of different shapes — and after one more token (the positions shifted past the images)
/// equal mlx-vlm's; and a request carrying the images (one image token each in its prompt)
/// decodes greedily to mlx-vlm's tokens, token for token.
#[test]
fn a_prompt_with_images_gives_mlx_vlms_logits() {
    use engine::checkpoint::{Architecture, Dtype, Layout};
    use engine::vision::{prefill, VisionTower};
    let mut o = common::options(Architecture::Qwen35, "small", None, 32, Dtype::Float32);
    o.layout = Layout::Transformers;
    let dir = common::make(&o);
    let processor = ImageProcessor { min_pixels: 64 * 64, max_pixels: 96 * 160, ..ImageProcessor::default() };
    let patches: Vec<_> =
        [picture(100, 70, 21), picture(60, 130, 22)].iter().map(|i| processor.preprocess(i).unwrap()).collect();
    let grids: Vec<[usize; 3]> = patches.iter().map(|p| p.grid).collect();
    let merged: Vec<[usize; 3]> = grids.iter().map(|g| [g[0], g[1] / 2, g[2] / 2]).collect();
    let values: Vec<f32> = patches.iter().flat_map(|p| p.values.iter().copied()).collect();
    let (start, end, image) = add_vision_tokens(dir.path());
    let block = |g: &[usize; 3]| -> Vec<u32> {
        [start].into_iter().chain(std::iter::repeat_n(image, g.iter().product())).chain([end]).collect()
    };
    let tokens = [vec![5, 6], block(&merged[0]), vec![7], block(&merged[1]), vec![8, 9]].concat();
    let pixels = dir.path().join("pixels.f32");
    std::fs::write(&pixels, values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    // The engine's processor reads the checkpoint's bounds: the same as the test's.
    let vision = small_tower(dir.path(), 2);
    let out = tempfile::tempdir().unwrap();
    let mut command = common::reference_command("mlx_vlm_vision_model.py");
    command.arg("--dir").arg(dir.path()).args(["--vision", &vision.to_string()]);
    command.args([
        "--tokens",
        &serde_json::to_string(&tokens).unwrap(),
        "--grids",
        &serde_json::to_string(&grids).unwrap(),
    ]);
    command.args(["--image-token", &image.to_string(), "--vision-start", &start.to_string()]);
    command
        .args(["--vision-end", &end.to_string(), "--next", "11"])
        .arg("--pixels")
        .arg(&pixels)
        .arg("--out")
        .arg(out.path());
    let run = command.output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let read = |name: &str| -> Vec<f32> {
        std::fs::read(out.path().join(name))
            .unwrap()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    };

    let mut engine = engine::Engine::load(dir.path()).unwrap();
    let tower = VisionTower::load_checkpoint(dir.path()).unwrap().expect("a tower");
    let rows = values.len() / tower.config.patch_values();
    let input = mlx_rs::Array::from_slice(&values, &[rows as i32, tower.config.patch_values() as i32]);
    let features = tower.forward(&input, &grids).unwrap();
    let model = engine.model();
    let mut cache = model.new_cache();
    let hidden = prefill(model, &tokens, image, &features, &merged, &mut cache, usize::MAX).unwrap();
    let close = |got: &mlx_rs::Array, want: &[f32], what: &str| {
        let got = got.as_dtype(mlx_rs::Dtype::Float32).unwrap();
        let got = got.as_slice::<f32>();
        assert_eq!(got.len(), want.len(), "{what}");
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        // f32 over 8 hybrid layers: mlx-vlm's gated-delta kernel sums in another order than
        // Ferrite's operations (the text-only reference tests allow 5e-4 on tiny models).
        assert!(worst <= 3e-4 * scale.max(1.0), "{what}: logits up to {worst} apart (largest {scale})");
    };
    close(&model.logits(&hidden).unwrap(), &read("prefill.f32"), "the prompt");
    let step = model.forward(&mlx_rs::Array::from_slice(&[11u32], &[1, 1]), &mut cache).unwrap();
    close(&step, &read("step.f32"), "the next token");

    // The same through a request: one image token per image, the images beside the prompt,
    // prefilled 5 positions a pass (the images and the text split across passes).
    engine.set_prefill_chunk(5);
    let engine = engine;
    assert!(engine.sees());
    let report = engine::inspect::inspect(dir.path(), &Default::default()).unwrap();
    assert!(report.to_string().contains("sees           yes: vision tower of"), "{report}");
    let greedy: Vec<u32> =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("greedy.json")).unwrap()).unwrap();
    let images: Vec<_> = [picture(100, 70, 21), picture(60, 130, 22)].into_iter().map(std::sync::Arc::new).collect();
    let one_each = vec![5, 6, start, image, end, 7, start, image, end, 8, 9];
    let request = engine::GenerateRequest {
        ignore_eos: true,
        draft_depth: 2,
        images: images.clone(),
        ..engine::GenerateRequest::greedy(one_each.clone(), greedy.len())
    };
    let (answer, summary) = run_to_end(&engine, request.clone());
    assert_eq!(answer, greedy, "greedy tokens after the images");
    assert_eq!(summary.usage.prompt_tokens, tokens.len(), "the image tokens count in the prompt");
    assert!(summary.speculative.is_none(), "this checkpoint has no MTP head: plain decoding");
    // Again: the prompt cache holds it now (its images known by their content), and the
    // answer after the restored prefix is mlx-vlm's still.
    let hits = engine.prompt_cache_stats().hits;
    let again = engine.generate(request.clone(), Default::default()).unwrap().token_ids().unwrap();
    assert_eq!(&again[..greedy.len()], &greedy[..]);
    assert_eq!(engine.prompt_cache_stats().hits, hits + 1);
    let two_for_one = engine::GenerateRequest { images: vec![images[0].clone()], ..request.clone() };
    let err = engine.generate(two_for_one, Default::default()).map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("2 image placeholders for 1 images"), "{err}");
    // A chat places an image's markup where it sits in a message; a client's text spelling
    // the image token stays text.
    let mut look = engine::tokenizer::ChatMessage::new("user", "Look <|image_pad|> here: and there");
    look.images = vec![look.content.find("here:").unwrap() + 5];
    let (ids, text) = engine.tokenizer().encode_chat(std::slice::from_ref(&look), true, &Default::default()).unwrap();
    assert_eq!(ids.iter().filter(|&&t| t == image).count(), 1, "{text}");
    let at = ids.iter().position(|&t| t == start).unwrap();
    assert_eq!(&ids[at..at + 3], &[start, image, end]);
    assert!(text.contains("here:<|vision_start|><|image_pad|><|vision_end|> and there"), "{text}");
    // A model that reads text only refuses images by name.
    let embedded = common::repo_root().join("assets/models/ferrite-code-20m");
    let report = engine::inspect::inspect(&embedded, &Default::default()).unwrap();
    assert!(report.to_string().contains("sees           no (text only)"), "{report}");
    let text_only = engine::Engine::load(&embedded).unwrap();
    let err = text_only.generate(request, Default::default()).map(|_| ()).unwrap_err().to_string();
    assert!(err.contains("reads text only"), "{err}");
    let err = text_only.tokenizer().encode_chat(&[look], true, &Default::default()).unwrap_err().to_string();
    assert!(err.contains("reads text only"), "{err}");
}

/// A Qwen3.5 checkpoint with an MTP head that sees (a one-block tower by mlx-vlm): its
/// directory, the options it was made with, and its vision start, end and image tokens.
fn seeing_with_mtp() -> (tempfile::TempDir, engine::checkpoint::MakeOptions, [u32; 3]) {
    use engine::checkpoint::{Architecture, Dtype, Layout};
    let mut o = common::options(Architecture::Qwen35, "small", None, 32, Dtype::Float32);
    o.layout = Layout::Transformers;
    o.mtp = true;
    let dir = common::make(&o);
    let (start, end, image) = add_vision_tokens(dir.path());
    let vision = small_tower(dir.path(), 1);
    let mut command = common::reference_command("mlx_vlm_vision_model.py");
    command.arg("--dir").arg(dir.path()).args(["--vision", &vision.to_string(), "--tower-only"]);
    command.args(["--vision-start", &start.to_string(), "--vision-end", &end.to_string()]);
    let run = command.args(["--image-token", &image.to_string()]).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    (dir, o, [start, end, image])
}

/// Inside a prompt with images the MTP head reads each position where the trunk placed it
/// (its slot `j` takes the trunk's features at `j`, so `j`'s MRoPE angles), also prefilled a
/// chunk a pass: its keys after the prefill are one pass of the head over the whole prompt at
/// those angles, and not at consecutive positions.
#[test]
fn the_mtp_head_reads_a_prompt_with_images_at_the_trunks_positions() {
    use engine::cache::LayerCache;
    use engine::vision::{angles, prefill, rope_positions, ImagePrompt, Vision};
    use engine::{Engine, GenerateRequest};
    use mlx_rs::{ops::indexing::IndexOp, Array};
    let (dir, _, [start, end, image]) = seeing_with_mtp();
    let mut e = Engine::load(dir.path()).unwrap();
    e.set_prefill_chunk(4);
    e.set_prompt_cache_budget(0);
    let shot = std::sync::Arc::new(picture(100, 70, 21));
    let prompt = vec![5, 6, 7, start, image, end, 8, 9];
    let request = GenerateRequest {
        ignore_eos: true,
        images: vec![shot.clone()],
        draft_depth: 1,
        ..GenerateRequest::greedy(prompt.clone(), 3)
    };
    let mut generation = e.generate(request, Default::default()).unwrap();
    for event in generation.by_ref() {
        event.unwrap();
    }

    // The same prompt in one pass of the trunk, then of the head.
    let model = e.model();
    let vision = Vision::load(dir.path(), model.config().vocab_size as usize).unwrap().unwrap();
    let mut tokens = prompt;
    let images = ImagePrompt::new(&vision, &mut tokens, &[shot]).unwrap();
    let features = vision.tower.forward(&images.patches, &images.grids).unwrap();
    let hidden = prefill(model, &tokens, image, &features, &images.merged, &mut model.new_cache(), usize::MAX).unwrap();
    let placed = rope_positions(&tokens, image, &images.merged).unwrap();
    assert!(placed.delta < 0, "the image's grid takes fewer positions than its tokens");
    let c = model.config();
    let angles = angles(&placed.positions, c.rope_dims() as usize, c.rope_theta(), c.mrope_section()).unwrap();
    let slots = tokens.len() as i32 - 1;
    let keys = |cache: &engine::cache::Cache| -> Vec<f32> {
        let LayerCache::Kv(kv) = &cache.layers[0] else { panic!("the head's layer attends") };
        let keys = kv.state()[0].index((.., .., ..slots, ..)).contiguous().unwrap();
        keys.as_slice::<f32>().to_vec()
    };
    let head = model.mtp().unwrap();
    let one_pass = |placed_at: Option<&Array>| -> Vec<f32> {
        let mut cache = head.new_cache();
        if let Some(angles) = placed_at {
            cache.place_next(&angles.index(..slots), placed.delta);
        }
        let next = Array::from_slice(&tokens[1..], &[1, slots]);
        head.forward(model, &hidden.index((.., ..slots, ..)), &next, &mut cache).unwrap();
        keys(&cache)
    };
    let apart = |a: &[f32], b: &[f32]| a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    let got = keys(generation.draft_cache().expect("the request speculates"));
    let (at_mrope, consecutive) = (one_pass(Some(&angles)), one_pass(None));
    let scale = at_mrope.iter().fold(0f32, |m, v| m.max(v.abs()));
    assert!(apart(&got, &at_mrope) <= 1e-4 * scale, "{} apart (largest {scale})", apart(&got, &at_mrope));
    assert!(apart(&consecutive, &at_mrope) > 1e-2 * scale, "the test tells the two placements apart");
}

/// The prompt cache knows a prompt's images by their content: the same screenshot again is
/// one cached prefix (nothing prefilled but the last token), another image of the same size
/// misses from where it starts, and the next turn of a conversation resumes after the last
/// answer — the positions after the images continuing where they were. All of it speculating
/// with the MTP head: the answers equal plain decoding's on an engine without a prompt cache,
/// token for token.
#[test]
fn the_prompt_cache_knows_images_by_their_content_and_speculation_stays_exact() {
    use engine::{Engine, GenerateRequest, Summary};
    use std::sync::Arc;
    let (dir, o, [start, end, image]) = seeing_with_mtp();

    let load = |cache: bool| {
        let mut e = Engine::load(dir.path()).unwrap();
        e.set_prefill_chunk(4);
        if !cache {
            e.set_prompt_cache_budget(0);
        }
        e
    };
    let (cached, fresh) = (load(true), load(false));
    assert!(cached.model().mtp().is_some());
    // The cached engine speculates (depth 2), the fresh one decodes plainly.
    let answer = |e: &Engine, prompt: &[u32], images: &[&Arc<RgbImage>]| -> (Vec<u32>, Summary) {
        let images = images.iter().map(|&i| i.clone()).collect();
        let draft_depth = if std::ptr::eq(e, &cached) { 2 } else { 0 };
        let req =
            GenerateRequest { ignore_eos: true, images, draft_depth, ..GenerateRequest::greedy(prompt.to_vec(), 10) };
        run_to_end(e, req)
    };
    let (shot, other, third) =
        (Arc::new(picture(100, 70, 21)), Arc::new(picture(100, 70, 99)), Arc::new(picture(60, 130, 5)));
    let first = vec![5, 6, 7, start, image, end, 8, 9];
    // 100x70 at these bounds: 3 x 2 merged groups; the prompt holds 13 tokens.
    let (a1, s1) = answer(&cached, &first, &[&shot]);
    assert_eq!((s1.usage.prompt_tokens, s1.usage.cached_tokens), (13, 0));
    let spec = s1.speculative.as_ref().expect("a request with images speculates");
    assert!(spec.cycles > 0 && spec.drafted[0] > 0, "{spec:?}");
    assert_eq!(a1, answer(&fresh, &first, &[&shot]).0);
    assert!(!a1.iter().any(|t| [start, end, image].contains(t)), "the answer is text: {a1:?}");

    let (again, s) = answer(&cached, &first, &[&shot]);
    assert_eq!(s.usage.cached_tokens, 12, "the same image: all but the last token cached");
    assert_eq!(again, a1);

    let (a_other, s) = answer(&cached, &first, &[&other]);
    assert!(s.usage.cached_tokens <= 4, "another image of the same size misses from its start: {:?}", s.usage);
    assert_eq!(a_other, answer(&fresh, &first, &[&other]).0);

    // The next turn: the conversation so far, the answer, and a new image of another shape.
    let next = [&first[..], &a1, &[10, start, image, end, 11, 12]].concat();
    let (a2, s) = answer(&cached, &next, &[&shot, &third]);
    assert_eq!(s.usage.cached_tokens, 13 + a1.len() - 1, "resumed after the last answer: {:?}", s.usage);
    assert!(s.speculative.is_some_and(|spec| spec.cycles > 0));
    assert_eq!(a2, answer(&fresh, &next, &[&shot, &third]).0, "the answer after a resumed prefill with images");
    let hits = cached.prompt_cache_stats().hits;
    assert!(hits >= 2, "{:?}", cached.prompt_cache_stats());

    // A block drafter reads the trunk's layers over the images too: the same answers, once
    // prefilled and once from the prompt cache.
    use engine::checkpoint::drafter::{make_drafter, DrafterOptions};
    let config = engine::ModelConfig::load(dir.path()).unwrap();
    let drafter = tempfile::tempdir().unwrap();
    make_drafter(&config, &DrafterOptions::new(&config, o.clone()), drafter.path()).unwrap();
    let options = engine::EngineOptions { drafter: Some(drafter.path().to_path_buf()), ..Default::default() };
    let mut blocks = Engine::load_with(dir.path(), &options).unwrap();
    blocks.set_prefill_chunk(4);
    for round in 0..2 {
        let req = GenerateRequest {
            ignore_eos: true,
            images: vec![shot.clone(), third.clone()],
            draft_depth: 3,
            draft_with: engine::DraftWith::Block,
            ..GenerateRequest::greedy(next.clone(), 10)
        };
        let (answer, summary) = run_to_end(&blocks, req);
        assert_eq!(answer, a2, "block drafting over images, round {round}");
        let spec = summary.speculative.expect("block drafting");
        assert!(spec.cycles > 0 && spec.drafted[0] > 0, "{spec:?}");
        assert_eq!(summary.usage.cached_tokens > 0, round == 1, "{:?}", summary.usage);
    }

    // In a batch: two requests with images of other shapes and a text-only one, decoded
    // together (each row at its own positions: the ones after images shifted), each answering
    // as it does alone.
    let mut e = Engine::load(dir.path()).unwrap();
    e.set_prefill_chunk(4);
    e.set_prompt_cache_budget(0);
    let requests = [
        GenerateRequest { ignore_eos: true, images: vec![shot.clone()], ..GenerateRequest::greedy(first.clone(), 12) },
        GenerateRequest {
            ignore_eos: true,
            images: vec![shot.clone(), third.clone()],
            ..GenerateRequest::greedy(next.clone(), 9)
        },
        GenerateRequest { ignore_eos: true, ..GenerateRequest::greedy(vec![5, 6, 7, 8], 10) },
    ];
    let alone: Vec<String> = requests.iter().map(|r| e.generate_text(r.clone()).unwrap().0).collect();
    let mut batch = engine::batch::Batch::default();
    batch.join(0, e.generate(requests[0].clone(), Default::default()).unwrap()).unwrap();
    for (key, request) in requests.iter().enumerate().skip(1) {
        batch.queue(key, e.generate(request.clone(), Default::default()).unwrap()).unwrap();
    }
    let mut texts = vec![String::new(); requests.len()];
    let mut steps = 0;
    while !batch.is_empty() {
        steps += 1;
        for (key, event) in batch.step() {
            if let engine::Event::Text(t) = event.unwrap() {
                texts[key].push_str(&t);
            }
        }
    }
    assert_eq!(texts, alone, "each request in the batch answers as it does alone");
    assert!(steps < 12 + 9 + 10, "they decoded together: {steps} steps");
}

/// A 16-bit grey PNG keeps its high byte, grey on all three channels. (Pillow 13, which
/// mlx-vlm reads images with, clips it to 255 instead: Ferrite does not copy that.)
#[test]
fn a_16_bit_grey_png_keeps_its_high_byte() {
    let grey =
        DynamicImage::ImageLuma16(image::ImageBuffer::from_fn(8, 2, |x, _| image::Luma([(x * 8192 + 255) as u16])));
    let image = decode(&encoded(&grey, ImageFormat::Png), Some("image/png"), &ImageLimits::default()).unwrap();
    let row: Vec<[u8; 3]> = (0..8).map(|x| image.get_pixel(x, 0).0).collect();
    assert_eq!(row, (0..8).map(|x| [(x * 32) as u8; 3]).collect::<Vec<_>>());
}

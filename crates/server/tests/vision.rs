//! Images over HTTP, on a Qwen3.5 checkpoint that sees (Ferrite's maker writes the text model,
//! mlx-vlm adds a random vision tower): OpenAI's `image_url`, Anthropic's `image` blocks at the
//! top level and inside a `tool_result`, the Responses API's `input_image` all reach the model
//! (the prompt counts each image's tokens); URLs to fetch, bad base64, mislabelled files and
//! decompression bombs are refused with the block's path, and nothing else breaks.

mod common;

use std::io::Cursor;
use std::path::Path;

use base64::Engine as _;
use engine::checkpoint::{Architecture, Dtype, Layout, MakeOptions};
use serde_json::{json, Value};

/// Qwen's vision tokens in the made tokenizer, small image bounds, and a tower by mlx-vlm.
fn make_it_see(dir: &Path) {
    let path = dir.join("tokenizer.json");
    let mut t: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let added = t["added_tokens"].as_array_mut().unwrap();
    let next = added.iter().map(|a| a["id"].as_u64().unwrap()).max().unwrap() + 1;
    for (i, content) in ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"].iter().enumerate() {
        added.push(json!({"id": next + i as u64, "content": content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}));
    }
    std::fs::write(&path, t.to_string()).unwrap();
    std::fs::write(dir.join("preprocessor_config.json"), r#"{"min_pixels": 4096, "max_pixels": 15360}"#).unwrap();
    let vision = json!({"depth": 1, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4, "in_channels": 3,
        "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 256,
        "num_position_embeddings": 36, "deepstack_visual_indexes": []});
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = std::process::Command::new(root.join("third_party/venv/bin/python"))
        .arg(root.join("tests/reference/mlx_vlm_vision_model.py"))
        .arg("--dir")
        .arg(dir)
        .args(["--vision", &vision.to_string(), "--tower-only"])
        .args(["--vision-start", &next.to_string(), "--vision-end", &(next + 1).to_string()])
        .args(["--image-token", &(next + 2).to_string()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

async fn seeing_server() -> common::Server {
    let mut o = MakeOptions::new(Architecture::Qwen35, "small");
    o.dtype = Dtype::Float32;
    o.layout = Layout::Transformers;
    common::start_prepared(&o, make_it_see, None, Default::default(), |_| {}).await
}

fn png(width: u32, height: u32) -> Vec<u8> {
    let image =
        image::RgbImage::from_fn(width, height, |x, y| image::Rgb([(x * 7) as u8, (y * 5) as u8, ((x + y) * 3) as u8]));
    let mut bytes = Vec::new();
    image.write_to(&mut Cursor::new(&mut bytes), image::ImageFormat::Png).unwrap();
    bytes
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_reach_the_model_in_every_api_and_bad_ones_are_refused_by_path() {
    let s = seeing_server().await;
    let get = |path: &str| {
        let url = format!("{}{path}", s.base);
        async move { reqwest::get(url).await.unwrap().json::<Value>().await.unwrap() }
    };
    let models = get("/v1/models").await;
    assert_eq!(models["data"][0]["input_modalities"], json!(["text", "image"]), "{models}");
    assert_eq!(get("/v1/status").await["sees"], true);
    let picture = b64(&png(100, 70));
    let data_url = format!("data:image/png;base64,{picture}");

    // OpenAI chat: an image_url part between two text parts; the prompt counts its tokens
    // (a 100x70 image at these bounds: 3 x 2 merged groups = 6).
    let text_only =
        json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "What is in it?"}]});
    let (status, plain) = common::post(&s, "/v1/chat/completions", &text_only).await;
    assert_eq!(status, 200, "{plain}");
    let body = json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in it?"},
        {"type": "image_url", "image_url": {"url": data_url}},
    ]}]});
    let (status, answer) = common::post(&s, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{answer}");
    let tokens = |v: &Value, field: &str| v["usage"][field].as_u64().unwrap();
    assert_eq!(tokens(&answer, "prompt_tokens"), tokens(&plain, "prompt_tokens") + 3 + 5, "markup and 6 image tokens");

    // Anthropic: an image block, and one inside a tool_result (Claude Code's Read of a PNG).
    let anthropic = json!({"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Read it"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": picture}}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "a.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(&png(60, 130))}}]}]},
    ], "tools": [{"name": "Read", "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}]});
    let (status, answer) = common::post(&s, "/v1/messages", &anthropic).await;
    assert_eq!(status, 200, "{answer}");
    let (status, counted) = common::post(&s, "/v1/messages/count_tokens", &anthropic).await;
    assert_eq!(status, 200, "{counted}");
    assert_eq!(counted["input_tokens"], answer["usage"]["input_tokens"], "count_tokens counts the images");

    // The Responses API: input_image with the data URL itself.
    let responses = json!({"model": "tiny", "max_output_tokens": 4, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is in it?"}, {"type": "input_image", "image_url": data_url}]}]});
    let (status, answer) = common::post(&s, "/v1/responses", &responses).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["usage"]["input_tokens"], tokens(&plain, "prompt_tokens") + 8);

    // Refused with the path of the block at fault.
    let mut bomb = b"GIF89a".to_vec();
    bomb.extend([0xff, 0xff, 0xff, 0xff, 0x00, 0x00, 0x00, 0x2c, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0x00, 0x02, 0x02]);
    bomb.extend([0x44, 0x01, 0x00, 0x3b]);
    let cases = [
        ("https://example.com/cat.png".to_string(), "not fetched"),
        ("data:image/png;base64,@@@".to_string(), "base64"),
        (format!("data:image/jpeg;base64,{picture}"), "labelled image/jpeg"),
        (format!("data:image/gif;base64,{}", b64(&bomb)), "65535x65535"),
        (format!("data:image/png;base64,{}", b64(&png(4000, 10))), "aspect ratio"),
    ];
    for (url, why) in cases {
        let body = json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]}]});
        let (status, err) = common::post(&s, "/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{why}: {err}");
        let message = err["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(why), "{why}: {err}");
        if why != "aspect ratio" {
            assert!(message.contains("messages[0].content[1].image_url"), "{err}");
        }
    }
    let broken = json!({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(&png(40, 40)[..60])}}]}]});
    let (status, err) = common::post(&s, "/v1/messages", &broken).await;
    assert_eq!(status, 400, "{err}");
    assert!(err["error"]["message"].as_str().unwrap().contains("messages.0.content.0.source"), "{err}");

    // The server still answers text after all that.
    let (status, _) = common::post(&s, "/v1/chat/completions", &text_only).await;
    assert_eq!(status, 200);
}

/// Requests with images decode in the worker's batch like any other: sent together with a
/// long text request running, each answers what it answers alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_with_images_decode_together_and_answer_as_alone() {
    let s = seeing_server().await;
    let ask = |picture: Option<Vec<u8>>, text: &str| {
        let mut content = vec![json!({"type": "text", "text": text})];
        if let Some(p) = picture {
            content
                .push(json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{}", b64(&p))}}));
        }
        json!({"model": "tiny", "max_tokens": 16, "ignore_eos": true, "temperature": 0,
               "messages": [{"role": "user", "content": content}]})
    };
    let bodies = [ask(Some(png(100, 70)), "What is in it?"), ask(Some(png(60, 130)), "And here?"), ask(None, "Hello")];
    let mut alone = vec![];
    for body in &bodies {
        let (status, v) = common::post(&s, "/v1/chat/completions", body).await;
        assert_eq!(status, 200, "{v}");
        alone.push(v["choices"][0]["message"]["content"].as_str().unwrap().to_string());
    }
    let base = s.base.clone();
    let long = tokio::spawn(async move {
        let body = json!({"model": "tiny", "max_tokens": 600, "ignore_eos": true,
                          "messages": [{"role": "user", "content": "Go on."}]});
        reqwest::Client::new().post(format!("{base}/v1/chat/completions")).json(&body).send().await
    });
    let mut seen = 0;
    let watch = async {
        for _ in 0..400 {
            let status: Value = reqwest::get(format!("{}/v1/status", s.base)).await.unwrap().json().await.unwrap();
            seen = seen.max(status["decoding_together"].as_u64().unwrap_or(0));
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    };
    let asks = futures_util::future::join_all(bodies.iter().map(|b| common::post(&s, "/v1/chat/completions", b)));
    let (together, _) = tokio::join!(asks, watch);
    for (i, (status, v)) in together.into_iter().enumerate() {
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["message"]["content"].as_str().unwrap(), alone[i], "request {i} in the batch");
    }
    assert!(seen >= 2, "the requests never decoded together");
    assert_eq!(long.await.unwrap().unwrap().status(), 200);
}

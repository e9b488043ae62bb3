//! The Anthropic-compatible API: `POST /v1/messages` (streaming and not) and
//! `POST /v1/messages/count_tokens`. Reasoning comes back as `thinking` blocks.

use std::convert::Infallible;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::tokenizer::{ChatMessage, ToolCall};
use engine::{FinishReason, GenerateRequest, SamplingParams, Summary};
use futures_util::stream::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_stream::wrappers::ReceiverStream;

use crate::error::{parse, AnthropicError, ApiError};
use crate::tools::CallEvent;
use crate::worker::{Clamp, ClampedBy, JobEvent, Prompt, Running};
use crate::AppState;

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

#[derive(Debug, Deserialize)]
struct Block {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
    /// tool_result blocks carry their output here (a string or text blocks).
    #[serde(default)]
    content: Option<Box<Content>>,
    /// tool_use blocks (earlier assistant turns).
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    input: Option<Value>,
    /// tool_result blocks: the tool_use they answer.
    #[serde(default)]
    tool_use_id: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Tool {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    input_schema: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    content: Content,
}

/// `thinking`: `enabled` or `adaptive` (the model decides: Qwen thinks) turn the model's
/// thinking on, `disabled` off.
#[derive(Debug, Deserialize)]
struct Thinking {
    #[serde(rename = "type")]
    kind: String,
}

/// `output_config`: of what Claude Code sends, `effort` is read (`low` turns thinking off).
#[derive(Debug, Default, Deserialize)]
struct OutputConfig {
    #[serde(default)]
    effort: Option<String>,
}

/// Fields both endpoints read.
#[derive(Debug, Deserialize)]
struct PromptPart {
    model: String,
    messages: Vec<Message>,
    #[serde(default)]
    system: Option<Content>,
    #[serde(default)]
    thinking: Option<Thinking>,
    #[serde(default)]
    output_config: Option<OutputConfig>,
    #[serde(default)]
    tools: Vec<Tool>,
    // Accepted and not used (nothing to do for a local model): `metadata`,
    // `context_management`, `cache_control` on blocks, `service_tier`, `container`, `mcp_servers`.
}

#[derive(Debug, Deserialize)]
struct Generation {
    max_tokens: usize,
    #[serde(default)]
    stop_sequences: Vec<String>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<i32>,
    #[serde(default)]
    stream: bool,
}

fn text_of(content: &Content) -> String {
    match content {
        Content::Text(t) => t.clone(),
        Content::Blocks(blocks) => blocks
            .iter()
            .map(|b| match (b.kind.as_str(), &b.text, &b.content) {
                ("text", Some(t), _) => t.clone(),
                ("tool_result", _, Some(c)) => text_of(c),
                _ => String::new(),
            })
            .collect::<Vec<_>>()
            .join(""),
    }
}

/// Claude Code's first system block is an attribution line for Anthropic's billing
/// (`x-anthropic-billing-header: cc_version=…; cc_entrypoint=…;`) that changes with the client's
/// version and build: first in the prompt, it would make every cached prefix miss. It tells
/// the model nothing, so it is left out.
fn system_text(system: &Content) -> String {
    let billing = |t: &str| t.trim_start().starts_with("x-anthropic-billing-header:");
    match system {
        Content::Text(t) if billing(t) => String::new(),
        Content::Text(t) => t.clone(),
        Content::Blocks(blocks) => blocks
            .iter()
            .filter(|b| b.kind == "text")
            .filter_map(|b| b.text.as_deref())
            .filter(|t| !billing(t))
            .collect::<Vec<_>>()
            .join(""),
    }
}

/// A block with content the model cannot see (images, documents, ...): refused rather than
/// silently dropped. Thinking blocks of earlier turns and server tool blocks carry nothing the
/// prompt needs.
fn unseen(b: &Block) -> bool {
    !matches!(
        b.kind.as_str(),
        "text"
            | "tool_use"
            | "tool_result"
            | "thinking"
            | "redacted_thinking"
            | "server_tool_use"
            | "web_search_tool_result"
    )
}

fn prompt(p: &PromptPart) -> Result<Prompt, ApiError> {
    if p.messages.is_empty() {
        return Err(ApiError::bad_request("messages: must not be empty").with_param("messages"));
    }
    let mut messages = Vec::new();
    if let Some(system) = &p.system {
        messages.push(ChatMessage::new("system", &system_text(system)));
    }
    for (i, m) in p.messages.iter().enumerate() {
        // Claude Code sends reminders as system-role messages among the turns: system turns,
        // in order.
        if !matches!(m.role.as_str(), "user" | "assistant" | "system") {
            return Err(ApiError::bad_request(format!(
                "messages.{i}.role: must be `user`, `assistant` or `system`, got `{}`",
                m.role
            ))
            .with_param(&format!("messages.{i}.role")));
        }
        if let Content::Blocks(blocks) = &m.content {
            if let Some((j, b)) = blocks.iter().enumerate().find(|(_, b)| unseen(b)) {
                return Err(ApiError::bad_request(format!(
                    "messages.{i}.content.{j}: `{}` blocks are not supported: the model reads text only",
                    b.kind
                ))
                .with_param(&format!("messages.{i}.content.{j}.type")));
            }
        }
        let Content::Blocks(blocks) = &m.content else {
            messages.push(ChatMessage::new(&m.role, &text_of(&m.content)));
            continue;
        };
        // Tool results become `tool` turns, tool uses the assistant's tool calls.
        let text: String = blocks.iter().filter(|b| b.kind == "text").filter_map(|b| b.text.clone()).collect();
        let mut turn = ChatMessage::new(&m.role, &text);
        for b in blocks {
            match b.kind.as_str() {
                "tool_use" => turn
                    .tool_calls
                    .push(ToolCall::new(b.name.as_deref().unwrap_or_default(), b.input.clone().unwrap_or(json!({})))),
                "tool_result" => {
                    let mut result = ChatMessage::new("tool", &b.content.as_deref().map(text_of).unwrap_or_default());
                    result.tool_call_id = b.tool_use_id.clone();
                    messages.push(result);
                }
                _ => {}
            }
        }
        if !turn.content.is_empty() || !turn.tool_calls.is_empty() {
            messages.push(turn);
        }
    }
    let mut vars = serde_json::Map::new();
    if !p.tools.is_empty() {
        let tools: Vec<Value> = p
            .tools
            .iter()
            .map(|t| {
                json!({"type": "function", "function": {"name": t.name, "description": t.description,
            "parameters": t.input_schema.clone().unwrap_or(json!({"type": "object", "properties": {}}))}})
            })
            .collect();
        vars.insert("tools".into(), Value::Array(tools));
    }
    let effort = p.output_config.as_ref().and_then(|o| o.effort.as_deref());
    let thinking = match (p.thinking.as_ref().map(|t| t.kind.as_str()), effort) {
        (Some("disabled"), _) | (_, Some("low")) => Some(false),
        (Some("enabled" | "adaptive"), _) => Some(true),
        (Some(other), _) => {
            return Err(ApiError::bad_request(format!(
                "thinking.type: must be `enabled`, `adaptive` or `disabled`, got `{other}`"
            ))
            .with_param("thinking.type"))
        }
        (None, _) => None,
    };
    if let Some(on) = thinking {
        vars.insert("enable_thinking".into(), on.into());
    }
    Ok(Prompt::Chat { messages, template_vars: vars })
}

/// Why the answer ended, in Anthropic's words. Out of tokens is `max_tokens` only when the
/// request's own limit was reached: at the context's end it is `model_context_window_exceeded`,
/// and at the server's `--max-output-tokens` the server ended the turn (`end_turn`; the
/// `x-ferrite-max-tokens-clamped-by: server` header says so). Agents answer `max_tokens` by
/// asking again for more, which a cap on this server would only repeat.
/// Anthropic's usage: `input_tokens` are the prompt tokens computed for this request, and
/// `cache_read_input_tokens` those restored from the prompt cache (the three input counts add
/// up to the prompt). Ferrite caches every prompt by itself, so nothing counts as cache creation.
fn usage(u: &engine::generate::Usage) -> Value {
    json!({"input_tokens": u.prompt_tokens - u.cached_tokens.min(u.prompt_tokens), "output_tokens": u.completion_tokens,
           "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0})
}

fn stop_reason(s: &Summary, tool_use: bool, clamped: Option<Clamp>) -> &'static str {
    if tool_use {
        return "tool_use";
    }
    match (s.finish_reason, &s.stop_string, clamped.map(|c| c.by)) {
        (FinishReason::Length, _, None) => "max_tokens",
        (FinishReason::Length, _, Some(ClampedBy::Context)) => "model_context_window_exceeded",
        (FinishReason::Length, _, Some(ClampedBy::ServerCap)) => "end_turn",
        (_, Some(_), _) => "stop_sequence",
        _ => "end_turn",
    }
}

pub async fn count_tokens(State(state): State<AppState>, body: Bytes) -> Result<Response, AnthropicError> {
    let p: PromptPart = parse(&body)?;
    let loaded = state.resolve_model(&p.model)?;
    let prompt = prompt(&p)?;
    let running = loaded.worker.run(prompt, GenerateRequest::greedy(vec![], 1), true).await?;
    Ok(Json(json!({"input_tokens": running.prompt_tokens})).into_response())
}

pub async fn messages(State(state): State<AppState>, body: Bytes) -> Result<Response, AnthropicError> {
    let p: PromptPart = parse(&body)?;
    let g: Generation = parse(&body)?;
    let loaded = state.resolve_model(&p.model)?;
    let prompt = prompt(&p)?;
    if g.max_tokens == 0 {
        return Err(ApiError::bad_request("max_tokens: must be at least 1").with_param("max_tokens").into());
    }
    if g.stop_sequences.iter().any(String::is_empty) {
        return Err(ApiError::bad_request("stop_sequences: must not contain empty strings").into());
    }
    let sampling = SamplingParams {
        temperature: g.temperature.unwrap_or(0.0),
        top_p: g.top_p.unwrap_or(1.0),
        top_k: g.top_k.unwrap_or(0),
        ..Default::default()
    };
    sampling.validate().map_err(|e| ApiError::bad_request(e.to_string()))?;
    let request = GenerateRequest {
        sampling,
        stop: g.stop_sequences.clone(),
        draft_depth: loaded.draft_depth,
        ..GenerateRequest::greedy(vec![], g.max_tokens)
    };
    let Running { events: mut rx, prompt_tokens, max_tokens, clamped, guard } =
        loaded.worker.run(prompt, request, false).await?;
    let headers = state.speed_headers(&loaded, max_tokens, clamped);
    let id = format!("msg_{:024}", state.next_id());
    let model = loaded.worker.info.id.clone();

    if !g.stream {
        let (mut text, mut thinking, mut calls) = (String::new(), String::new(), Vec::new());
        while let Some(event) = rx.recv().await {
            match event {
                JobEvent::Delta { content, reasoning, tool_calls } => {
                    text.push_str(&content);
                    thinking.push_str(&reasoning);
                    calls.extend(CallEvent::completed(tool_calls));
                }
                JobEvent::Finished { summary, .. } => {
                    let mut content = vec![];
                    if !thinking.is_empty() {
                        content.push(json!({"type": "thinking", "thinking": thinking, "signature": ""}));
                    }
                    if !text.is_empty() || calls.is_empty() {
                        content.push(json!({"type": "text", "text": text}));
                    }
                    for (i, c) in calls.iter().enumerate() {
                        content.push(json!({"type": "tool_use", "id": format!("toolu_{id}_{i}"), "name": c.name, "input": c.arguments}));
                    }
                    drop(guard);
                    let body = json!({
                        "id": id, "type": "message", "role": "assistant", "model": model, "content": content,
                        "stop_reason": stop_reason(&summary, !calls.is_empty(), clamped), "stop_sequence": summary.stop_string,
                        "usage": usage(&summary.usage),
                    });
                    return Ok((headers, Json(body)).into_response());
                }
                JobEvent::Failed(e) => return Err(e.into()),
                JobEvent::Started { .. } => {}
            }
        }
        return Err(ApiError::internal("the engine ended the request without a summary").into());
    }

    // Streaming: a thinking block (if any) then a text block, each opened on its first delta.
    let start = json!({"type": "message_start", "message": {
        "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}});
    let mut blocks = BlockState::default();
    let (mut tool_uses, mut tool_open) = (0usize, false);
    let events = ReceiverStream::new(rx).flat_map(move |event| {
        let _keep = &guard; // cancels the job when the client goes
        let out = match event {
            JobEvent::Delta { content, reasoning, tool_calls } => {
                let mut out = vec![];
                if !reasoning.is_empty() {
                    out.extend(blocks.delta("thinking", json!({"type": "thinking_delta", "thinking": reasoning})));
                }
                if !content.is_empty() {
                    out.extend(blocks.delta("text", json!({"type": "text_delta", "text": content})));
                }
                // A tool_use block streams as the call is written: it starts with the name and
                // empty input, the input follows in JSON fragments, and it stops at the call's end.
                for event in tool_calls {
                    let delta = |index: usize, json: String| {
                        ("content_block_delta", json!({"type": "content_block_delta", "index": index,
                            "delta": {"type": "input_json_delta", "partial_json": json}}))
                    };
                    match event {
                        CallEvent::Begin { name } => {
                            out.extend(blocks.close());
                            out.push(tool_use_start(&blocks, &id, tool_uses, &name));
                            tool_open = true;
                        }
                        CallEvent::Arguments(a) => out.push(delta(blocks.index, a)),
                        CallEvent::End(c) => {
                            if !tool_open {
                                out.extend(blocks.close());
                                out.push(tool_use_start(&blocks, &id, tool_uses, &c.name));
                                out.push(delta(blocks.index, c.arguments.to_string()));
                            }
                            out.push(("content_block_stop", json!({"type": "content_block_stop", "index": blocks.index})));
                            blocks.index += 1;
                            tool_uses += 1;
                            tool_open = false;
                        }
                    }
                }
                out
            }
            JobEvent::Finished { summary, .. } => {
                let mut out = blocks.close();
                out.push(("message_delta", json!({"type": "message_delta",
                    "delta": {"stop_reason": stop_reason(&summary, tool_uses > 0, clamped), "stop_sequence": summary.stop_string},
                    "usage": usage(&summary.usage)})));
                out.push(("message_stop", json!({"type": "message_stop"})));
                out
            }
            JobEvent::Failed(e) => vec![("error", json!({"type": "error", "error": {"type": "api_error", "message": format!("{e:?}")}}))],
            JobEvent::Started { .. } => vec![],
        };
        futures_util::stream::iter(out)
    });
    let stream = futures_util::stream::iter([("message_start", start), ("ping", json!({"type": "ping"}))])
        .chain(events)
        .map(|(name, data)| Ok::<_, Infallible>(SseEvent::default().event(name).data(data.to_string())));
    Ok((headers, Sse::new(stream).keep_alive(KeepAlive::default())).into_response())
}

/// The start of a streamed tool_use block (its input follows as JSON deltas).
fn tool_use_start(blocks: &BlockState, id: &str, n: usize, name: &str) -> (&'static str, Value) {
    let block = json!({"type": "tool_use", "id": format!("toolu_{id}_{n}"), "name": name, "input": {}});
    ("content_block_start", json!({"type": "content_block_start", "index": blocks.index, "content_block": block}))
}

/// Which content block is open in a streamed message.
#[derive(Default)]
struct BlockState {
    open: Option<&'static str>,
    index: usize,
}

impl BlockState {
    fn delta(&mut self, kind: &'static str, delta: Value) -> Vec<(&'static str, Value)> {
        let mut out = vec![];
        if self.open != Some(kind) {
            out.extend(self.close());
            let block = if kind == "thinking" {
                json!({"type": "thinking", "thinking": "", "signature": ""})
            } else {
                json!({"type": "text", "text": ""})
            };
            out.push((
                "content_block_start",
                json!({"type": "content_block_start", "index": self.index, "content_block": block}),
            ));
            self.open = Some(kind);
        }
        out.push(("content_block_delta", json!({"type": "content_block_delta", "index": self.index, "delta": delta})));
        out
    }

    fn close(&mut self) -> Vec<(&'static str, Value)> {
        match self.open.take() {
            Some(_) => {
                let e = ("content_block_stop", json!({"type": "content_block_stop", "index": self.index}));
                self.index += 1;
                vec![e]
            }
            None => vec![],
        }
    }
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn message_bodies_never_panic(body in crate::fuzz::body()) {
            let body = Bytes::from(body);
            if let Ok(p) = parse::<PromptPart>(&body) {
                if let Err(e) = prompt(&p) {
                    prop_assert!(e.status.is_client_error(), "{}", e.message);
                }
            }
            let _ = parse::<Generation>(&body);
        }
    }
}

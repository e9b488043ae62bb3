//! The OpenAI-compatible API: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use engine::tokenizer::{ChatMessage, ToolCall};
use engine::{FinishReason, GenerateRequest, SamplingParams};
use futures_util::stream::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_stream::wrappers::ReceiverStream;

use crate::error::{parse, ApiError};
use crate::response_format::{Expect, ResponseFormat};
use crate::tools::CallEvent;
use crate::worker::{JobEvent, Prompt, Running};
use std::sync::Arc;

use crate::{AppState, Loaded};

pub const DEFAULT_MAX_TOKENS: usize = 4096;

/// Message content as OpenAI's APIs send it: a string, or typed parts (also the Responses API's).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
pub(crate) struct Part {
    #[serde(rename = "type")]
    pub(crate) kind: String,
    #[serde(default)]
    pub(crate) text: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    #[serde(default)]
    content: Option<Content>,
    #[serde(default)]
    tool_calls: Vec<InCall>,
    #[serde(default)]
    tool_call_id: Option<String>,
}

/// A tool call of an earlier assistant turn, as the client sends it back.
#[derive(Debug, Deserialize)]
struct InCall {
    function: InFunction,
}

#[derive(Debug, Deserialize)]
struct InFunction {
    name: String,
    /// A JSON document in a string, as OpenAI sends it.
    #[serde(default)]
    arguments: String,
}

#[derive(Debug, Deserialize)]
struct Tool {
    #[serde(rename = "type")]
    kind: String,
    function: ToolFunction,
}

#[derive(Debug, Deserialize)]
struct ToolFunction {
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    parameters: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Fields shared by chat and text completions.
#[derive(Debug, Deserialize)]
struct Common {
    model: String,
    #[serde(default)]
    max_tokens: Option<usize>,
    #[serde(default)]
    max_completion_tokens: Option<usize>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    top_p: Option<f32>,
    #[serde(default)]
    top_k: Option<i32>,
    #[serde(default)]
    min_p: Option<f32>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    stop: Option<Stop>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    /// Extension (as vLLM has it): keep generating past end-of-sequence, for benchmarks.
    #[serde(default)]
    ignore_eos: bool,
    /// OpenAI's penalties, and the repetition penalty of mlx-lm's and vLLM's servers, applied
    /// as mlx-lm applies them (over the last 20 tokens); see `engine::penalties`.
    #[serde(default)]
    presence_penalty: Option<f32>,
    #[serde(default)]
    frequency_penalty: Option<f32>,
    #[serde(default)]
    repetition_penalty: Option<f32>,
    /// Choices per request: only 1 is served, and anything else is refused rather than ignored.
    #[serde(default)]
    n: Option<u32>,
    /// Log-probabilities are not served: asking for them is refused rather than ignored
    /// (`true` or a count for chat, a count for text completions).
    #[serde(default)]
    logprobs: Option<Value>,
    #[serde(default)]
    top_logprobs: Option<u32>,
}

/// Chat-only fields (read from the same body as [`Common`]: serde's `flatten` would lose the
/// path of a wrong field).
#[derive(Debug, Deserialize)]
struct ChatRequest {
    messages: Vec<Message>,
    #[serde(default)]
    tools: Vec<Tool>,
    /// `none` hides the tools; `auto`, `required` or a named function offer them.
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    reasoning_effort: Option<String>,
    #[serde(default)]
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    response_format: Option<ResponseFormat>,
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    prompt: String,
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Length => "length",
        _ => "stop",
    }
}

impl Common {
    /// The request for the engine, and the model that will run it.
    fn generate_request(&self, state: &AppState) -> Result<(GenerateRequest, Arc<Loaded>), ApiError> {
        let loaded = state.resolve_model(&self.model)?;
        let max_tokens = self.max_completion_tokens.or(self.max_tokens).unwrap_or(DEFAULT_MAX_TOKENS);
        if max_tokens == 0 {
            return Err(ApiError::bad_request("max_tokens must be at least 1").with_param("max_tokens"));
        }
        if self.n.is_some_and(|n| n != 1) {
            return Err(ApiError::bad_request(
                "n: Ferrite returns one choice per request; send several requests for more",
            )
            .with_param("n"));
        }
        let wants_logprobs = match &self.logprobs {
            Some(Value::Bool(b)) => *b,
            Some(Value::Number(n)) => n.as_u64() != Some(0),
            _ => false,
        };
        if wants_logprobs || self.top_logprobs.is_some_and(|n| n > 0) {
            return Err(
                ApiError::bad_request("logprobs: Ferrite does not return log-probabilities").with_param("logprobs")
            );
        }
        let sampling = SamplingParams {
            temperature: self.temperature.unwrap_or(0.0),
            top_p: self.top_p.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(0),
            min_p: self.min_p.unwrap_or(0.0),
            seed: self.seed,
            penalties: engine::Penalties {
                repetition: self.repetition_penalty.unwrap_or(1.0),
                presence: self.presence_penalty.unwrap_or(0.0),
                frequency: self.frequency_penalty.unwrap_or(0.0),
            },
        };
        sampling.validate().map_err(|e| {
            let message = e.to_string();
            // The engine names the field first: "request: top_p must be in (0, 1], got 0".
            let field = message.trim_start_matches("request: ").split_once(" must").map(|(f, _)| f.to_string());
            let error = ApiError::bad_request(message.clone());
            match field {
                Some(f) => error.with_param(&f),
                None => error,
            }
        })?;
        let stop = match &self.stop {
            None => vec![],
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::bad_request("stop strings must not be empty").with_param("stop"));
        }
        let request = GenerateRequest {
            max_tokens,
            sampling,
            stop,
            draft_depth: loaded.draft_depth,
            ignore_eos: self.ignore_eos,
            ..GenerateRequest::greedy(vec![], max_tokens)
        };
        Ok((request, loaded))
    }
}

fn chat_prompt(req: &ChatRequest) -> Result<Prompt, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::bad_request("messages must not be empty").with_param("messages"));
    }
    let mut messages = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        if !matches!(m.role.as_str(), "system" | "developer" | "user" | "assistant" | "tool") {
            return Err(
                ApiError::bad_request(format!("messages[{i}].role: unknown role `{}`", m.role)).with_param("messages")
            );
        }
        let content = match &m.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                parts.iter().filter(|p| p.kind == "text").filter_map(|p| p.text.clone()).collect::<Vec<_>>().join("")
            }
        };
        let role = if m.role == "developer" { "system" } else { m.role.as_str() };
        let mut message = ChatMessage::new(role, &content);
        message.tool_call_id = m.tool_call_id.clone();
        for call in &m.tool_calls {
            let args = serde_json::from_str(&call.function.arguments)
                .unwrap_or_else(|_| Value::String(call.function.arguments.clone()));
            message.tool_calls.push(ToolCall::new(&call.function.name, args));
        }
        messages.push(message);
    }
    let mut vars = req.chat_template_kwargs.clone().unwrap_or_default();
    let offer_tools = !req.tools.is_empty() && req.tool_choice.as_ref().and_then(Value::as_str) != Some("none");
    if offer_tools {
        let mut tools = Vec::new();
        for (i, t) in req.tools.iter().enumerate() {
            if t.kind != "function" || t.function.name.is_empty() {
                return Err(ApiError::bad_request(format!("tools[{i}]: only named functions are supported"))
                    .with_param("tools"));
            }
            tools.push(json!({"type": "function", "function": {"name": t.function.name, "description": t.function.description,
                              "parameters": t.function.parameters.clone().unwrap_or(json!({"type": "object", "properties": {}}))}}));
        }
        vars.insert("tools".into(), Value::Array(tools));
    }
    if req.reasoning_effort.as_deref() == Some("none") {
        vars.insert("enable_thinking".into(), false.into());
    }
    Ok(Prompt::Chat { messages, template_vars: vars })
}

pub async fn chat_completions(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let common: Common = parse(&body)?;
    let req: ChatRequest = parse(&body)?;
    let (request, loaded) = common.generate_request(&state)?;
    let prompt = chat_prompt(&req)?;
    let expect = match &req.response_format {
        Some(format) => format.expectation()?,
        None => None,
    };
    respond(state, loaded, prompt, request, &common, Kind::Chat, expect).await
}

pub async fn completions(State(state): State<AppState>, body: Bytes) -> Result<Response, ApiError> {
    let common: Common = parse(&body)?;
    let req: CompletionRequest = parse(&body)?;
    let (request, loaded) = common.generate_request(&state)?;
    respond(state, loaded, Prompt::Text(req.prompt), request, &common, Kind::Text, None).await
}

pub async fn models(State(state): State<AppState>) -> Json<Value> {
    let loaded = state.loaded();
    let info = &loaded.worker.info;
    let mut data =
        vec![json!({"id": info.id, "object": "model", "created": state.started_unix, "owned_by": "ferrite"})];
    for alias in &loaded.aliases {
        data.push(json!({"id": alias, "object": "model", "created": state.started_unix, "owned_by": "ferrite"}));
    }
    Json(json!({"object": "list", "data": data}))
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Text,
}

/// Runs the request and answers it, whole or as server-sent events. With a `response_format`,
/// the answer's check goes beside it (`response_format_check`, and a header when not streaming).
#[allow(clippy::too_many_arguments)]
async fn respond(
    state: AppState,
    loaded: Arc<Loaded>,
    prompt: Prompt,
    request: GenerateRequest,
    common: &Common,
    kind: Kind,
    expect: Option<Expect>,
) -> Result<Response, ApiError> {
    let Running { events: mut rx, max_tokens, clamped, guard, .. } = loaded.worker.run(prompt, request, false).await?;
    let headers = state.speed_headers(&loaded, max_tokens, clamped);
    let id = format!("{}-{}", if kind == Kind::Chat { "chatcmpl" } else { "cmpl" }, state.next_id());
    let model = loaded.worker.info.id.clone();
    let created = now();

    if !common.stream {
        let (mut content, mut reasoning, mut calls) = (String::new(), String::new(), Vec::new());
        while let Some(event) = rx.recv().await {
            match event {
                JobEvent::Delta { content: c, reasoning: r, tool_calls } => {
                    content.push_str(&c);
                    reasoning.push_str(&r);
                    calls.extend(CallEvent::completed(tool_calls));
                }
                JobEvent::Finished { summary, reasoning_tokens } => {
                    let usage = usage(&summary.usage, reasoning_tokens);
                    let reason = if calls.is_empty() { finish_reason(summary.finish_reason) } else { "tool_calls" };
                    let mut body = match kind {
                        Kind::Chat => {
                            let mut message = json!({"role": "assistant", "content": content});
                            if !reasoning.is_empty() {
                                message["reasoning_content"] = json!(reasoning);
                            }
                            if !calls.is_empty() {
                                let base = id.clone();
                                message["tool_calls"] = Value::Array(
                                    calls.iter().enumerate().map(|(i, c)| out_call(&base, i, c)).collect(),
                                );
                                if content.is_empty() {
                                    message["content"] = Value::Null;
                                }
                            }
                            json!({"id": id, "object": "chat.completion", "created": created, "model": model,
                                   "choices": [{"index": 0, "message": message, "finish_reason": reason}], "usage": usage,
                                   "timings": timings(&summary)})
                        }
                        Kind::Text => json!({"id": id, "object": "text_completion", "created": created, "model": model,
                                   "choices": [{"index": 0, "text": reasoning + &content, "finish_reason": reason}], "usage": usage,
                                   "timings": timings(&summary)}),
                    };
                    drop(guard);
                    let mut headers = headers;
                    if let Some(expect) = &expect {
                        let check = expect.report(&content);
                        let valid = check["valid"] == json!(true);
                        headers.insert(
                            "x-ferrite-response-format",
                            axum::http::HeaderValue::from_static(if valid { "valid" } else { "invalid" }),
                        );
                        body["response_format_check"] = check;
                    }
                    return Ok((headers, Json(body)).into_response());
                }
                JobEvent::Failed(e) => return Err(e.into()),
                JobEvent::Started { .. } => {}
            }
        }
        return Err(ApiError::internal("the engine ended the request without a summary"));
    }

    let include_usage = common.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let chunk = move |delta: Value, finish: Option<&str>| -> Value {
        match kind {
            Kind::Chat => json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}),
            Kind::Text => json!({"id": id, "object": "text_completion", "created": created, "model": model,
                                 "choices": [{"index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")), "finish_reason": finish}]}),
        }
    };
    let first = chunk(json!({"role": "assistant", "content": ""}), None);
    let events = ReceiverStream::new(rx);
    let call_base = format!("call-{created}");
    let (mut calls_sent, mut call_open) = (0usize, false);
    // Only kept when the finished answer must be checked.
    let mut answer = String::new();
    let stream = futures_util::stream::once(async move { first })
        .chain(events.flat_map(move |event| {
            let _keep = &guard; // cancels the job when the client goes
            let out: Vec<Value> = match event {
                JobEvent::Delta { content, reasoning, tool_calls } => {
                    let mut delta = json!({});
                    if expect.is_some() {
                        answer.push_str(&content);
                    }
                    if !content.is_empty() {
                        delta["content"] = json!(content);
                    }
                    if !reasoning.is_empty() {
                        delta["reasoning_content"] = json!(reasoning);
                    }
                    let mut out = vec![];
                    if delta.as_object().is_some_and(|d| !d.is_empty()) || tool_calls.is_empty() {
                        out.push(chunk(delta, None));
                    }
                    // A call streams as it is written: its id and name, then its arguments in fragments.
                    for event in tool_calls {
                        let call = match event {
                            CallEvent::Begin { name } => {
                                call_open = true;
                                json!({"index": calls_sent, "id": format!("{call_base}-{calls_sent}"), "type": "function",
                                       "function": {"name": name, "arguments": ""}})
                            }
                            CallEvent::Arguments(a) => json!({"index": calls_sent, "function": {"arguments": a}}),
                            CallEvent::End(c) => {
                                let whole = (!call_open).then(|| {
                                    let mut v = out_call(&call_base, calls_sent, &c);
                                    v["index"] = json!(calls_sent);
                                    v
                                });
                                call_open = false;
                                calls_sent += 1;
                                let Some(whole) = whole else { continue };
                                whole
                            }
                        };
                        out.push(chunk(json!({"tool_calls": [call]}), None));
                    }
                    out
                }
                JobEvent::Finished { summary, reasoning_tokens } => {
                    let reason = if calls_sent > 0 { "tool_calls" } else { finish_reason(summary.finish_reason) };
                    let mut last = chunk(json!({}), Some(reason));
                    last["timings"] = timings(&summary);
                    if let Some(expect) = &expect {
                        last["response_format_check"] = expect.report(&answer);
                    }
                    let mut out = vec![];
                    if include_usage {
                        let mut u = chunk(json!({}), None);
                        u["choices"] = json!([]);
                        u["usage"] = usage(&summary.usage, reasoning_tokens);
                        last["usage"] = Value::Null;
                        out.push(last);
                        out.push(u);
                    } else {
                        out.push(last);
                    }
                    out
                }
                JobEvent::Failed(e) => vec![json!({"error": {"message": format!("{e:?}"), "type": "server_error"}})],
                JobEvent::Started { .. } => vec![],
            };
            futures_util::stream::iter(out)
        }))
        .map(|v| Ok::<_, Infallible>(SseEvent::default().data(v.to_string())))
        .chain(futures_util::stream::once(async { Ok(SseEvent::default().data("[DONE]")) }));
    Ok((headers, Sse::new(stream).keep_alive(KeepAlive::default())).into_response())
}

/// A tool call in OpenAI's response shape (arguments as a JSON string).
fn out_call(base: &str, i: usize, c: &crate::tools::ParsedCall) -> Value {
    json!({"id": format!("{base}-{i}"), "type": "function", "function": {"name": c.name, "arguments": c.arguments.to_string()}})
}

/// The engine's own figures for the request, so a client can compare what it saw at the
/// HTTP boundary with what the engine did (an extension field; SDKs ignore it).
fn timings(summary: &engine::Summary) -> Value {
    let t = &summary.timings;
    let mut v = json!({"ttft_ms": t.ttft.as_secs_f64() * 1e3, "prompt_tps": t.prompt_tps, "decode_tps": t.decode_tps,
                       "peak_memory_bytes": t.peak_memory_bytes});
    if let Some(spec) = &summary.speculative {
        v["draft_depth"] = json!(spec.depth);
        v["acceptance"] = json!(spec.acceptance());
        v["tokens_per_cycle"] = json!(spec.tokens_per_cycle());
    }
    v
}

fn usage(u: &engine::generate::Usage, reasoning: usize) -> Value {
    json!({"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
           "total_tokens": u.prompt_tokens + u.completion_tokens,
           "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
           "completion_tokens_details": {"reasoning_tokens": reasoning}})
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Any body: parsed or refused with a 4xx naming what was wrong; never a panic.
        #[test]
        fn chat_bodies_never_panic(body in crate::fuzz::body()) {
            let body = Bytes::from(body);
            if let (Ok(_common), Ok(req)) = (parse::<Common>(&body), parse::<ChatRequest>(&body)) {
                if let Err(e) = chat_prompt(&req) {
                    prop_assert!(e.status.is_client_error(), "{}", e.message);
                }
                if let Some(format) = &req.response_format {
                    let _ = format.expectation();
                }
            }
            let _ = parse::<CompletionRequest>(&body);
        }
    }
}
